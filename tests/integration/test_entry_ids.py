"""Entry ids in place of dedup records (docs/DESIGN.md, "Batches from snapshots").

A row's entry id is `<its tick's ms>-<its rank in its stream's rows of the
batch>`, the same for every relay and after any crash, and XADD refuses an
id at or below the stream's last one: a row already in its stream is never
appended again, with no record per message in Redis.

Promises tested:
- a batch published before a crash (the relay SIGKILLed after its XADDs,
  while outbox.record_batch waits) is not published again by the next run:
  exactly one entry per message_id, each with the entry id the first run gave
  it, and the rows written after go on behind them;
- outbox.record_batch failing after the publish adds no second copy: its
  PostgreSQL connection terminated while it waits (pg_terminate_backend), or
  the statement refused once (a trigger); the relay says why, reads the batch
  again and records it, and every row is in its stream once, in order;
- a stream's rows go in calls (MULTI, one XADD per row, EXEC) of at most 64
  rows (RELAY_CALL_ROWS) and 256 KiB of entries (RELAY_CALL_BYTES), a bigger
  row alone, seen with MONITOR; each row is taken once (one XADD per row);
- a Redis restarted from a snapshot taken a second earlier, under load,
  lost the entries written after it: the relay finds each such stream
  behind what it wrote, says so, and publishes what Redis lost again from
  the outbox: every committed row in its stream once, in order;
- Redis holds no key per message: after draining thousands of rows the
  keyspace is the streams and nothing else, and stays so after thousands
  more, so what prevents a copy costs nothing per message;
- a tick is on disk before its batch is published, also under a database
  whose default is synchronous_commit off (the entry ids come from it).
"""

import contextlib
import threading
import time
import unittest

from testkit import harness
from testkit.harness import insert_many, scalar, wait_until

harness.require_relay()
harness.set_deadline(300)

RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="500ms",
                   stream_retention="0")
CALL_ROWS = 64
CALL_BYTES = 256 * 1024


class EntryIdTest(harness.ServerTestCase):

    def start_relay(self, **flags):
        relay = self.relay(**{**RELAY_FLAGS, **flags})
        relay.wait_for_log(r"^\S+ INFO redis: .*ready", timeout=30)
        return relay

    def warm_relay(self):
        """A relay past its first batches (the first records the lead even
        when empty), with one row in each stream: the next batch's record
        is the one a test holds."""
        relay = self.start_relay()
        insert_many(self.db, [("orders", b"warm-up"), ("billing", b"warm-up")])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        return relay

    def entries(self):
        """{message_id: [entry_id, ...]} over every stream."""
        return {mid: [e[1] for e in found]
                for mid, found in harness.entries_by_message_id(self.r).items()}

    def assert_in_order(self, topics):
        """Each stream's entries in outbox id order (the order of one writer)."""
        for topic in topics:
            ids = [int(f[b"outbox_id"]) for _, f in harness.stream_entries(self.r, topic)]
            self.assertEqual(ids, sorted(ids), f"{topic}: entries out of outbox order")

    def hold_record_batch(self):
        """Locks outbox.stream_positions against writes (reads go on): the
        relay's outbox.record_batch waits. Returns the locking connection;
        its commit releases the lock."""
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        with conn.cursor() as cur:
            cur.execute("LOCK TABLE outbox.stream_positions IN EXCLUSIVE MODE")
        return conn

    def waiting_record_backends(self):
        with self.db.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                        " AND wait_event_type = 'Lock' AND query LIKE '%record_batch%'")
            return [r[0] for r in cur.fetchall()]

    def wait_published_and_held(self, n, relay=None):
        """Waits until n entries are in Redis and the batch's record waits."""
        wait_until(lambda: sum(self.r.xlen(s) for s in harness.stream_names(self.r)) >= n,
                   timeout=30, interval=0.05, relay=relay, message=f"{n} entries in Redis")
        wait_until(lambda: self.waiting_record_backends() != [], timeout=30, interval=0.05,
                   relay=relay, message="outbox.record_batch to wait for the lock")

    def terminate_waiting_records(self):
        """Ends the sessions whose record waits, and waits until they are gone
        (pg_terminate_backend only signals them)."""
        pids = self.waiting_record_backends()
        with self.db.cursor() as cur:
            for pid in pids:
                cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: scalar(self.db, "SELECT count(*) FROM pg_stat_activity"
                                           " WHERE pid = ANY(%s)", (pids,)) == 0,
                   timeout=10, interval=0.05, message="the terminated sessions to end")
        return pids

    def rows(self, n, topics=("orders", "billing"), keyed=True):
        return [(topics[i % len(topics)], b"row %d" % i, f"k{i % 7}" if keyed else None)
                for i in range(n)]

    # (a)
    def test_rows_published_before_a_crash_are_not_published_again(self):
        n = 60
        first = self.warm_relay()
        lock = self.hold_record_batch()
        mids = insert_many(self.db, self.rows(n))
        self.wait_published_and_held(n + 2, relay=first)
        before = self.entries()
        self.assertEqual(sorted(len(v) for v in before.values()), [1] * (n + 2))
        first.kill()  # SIGKILL: after the XADDs, before the record
        # The dead relay's statement must not go through when the lock goes:
        # its session ends with the process, as after a crash of the host.
        self.assertGreater(len(self.terminate_waiting_records()), 0)
        lock.commit()
        self.assertEqual(harness.count_unsent(self.db), n, "the batch was recorded")
        self.assertEqual(len(self.waiting_record_backends()), 0)

        second = self.start_relay()
        later = insert_many(self.db, self.rows(10))
        harness.wait_all_sent(self.db, timeout=30, relay=second)
        after = self.entries()
        for mid in mids:
            self.assertEqual(after.get(mid), before[mid],
                             f"{mid}: published again, or its entry changed")
        for mid in later:
            self.assertEqual(len(after.get(mid, [])), 1, f"{mid} after the restart")
        self.verifier(compare_payloads=True).report("published before a crash") \
            .assert_exactly_once(self)
        self.assert_in_order(("orders", "billing"))

    # (b)
    def test_record_connection_lost_after_publish_adds_no_second_copy(self):
        n = 60
        relay = self.warm_relay()
        lock = self.hold_record_batch()
        insert_many(self.db, self.rows(n))
        self.wait_published_and_held(n + 2, relay=relay)
        before = self.entries()
        self.assertGreater(len(self.terminate_waiting_records()), 0)
        lock.commit()
        relay.wait_for_log(r"^\S+ WARNING batch: batch not published: recording the batch"
                           r" failed: .*; it is read again after a backoff", timeout=15)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(self.entries(), before, "the batch read again added or moved entries")
        self.verifier(compare_payloads=True).report("record connection lost") \
            .assert_exactly_once(self)
        self.assert_in_order(("orders", "billing"))
        self.assertTrue(relay.alive(), relay.log_tail())

    def test_record_refused_once_after_publish_adds_no_second_copy(self):
        with self.db.cursor() as cur:
            cur.execute("DROP SEQUENCE IF EXISTS public.record_failures;"
                        " CREATE SEQUENCE public.record_failures")
            cur.execute("""
                CREATE OR REPLACE FUNCTION public.refuse_first_record() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                  IF nextval('public.record_failures') = 1 THEN
                    RAISE EXCEPTION 'test: this record is refused once';
                  END IF;
                  RETURN NEW;
                END $$""")
            cur.execute("CREATE TRIGGER refuse_first_record BEFORE INSERT OR UPDATE"
                        " ON outbox.stream_positions FOR EACH ROW"
                        " EXECUTE FUNCTION public.refuse_first_record()")

        def drop():
            with self.db.cursor() as cur:
                cur.execute("DROP TRIGGER IF EXISTS refuse_first_record"
                            " ON outbox.stream_positions")
        self.addCleanup(drop)
        n = 50
        insert_many(self.db, self.rows(n, keyed=False))
        self.r.config_resetstat()
        relay = self.start_relay()
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        relay.wait_for_log(r"^\S+ WARNING batch: batch not published: recording the batch"
                           r" failed: .*this record is refused once", timeout=5)
        self.assertGreater(scalar(self.db, "SELECT last_value FROM public.record_failures"), 1)
        self.verifier(compare_payloads=True).report("record refused once") \
            .assert_exactly_once(self)
        self.assert_in_order(("orders", "billing"))
        # The second reading of the batch appended nothing: at most one XADD
        # per row was accepted, whatever it sent again.
        xadds = self.r.info("commandstats").get("cmdstat_xadd", {})
        self.assertEqual(xadds.get("calls", 0) - xadds.get("failed_calls", 0), n)

    # (c)
    def test_a_stream_s_calls_hold_64_rows_and_256_kib(self):
        """A batch cuts each stream's rows into calls of at most 64 rows and
        256 KiB of entries, a bigger row going alone: Redis holds its one
        thread for one call, and a call stays far below its limit on a
        command."""
        kib = 1024
        sizes = [100 * kib] * 3 + [300 * kib] + [10] * 72
        # In id order: {100, 100} KiB (a third would pass 256 KiB), {100}
        # (the 300 KiB row does not fit beside it), {300} (nor does a small
        # row), then 64 small rows and the last 8.
        expected = [2, 1, 1, 64, 8]
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'cut', convert_to(repeat('x', n), 'UTF8')"
                        " FROM unnest(%s::int[]) WITH ORDINALITY AS s(n, i) ORDER BY i",
                        (sizes,))
        calls = {}  # client -> [rows of each call]
        done = threading.Event()
        ready = threading.Event()

        def monitor():
            with contextlib.closing(self.redis.client()) as c, c.monitor() as m:
                ready.set()
                open_call = {}
                for cmd in m.listen():
                    words = cmd["command"].split(" ", 2)
                    client = (cmd.get("client_address"), cmd.get("client_port"))
                    name = words[0].upper()
                    if name == "ECHO" and len(words) > 1 and "monitor-end" in words[1]:
                        break
                    if name == "MULTI":
                        open_call[client] = 0
                    elif name == "XADD" and client in open_call:
                        open_call[client] += 1
                    elif name == "EXEC" and client in open_call:
                        calls.setdefault(client, []).append(open_call.pop(client))
            done.set()
        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        self.assertTrue(ready.wait(10))
        time.sleep(0.2)
        self.r.config_resetstat()
        relay = self.start_relay()
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.r.echo("monitor-end")
        self.assertTrue(done.wait(20), "MONITOR did not see its end")
        seen = [n for per in calls.values() for n in per if n > 0]
        print(f"rows per call: {seen}", flush=True)
        self.assertEqual(seen, expected,
                         f"{len(sizes)} rows in calls of at most {CALL_ROWS} rows and 256 KiB")
        at = 0
        for n in seen:
            cut = sizes[at:at + n]
            self.assertTrue(n <= CALL_ROWS and (n == 1 or sum(cut) <= CALL_BYTES), cut)
            at += n
        xadds = self.r.info("commandstats").get("cmdstat_xadd", {})
        self.assertEqual(xadds.get("calls", 0), len(sizes), "each row taken once")
        self.assertEqual([len(f[b"payload"]) for _, f in harness.stream_entries(self.r, "cut")],
                         sizes, "the rows in id order")
        self.verifier().report("calls").assert_exactly_once(self)

    # (d)
    def test_redis_restored_from_an_earlier_snapshot_loses_nothing(self):
        relay = self.start_relay()
        producers = harness.Producers(self.pg, n=2, rate=400, topics=("orders", "billing"))
        producers.start()
        try:
            wait_until(lambda: self.r.xlen("orders") > 100, timeout=30, relay=relay,
                       message="entries before the snapshot")
            self.r.save()  # what a restore brings back
            before = self.r.xlen("orders")
            wait_until(lambda: self.r.xlen("orders") > before + 100, timeout=30, relay=relay,
                       message="entries after the snapshot")
            self.redis.kill()
            self.redis.start()  # from the snapshot: the entries after it are gone
            self.assertLess(self.r.xlen("orders"), before + 100)
            time.sleep(1.0)
        finally:
            producers.stop()
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        relay.wait_for_log(r"WARNING batch: stream orders holds less than was published",
                           timeout=10)
        fig = self.verifier().report("restored from an earlier snapshot")
        fig.assert_exactly_once(self)
        self.assertGreater(fig.committed, 400)

    def test_no_key_per_message(self):
        topics = ("orders", "billing", "audit")
        relay = self.start_relay(batch_size=1000)
        sizes = []
        for round_ in range(2):
            with self.db.cursor() as cur:
                cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload)"
                            " SELECT (%s::text[])[1 + i %% 3], 'k' || (i %% 50),"
                            " convert_to('row ' || i, 'UTF8')"
                            " FROM generate_series(1, 5000) AS i", (list(topics),))
            harness.wait_all_sent(self.db, timeout=60, relay=relay)
            keys = {k: self.r.type(k) for k in self.r.scan_iter(count=1000)}
            print(f"after {5000 * (round_ + 1)} rows: {self.r.dbsize()} keys {keys}", flush=True)
            self.assertEqual(sorted(keys), sorted(t.encode() for t in topics),
                             "Redis holds keys beside the streams")
            self.assertEqual(set(keys.values()), {b"stream"})
            sizes.append(self.r.dbsize())
        self.assertEqual(sizes, [len(topics)] * 2, "the keyspace grew with the rows")
        fig = self.verifier().report("no key per message")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, 10_000)
        self.assert_in_order(topics)

    def test_a_tick_is_on_disk_before_its_batch_is_published(self):
        """Under a database whose default is synchronous_commit off, the batch
        session still commits its ticks synchronously (docs/DESIGN.md, "What
        must reach the disk"): once a row is in its stream, the WAL is flushed
        past where it stood when the row committed. The WAL writer is slowed
        to 10 s and every other session commits asynchronously, so only the
        tick's own commit can have flushed it."""
        with self.db.cursor() as cur:
            cur.execute("ALTER DATABASE app SET synchronous_commit = off")
            cur.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
            cur.execute("SELECT pg_reload_conf()")

        def restore():
            with self.db.cursor() as cur:
                cur.execute("ALTER DATABASE app RESET synchronous_commit")
                cur.execute("ALTER SYSTEM RESET wal_writer_delay")
                cur.execute("SELECT pg_reload_conf()")
        self.addCleanup(restore)
        relay = self.start_relay()
        producer = self.pg.connect()  # a new session: the database's default applies
        self.addCleanup(producer.close)
        with producer.cursor() as cur:
            cur.execute("SHOW synchronous_commit")
            self.assertEqual(cur.fetchone()[0], "off")
            cur.execute("INSERT INTO outbox.messages (topic, payload) VALUES ('orders', 'x')")
        producer.commit()
        written = scalar(self.db, "SELECT pg_current_wal_insert_lsn()::text")
        wait_until(lambda: self.r.xlen("orders") >= 1, timeout=20, relay=relay,
                   message="the row in its stream")
        self.assertTrue(scalar(self.db, "SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn",
                               (written,)),
                        "the tick of a published batch is not on disk")


if __name__ == "__main__":
    unittest.main()
