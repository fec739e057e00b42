"""Delivery: every committed row arrives once, with every field as the stream contract says.

Promises tested (docs/DESIGN.md P1, P3, P4, "Batches from snapshots", and the
README's stream contract):
- rows committed before and after the relay starts each arrive exactly once in
  the stream named by their topic, and leave outbox.unsent;
- an entry carries id (message_id), topic, key (absent when partition_key is
  NULL), payload bytes verbatim, created_at (RFC 3339 UTC, the row's time),
  outbox_id (the row id in decimal) and one "h.<name>" field per header;
- created_at, written by the relay from its binary value, is what
  PostgreSQL's to_char writes for it, from 4713 BC to the year 294,276,
  and empty for infinity;
- payloads written through outbox.enqueue as text, jsonb and bytea arrive as
  the bytes the table holds;
- rows of rolled-back transactions (and rolled-back savepoints) never arrive;
  a row that commits after rows with higher ids is not skipped, nor, while a
  backlog drains, left until the backlog is gone;
- batches reach each stream in order while batches fail (Redis frozen past
  publish_timeout); the relay reads its batches on one claiming connection;
- a relay started on an empty outbox reads a later burst of 120,000 rows
  through messages_txid_idx, each chunk from where the one before ended: no
  sequential scan per chunk, and index reads that grow with the rows read,
  not with the table times the chunks;
- a row with a topic outside [A-Za-z0-9._-]{1,200} is not published, is
  quarantined with an error that names the topic at its first batch, does not
  hold back the rows behind it, and is explained in the log.
"""

import datetime
import json
import random
import re
import time
import unittest

import psycopg2

from testkit import harness
from testkit.harness import insert, scalar, wait_until

harness.require_relay()
harness.set_deadline(240)

POLL = "200ms"


def rows_by_message_id(conn):
    with conn.cursor() as cur:
        cur.execute("SELECT m.message_id::text, m.id, m.topic, m.partition_key, m.payload,"
                    " m.headers, m.created_at, q.error, q.quarantined_at,"
                    " q.id IS NULL AND NOT EXISTS (SELECT FROM outbox.unsent AS u"
                    "                              WHERE u.id = m.id) AS sent"
                    " FROM outbox.messages AS m LEFT JOIN outbox.quarantine AS q ON q.id = m.id"
                    " ORDER BY m.id")
        names = [d[0] for d in cur.description]
        return {r[0]: dict(zip(names, r)) for r in cur.fetchall()}


def expected_header_fields(headers):
    """Strings verbatim; other JSON values as their JSON text."""
    fields = {}
    for name, value in (headers or {}).items():
        text = value if isinstance(value, str) else json.dumps(value)
        fields[b"h." + name.encode()] = text.encode()
    return fields


class DeliveryTest(harness.ServerTestCase):

    def assert_entry_matches_row(self, row, stream, fields):
        mid = row["message_id"]
        self.assertEqual(stream, row["topic"].encode(), f"{mid}: stream is the topic")
        expected = {
            b"id": mid.encode(),
            b"topic": row["topic"].encode(),
            b"payload": bytes(row["payload"]),
            b"outbox_id": str(row["id"]).encode(),
            **expected_header_fields(row["headers"]),
        }
        if row["partition_key"] is not None:
            expected[b"key"] = row["partition_key"].encode()
        created = fields.get(b"created_at", b"").decode(errors="replace")
        got = {k: v for k, v in fields.items() if k != b"created_at"}
        self.assertEqual(got, expected, f"entry fields of row {row['id']}")
        parsed = harness.parse_rfc3339_utc(created)
        self.assertIsNotNone(parsed, f"created_at {created!r} is RFC 3339 UTC ending in Z")
        when, digits = parsed
        slack = datetime.timedelta(seconds=10 ** -digits) if digits < 6 else \
            datetime.timedelta(microseconds=1)
        self.assertLess(abs(when - row["created_at"]), slack,
                        f"created_at {created} is the row's {row['created_at'].isoformat()}")

    def assert_all_delivered_once(self):
        rows = rows_by_message_id(self.db)
        found = harness.entries_by_message_id(self.r)
        for mid, row in rows.items():
            entries = found.get(mid, [])
            self.assertEqual(len(entries), 1, f"row {row['id']} ({mid}) has {len(entries)} entries")
            stream, _, fields = entries[0]
            self.assert_entry_matches_row(row, stream, fields)
            self.assertTrue(row["sent"], f"row {row['id']} is out of outbox.unsent")
        self.verifier().report().assert_exactly_once(self)
        return rows, found

    def test_rows_before_and_after_start_arrive_once_with_every_field(self):
        cases = [
            ("orders", b"plain", None, None),
            ("orders", b"\x00\xff\xfe\r\n", "customer-42", None),
            ("orders", b"\xc3\x28 invalid utf-8 \xa0\xa1", "k", {"trace": "abc"}),
            ("billing.invoices", b"", None, {"a": "1", "n": 42, "flag": True, "neg": -7}),
            ("A-z_0.9", "unicode ☃ payload".encode(), "kéy ☃", {"quote": 'he said "hi" ☃'}),
            ("t" * 200, b"x" * 65536, None, {}),
        ]
        for topic, payload, key, headers in cases:
            insert(self.db, topic, payload, key, headers)
        relay = self.relay(poll_interval=POLL)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        for topic, payload, key, headers in cases:
            insert(self.db, topic, payload + b"-after", key, headers)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        rows, found = self.assert_all_delivered_once()
        self.assertEqual(len(rows), 2 * len(cases))
        for mid, row in rows.items():
            if row["partition_key"] is None:
                self.assertNotIn(b"key", found[mid][0][2], "no key field when key is NULL")

    def test_created_at_is_written_as_postgresql_writes_it(self):
        """The relay writes created_at from its binary value: each entry's is
        what to_char writes for the row (years BC, past 9999, infinity)."""
        rng = random.Random(40)
        values = ["2026-12-07 22:58:01.123456+00", "2024-02-29 12:34:56.000001+05",
                  "2000-01-01 00:00:00+00", "1999-12-31 23:59:59.999999+00",
                  "0001-01-01 00:00:00+00", "0001-12-31 23:59:59.999999+00 BC",
                  "0044-03-15 12:00:00+00 BC", "4713-01-01 00:00:00+00 BC",
                  "9999-12-31 23:59:59.999999+00", "10000-01-01 00:00:00+00",
                  "294276-12-31 23:59:59.999999+00", "infinity", "-infinity"]
        with self.db.cursor() as cur:
            for v in values:
                cur.execute("INSERT INTO outbox.messages (topic, payload, created_at)"
                            " VALUES ('stamps', 'x', %s::timestamptz)", (v,))
            for _ in range(300):  # days from 4713 BC to the year 292,000
                cur.execute("INSERT INTO outbox.messages (topic, payload, created_at)"
                            " VALUES ('stamps', 'x', timestamptz '2000-01-01 00:00:00+00'"
                            " + make_interval(days => %s, secs => %s))",
                            (rng.randint(-2451000, 106000000), rng.randint(0, 86399999999) / 1e6))
        relay = self.relay(poll_interval=POLL)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        with self.db.cursor() as cur:
            cur.execute("SELECT id, coalesce(to_char(created_at AT TIME ZONE 'UTC',"
                        " 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), '') FROM outbox.messages")
            want = {str(i): text for i, text in cur.fetchall()}
        got = {fields[b"outbox_id"].decode(): fields[b"created_at"].decode()
               for _, fields in self.r.xrange("stamps")}
        self.assertEqual(len(want), len(values) + 300)
        self.assertEqual(got, want)

    def test_backlog_larger_than_a_batch_arrives_once_in_id_order(self):
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        for start in range(0, 1050, 350):
            harness.insert_many(conn, [(f"topic{i % 3}", b"%d" % i, f"k{i % 7}")
                                       for i in range(start, start + 350)])
        relay = self.relay(poll_interval=POLL, batch_size=100)
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.verifier().report().assert_exactly_once(self)
        for stream, entries in harness.all_entries(self.r).items():
            ids = [int(fields[b"outbox_id"]) for _, fields in entries]
            self.assertEqual(ids, sorted(ids), f"stream {stream!r} is in claim (id) order")
            self.assertEqual(len(ids), 350)

    def test_a_burst_after_an_empty_start_is_read_by_index(self):
        # The relay prepares its batch statement once, on an empty outbox
        # here, and the statistics say the table is empty until autovacuum
        # comes: each batch's bounds must still come off messages_txid_idx
        # (outbox.batch_bounds, once per batch: its entries read stay a small
        # multiple of the rows) and each chunk off the primary key (at least a
        # scan per chunk), never from a scan of the table.
        rows = 120000
        chunk = 500

        def reads():
            # Of the table's partitions that rows went to (a scan of an
            # empty one, which a plan may choose, reads nothing).
            seq = scalar(self.db, "SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_user_tables"
                                  " WHERE relid IN (SELECT relid FROM"
                                  " pg_partition_tree('outbox.messages') WHERE isleaf)"
                                  " AND n_tup_ins > 0")
            return ((seq,) + harness.index_reads(self.db, "messages_pkey")
                    + harness.index_reads(self.db, "messages_txid_idx"))
        # Empty and analysed, as autovacuum leaves an outbox after a drain.
        with self.db.cursor() as cur:
            cur.execute("SELECT outbox.set_partitions('keyed', 4)")
            cur.execute("VACUUM ANALYZE outbox.messages")
        relay = self.relay(poll_interval=POLL, batch_size=chunk, observe_interval="10m")
        relay.wait_for_log(r"INFO relay: .*running", timeout=30)
        time.sleep(2.0)  # the relay's first statements (if their statistics come late, a few count)
        before = reads()
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'burst', convert_to(g::text, 'UTF8')"
                        " FROM generate_series(1, 100000) AS g")
            cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload)"
                        " SELECT 'keyed', 'k' || (g % 1000), convert_to(g::text, 'UTF8')"
                        " FROM generate_series(1, 20000) AS g")
        wait_until(lambda: self.r.exists("burst") and self.r.xlen("burst") == 100000
                   and sum(self.r.xlen(f"keyed:{p:03d}") for p in range(4)) == 20000,
                   timeout=120, relay=relay, message="the burst to be published")
        # (No look at outbox.unsent until the figures are in: its reads would
        # count.) A backend that goes idle within a second of its last flush of
        # statistics flushes them only after PostgreSQL's idle interval
        # (10 s): read until the burst's index reads are in, 15 s at most.
        chunks = rows // chunk
        deadline = time.monotonic() + 15.0
        while True:
            seq, pk_scan, pk_read, txid_scan, txid_read = (
                a - b for a, b in zip(reads(), before))
            if (pk_scan >= chunks and pk_read >= rows and txid_read >= rows) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        print(f"burst: {chunks} chunks; primary key {pk_scan} scans, {pk_read} entries;"
              f" messages_txid_idx {txid_scan} scans, {txid_read} entries; {seq} table scans")
        # Other sessions scan the table now and then; a plan that scans runs
        # once per chunk.
        self.assertLess(seq, chunks / 5,
                        f"{seq} sequential scans of outbox.messages for {chunks} chunks")
        self.assertGreaterEqual(pk_scan, chunks,
                                f"{pk_scan} scans of the primary key for {chunks} chunks")
        self.assertGreaterEqual(pk_read, rows, f"{pk_read} primary key entries for {rows} rows")
        # Every statement of the relay counts here, not the chunks alone: a
        # statement that walked the outbox once per chunk (the quarantine's
        # copy did, for an empty list) reads the rows times the chunks.
        self.assertLess(pk_read, 4 * rows,
                        f"{pk_read} primary key entries read for {rows} rows in {chunks} chunks:"
                        " a statement of the relay reads the outbox per chunk")
        self.assertLess(txid_read, 4 * rows,
                        f"{txid_read} entries of messages_txid_idx read for {rows} rows: the"
                        " bounds of a batch are read more than once")

    def claim_connections(self):
        return scalar(self.db, "SELECT count(*) FROM pg_stat_activity"
                               " WHERE application_name = 'outbox-relay'")

    def stream_total(self):
        return sum(self.r.xlen(f"topic{i}") for i in range(3))

    def test_batches_keep_stream_order_when_batches_fail(self):
        """The next chunk is read while one publishes. Freezing Redis fails
        the batch by publish_timeout while its next chunk waits, read: the
        batch is read again from its start after a backoff, what Redis holds
        is skipped, and nothing overtakes it, so each stream stays in id
        order with every row once."""
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        rows = 12000
        for start in range(0, rows, 2000):
            harness.insert_many(conn, [(f"topic{i % 3}", b"%d" % i, None)
                                       for i in range(start, start + 2000)])
        relay = self.relay(poll_interval=POLL, batch_size=100, publish_timeout="300ms",
                           reconnect_min="50ms", reconnect_max="200ms")
        relay.wait_for_log(r"INFO relay: .*running", timeout=30)
        failures = 0
        published = 0
        for _ in range(3):
            # The rows of a batch leave outbox.unsent together when it is
            # recorded: progress is what the streams hold.
            wait_until(lambda: self.stream_total() >= min(rows, published + 200),
                       timeout=60, interval=0.01, relay=relay)
            if self.stream_total() == rows:
                break
            self.redis.pause()
            try:
                time.sleep(0.8)
            finally:
                self.redis.resume()
            failures += 1
            published = self.stream_total()
        harness.wait_all_sent(self.db, timeout=120, relay=relay)
        self.assertGreater(failures, 0, "the drain ended before Redis could be frozen")
        relay.wait_for_log(r"no reply from Redis within publish_timeout", timeout=5)
        self.assertEqual(harness.problem_lines(relay.log(), "pg"), [],
                         "no claiming connection was lost or timed out")
        self.verifier().report().assert_exactly_once(self)
        for stream, entries in harness.all_entries(self.r).items():
            ids = [int(fields[b"outbox_id"]) for _, fields in entries]
            self.assertEqual(ids, sorted(ids), f"stream {stream!r} is in claim (id) order")
            self.assertEqual(len(ids), 4000)

    def test_batches_are_read_on_one_claiming_connection(self):
        # One design: the next chunk's query is in flight on the same
        # connection while the one before publishes; no second claiming
        # connection, whatever the (no longer effective) pipeline key says.
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        for start in range(0, 1000, 250):
            harness.insert_many(conn, [("orders", b"%d" % i, None)
                                       for i in range(start, start + 250)])
        relay = self.relay(poll_interval=POLL, batch_size=100)
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.assertEqual(self.claim_connections(), 1)
        self.verifier().report().assert_exactly_once(self)
        ids = [int(f[b"outbox_id"]) for _, f in harness.stream_entries(self.r, "orders")]
        self.assertEqual(ids, sorted(ids))
        self.assertEqual(len(ids), 1000)

    def test_enqueue_payloads_arrive_as_stored(self):
        relay = self.relay(poll_interval=POLL)
        with self.db.cursor() as cur:
            cur.execute("SELECT outbox.enqueue('orders', 'k1', %s)", ("héllo ☃\n",))
            cur.execute("SELECT outbox.enqueue('orders', NULL, %s::jsonb, %s::jsonb)",
                        ('{"b": [true, null], "a": 1}', '{"source": "enqueue"}'))
            cur.execute("SELECT outbox.enqueue('orders', NULL, %s)",
                        (psycopg2.Binary(b"\x00\xff\xfe\r\n"),))
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assert_all_delivered_once()
        payloads = sorted(f[b"payload"] for _, _, f in
                          sum(harness.entries_by_message_id(self.r).values(), []))
        self.assertEqual(payloads, sorted([
            "héllo ☃\n".encode(), b'{"a": 1, "b": [true, null]}', b"\x00\xff\xfe\r\n"]))

    def test_rolled_back_rows_never_arrive(self):
        relay = self.relay(poll_interval=POLL)
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        rolled_back = [insert(conn, "orders", b"rolled back %d" % i, commit=False)
                       for i in range(5)]
        conn.rollback()
        kept = [insert(conn, "orders", b"kept before savepoint", commit=False)]
        conn.cursor().execute("SAVEPOINT s")
        rolled_back.append(insert(conn, "orders", b"in savepoint", commit=False))
        conn.cursor().execute("ROLLBACK TO SAVEPOINT s")
        kept.append(insert(conn, "orders", b"kept after savepoint", commit=False))
        conn.commit()
        marker = insert(self.db, "orders", b"marker")
        wait_until(lambda: marker in harness.entries_by_message_id(self.r), timeout=30,
                   relay=relay, message="the marker row's entry")
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        found = harness.entries_by_message_id(self.r)
        for mid in rolled_back:
            self.assertNotIn(mid, found, "a rolled-back row was published")
        for mid in kept:
            self.assertIn(mid, found)
        self.assert_all_delivered_once()

    def test_row_committed_after_higher_ids_is_not_skipped(self):
        relay = self.relay(poll_interval=POLL)
        slow = self.pg.connect(autocommit=False)
        self.addCleanup(slow.close)
        late = insert(slow, "orders", b"lower id, commits last", commit=False)
        later_ids = [insert(self.db, "orders", b"higher id %d" % i) for i in range(3)]
        wait_until(lambda: all(m in harness.entries_by_message_id(self.r) for m in later_ids),
                   timeout=30, relay=relay, message="the rows committed first")
        self.assertNotIn(late, harness.entries_by_message_id(self.r))
        slow.commit()
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertIn(late, harness.entries_by_message_id(self.r))
        self.assert_all_delivered_once()

    def test_row_committed_late_during_a_backlog_is_not_left_behind_it(self):
        # A row that commits late, while a backlog drains, joins the batch of
        # the first tick after its commit: the rows committed before it may
        # go first, but none committed after it, however many wait.
        slow = self.pg.connect(autocommit=False)
        self.addCleanup(slow.close)
        late = insert(slow, "orders", b"lowest id, commits during the drain", commit=False)
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        total = 30000
        for start in range(0, total, 10000):
            harness.insert_many(conn, [("backlog", b"%d" % i) for i in range(start, start + 10000)])
        relay = self.relay(poll_interval=POLL, batch_size=100)
        wait_until(lambda: self.r.xlen("backlog") >= total // 10, timeout=60, relay=relay,
                   message="a tenth of the backlog")
        slow.commit()
        after_ids = []
        for start in range(total, 2 * total, 10000):
            after_ids += harness.insert_many(
                conn, [("backlog", b"%d" % i) for i in range(start, start + 10000)])
        harness.wait_all_sent(self.db, timeout=120, relay=relay)
        self.assert_all_delivered_once()
        found = harness.entries_by_message_id(self.r)
        late_ms = int(found[late][0][1].split("-")[0])
        behind = [mid for mid in after_ids if int(found[mid][0][1].split("-")[0]) < late_ms]
        self.assertEqual(behind, [], f"{len(behind)} of {total} rows committed after the late"
                                     " row were published in a batch before it")
        ids = [int(f[b"outbox_id"]) for _, f in self.r.xrange("backlog")]
        self.assertEqual(ids, sorted(ids), "the backlog's stream is in commit (id) order")
        self.assertEqual(len(ids), 2 * total)

    BAD_TOPICS = ["bad topic!", "{x}", "", "t" * 201, "ünïcode"]

    def insert_good_and_bad(self):
        good = [insert(self.db, "orders", b"good before")]
        bad = {insert(self.db, topic, b"bad"): topic for topic in self.BAD_TOPICS}
        good += [insert(self.db, "orders", b"good after %d" % i) for i in range(4)]
        return good, bad

    def test_bad_topic_is_not_published_and_does_not_block_others(self):
        good, bad = self.insert_good_and_bad()
        relay = self.relay(poll_interval=POLL)

        def good_sent():
            rows = rows_by_message_id(self.db)
            return all(rows[m]["sent"] for m in good)
        wait_until(good_sent, timeout=30, relay=relay, message="the good rows behind bad ones")

        def bad_quarantined():
            rows = rows_by_message_id(self.db)
            return all(rows[m]["error"] for m in bad)
        wait_until(bad_quarantined, timeout=30, relay=relay,
                   message="every bad row quarantined with its error")

        rows = rows_by_message_id(self.db)
        found = harness.entries_by_message_id(self.r)
        streams = harness.stream_names(self.r)
        for mid, topic in bad.items():
            self.assertFalse(rows[mid]["sent"], f"bad topic {topic!r} counted as sent")
            self.assertNotIn(mid, found, f"bad topic {topic!r} published")
            self.assertNotIn(topic.encode(), streams)
            self.assertRegex(rows[mid]["error"], r"(?i)topic",
                             f"the quarantine's error for topic {topic!r} says why")
        self.assertEqual(streams, [b"orders"])
        for mid in good:
            self.assertEqual(len(found.get(mid, [])), 1)
        self.assertEqual(harness.count_unsent(self.db), 0)
        bad_mid = next(m for m, t in bad.items() if t == "bad topic!")
        relay.wait_for_log(r"^.*\b(WARNING|ERROR)\b.*(?i:topic).*$", timeout=10)
        lines = [line for line in relay.log().splitlines()
                 if re.search(r"\b(WARNING|ERROR)\b", line) and re.search(r"(?i)topic", line)
                 and (bad_mid in line or "bad topic!" in line)]
        self.assertTrue(lines, "the log names the row with the bad topic and says why\n"
                        + relay.log_tail())

    def test_bad_topic_is_quarantined_at_once(self):
        # No retry can fix a topic: the batch that first holds the bad rows
        # quarantines them (one record_batch, one quarantined_at) and publishes
        # the good rows around them; no batch fails and is read again.
        good, bad = self.insert_good_and_bad()
        relay = self.relay(poll_interval=POLL)

        def quarantined():
            rows = rows_by_message_id(self.db)
            return all(rows[m]["error"] for m in bad) and all(rows[m]["sent"] for m in good)
        wait_until(quarantined, timeout=30, relay=relay,
                   message="every bad row quarantined and every good one sent")
        rows = rows_by_message_id(self.db)
        for mid in bad:
            self.assertFalse(rows[mid]["sent"])
        self.assertEqual(len({rows[m]["quarantined_at"] for m in bad}), 1,
                         "the bad rows were quarantined by one batch")
        self.assertEqual(harness.count_unsent(self.db), 0)
        text = harness.metrics_text(relay)
        failed = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^outbox_relay_publish_errors_total\{kind="([^"]+)"\} (\S+)$', text, re.MULTILINE)
            if m.group(1) != "row"}
        self.assertTrue(failed, "the failed-batch counters are on /metrics")
        self.assertEqual(sum(failed.values()), 0, f"a batch failed and was read again: {failed}")
        self.assertEqual(harness.metric(text, "outbox_relay_rows_quarantined_total"), len(bad))


if __name__ == "__main__":
    unittest.main()
