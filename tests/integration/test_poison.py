"""Poison rows: one bad row never stops the others (docs/DESIGN.md P4, "Batches
from snapshots", "Rows that cannot be published").

Every test runs the relay with --poll-interval 500ms --max-payload-bytes 1000.
A row is sent once outbox.unsent no longer shows it; a row that can never be
published is copied into outbox.quarantine with its error. Promises tested:
- for each kind of row that cannot be published
    * a payload larger than max_payload_bytes (2000 bytes; 1000 bytes still goes),
    * a topic outside [A-Za-z0-9._-]{1,200} ("bad topic", "{orders}", "a:b", 201 chars),
      and a non-ASCII topic or header name whose quote in the error is cut at
      64 bytes inside a UTF-8 character (the error stays valid UTF-8),
    * headers that cannot be encoded (a JSON array, 65 headers, a 200-byte name,
      a value over 8192 bytes; 64 headers, a 128-byte name and an 8192-byte value go),
    * WRONGTYPE: its topic's stream key holds a string (only that topic's rows),
  the poison row sits between good rows committed in one transaction, and more
  good rows are committed one by one after it: every good row is in its stream
  once within GOOD_ROW_BOUND seconds of its commit (as seen in Redis); the good
  rows of the transaction are one batch (one entry id time), and the poison row
  is quarantined in that batch: recorded with the positions that make its
  neighbours sent (never seen sent without it), keeping its rank (a gap in its
  stream's entry ids); nothing of it is in Redis; its error says what is wrong
  and what to do; the relay log names the row id with the error and the
  quarantine; no row's attempts, retry_at, last_error, sent_at or failed_at
  is written. WRONGTYPE leaves the key as it was and makes no other key;
  after the key is deleted, `failed retry <ids>` publishes its rows, in
  order; the log line of each such row names the key that holds another type;
- in a partitioned topic a quarantined row holds its key (P8): the key's later
  rows, in its batch and in later ones, are quarantined "held behind row N",
  the other keys flow; `failed retry N` writes them all again and they are
  published in their order; `failed drop N` drops N (never published) and the
  rows held behind it are written again and published in order;
- a stream key that turns WRONGTYPE in the middle of a backlog of 300 rows of
  one stream (renamed away and set to a string while the relay is stopped,
  after 100 of them were published): the 200 rows behind are quarantined, the
  other topic's rows of the same batches are published, no batch fails; once
  the stream is back, `failed retry --all` publishes the 200 and the stream
  holds all 300 once, in order;
- more rows of a WRONGTYPE stream in one batch than the relay quarantines at
  once (300 with batch_size 100, a backlog built while it was down): the
  other topic's rows are sent, all 300 are quarantined, and a later batch is
  published (within 30 s);
- the advice follows the cause: a row the producer wrote wrongly (a bad topic)
  says to drop it with `failed drop <id>` and write it again, and retried as it
  is it is quarantined again; a row refused by the setup (WRONGTYPE) says to
  retry it with `failed retry <id>` once that is fixed, and then goes through;
  the log and `failed list` give the same advice;
- `outbox-relay failed list` shows the quarantined rows with their errors and
  their count; after the cause is fixed `failed retry <id>` (exit 0) writes
  that row alone again and the running relay publishes it within
  GOOD_ROW_BOUND seconds; retried again it exits 65; `failed retry --all`
  writes every quarantined row again as a new row (same message id, topic and
  payload), after which `failed list` shows none; `failed retry 999999` exits
  65 saying it is not quarantined; `failed retry abc` and `failed retry` exit
  64; a dropped row leaves the outbox and the quarantine, never published;
- errors about Redis as a whole never blame a row: while Redis answers OOM
  (maxmemory 1 byte, noeviction), also across a dropped connection whose
  reconnect is refused with OOM too, nothing is quarantined, no row reaches
  Redis, the rows stay unsent, the log says the batch is not published
  because of OOM, and once the limit is lifted the relay reconnects and
  every row arrives exactly once and in order;
  after FUNCTION FLUSH (the relay needs no function to publish) rows keep
  arriving, each once, and again no row is blamed.
"""

import re
import time
import unittest

import psycopg2
import psycopg2.extras

from testkit import harness
from testkit.harness import insert, wait_until

harness.require_relay()
harness.set_deadline(240)

RELAY_FLAGS = dict(poll_interval="500ms", max_payload_bytes=1000,
                   reconnect_min="50ms", reconnect_max="1s")


def advice(spec, oid):
    """What a poison row's error tells the operator to do, by its cause: a row the
    producer wrote wrongly is dropped and written again (retried as it is, it is
    quarantined again); one refused by what an operator can change (WRONGTYPE, a
    payload over max_payload_bytes) is retried once that is changed."""
    setup = spec.get("wrongtype", False) or len(spec.get("payload", b"")) > 1000
    return f"'outbox-relay failed {'retry' if setup else 'drop'} {oid}'"


GOOD_ROW_BOUND = 5.0   # seconds from commit to the stream: one poll interval plus much slack
GOOD_TOPICS = ("orders", "billing")


def quarantined(conn, ids=None):
    """{id: row dict} of outbox.quarantine (only the given ids, when given)."""
    with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
        cur.execute("SELECT id, message_id::text, topic, partition_key, payload, error"
                    " FROM outbox.quarantine WHERE %s OR id = ANY(%s)",
                    (ids is None, list(ids or [])))
        return {r["id"]: dict(r) for r in cur.fetchall()}


def quarantined_by_mid(conn):
    return {r["message_id"]: r for r in quarantined(conn).values()}


def unsent_ids(conn, ids):
    with conn.cursor() as cur:
        cur.execute("SELECT id FROM outbox.unsent WHERE id = ANY(%s)", (list(ids),))
        return {r[0] for r in cur.fetchall()}


def entry_ms(entry_id):
    return int(entry_id.split("-")[0])


def entry_seq(entry_id):
    return int(entry_id.split("-")[1])


def stream_mids(r, stream):
    """The message ids of a stream's entries, in stream order."""
    return [f[b"id"].decode() for _, f in harness.stream_entries(r, stream)]


class PoisonTest(harness.ServerTestCase):

    # ---- helpers -------------------------------------------------------

    def start_relay(self, **flags):
        relay = self.relay(**{**RELAY_FLAGS, **flags})
        warm = insert(self.db, "warmup", b"warm-up")
        wait_until(lambda: warm in harness.entries_by_message_id(self.r), timeout=30,
                   relay=relay, message="the relay to publish a warm-up row")
        # Its entry is in Redis before its batch is recorded: wait for that
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

        Returns ({good id: (message_id, commit time)}, {poison id: (message_id, spec)},
        [(id, topic)] in insertion order).
        """
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        good, poison, order = {}, {}, []
        n = 0

        def five():
            nonlocal n
            for _ in range(5):
                topic = GOOD_TOPICS[n % len(GOOD_TOPICS)]
                oid, mid = self.insert_row(conn, topic, good_payload + b" %d" % n,
                                           key=f"k{n}", headers=good_headers)
                good[oid] = mid
                order.append((oid, topic))
                n += 1
        for spec in poisons:
            five()
            oid, mid = self.insert_row(conn, spec["topic"], spec.get("payload", b"poison"),
                                       headers=spec.get("headers"))
            poison[oid] = (mid, spec)
            order.append((oid, spec["topic"]))
        five()
        conn.commit()
        committed = time.time()
        return {oid: (mid, committed) for oid, mid in good.items()}, poison, order

    def watch_arrivals(self, relay, good, what, check=None, seen=None):
        """Polls Redis until every good row's message id is in a stream; returns
        ({message_id: entries}, {message_id: time first seen}), from seen if
        given. check(), if given, runs at every poll."""
        mids = {mid for mid, _ in good.values()}
        seen = dict(seen or {})
        deadline = time.monotonic() + 30
        while True:
            if check is not None:
                check()
            found = harness.entries_by_message_id(self.r)
            now = time.time()
            for m in mids:
                if m in found and m not in seen:
                    seen[m] = now
            if len(seen) == len(mids):
                return found, seen
            if time.monotonic() > deadline:
                self.fail(f"{len(mids) - len(seen)} good rows ({what}) not in their stream"
                          f" within 30 s\n{relay.log_tail()}")
            self.assertTrue(relay.alive(), "the relay exited\n" + relay.log_tail())
            time.sleep(0.05)

    def assert_good_rows_prompt(self, relay, good, what, check=None, seen=None):
        """Every good row is in its stream once, within GOOD_ROW_BOUND s of its commit,
        and is then sent (out of outbox.unsent)."""
        found, seen = self.watch_arrivals(relay, good, what, check, seen)
        worst = 0.0
        for oid, (mid, committed) in good.items():
            entries = found[mid]
            self.assertEqual(len(entries), 1, f"good row {oid} has {len(entries)} entries")
            latency = seen[mid] - committed
            worst = max(worst, latency)
            self.assertLess(latency, GOOD_ROW_BOUND,
                            f"good row {oid} ({what}) reached its stream {latency:.2f}s after its"
                            f" commit: held back by a poison row?\n{relay.log_tail()}")
        print(f"{what}: {len(good)} good rows, slowest commit-to-stream {worst:.3f}s",
              flush=True)
        wait_until(lambda: not unsent_ids(self.db, good), timeout=10, relay=relay,
                   message=f"the good rows ({what}) to be sent")
        return found

    def assert_quarantined_with_neighbours(self, good, poison):
        """Runs at every poll while the sandwich's good rows arrive: in any one
        snapshot of the database, once a good row of the transaction is sent,
        every poison row of it is quarantined (one statement records both)."""
        def check():
            with self.db.cursor() as cur:
                cur.execute("SELECT (SELECT count(*) FROM outbox.unsent WHERE id = ANY(%s)),"
                            " (SELECT count(*) FROM outbox.quarantine WHERE id = ANY(%s))",
                            (list(good), list(poison)))
                good_unsent, poison_quarantined = cur.fetchone()
            if good_unsent < len(good):
                self.assertEqual(poison_quarantined, len(poison),
                                 "good rows of the transaction are sent while a poison row of"
                                 " it is not quarantined: not quarantined in their batch")
        return check

    def assert_one_batch_with_gaps(self, found, good, order):
        """The good rows of one transaction carry one entry id time (one batch), and
        in each stream their ranks count the poison rows between them."""
        ms = {entry_ms(found[mid][0][1]) for mid, _ in good.values()}
        self.assertEqual(len(ms), 1, f"the good rows of one transaction in {len(ms)} batches")
        for topic in GOOD_TOPICS:
            rows = [oid for oid, t in order if t == topic]
            ranked = [(rank, oid) for rank, oid in enumerate(rows) if oid in good]
            first_rank, first_oid = ranked[0]
            base = entry_seq(found[good[first_oid][0]][0][1]) - first_rank
            for rank, oid in ranked:
                self.assertEqual(entry_seq(found[good[oid][0]][0][1]), base + rank,
                                 f"row {oid} of {topic}: its rank does not count the"
                                 f" quarantined rows before it")

    def assert_no_row_columns_written(self):
        """The relay writes no per-row column: attempts, retry_at, last_error,
        sent_at and failed_at stay as the producer left them."""
        with self.db.cursor() as cur:
            cur.execute("SELECT count(*) FILTER (WHERE attempts <> 0),"
                        " count(*) FILTER (WHERE retry_at IS NOT NULL),"
                        " count(*) FILTER (WHERE last_error IS NOT NULL),"
                        " count(*) FILTER (WHERE sent_at IS NOT NULL),"
                        " count(*) FILTER (WHERE failed_at IS NOT NULL) FROM outbox.messages")
            self.assertEqual(cur.fetchone(), (0, 0, 0, 0, 0),
                             "rows with (attempts, retry_at, last_error, sent_at, failed_at)")

    def assert_quarantined(self, relay, poison, phrases_of):
        got = quarantined(self.db, poison)
        found = harness.entries_by_message_id(self.r)
        log = relay.log()
        for oid, (mid, spec) in poison.items():
            name = spec["name"]
            self.assertIn(oid, got, f"{name}: row {oid} not quarantined")
            self.assertEqual(got[oid]["message_id"], mid)
            self.assertNotIn(mid, found, f"{name}: row {oid} published")
            error = got[oid]["error"]
            for phrase in phrases_of(spec) + [advice(spec, oid)]:
                self.assertIn(phrase, error, f"{name}: error of row {oid} lacks {phrase!r}:"
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
            print(f"{name}: row {oid} quarantined: {error}", flush=True)

    def trickle(self, n=8, every=0.25):
        """Commits n good rows one by one, watching Redis meanwhile; returns
        ({id: (mid, commit time)}, {mid: time first seen in a stream})."""
        good, seen = {}, {}
        for i in range(n):
            oid, mid = self.insert_row(self.db, GOOD_TOPICS[i % 2], b"trickle %d" % i)
            good[oid] = (mid, time.time())
            end = time.monotonic() + every
            while time.monotonic() < end:
                found = harness.entries_by_message_id(self.r)
                now = time.time()
                for m, _ in good.values():
                    if m in found:
                        seen.setdefault(m, now)
                time.sleep(0.05)
        return good, seen

    def run_kind(self, poisons, phrases_of, good_headers=None, good_payload=b"good"):
        relay = self.start_relay()
        good, poison, order = self.insert_sandwich(poisons, good_headers, good_payload)
        found = self.assert_good_rows_prompt(
            relay, good, "one transaction around the poison rows",
            check=self.assert_quarantined_with_neighbours(good, poison))
        self.assert_one_batch_with_gaps(found, good, order)
        trickled, seen = self.trickle()
        self.assert_good_rows_prompt(relay, trickled, "one by one after the poison rows",
                                     seen=seen)
        self.assert_quarantined(relay, poison, phrases_of)
        self.assertEqual(harness.count_unsent(self.db), 0, "rows left unsent")
        self.assert_no_row_columns_written()
        return relay, good, poison

    def failed_tool(self, *args):
        """`outbox-relay failed ...` with only OUTBOX_RELAY_POSTGRES set."""
        return harness.run_relay(["failed", *args], env=harness.relay_env(self.pg))

    # ---- the kinds of poison ------------------------------------------

    def test_payload_over_max_payload_bytes(self):
        poisons = [dict(name="payload 2000 bytes", topic="orders", payload=b"p" * 2000)]
        self.run_kind(
            poisons, lambda s: ["2000 bytes", "max_payload_bytes (1000)",
                                "raise max_payload_bytes"],
            good_payload=b"g" * 998)  # with the " <n>" suffix (n < 10): exactly 1000 bytes
        lengths = [len(f[b"payload"]) for _, _, f in
                   sum(harness.entries_by_message_id(self.r).values(), [])]
        self.assertIn(1000, lengths, "a payload of exactly max_payload_bytes is published")

    def test_topic_outside_allowed_set(self):
        poisons = [dict(name=f"topic {t[:20]!r}{'...' if len(t) > 20 else ''}", topic=t)
                   for t in ("bad topic", "{orders}", "a:b", "t" * 201)]
        self.run_kind(poisons, lambda s: [f'topic "{s["topic"][:64]}"', "is not allowed",
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
                 phrases=["names are 1 to 128 bytes", "header name \"" + "n" * 64 + "\"",
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

    def test_error_text_cut_inside_a_utf8_character(self):
        """Errors quote at most 64 bytes of a topic or header name: the cut must not
        leave a partial UTF-8 character, which PostgreSQL refuses in the
        quarantine's error (the batch could then never be recorded)."""
        poisons = [
            # 1 + 40 * 2 bytes: 64 bytes end inside the 32nd "é"; 63 are quoted.
            dict(name="non-ASCII topic of 81 bytes", topic="a" + "\u00e9" * 40,
                 phrases=["is not allowed", 'topic "a' + "\u00e9" * 31 + '" is not allowed',
                          "A-Z a-z 0-9 . _ -"]),
            dict(name="non-ASCII header name of 201 bytes", topic="orders",
                 headers={"b" + "\u00fc" * 100: "v"},
                 phrases=["names are 1 to 128 bytes",
                          'header name "b' + "\u00fc" * 31 + '" cannot be encoded']),
        ]
        self.run_kind(poisons, lambda s: s["phrases"])
        for r in quarantined(self.db).values():
            r["error"].encode("utf-8")  # psycopg2 decoded it: valid UTF-8

    def test_wrongtype_stream_key_fails_only_its_topic(self):
        self.r.set("ledger", "a string where a stream should be")
        poisons = [dict(name=f"WRONGTYPE row {i}", topic="ledger", payload=b"ledger %d" % i,
                        wrongtype=True) for i in range(3)]
        relay, good, poison = self.run_kind(
            poisons, lambda s: ["WRONGTYPE", "holds another type", "rename or delete"])
        self.assertEqual(self.r.get("ledger"), b"a string where a stream should be")
        self.assertEqual(self.r.type("ledger"), b"string")
        self.assertEqual(sorted(self.r.keys()),
                         sorted([b"billing", b"ledger", b"orders", b"warmup"]))

        # The key fixed as the error says, the rows retried: published, in order.
        self.r.delete("ledger")
        ids = sorted(poison)
        done = self.failed_tool("retry", *map(str, ids))
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("re-queued 3 row", done.stdout)
        wait_until(lambda: self.r.exists("ledger") and self.r.xlen("ledger") == 3, timeout=10,
                   relay=relay, message="the retried rows in the ledger stream")
        self.assertEqual(stream_mids(self.r, "ledger"), [poison[i][0] for i in ids])
        harness.wait_all_sent(self.db, timeout=10, relay=relay)
        self.assertEqual(quarantined(self.db), {})
        self.verifier().report("after the key is fixed").assert_exactly_once(self)

        # The error says which key holds another type: the operator renames or
        # deletes that one.
        for oid in ids:
            line = next((ln for ln in relay.log().splitlines()
                         if re.search(rf"\bid={oid}\b.*quarantined", ln)), "")
            self.assertIn("ledger", line, f"the quarantine of row {oid} does not name the key"
                                          f" that holds another type: {line!r}")

    # ---- a partitioned key waits behind its quarantined row -------------

    def key_order(self, *starts):
        """Message ids of the entries whose payload starts with one of starts, in
        entry id order (the rows of one key are in one stream)."""
        entries = sorted((e for es in harness.entries_by_message_id(self.r).values() for e in es
                          if e[2][b"payload"][:1] in starts),
                         key=lambda e: (entry_ms(e[1]), entry_seq(e[1])))
        return [e[2][b"id"].decode() for e in entries]

    def test_a_quarantined_row_holds_its_key(self):
        """In a partitioned topic a quarantined row holds the later rows of its
        key, in its batch and in later ones (P8); the other keys go on. Retrying
        the row writes them all again, in order; dropping it lets the held rows
        go on, in order."""
        harness.scalar(self.db, "SELECT outbox.set_partitions('accounts', 2)")
        relay = self.start_relay()
        big = b"b" * 2000  # over max_payload_bytes (1000)
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        plan = [("retried", b"r0", big), ("other", b"o0", None), ("retried", b"r1", None),
                ("dropped", b"d0", big), ("retried", b"r2", None), ("dropped", b"d1", None),
                ("other", b"o1", None), ("dropped", b"d2", None)]
        rows = {}
        for key, name, payload in plan:
            rows[name] = self.insert_row(conn, "accounts", payload or name, key=key)
        conn.commit()
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        # Later batches: the keys are still held.
        for key, name in (("retried", b"r3"), ("dropped", b"d3"), ("other", b"o2")):
            rows[name] = self.insert_row(conn, "accounts", name, key=key)
            conn.commit()
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        found = harness.entries_by_message_id(self.r)
        for name in (b"o0", b"o1", b"o2"):
            self.assertEqual(len(found.get(rows[name][1], [])), 1, f"row {name} of another key")
        got = quarantined(self.db)
        first = {b"r": rows[b"r0"][0], b"d": rows[b"d0"][0]}
        for name, (oid, mid) in rows.items():
            if name.startswith(b"o"):
                continue
            self.assertIn(oid, got, f"row {name} ({oid}) is not quarantined")
            self.assertNotIn(mid, found, f"row {name} ({oid}) was published")
            if name.endswith(b"0"):
                self.assertIn("exceeds max_payload_bytes", got[oid]["error"])
            else:
                self.assertIn(f"held behind row {first[name[:1]]}", got[oid]["error"])
                self.assertIn(f"'outbox-relay failed retry {first[name[:1]]}'", got[oid]["error"])
        print("held: " + "; ".join(f"{i}: {r['error']}" for i, r in sorted(got.items())),
              flush=True)

        # Dropped: never published, and the rows held behind it go on, in order.
        dropped = self.failed_tool("drop", str(first[b"d"]))
        self.assertEqual(dropped.returncode, 0, dropped.output)
        self.assertRegex(dropped.stdout, r"dropped 1 row.*\b3 row\(s\) of their keys written")
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(self.key_order(b"d"), [rows[n][1] for n in (b"d1", b"d2", b"d3")])
        self.assertEqual(harness.scalar(self.db, "SELECT count(*) FROM outbox.messages"
                                                 " WHERE message_id = %s", (rows[b"d0"][1],)), 0)

        # Retried once its cause is lifted: all of the key, in order.
        self.assertEqual(relay.terminate(), 0)
        retried = self.failed_tool("retry", str(first[b"r"]))
        self.assertEqual(retried.returncode, 0, retried.output)
        self.assertIn("re-queued 4 row", retried.stdout)
        relay = self.relay(**{**RELAY_FLAGS, "max_payload_bytes": 4096})
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(quarantined(self.db), {})
        self.assertEqual(self.key_order(b"r", b"b"),
                         [rows[n][1] for n in (b"r0", b"r1", b"r2", b"r3")])
        # Every row once, over the topic's partition streams (the Verifier reads
        # one stream a topic).
        with self.db.cursor() as cur:
            cur.execute("SELECT message_id::text FROM outbox.messages WHERE topic = 'accounts'")
            mids = [m for m, in cur.fetchall()]
        found = harness.entries_by_message_id(self.r)
        self.assertEqual(len(mids), len(rows) - 1, "every row but the dropped one")
        self.assertEqual({m: len(found.get(m, [])) for m in mids}, {m: 1 for m in mids})

    # ---- a key that turns WRONGTYPE in the middle of a backlog ----------

    def test_key_turning_wrongtype_in_a_backlog_quarantines_its_rows_only(self):
        """300 rows of one stream: 100 published, then, the relay stopped, the
        stream renamed away and its key set to a string. The 200 behind are
        quarantined as the relay reads them, in a batch of several chunks with
        the other topic's rows, which are published; no batch fails. With the
        stream back, 'failed retry --all' publishes the 200 behind the 100."""
        relay = self.start_relay(batch_size=128)

        def backlog(first, count, transactions):
            ids = []
            per = count // transactions
            for t in range(transactions):
                with self.db.cursor() as cur:
                    cur.execute("INSERT INTO outbox.messages (topic, payload)"
                                " SELECT CASE WHEN g %% 2 = 0 THEN 'ledger' ELSE 'orders' END,"
                                "  convert_to('row ' || g, 'UTF8')"
                                " FROM generate_series(%s, %s) AS g"
                                " RETURNING id, topic, message_id::text",
                                (2 * (first + t * per), 2 * (first + (t + 1) * per) - 1))
                    ids += cur.fetchall()
            ids.sort()
            return ([(i, m) for i, t, m in ids if t == "ledger"],
                    [(i, m) for i, t, m in ids if t == "orders"])

        ledger, orders = backlog(0, 100, 2)
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.assertEqual(self.r.xlen("ledger"), 100)
        self.assertEqual(relay.terminate(), 0)
        self.r.rename("ledger", "ledger.saved")
        self.r.set("ledger", "a string where a stream should be")
        behind, orders_behind = backlog(100, 200, 2)
        self.assertEqual((len(behind), len(orders_behind)), (200, 200))

        relay = self.relay(**{**RELAY_FLAGS, "batch_size": 128})
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        found = harness.entries_by_message_id(self.r)
        for oid, mid in orders + orders_behind:
            self.assertEqual(len(found.get(mid, [])), 1, f"orders row {oid}")
        got = quarantined(self.db)
        self.assertEqual(sorted(got), [i for i, _ in behind],
                         "exactly the ledger rows behind the change are quarantined")
        for oid, r in got.items():
            self.assertIn("WRONGTYPE", r["error"])
            self.assertIn(f"'outbox-relay failed retry {oid}'", r["error"])
        log = relay.log()
        named = set(int(i) for i in re.findall(r"^\S+ (?:WARNING|ERROR) .*\brow id=(\d+)"
                                               r" quarantined: .*WRONGTYPE", log, re.MULTILINE))
        self.assertEqual(named, set(got), "the log names every quarantined row")
        failed = re.search(r"^.*batch not published: .*$", log, re.MULTILINE)
        self.assertIsNone(failed, f"a batch failed as a whole: {failed and failed.group(0)}")
        self.assertEqual(self.r.type("ledger"), b"string")
        self.assert_no_row_columns_written()
        print(f"quarantined {len(got)} ledger rows, published {len(orders_behind)} orders rows"
              " of the same batches", flush=True)

        # The stream back in place, every quarantined row retried.
        self.r.delete("ledger")
        self.r.rename("ledger.saved", "ledger")
        everything = self.failed_tool("retry", "--all")
        self.assertEqual(everything.returncode, 0, everything.output)
        self.assertIn("re-queued 200 row", everything.stdout)
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.assertEqual(stream_mids(self.r, "ledger"), [m for _, m in ledger + behind],
                         "the ledger stream holds all 300 rows once, in order")
        self.assertEqual(quarantined(self.db), {})
        self.verifier().report("after failed retry --all").assert_exactly_once(self)

    def test_a_wrongtype_backlog_larger_than_batch_size_stops_no_topic(self):
        """A batch can hold more rows of a WRONGTYPE stream than batch_size (a
        backlog built while the relay was down): 300 ledger rows and 300 orders
        rows in one batch, batch_size 100. The orders rows are published and
        recorded sent, every ledger row is quarantined, and the relay goes on
        with the next batch: one bad key never stops the others (P4)."""
        self.r.set("ledger", "a string where a stream should be")
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT CASE WHEN g % 2 = 0 THEN 'ledger' ELSE 'orders' END,"
                        "  convert_to('row ' || g, 'UTF8') FROM generate_series(1, 600) AS g"
                        " RETURNING id, topic")
            ids = cur.fetchall()
        relay = self.relay(**{**RELAY_FLAGS, "batch_size": 100})
        after = insert(self.db, "billing", b"a later batch")

        def state():
            return (harness.count_sent(self.db, "m.topic <> 'ledger'"),
                    harness.scalar(self.db, "SELECT count(*) FROM outbox.quarantine"))
        deadline = time.monotonic() + 30
        while state() != (301, 300):
            self.assertTrue(relay.alive(), "the relay exited\n" + relay.log_tail())
            if time.monotonic() > deadline:
                stuck = re.findall(r"^.*batch not published: .*$", relay.log(), re.MULTILINE)
                self.fail(f"(rows of other topics sent, rows quarantined) = {state()} after 30 s,"
                          f" expected (301, 300); {stuck[:1]}")
            time.sleep(0.1)
        self.assertEqual(sorted(quarantined(self.db)), sorted(i for i, t in ids if t == "ledger"))
        self.assertEqual(len(harness.entries_by_message_id(self.r).get(after, [])), 1)
        self.assert_no_row_columns_written()

    # ---- the operator's tool ------------------------------------------

    def test_failed_list_and_retry(self):
        self.r.set("ledger", "not a stream")
        relay = self.start_relay()
        good, poison, _ = self.insert_sandwich([
            dict(name="WRONGTYPE 1", topic="ledger", wrongtype=True),
            dict(name="WRONGTYPE 2", topic="ledger", wrongtype=True),
            dict(name="oversized", topic="orders", payload=b"o" * 2000)])
        self.assert_good_rows_prompt(relay, good, "around the rows to quarantine")
        wait_until(lambda: len(quarantined(self.db, poison)) == 3,
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

        # Fix the cause of one row, retry it: the running relay publishes it.
        self.r.delete("ledger")
        done = self.failed_tool("retry", str(wt1))
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("re-queued 1 row", done.stdout)
        requeued_at = time.time()
        mid1 = poison[wt1][0]
        found = wait_until(lambda: harness.entries_by_message_id(self.r).get(mid1), timeout=10,
                           relay=relay, message=f"retried row {wt1} to be published")
        self.assertLess(time.time() - requeued_at, GOOD_ROW_BOUND)
        self.assertEqual(len(found), 1)
        harness.wait_all_sent(self.db, timeout=10, relay=relay)
        self.assertEqual(sorted(quarantined(self.db)), [wt2, big],
                         "'failed retry <id>' retried other rows too")
        again = self.failed_tool("retry", str(wt1))
        self.assertEqual(again.returncode, 65, "retrying a row no longer quarantined: "
                                               + again.output)

        # --all with no relay running: every quarantined row is written again at once.
        self.assertEqual(relay.terminate(), 0)
        everything = self.failed_tool("retry", "--all")
        self.assertEqual(everything.returncode, 0, everything.output)
        self.assertIn("re-queued 2 row", everything.stdout)
        with self.db.cursor() as cur:
            cur.execute("SELECT id, message_id::text, topic, length(payload) FROM outbox.unsent")
            back = {mid: (oid, topic, size) for oid, mid, topic, size in cur.fetchall()}
        for oid in (wt2, big):
            mid, spec = poison[oid]
            self.assertIn(mid, back, f"row {oid} is not written again")
            self.assertGreater(back[mid][0], big, "written again as a new row")
            self.assertEqual(back[mid][1:], (spec["topic"], len(spec.get("payload", b"poison"))))
        none = self.failed_tool("list")
        self.assertEqual(none.returncode, 0, none.output)
        self.assertIn("no quarantined rows", none.stdout)

        # The oversized row's fix is a larger max_payload_bytes.
        relay = self.relay(**{**RELAY_FLAGS, "max_payload_bytes": 4096})
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(quarantined(self.db), {})
        self.verifier().report("after failed retry").assert_exactly_once(self)

    def test_advice_follows_the_cause(self):
        """A quarantined row's advice depends on whose the fault is. A row the
        producer wrote wrongly (a bad topic) is to be dropped and written again:
        retried as it is, it is quarantined again, which is why its error never
        says to retry it. A row refused by something an operator can change
        (WRONGTYPE: the stream key holds a string) is to be retried once that
        is changed, and then goes through as it is."""
        self.r.set("ledger", "a string where a stream should be")
        relay = self.start_relay()
        wrong_id, wrong = self.insert_row(self.db, "bad topic", b"written wrongly")
        refused_id, refused = self.insert_row(self.db, "ledger", b"refused by the setup")
        both = [wrong_id, refused_id]
        wait_until(lambda: len(quarantined(self.db, both)) == 2,
                   timeout=30, relay=relay, message="both rows to be quarantined")
        got = quarantined(self.db, both)
        drop = f"'outbox-relay failed drop {wrong_id}'"
        retry = f"'outbox-relay failed retry {refused_id}'"
        row_error, setup_error = got[wrong_id]["error"], got[refused_id]["error"]
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

        # Retried against the advice, the row written wrongly is quarantined
        # again: the producer's fix cannot change a row that is already written.
        again = self.failed_tool("retry", str(wrong_id))
        self.assertEqual(again.returncode, 0, again.output)
        back = wait_until(lambda: quarantined_by_mid(self.db).get(wrong), timeout=10,
                          relay=relay, message=f"row {wrong_id} quarantined again after its retry")
        new_id = back["id"]
        self.assertNotEqual(new_id, wrong_id, "written again as a new row")
        self.assertIn(f"'outbox-relay failed drop {new_id}'", back["error"])
        self.assertNotIn("failed retry", back["error"])
        # Dropped, as the advice says: given up, never published.
        dropped = self.failed_tool("drop", str(new_id))
        self.assertEqual(dropped.returncode, 0, dropped.output)
        self.assertIn("dropped 1 row", dropped.stdout)
        self.assertEqual(harness.scalar(self.db, "SELECT count(*) FROM outbox.messages"
                                                 " WHERE message_id = %s", (wrong,)), 0)
        self.assertNotIn(wrong, quarantined_by_mid(self.db))
        self.assertNotIn(wrong, harness.entries_by_message_id(self.r))

        # The setup fixed and the row retried, as its advice says: published.
        self.r.delete("ledger")
        done = self.failed_tool("retry", str(refused_id))
        self.assertEqual(done.returncode, 0, done.output)
        wait_until(lambda: harness.entries_by_message_id(self.r).get(refused), timeout=10,
                   relay=relay, message=f"row {refused_id} published once the key is fixed")
        harness.wait_all_sent(self.db, timeout=10, relay=relay)
        self.assertEqual(len(harness.entries_by_message_id(self.r).get(refused, [])), 1)
        self.assertEqual(quarantined(self.db), {})

    # ---- errors of Redis as a whole blame no row ------------------------

    def assert_no_row_blamed(self):
        self.assertEqual(quarantined(self.db), {}, "rows quarantined")
        self.assert_no_row_columns_written()

    def test_redis_oom_blames_no_row(self):
        relay = self.start_relay()
        self.addCleanup(lambda: self.redis.client().config_set("maxmemory", 0))
        self.assertEqual(self.r.config_get("maxmemory-policy")["maxmemory-policy"], "noeviction")
        mark = relay.mark()
        self.r.config_set("maxmemory", 1)
        with self.assertRaises(Exception, msg="XADD is refused with OOM") as refused:
            self.r.xadd("probe", {"f": "v"})
        self.assertIn("maxmemory", str(refused.exception))
        during = [insert(self.db, GOOD_TOPICS[i % 2], b"during OOM %d" % i) for i in range(10)]
        # Several batch backoffs long. Halfway, the server drops the relay's
        # connection: it reconnects into the same refusals.
        end = time.monotonic() + 6
        killed = False
        while time.monotonic() < end:
            if not killed and end - time.monotonic() < 3:
                kill_mark = relay.mark()
                killed = self.r.client_kill_filter(_type="normal", skipme=True) >= 1
                self.assertTrue(killed, "the relay's connection to kill")
            self.assert_no_row_blamed()
            self.assertEqual(harness.count_unsent(self.db), len(during))
            self.assertTrue(relay.alive(), relay.log_tail())
            time.sleep(0.25)
        relay.wait_for_log(r"^\S+ WARNING batch: batch not published: .*(?:OOM|maxmemory)",
                           since=mark, timeout=5)
        # Its reconnect is refused too (its setup writes), and is retried.
        relay.wait_for_log(r"^\S+ ERROR redis: .*OOM", since=kill_mark, timeout=5)
        arrived = set(during) & set(harness.entries_by_message_id(self.r))
        self.assertEqual(arrived, set(), "rows arrived while Redis refused writes")
        self.r.config_set("maxmemory", 0)
        lifted = time.time()
        relay.wait_for_log(harness.LOG_CONNECTED.format(component="redis"), since=kill_mark,
                           timeout=15)
        harness.wait_all_sent(self.db, timeout=15, relay=relay)
        print(f"OOM lifted: all rows sent {time.time() - lifted:.2f}s later", flush=True)
        self.assert_no_row_blamed()
        for i, topic in enumerate(GOOD_TOPICS):
            self.assertEqual(stream_mids(self.r, topic), during[i::2],
                             f"{topic}: each row once, in order")
        self.verifier().report("after OOM").assert_exactly_once(self)

    def test_function_flush_blames_no_row(self):
        """The relay publishes with plain XADD: a FUNCTION FLUSH takes nothing it
        needs to publish. Rows keep arriving and no row is blamed."""
        relay = self.start_relay()
        for round_ in range(3):
            self.r.function_flush()
            ids = [insert(self.db, GOOD_TOPICS[i % 2], b"after flush %d.%d" % (round_, i))
                   for i in range(5)]
            flushed = time.time()
            harness.wait_all_sent(self.db, timeout=15, relay=relay)
            took = time.time() - flushed
            found = harness.entries_by_message_id(self.r)
            self.assertTrue(all(len(found.get(m, [])) == 1 for m in ids))
            print(f"FUNCTION FLUSH round {round_}: rows sent {took:.2f}s later", flush=True)
            self.assert_no_row_blamed()
        self.verifier().report("after FUNCTION FLUSH").assert_exactly_once(self)


if __name__ == "__main__":
    unittest.main()
