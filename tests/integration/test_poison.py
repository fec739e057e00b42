"""Poison rows: one bad row never stops the others (docs/DESIGN.md P4).

Every test runs the relay with --poll-interval 500ms --max-attempts 3
--max-payload-bytes 1000. Promises tested:
- for each kind of row that cannot be published for a reason of its own
    * a payload larger than max_payload_bytes (2000 bytes; 1000 bytes still goes),
    * a topic outside [A-Za-z0-9._-]{1,200} ("bad topic", "{orders}", "a:b", 201 chars),
      and a non-ASCII topic or header name whose quote in last_error is cut at 64
      bytes inside a UTF-8 character,
    * headers that cannot be encoded (a JSON array, 65 headers, a 200-byte name,
      a value over 8192 bytes; 64 headers, a 128-byte name and an 8192-byte value go),
    * WRONGTYPE: its topic's stream key holds a string (only that topic's rows fail),
  the poison row sits between good rows committed in one transaction, and more
  good rows are committed one by one while it is being retried: every good row
  is in its stream within GOOD_ROW_BOUND seconds of its commit (measured from
  the commit to the millisecond time of its stream entry id), the good rows of
  the poison's first batch are committed in that same batch, and the poison row
  is quarantined: failed_at set, sent_at NULL, nothing in Redis, last_error says
  what is wrong and what to do; the relay log names the row id with the error and
  the quarantine. A permanent failure (the topic, the payload size, the headers:
  what the producer wrote) is quarantined at its first attempt, in the batch of
  its neighbours (attempts = 1, failed_at = their sent_at), never retried; a
  transient one (WRONGTYPE, which an operator can fix while the row waits) is
  retried with backoff and quarantined after max_attempts (attempts = 3);
- a row that fails in the middle of its stream's rows (its dedup record is a
  hash, in the second of three calls of 150 rows of one stream) fails alone:
  the rows before it are published, every row behind it, in its call and the
  next, waits with it, and once the record is removed all 150 are in the
  stream in claim order;
- a row published before (its dedup record is there) behind a row that fails
  in its stream ends the wait: the rows after it are published, no batch
  fails, and the other topic's rows of the batch are committed;
- the advice follows the cause: a row the producer wrote wrongly (a bad topic)
  says to drop it with `failed drop <id>` and write it again, and re-queued
  as it is it is quarantined again; a row refused by the setup (WRONGTYPE)
  says to re-queue it with `failed retry <id>` once that is fixed, and then
  goes through; the log and `failed list` give the same advice;
- `outbox-relay failed list` shows the quarantined rows with their errors;
  after the cause is fixed `failed retry <id>` re-queues one row (exit 0) and
  the running relay publishes it; `failed retry --all` re-queues every
  quarantined row with a clean attempt count; `failed retry 999999` exits 65
  saying it is not quarantined; `failed retry abc` exits 64;
- errors about Redis as a whole never blame a row: while Redis answers OOM
  (maxmemory 1 byte, noeviction), also across a reconnect that cannot load the
  function, rows keep attempts = 0 and failed_at NULL and all arrive once the
  limit is lifted; after FUNCTION FLUSH the relay loads its function again and
  keeps publishing, again without blaming a row.
"""

import re
import time
import unittest
import uuid

import psycopg2
import psycopg2.extras

from testkit import harness
from testkit.harness import insert, wait_until

harness.require_relay()
harness.set_deadline(240)

RELAY_FLAGS = dict(poll_interval="500ms", max_attempts=3, max_payload_bytes=1000,
                   reconnect_min="50ms", reconnect_max="1s")
MAX_ATTEMPTS = 3


def permanent(spec):
    """Whether a poison spec fails for good: everything but WRONGTYPE, which is transient."""
    return not spec.get("transient", False)


def advice(spec, oid):
    """What a poison row's error tells the operator to do, by its cause: a row the
    producer wrote wrongly is dropped and written again (re-queued as it is, it
    fails again); one refused by what an operator can change (WRONGTYPE, a payload
    over max_payload_bytes) is re-queued once that is changed."""
    setup = spec.get("transient", False) or len(spec.get("payload", b"")) > 1000
    return f"'outbox-relay failed {'retry' if setup else 'drop'} {oid}'"


GOOD_ROW_BOUND = 5.0   # seconds from commit to the stream: one poll interval plus much slack
GOOD_TOPICS = ("orders", "billing")


def rows(conn, ids):
    """{outbox id: row dict} for the given ids."""
    with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
        cur.execute("SELECT id, message_id::text, topic, sent_at, attempts, last_error,"
                    " retry_at, failed_at FROM outbox.messages WHERE id = ANY(%s)",
                    (list(ids),))
        return {r["id"]: dict(r) for r in cur.fetchall()}


def entry_ms(entry_id):
    return int(entry_id.split("-")[0])


class PoisonTest(harness.ServerTestCase):

    # ---- helpers -------------------------------------------------------

    def start_relay(self, **flags):
        relay = self.relay(**{**RELAY_FLAGS, **flags})
        warm = insert(self.db, "warmup", b"warm-up")
        wait_until(lambda: warm in harness.entries_by_message_id(self.r), timeout=30,
                   relay=relay, message="the relay to publish a warm-up row")
        # Its entry is in Redis before its batch commits: wait for the commit
        # too, so the tests count only their own rows as unsent.
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        return relay

    def insert_row(self, conn, topic, payload, key=None, headers=None):
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO outbox.messages (topic, partition_key, payload, headers)"
                " VALUES (%s, %s, %s, %s) RETURNING id, message_id::text",
                (topic, key, psycopg2.Binary(payload),
                 psycopg2.extras.Json(headers) if headers is not None else None))
            return cur.fetchone()

    def insert_sandwich(self, poisons, good_headers=None, good_payload=b"good"):
        """One transaction: 5 good, poison 1, 5 good, poison 2, ..., 5 good.

        Returns ({good id: (message_id, commit time)}, {poison id: (message_id, spec)}).
        """
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        good, poison = {}, {}
        n = 0

        def five():
            nonlocal n
            for _ in range(5):
                topic = GOOD_TOPICS[n % len(GOOD_TOPICS)]
                oid, mid = self.insert_row(conn, topic, good_payload + b" %d" % n,
                                           key=f"k{n}", headers=good_headers)
                good[oid] = mid
                n += 1
        for spec in poisons:
            five()
            oid, mid = self.insert_row(conn, spec["topic"], spec.get("payload", b"poison"),
                                       headers=spec.get("headers"))
            poison[oid] = (mid, spec)
        five()
        conn.commit()
        committed = time.time()
        return {oid: (mid, committed) for oid, mid in good.items()}, poison

    def trickle_until_quarantined(self, relay, poison_ids, timeout=30):
        """Commits a good row every 250 ms, each in its own transaction, until every
        poison row is quarantined (and one more second); returns {id: (mid, commit time)}."""
        good = {}
        deadline = time.monotonic() + timeout
        done_at = None
        n = 0
        while True:
            oid, mid = self.insert_row(self.db, GOOD_TOPICS[n % 2], b"trickle %d" % n)
            good[oid] = (mid, time.time())
            n += 1
            if done_at is None:
                got = rows(self.db, poison_ids)
                if all(r["failed_at"] is not None for r in got.values()):
                    done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > 1.0:
                return good
            if time.monotonic() > deadline:
                got = rows(self.db, poison_ids)
                self.fail(f"poison rows not quarantined within {timeout}s: "
                          + ", ".join(f"id={i} attempts={r['attempts']} failed_at={r['failed_at']}"
                                      for i, r in sorted(got.items()))
                          + "\n" + relay.log_tail())
            self.assertTrue(relay.alive(), "the relay exited\n" + relay.log_tail())
            time.sleep(0.25)

    def assert_good_rows_prompt(self, relay, good, what):
        """Every good row is in its stream once, within GOOD_ROW_BOUND s of its commit."""
        mids = {mid for mid, _ in good.values()}

        def all_there():
            found = harness.entries_by_message_id(self.r)
            return found if all(m in found for m in mids) else None
        found = wait_until(all_there, timeout=30, relay=relay, message=f"the good rows ({what})")
        worst = 0.0
        for oid, (mid, committed) in good.items():
            entries = found[mid]
            self.assertEqual(len(entries), 1, f"good row {oid} has {len(entries)} entries")
            latency = entry_ms(entries[0][1]) / 1000.0 - committed
            worst = max(worst, latency)
            self.assertLess(latency, GOOD_ROW_BOUND,
                            f"good row {oid} ({what}) reached its stream {latency:.2f}s after its"
                            f" commit: held back by a poison row?\n{relay.log_tail()}")
        print(f"{what}: {len(good)} good rows, slowest commit-to-stream {worst:.3f}s",
              flush=True)
        wait_until(lambda: all(r["sent_at"] for r in rows(self.db, good).values()),
                   timeout=10, relay=relay, message=f"sent_at on the good rows ({what})")

    def assert_first_failure_in_same_batch(self, relay, good, poison):
        """The first attempt on a poison row is recorded in the transaction that
        committed its neighbours: retry_at = now() + 1 s there, sent_at = now().
        A permanent failure is quarantined right there: failed_at = now()."""
        wait_until(lambda: all(r["attempts"] >= 1 for r in rows(self.db, poison).values()),
                   timeout=10, relay=relay, message="the first failure of every poison row")
        poisoned = rows(self.db, poison)
        sent = {r["sent_at"] for r in rows(self.db, good).values()}
        self.assertEqual(len(sent), 1, f"the good rows of one transaction were committed in"
                                       f" {len(sent)} batches")
        sent_at = sent.pop()
        for oid, r in poisoned.items():
            name = poison[oid][1]["name"]
            self.assertIsNone(r["sent_at"])
            self.assertIsNotNone(r["last_error"], f"poison row {oid} has no last_error")
            if r["attempts"] == 1:  # not retried yet: its retry_at is from the first batch
                self.assertAlmostEqual(
                    (r["retry_at"] - sent_at).total_seconds(), 1.0, delta=0.01,
                    msg=f"poison row {oid} failed in another batch than its neighbours")
            if permanent(poison[oid][1]):
                self.assertEqual(r["attempts"], 1, f"{name}: a permanent failure was retried")
                self.assertEqual(r["failed_at"], sent_at,
                                 f"{name}: row {oid} not quarantined in its first batch")

    def assert_quarantined(self, relay, poison, phrases_of):
        got = rows(self.db, poison)
        found = harness.entries_by_message_id(self.r)
        log = relay.log()
        for oid, (mid, spec) in poison.items():
            r = got[oid]
            name = spec["name"]
            self.assertIsNotNone(r["failed_at"], f"{name}: row {oid} not quarantined")
            self.assertEqual(r["attempts"], 1 if permanent(spec) else MAX_ATTEMPTS,
                             f"{name}: attempts of row {oid}")
            self.assertIsNone(r["sent_at"], f"{name}: row {oid} marked sent")
            self.assertNotIn(mid, found, f"{name}: row {oid} published")
            error = r["last_error"] or ""
            for phrase in phrases_of(spec) + [advice(spec, oid)]:
                self.assertIn(phrase, error, f"{name}: last_error of row {oid} lacks {phrase!r}:"
                                             f" {error!r}")
            lines = [line for line in log.splitlines()
                     if re.search(rf"\bid={oid}\b", line)
                     and re.match(r"^\S+ (WARNING|ERROR) ", line)]
            key_phrase = phrases_of(spec)[0]
            self.assertTrue(any(key_phrase in line for line in lines),
                            f"{name}: no WARNING/ERROR log line names row id={oid} with"
                            f" {key_phrase!r}\n{relay.log_tail()}")
            self.assertTrue(any(re.search(r"(?i)quarantined", line) for line in lines),
                            f"{name}: no log line says row id={oid} was quarantined\n"
                            f"{relay.log_tail()}")
            print(f"{name}: row {oid} quarantined after {r['attempts']} attempts:"
                  f" {error}", flush=True)

    def run_kind(self, poisons, phrases_of, good_headers=None, good_payload=b"good"):
        relay = self.start_relay()
        good, poison = self.insert_sandwich(poisons, good_headers, good_payload)
        self.assert_good_rows_prompt(relay, good, "one transaction around the poison rows")
        self.assert_first_failure_in_same_batch(relay, good, poison)
        trickle = self.trickle_until_quarantined(relay, poison)
        self.assert_good_rows_prompt(relay, trickle, "one by one while the poison is retried")
        self.assert_quarantined(relay, poison, phrases_of)
        self.assertEqual(harness.count_unsent(self.db), 0, "rows left unsent")
        return relay, good, poison

    def failed_tool(self, *args):
        """`outbox-relay failed ...` with only OUTBOX_RELAY_POSTGRES set."""
        return harness.run_relay(["failed", *args], env=harness.relay_env(self.pg))

    # ---- the kinds of poison ------------------------------------------

    def test_payload_over_max_payload_bytes(self):
        poisons = [dict(name="payload 2000 bytes", topic="orders", payload=b"p" * 2000)]
        relay, good, _ = self.run_kind(
            poisons, lambda s: ["2000 bytes", "max_payload_bytes (1000)",
                                "raise max_payload_bytes"],
            good_payload=b"g" * 998)  # with the " <n>" suffix (n < 10): exactly 1000 bytes
        lengths = [len(f[b"payload"]) for _, _, f in
                   sum(harness.entries_by_message_id(self.r).values(), [])]
        self.assertIn(1000, lengths, "a payload of exactly max_payload_bytes is published")

    def test_topic_outside_allowed_set(self):
        poisons = [dict(name=f"topic {t[:20]!r}{'...' if len(t) > 20 else ''}", topic=t)
                   for t in ("bad topic", "{orders}", "a:b", "t" * 201)]
        self.run_kind(poisons, lambda s: [f'topic "{s["topic"][:64]}', "is not allowed",
                                          "A-Z a-z 0-9 . _ -", "fix the producer",
                                          "outbox-relay failed drop"])
        streams = harness.stream_names(self.r)
        for spec in poisons:
            self.assertNotIn(spec["topic"].encode(), streams)

    def test_headers_that_cannot_be_encoded(self):
        poisons = [
            dict(name="headers JSON array", topic="orders", headers=["a", "b"],
                 phrases=["headers must be a JSON object", "not a JSON array",
                          "fix the producer"]),
            dict(name="65 headers", topic="orders",
                 headers={f"h{i:02d}": "v" for i in range(65)},
                 phrases=["at most 64 headers", "reduce them in the producer"]),
            dict(name="header name of 200 bytes", topic="orders", headers={"n" * 200: "v"},
                 phrases=["names are 1 to 128 bytes", "header name \"" + "n" * 64,
                          "fix the producer"]),
            dict(name="header value of 8193 bytes", topic="orders",
                 headers={"big": "v" * 8193},
                 phrases=['value of header "big" exceeds 8192 bytes', "shorten it"]),
        ]
        # The good rows sit at every limit: 64 headers, a 128-byte name, an 8192-byte value.
        at_limits = {f"h{i:02d}": str(i) for i in range(62)}
        at_limits["n" * 128] = "name at the limit"
        at_limits["big"] = "v" * 8192
        self.run_kind(poisons, lambda s: s["phrases"], good_headers=at_limits)
        some = next(f for _, _, f in sum(harness.entries_by_message_id(self.r).values(), [])
                    if f.get(b"topic") == b"orders")
        self.assertEqual(len([k for k in some if k.startswith(b"h.")]), 64)
        self.assertEqual(some[b"h.big"], b"v" * 8192)

    def test_wrongtype_stream_key_fails_only_its_topic(self):
        self.r.set("ledger", "a string where a stream should be")
        poisons = [dict(name=f"WRONGTYPE row {i}", topic="ledger", payload=b"ledger %d" % i,
                        transient=True) for i in range(3)]
        relay, good, poison = self.run_kind(
            poisons, lambda s: ["WRONGTYPE", 'the stream key for topic "ledger" holds another'
                                " type", "rename or delete that key"])
        self.assertEqual(self.r.get("ledger"), b"a string where a stream should be")
        self.assertEqual(self.r.type("ledger"), b"string")
        self.assertEqual(list(self.r.scan_iter(match="{ledger}:dedup:*")), [],
                         "a failed XADD left a dedup record")
        self.assertEqual(sorted(harness.stream_names(self.r)),
                         sorted([b"billing", b"orders", b"warmup"]))

    def test_rows_behind_a_failed_row_of_their_stream_wait_with_it(self):
        """Rows of one stream in one batch are chained (docs/DESIGN.md, "The
        claim cycle"): when the first fails for a reason of its own, the ones
        behind it are refused by the publish function and wait with it, with
        its reason; once the key is fixed all are published in claim order."""
        self.r.set("ledger", "a string where a stream should be")
        with self.db.cursor() as cur:
            ids = []
            for i in range(3):
                cur.execute("INSERT INTO outbox.messages (topic, payload) VALUES"
                            " ('ledger', %s) RETURNING id", (b"ledger %d" % i,))
                ids.append(cur.fetchone()[0])
        self.db.commit()
        relay = self.relay(**{**RELAY_FLAGS, "max_attempts": 100})
        wait_until(lambda: all(r["attempts"] >= 1 for r in rows(self.db, ids).values()),
                   timeout=30, relay=relay, message="a first attempt of the three rows")
        got = rows(self.db, ids)
        first, second, third = (got[i]["last_error"] for i in ids)
        print(f"the rows behind: {second!r}", flush=True)
        self.assertIn("WRONGTYPE", first)
        self.assertNotIn("the row before it", first)
        for error in (second, third):
            self.assertIn(f"held back behind row {ids[0]} of its stream, which failed: Redis "
                          f"refused the entry: WRONGTYPE", error)
            self.assertIn("rename or delete that key", error)
        self.assertTrue(all(r["failed_at"] is None for r in got.values()))
        self.assertEqual(self.r.type("ledger"), b"string")
        self.r.delete("ledger")
        wait_until(lambda: all(r["sent_at"] for r in rows(self.db, ids).values()),
                   timeout=30, relay=relay, message="the three rows once the key is fixed")
        published = [int(f[b"outbox_id"]) for _, f in harness.stream_entries(self.r, "ledger")]
        self.assertEqual(published, ids)

    def test_a_row_that_fails_within_its_stream_s_calls_holds_back_the_rest(self):
        """A batch sends each stream's rows in calls of up to 64 rows, each
        call after the first naming the last row of the call before
        (docs/DESIGN.md, "The claim cycle"). A row in the middle of the
        second call that fails (its dedup record is of another type) fails
        alone; the rows behind it, in its call and in the next, wait with it;
        those before it are published; once fixed, all are in claim order."""
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'journal', convert_to('journal ' || g, 'UTF8')"
                        " FROM generate_series(1, 150) AS g RETURNING id, message_id::text")
            got = sorted(cur.fetchall())
        self.db.commit()
        ids = [i for i, _ in got]
        bad = 99  # the 36th row of the second call
        record = f"{{journal}}:dedup:{got[bad][1]}"
        self.r.hset(record, "f", "a hash where a dedup record should be")
        relay = self.relay(**{**RELAY_FLAGS, "max_attempts": 100})
        wait_until(lambda: rows(self.db, [ids[bad]])[ids[bad]]["attempts"] >= 1, timeout=30,
                   relay=relay, message="a first attempt of the row whose record is a hash")
        now = rows(self.db, ids)
        self.assertTrue(all(now[i]["sent_at"] for i in ids[:bad]), "the rows before it")
        self.assertIn("WRONGTYPE", now[ids[bad]]["last_error"])
        for i in ids[bad + 1:]:
            self.assertIsNone(now[i]["sent_at"], f"row {i} was published ahead of row {ids[bad]}")
            self.assertIn(f"held back behind row {ids[bad]} of its stream", now[i]["last_error"])
        self.assertEqual(self.r.xlen("journal"), bad)
        self.r.delete(record)
        wait_until(lambda: all(r["sent_at"] for r in rows(self.db, ids).values()), timeout=30,
                   relay=relay, message="every row once the record is fixed")
        published = [int(f[b"outbox_id"]) for _, f in harness.stream_entries(self.r, "journal")]
        self.assertEqual(published, ids)

    def test_a_row_recorded_before_ends_the_wait_behind_a_failed_row(self):
        """A row whose message was published before (its dedup record is
        there: a repeated message id, or an attempt rolled back after Redis
        took it) sits behind a row that fails for a reason of its own. As with
        a call for each row, the rows after the recorded one are published:
        the batch is not failed for them, the other topic's rows of the same
        batch are committed with it, and only the failed row waits."""
        relay = self.relay(**{**RELAY_FLAGS, "max_attempts": 100})
        relay.wait_for_log(r"^\S+ INFO redis: .*ready", timeout=30)
        mids = [str(uuid.uuid4()) for _ in range(20)]
        failed_mid, recorded_mid = mids[5], mids[7]  # the 3rd and 4th journal rows
        self.r.hset(f"{{journal}}:dedup:{failed_mid}", "f", "a hash where a record should be")
        entry = self.r.fcall("outbox_relay_publish_v2", 2, "journal",
                             f"{{journal}}:dedup:{recorded_mid}", 600000, 9999999999999,
                             "id", recorded_mid, "payload", b"published before")
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (message_id, topic, payload)"
                        " SELECT (%s::text[])[g]::uuid,"
                        "  CASE WHEN g %% 2 = 0 THEN 'journal' ELSE 'orders' END,"
                        "  convert_to('row ' || g, 'UTF8') FROM generate_series(1, 20) AS g"
                        " RETURNING id, topic, message_id::text", (mids,))
            got = sorted(cur.fetchall())
        self.db.commit()
        journal = [(i, m) for i, t, m in got if t == "journal"]
        failed, recorded = journal[2], journal[3]
        self.assertEqual((failed[1], recorded[1]), (failed_mid, recorded_mid))
        others = [i for i, _, _ in got if i != failed[0]]
        wait_until(lambda: all(r["sent_at"] for r in rows(self.db, others).values()),
                   timeout=30, relay=relay, message="every row but the failed one")
        now = rows(self.db, [failed[0]])[failed[0]]
        self.assertIsNone(now["sent_at"])
        self.assertIn("WRONGTYPE", now["last_error"])
        batch = re.search(r"^.* batch of \d+ rows not published: .*$", relay.log(), re.MULTILINE)
        self.assertIsNone(batch, f"a batch failed as a whole: {batch and batch.group(0)}")
        published = {f[b"id"].decode(): e for e, f in harness.stream_entries(self.r, "journal")}
        self.assertEqual(published[recorded[1]], entry.decode(), "the recorded row's first entry")
        self.assertEqual(len(published), len(journal) - 1)

    def test_rows_behind_a_failed_row_of_the_batch_ahead_are_claimed_again(self):
        """A batch that publishes behind the one before it while that one's
        replies come in chains each stream's first row to the last row the
        batch ahead sent there (docs/DESIGN.md, "The claim cycle"). Refused
        behind a row that failed there, it is left for the next claim (with no
        attempt counted: tests/unit/test_batch.c), no batch fails for it, the
        other topics flow, and once the key is fixed every row of the stream
        is published, once."""
        self.r.set("ledger", "a string where a stream should be")
        relay = self.relay(**{**RELAY_FLAGS, "max_attempts": 1000, "batch_size": 300,
                              "log_level": "debug"})
        ledger, left = [], []
        # A batch publishes behind another only when its claim returns before
        # the other's replies are in: a backlog of 20 batches, again if need be.
        for backlog in range(5):
            with self.db.cursor() as cur:
                cur.execute("INSERT INTO outbox.messages (topic, payload)"
                            " SELECT CASE WHEN g %% 10 = 0 THEN 'ledger' ELSE 'orders' END,"
                            "  convert_to(%s || g, 'UTF8') FROM generate_series(1, 6000) AS g"
                            " RETURNING id, topic", (f"backlog {backlog} row ",))
                ids = cur.fetchall()
            self.db.commit()
            ledger += [i for i, t in ids if t == "ledger"]
            orders = [i for i, t in ids if t == "orders"]
            wait_until(lambda: all(r["sent_at"] for r in rows(self.db, orders).values()),
                       timeout=60, relay=relay, message="every row of the other topic")
            wait_until(lambda: all(r["attempts"] >= 1 for r in rows(self.db, ledger).values()),
                       timeout=60, relay=relay, message="a first attempt of every ledger row")
            left = [int(n) for n in
                    re.findall(r"batch committed: .* (\d+) left behind the batch ahead",
                               relay.log())]
            if left:
                break
        print(f"batches with rows left behind the batch ahead: {len(left)}, rows: {sum(left)}",
              flush=True)
        failed = re.search(r"^.* batch of \d+ rows not published: .*$", relay.log(), re.MULTILINE)
        self.assertIsNone(failed, f"a batch failed as a whole: {failed and failed.group(0)}")
        self.assertTrue(left, "no batch published behind another while its replies came in\n"
                        + relay.log_tail())
        got = rows(self.db, ledger)
        self.assertTrue(all(r["failed_at"] is None and r["sent_at"] is None
                            for r in got.values()))
        # Each ledger row failed for its own reason, or was held back behind a
        # row of its own batch that did.
        self.assertTrue(all("WRONGTYPE" in r["last_error"] for r in got.values()))
        self.r.delete("ledger")
        wait_until(lambda: all(r["sent_at"] for r in rows(self.db, ledger).values()),
                   timeout=60, relay=relay, message="the ledger rows once the key is fixed")
        # Each row keeps its own retry time after its own failure, so across
        # them the stream's order is not promised (only a partitioned topic's
        # keys keep theirs): every row once is.
        published = [int(f[b"outbox_id"]) for _, f in harness.stream_entries(self.r, "ledger")]
        self.assertEqual(sorted(published), sorted(ledger))

    def test_error_text_cut_inside_a_utf8_character(self):
        """Errors quote at most 64 bytes of a topic or header name: the cut must not
        leave a partial UTF-8 character that PostgreSQL refuses in last_error."""
        poisons = [
            dict(name="non-ASCII topic of 81 bytes", topic="a" + "\u00e9" * 40,
                 phrases=["is not allowed", "A-Z a-z 0-9 . _ -"]),
            dict(name="non-ASCII header name of 201 bytes", topic="orders",
                 headers={"b" + "\u00fc" * 100: "v"}, phrases=["names are 1 to 128 bytes"]),
        ]
        self.run_kind(poisons, lambda s: s["phrases"])

    # ---- the operator's tool ------------------------------------------

    def test_failed_list_and_retry(self):
        self.r.set("ledger", "not a stream")
        relay = self.start_relay()
        good, poison = self.insert_sandwich([
            dict(name="WRONGTYPE 1", topic="ledger", transient=True),
            dict(name="WRONGTYPE 2", topic="ledger", transient=True),
            dict(name="oversized", topic="orders", payload=b"o" * 2000)])
        self.assert_good_rows_prompt(relay, good, "around the rows to quarantine")
        wait_until(lambda: all(r["failed_at"] for r in rows(self.db, poison).values()),
                   timeout=30, relay=relay, message="the rows to be quarantined")
        (wt1, wt2, big) = sorted(poison)

        listed = self.failed_tool("list")
        self.assertEqual(listed.returncode, 0, listed.output)
        print("failed list:\n" + listed.stdout, flush=True)
        for oid, (mid, spec) in poison.items():
            line = next((ln for ln in listed.stdout.splitlines()
                         if re.match(rf"^{oid}\s", ln)), None)
            self.assertIsNotNone(line, f"row {oid} missing from 'failed list'\n{listed.output}")
            self.assertIn(mid, line)
            self.assertIn("WRONGTYPE" if spec["topic"] == "ledger" else "exceeds max_payload_bytes",
                          line, "'failed list' shows the row's error")
        self.assertRegex(listed.stdout, r"\b3 quarantined\b")

        bad = self.failed_tool("retry", "999999")
        self.assertEqual(bad.returncode, 65, bad.output)
        self.assertIn("not quarantined", bad.output)
        self.assertIn("999999", bad.output)
        self.assertEqual(self.failed_tool("retry", "abc").returncode, 64)
        self.assertEqual(self.failed_tool("retry").returncode, 64)

        # Fix the cause of one row, re-queue it: the running relay publishes it.
        self.r.delete("ledger")
        done = self.failed_tool("retry", str(wt1))
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("re-queued 1 row", done.stdout)
        requeued_at = time.time()
        mid1 = poison[wt1][0]
        found = wait_until(lambda: harness.entries_by_message_id(self.r).get(mid1), timeout=10,
                           relay=relay, message=f"re-queued row {wt1} to be published")
        self.assertEqual(len(found), 1)
        self.assertLess(entry_ms(found[0][1]) / 1000.0 - requeued_at, GOOD_ROW_BOUND)
        wait_until(lambda: rows(self.db, [wt1])[wt1]["sent_at"], timeout=10, relay=relay,
                   message=f"sent_at on row {wt1}")
        left = rows(self.db, [wt2, big])
        self.assertTrue(all(r["failed_at"] for r in left.values()),
                        "'failed retry <id>' re-queued other rows too")
        again = self.failed_tool("retry", str(wt1))
        self.assertEqual(again.returncode, 65, "re-queueing a sent row: " + again.output)

        # --all with no relay running: every quarantined row is back in line at once.
        self.assertEqual(relay.terminate(), 0)
        everything = self.failed_tool("retry", "--all")
        self.assertEqual(everything.returncode, 0, everything.output)
        self.assertIn("re-queued 2 row", everything.stdout)
        for oid, r in rows(self.db, [wt2, big]).items():
            self.assertEqual((r["failed_at"], r["attempts"], r["retry_at"], r["last_error"]),
                             (None, 0, None, None), f"row {oid} after 'failed retry --all'")
        none = self.failed_tool("list")
        self.assertEqual(none.returncode, 0, none.output)
        self.assertIn("no quarantined rows", none.stdout)

        # The oversized row's fix is a larger max_payload_bytes.
        relay = self.relay(**{**RELAY_FLAGS, "max_payload_bytes": 4096})
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.verifier().report("after failed retry").assert_exactly_once(self)

    def test_advice_follows_the_cause(self):
        """A quarantined row's advice depends on whose the fault is. A row the
        producer wrote wrongly (a bad topic) is to be dropped and written again:
        re-queued as it is, it is quarantined again at its next attempt, which
        is why its error never says to retry it. A row refused by something an
        operator can change (WRONGTYPE: the stream key holds a string) is to be
        re-queued once that is changed, and then goes through as it is."""
        self.r.set("ledger", "a string where a stream should be")
        relay = self.start_relay()
        wrong_id, wrong = self.insert_row(self.db, "bad topic", b"written wrongly")
        refused_id, refused = self.insert_row(self.db, "ledger", b"refused by the setup")
        self.db.commit()
        both = [wrong_id, refused_id]
        wait_until(lambda: all(r["failed_at"] for r in rows(self.db, both).values()),
                   timeout=30, relay=relay, message="both rows to be quarantined")
        got = rows(self.db, both)
        drop = f"'outbox-relay failed drop {wrong_id}'"
        retry = f"'outbox-relay failed retry {refused_id}'"
        row_error, setup_error = got[wrong_id]["last_error"], got[refused_id]["last_error"]
        print(f"row's fault: {row_error}\nsetup's fault: {setup_error}", flush=True)
        self.assertIn(drop, row_error)
        self.assertIn("write it again from the fixed producer", row_error)
        self.assertNotIn("failed retry", row_error)
        self.assertIn(retry, setup_error)
        self.assertNotIn("failed drop", setup_error)
        # The log and 'failed list' give the same advice.
        log = relay.log()
        for oid, phrase in ((wrong_id, drop), (refused_id, retry)):
            self.assertTrue(any(re.search(rf"\bid={oid}\b.*quarantined", line) and phrase in line
                                for line in log.splitlines()),
                            f"no log line quarantines row {oid} with {phrase}\n{relay.log_tail()}")
        listed = self.failed_tool("list")
        self.assertEqual(listed.returncode, 0, listed.output)
        for oid, phrase in ((wrong_id, drop), (refused_id, retry)):
            line = next((ln for ln in listed.stdout.splitlines() if re.match(rf"^{oid}\s", ln)), "")
            self.assertIn(phrase, line, f"'failed list' for row {oid}\n{listed.output}")

        # Retried as the old advice said, the row written wrongly fails again
        # within a second or so: the producer's fix cannot change a row that
        # is already written.
        again = self.failed_tool("retry", str(wrong_id))
        self.assertEqual(again.returncode, 0, again.output)
        wait_until(lambda: rows(self.db, [wrong_id])[wrong_id]["failed_at"], timeout=10,
                   relay=relay, message=f"row {wrong_id} quarantined again after its retry")
        r = rows(self.db, [wrong_id])[wrong_id]
        self.assertEqual(r["attempts"], 1, "quarantined at its first attempt again")
        self.assertIn(drop, r["last_error"])
        # Dropped, as the advice says: given up, never published.
        dropped = self.failed_tool("drop", str(wrong_id))
        self.assertEqual(dropped.returncode, 0, dropped.output)
        r = rows(self.db, [wrong_id])[wrong_id]
        self.assertIsNotNone(r["sent_at"])
        self.assertTrue(r["last_error"].startswith("dropped by an operator"), r["last_error"])
        self.assertNotIn(wrong, harness.entries_by_message_id(self.r))

        # The setup fixed and the row re-queued, as its advice says: published.
        self.r.delete("ledger")
        done = self.failed_tool("retry", str(refused_id))
        self.assertEqual(done.returncode, 0, done.output)
        wait_until(lambda: rows(self.db, [refused_id])[refused_id]["sent_at"], timeout=10,
                   relay=relay, message=f"row {refused_id} published once the key is fixed")
        self.assertEqual(len(harness.entries_by_message_id(self.r).get(refused, [])), 1)

    # ---- errors of Redis as a whole blame no row ------------------------

    def assert_no_row_blamed(self):
        with self.db.cursor() as cur:
            cur.execute("SELECT count(*) FILTER (WHERE attempts <> 0),"
                        " count(*) FILTER (WHERE failed_at IS NOT NULL),"
                        " count(*) FILTER (WHERE last_error IS NOT NULL) FROM outbox.messages")
            self.assertEqual(cur.fetchone(), (0, 0, 0),
                             "(rows with attempts, quarantined rows, rows with last_error)")

    def test_redis_oom_blames_no_row(self):
        relay = self.start_relay()
        self.addCleanup(lambda: self.redis.client().config_set("maxmemory", 0))
        self.assertEqual(self.r.config_get("maxmemory-policy")["maxmemory-policy"], "noeviction")
        mark = relay.mark()
        self.r.config_set("maxmemory", 1)
        with self.assertRaises(Exception, msg="FCALL is refused with OOM") as refused:
            self.r.fcall("outbox_relay_publish_v2", 2, "probe", "{probe}:dedup:x", 1000, 9999999999999,
                         "id", "x")
        self.assertIn("maxmemory", str(refused.exception))
        during = [insert(self.db, GOOD_TOPICS[i % 2], b"during OOM %d" % i) for i in range(10)]
        # Longer than a row's whole retry schedule with max_attempts=3 (1 s + 2 s):
        # if the relay blamed the rows, they would be quarantined by now. Halfway,
        # the server drops the relay's connection: it cannot even load its function
        # again (FUNCTION LOAD is refused with OOM too) until the limit is lifted.
        end = time.monotonic() + 6
        killed = False
        while time.monotonic() < end:
            if not killed and end - time.monotonic() < 3:
                killed = self.r.client_kill_filter(_type="normal", skipme=True) >= 1
                self.assertTrue(killed, "the relay's connection to kill")
            self.assert_no_row_blamed()
            self.assertEqual(harness.count_unsent(self.db), len(during))
            self.assertTrue(relay.alive(), relay.log_tail())
            time.sleep(0.25)
        relay.wait_for_log(r"^\S+ WARNING relay: .*OOM", since=mark, timeout=5)
        relay.wait_for_log(r"^\S+ ERROR redis: .*OOM", since=mark, timeout=5)
        self.r.config_set("maxmemory", 0)
        lifted = time.time()
        harness.wait_all_sent(self.db, timeout=15, relay=relay)
        print(f"OOM lifted: all rows sent {time.time() - lifted:.2f}s later", flush=True)
        self.assert_no_row_blamed()
        self.verifier().report("after OOM").assert_exactly_once(self)

    def loaded_libraries(self):
        """Names of the function libraries loaded in Redis."""
        names = []
        for lib in self.r.execute_command("FUNCTION", "LIST"):
            fields = dict(zip(lib[::2], lib[1::2])) if isinstance(lib, list) else lib
            names.append(fields[b"library_name"])
        return names

    def test_function_flush_is_repaired_and_blames_no_row(self):
        relay = self.start_relay()
        for round_ in range(3):
            mark = relay.mark()
            self.r.function_flush()
            self.assertFalse(self.loaded_libraries(), "FUNCTION FLUSH left a library")
            ids = [insert(self.db, GOOD_TOPICS[i % 2], b"after flush %d.%d" % (round_, i))
                   for i in range(5)]
            flushed = time.time()
            harness.wait_all_sent(self.db, timeout=15, relay=relay)
            took = time.time() - flushed
            found = harness.entries_by_message_id(self.r)
            self.assertTrue(all(m in found for m in ids))
            self.assertIn(b"outbox_relay", self.loaded_libraries(),
                          "the relay loaded its function again")
            relay.wait_for_log(r"(?i)function", since=mark, timeout=5)
            print(f"FUNCTION FLUSH round {round_}: rows sent {took:.2f}s later", flush=True)
            self.assert_no_row_blamed()
        self.verifier().report("after FUNCTION FLUSH").assert_exactly_once(self)


if __name__ == "__main__":
    unittest.main()
