"""Batches from snapshots in SQL (migrations/016_batches.sql), without the relay.

Promises tested:
- the rows pending when 016 is applied are the batch of the tick after it,
  each once, in id order; rows sent or quarantined before it are in no batch;
- outbox.tick() takes a tick only when something committed since the last
  one, numbers ticks in snapshot order, and gives each a strictly increasing
  ms of at least min_ms;
- a transaction open across ticks is in no batch until it commits, holds back
  none of the transactions that commit after it began, and joins the batch of
  the first tick after its commit; an aborted one is in none;
- a batch is in id order, also where a transaction that committed later had
  the lower transaction id (it waited for the other before inserting);
- under concurrent producers and two sessions ticking, every committed row is
  in exactly one batch, and the batches, read in chunks that resume after the
  last id, cover each batch exactly;
- outbox.tick_bounds, taken under the same load, reads the bounds of the
  batch of its tick when that tick is the one after the lead it is given
  (the same as outbox.batch_bounds afterwards), and none otherwise;
- outbox.batch_bounds reads a batch's bounds off messages_txid_idx and
  outbox.batch_rows its chunks off the primary key, never a scan of the table;
  the runs between running transactions (outbox.finished_runs) are planned
  with the tick's and the bounds' statements, not called;
- outbox.record_batch moves each stream's position, and the lead, forward
  only, and quarantines a copy of a row, once, with its error;
- outbox.unsent holds the rows past their stream's recorded position that are
  not quarantined;
- outbox.backlog counts, per topic, the rows outbox.unsent holds and the
  oldest one's created_at, also for a topic never published (each row, not
  the span of its ids), from the oldest position asked about or the lead
  (what a walk reads: tests/integration/test_observer.py);
- roles: the relay may tick and read ticks, batches and positions; producers
  may do none of it.
"""

import os
import random
import threading
import time
import unittest

import psycopg2

from testkit import harness
from testkit.harness import scalar
from testkit.postgres import Postgres

harness.set_deadline(300)


def bounds(conn, prev, nxt):
    with conn.cursor() as cur:
        cur.execute("SELECT lo, hi FROM outbox.batch_bounds(%s, %s)", (prev, nxt))
        return cur.fetchone()


def batch(conn, prev, nxt, after=None, limit=1_000_000):
    """[(txid, id)] of the batch (prev, nxt], from after (an id) on, as the
    relay reads it: within the batch's bounds, in id order."""
    lo, hi = bounds(conn, prev, nxt)
    if lo is None:
        return []
    with conn.cursor() as cur:
        cur.execute("SELECT txid::text, id FROM outbox.batch_rows(%s, %s, %s, %s, %s)",
                    (prev, nxt, lo - 1 if after is None else after, hi, limit))
        return [(x, i) for x, i in cur.fetchall()]


def tick(conn, min_ms=0):
    return scalar(conn, "SELECT outbox.tick(%s)", (min_ms,))


def insert(conn, topic="orders", n=1):
    with conn.cursor() as cur:
        cur.execute("INSERT INTO outbox.messages (topic, payload)"
                    " SELECT %s, '\\x00' FROM generate_series(1, %s) RETURNING id", (topic, n))
        return [r[0] for r in cur.fetchall()]


class UpgradeTest(unittest.TestCase):
    """016 applied to a database that has rows: pending, sent and quarantined."""

    def test_rows_pending_at_the_upgrade_are_the_next_batch(self):
        with Postgres(migrations=False) as pg:
            files = pg.migration_files()
            before = [f for f in files if os.path.basename(f) < "016"]
            pg.apply_migrations(before)
            db = pg.connect()
            ids = insert(db, n=6)
            with db.cursor() as cur:
                cur.execute("UPDATE outbox.messages SET sent_at = now() WHERE id = ANY(%s)",
                            (ids[:2],))
                cur.execute("UPDATE outbox.messages SET failed_at = now() WHERE id = %s",
                            (ids[2],))
            pg.apply_migrations([f for f in files if f not in before])
            pg.apply_migrations([f for f in files if f not in before])  # idempotent
            self.assertEqual(scalar(db, "SELECT count(*) FROM outbox.ticks"), 1)
            self.assertEqual(tick(db), 2)
            rows = batch(db, 1, 2)
            self.assertEqual([i for _, i in rows], ids[3:])
            self.assertEqual(len({x for x, _ in rows}), 1, "one transaction: the upgrade's")
            # Nothing else committed: no third tick.
            self.assertEqual(tick(db), 2)
            late = insert(db, n=2)
            self.assertEqual(tick(db), 3)
            self.assertEqual([i for _, i in batch(db, 2, 3)], late)
            self.assertEqual([i for _, i in batch(db, 1, 3)], ids[3:] + late)
            db.close()


class BusyUpgradeTest(unittest.TestCase):
    """016 applied while producers run: its own transaction is not in the first
    tick's list of running ones (PostgreSQL leaves a transaction's own id out of
    its snapshot), yet later transactions commit before that tick."""

    def test_rows_pending_at_a_busy_upgrade_are_the_next_batch(self):
        with Postgres(migrations=False) as pg:
            files = pg.migration_files()
            before = [f for f in files if os.path.basename(f) < "016"]
            pg.apply_migrations(before)
            db = pg.connect()
            pending = insert(db, n=3)
            # A producer in the middle of its transaction holds the upgrade at
            # its ALTER TABLE, after the upgrade has taken its transaction id.
            producer = pg.connect(autocommit=False)
            held = insert(producer, n=1)
            upgrade = threading.Thread(
                target=pg.apply_migrations, args=([f for f in files if f not in before],))
            upgrade.start()
            harness.wait_until(lambda: scalar(db, "SELECT count(*) FROM pg_stat_activity"
                                                  " WHERE wait_event_type = 'Lock'") > 0,
                               timeout=30, message="the upgrade to wait for the producer")
            # A later transaction commits before the first tick is taken.
            scalar(db, "SELECT pg_current_xact_id()::text")
            producer.commit()
            producer.close()
            upgrade.join(60)
            self.assertFalse(upgrade.is_alive())
            self.assertEqual(scalar(db, "SELECT count(*) FROM outbox.ticks"), 1)
            self.assertEqual(tick(db), 2)
            self.assertEqual([i for _, i in batch(db, 1, 2)], pending + held)
            self.assertEqual(scalar(db, "SELECT count(*) FROM outbox.unsent"), 4)
            db.close()


class RelayUpgradeTest(unittest.TestCase):
    """A relay of this version on a database and Redis that relays before 016
    left: what they published stays, what was pending is published once,
    above their entries, and what they quarantined is in the quarantine."""

    def test_rows_pending_at_the_upgrade_are_published_once(self):
        harness.require_relay()
        with Postgres(migrations=False) as pg, harness.Redis() as redis:
            files = pg.migration_files()
            before = [f for f in files if os.path.basename(f) < "016"]
            pg.apply_migrations(before)
            db = pg.connect()
            r = redis.client()
            ids = [i for _ in range(8) for i in insert(db)]
            with db.cursor() as cur:
                cur.execute("SELECT id, message_id::text FROM outbox.messages ORDER BY id")
                mids = dict(cur.fetchall())
                # The relays before published the first three with Redis's
                # clock, here an hour ahead of PostgreSQL's.
                ahead = int(time.time() * 1000) + 3_600_000
                for k, i in enumerate(ids[:3]):
                    r.xadd("orders", {"id": mids[i], "outbox_id": str(i)},
                           id=f"{ahead}-{k}")
                cur.execute("UPDATE outbox.messages SET sent_at = now() WHERE id = ANY(%s)",
                            (ids[:3],))
                cur.execute("UPDATE outbox.messages SET failed_at = now(),"
                            " last_error = 'too big' WHERE id = %s", (ids[3],))
            pg.apply_migrations([f for f in files if f not in before])
            self.assertEqual(scalar(db, "SELECT error FROM outbox.quarantine WHERE id = %s",
                                    (ids[3],)), "too big")
            with harness.Relay(pg, redis, poll_interval="100ms") as relay:
                harness.wait_until(lambda: scalar(db, "SELECT count(*) FROM outbox.unsent") == 0,
                                   timeout=30, relay=relay, message="the pending rows")
                later = insert(db, n=2)
                harness.wait_until(lambda: scalar(db, "SELECT count(*) FROM outbox.unsent") == 0,
                                   timeout=30, relay=relay, message="the rows after the upgrade")
            entries = harness.stream_entries(r, "orders")
            got = [int(f[b"outbox_id"]) for _, f in entries]
            self.assertEqual(got, ids[:3] + ids[4:] + later,
                             "each row once, in order, the quarantined one not at all")
            first_new = entries[3][0]
            if isinstance(first_new, bytes):
                first_new = first_new.decode()
            self.assertGreater(int(first_new.split("-")[0]), ahead,
                               "the new entries lie above those the relays before wrote")
            db.close()


class BatchSqlTest(harness.PostgresTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with cls.db.cursor() as cur:
            cur.execute("CREATE ROLE producer_login LOGIN IN ROLE outbox_producer;"
                        "CREATE ROLE relay_login LOGIN IN ROLE outbox_relay")

    def setUp(self):
        super().setUp()  # outbox.messages emptied
        with self.db.cursor() as cur:
            cur.execute("TRUNCATE outbox.ticks, outbox.stream_positions, outbox.quarantine")
            cur.execute("INSERT INTO outbox.ticks (tick_id, snap, ms)"
                        " VALUES (1, pg_current_snapshot(), 1)")

    def test_a_tick_only_when_something_committed(self):
        self.assertEqual(tick(self.db), 1)
        insert(self.db)
        self.assertEqual(tick(self.db), 2)
        self.assertEqual(tick(self.db), 2)
        # An open transaction's row is not committed: no tick for it.
        other = self.pg.connect(autocommit=False)
        try:
            insert(other)
            self.assertEqual(tick(self.db), 2)
            other.commit()
        finally:
            other.close()
        self.assertEqual(tick(self.db), 3)

    def test_ms_strictly_increases_and_honours_min_ms(self):
        insert(self.db)
        tick(self.db, min_ms=10**13)  # far in the future: the clock is behind it
        insert(self.db)
        tick(self.db)
        insert(self.db)
        tick(self.db, min_ms=5)
        with self.db.cursor() as cur:
            cur.execute("SELECT ms FROM outbox.ticks ORDER BY tick_id")
            ms = [r[0] for r in cur.fetchall()]
        self.assertEqual(ms[1], 10**13)
        self.assertEqual(ms[2:], [10**13 + 1, 10**13 + 2])

    def test_an_open_transaction_holds_back_no_one_and_joins_the_batch_after_its_commit(self):
        slow = self.pg.connect(autocommit=False)
        try:
            (held,) = insert(slow)  # a lower xid, committed last
            fast = insert(self.db, n=3)
            self.assertEqual(tick(self.db), 2)
            self.assertEqual([i for _, i in batch(self.db, 1, 2)], fast)
            slow.commit()
        finally:
            slow.close()
        self.assertEqual(tick(self.db), 3)
        self.assertEqual([i for _, i in batch(self.db, 2, 3)], [held])
        # Its xid is below the rows of the batch before: order is by commit, then id.
        self.assertLess(int(batch(self.db, 2, 3)[0][0]), int(batch(self.db, 1, 2)[0][0]))

    def test_a_running_transaction_is_read_once_by_the_batch_it_commits_in(self):
        """A long transaction that wrote many rows costs the ticks and the bounds
        taken while it runs nothing: its index entries are stepped over, not read
        and filtered at every poll."""
        def txid_reads():
            scalar(self.db, "SELECT pg_stat_force_next_flush()")
            return harness.index_reads(self.db, "messages_txid_idx")[1]

        slow = self.pg.connect(autocommit=False)
        try:
            held = insert(slow, n=20000)
            prev, reads = 1, txid_reads()
            for _ in range(5):
                insert(self.db)
                nxt = tick(self.db)
                self.assertGreater(nxt, prev, "a committed row takes a tick")
                self.assertIsNotNone(bounds(self.db, prev, nxt)[0])
                prev = nxt
            self.assertEqual(tick(self.db), prev, "a running transaction takes no tick")
            read = txid_reads() - reads
            self.assertLess(read, 100, f"{read} entries of messages_txid_idx read by 6 ticks"
                            " and 5 batches of one row beside a running transaction")
            slow.commit()
        finally:
            slow.close()
        nxt = tick(self.db)
        self.assertGreater(nxt, prev)
        self.assertEqual([i for _, i in batch(self.db, prev, nxt)], held)

    def test_a_batch_is_in_id_order_whatever_the_transaction_ids(self):
        """A producer that waits for another before inserting (a lock on its
        aggregate) may have its transaction id first, but draws its row's id
        after the other committed: the batch keeps that order, by id."""
        first_xid = self.pg.connect(autocommit=False)
        try:
            with first_xid.cursor() as cur:
                cur.execute("SELECT pg_current_xact_id()")  # the lower xid, inserting second
            (a,) = insert(self.db)  # committed first, higher xid
            (b,) = insert(first_xid)
            first_xid.commit()
        finally:
            first_xid.close()
        self.assertEqual(tick(self.db), 2)
        rows = batch(self.db, 1, 2)
        self.assertEqual([i for _, i in rows], [a, b])
        self.assertGreater(int(rows[0][0]), int(rows[1][0]), "the txids run the other way")

    def test_the_bounds_a_tick_reads_count_rows_committed_while_it_waited(self):
        """outbox.tick_bounds reads the bounds after its tick's snapshot: a
        row committed while the call waited for the ticks' lock is in the
        tick, so in the bounds too."""
        insert(self.db)
        after = tick(self.db)
        (first,) = insert(self.db)
        holder = self.pg.connect(autocommit=False)
        caller = self.pg.connect()
        got = {}
        try:
            with holder.cursor() as cur:
                cur.execute("LOCK TABLE outbox.ticks IN SHARE ROW EXCLUSIVE MODE")
            pid = scalar(caller, "SELECT pg_backend_pid()")

            def call():
                with caller.cursor() as cur:
                    cur.execute("SELECT tick, lo, hi FROM outbox.tick_bounds(0, %s)", (after,))
                    got["row"] = cur.fetchone()

            t = threading.Thread(target=call)
            t.start()
            harness.wait_until(lambda: scalar(self.db, "SELECT wait_event_type FROM"
                                              " pg_stat_activity WHERE pid = %s", (pid,)) == "Lock",
                               timeout=10, message="the tick to wait for the lock")
            (second,) = insert(self.db)  # committed after the call began
            holder.rollback()
            t.join(10)
        finally:
            holder.close()
            caller.close()
        self.assertEqual(got["row"], (after + 1, first, second))
        self.assertEqual(bounds(self.db, after, after + 1), (first, second))
        # A tick that is not the one after the lead named reads no bounds.
        insert(self.db)
        with self.db.cursor() as cur:
            cur.execute("SELECT tick, lo, hi FROM outbox.tick_bounds(0, %s)", (after,))
            self.assertEqual(cur.fetchone(), (after + 2, None, None))

    def test_the_runs_are_planned_with_the_statements_that_read_them(self):
        """outbox.finished_runs is inlined where the tick and the bounds read
        it, so a busy cycle does not parse and plan its body twice, as a
        function call would (a function counted by track_functions)."""
        insert(self.db)
        after = tick(self.db)
        insert(self.db)
        conn = self.pg.connect(autocommit=False)
        try:
            with conn.cursor() as cur:
                cur.execute("SET LOCAL track_functions = 'all'")
                cur.execute("SELECT tick, lo, hi FROM outbox.tick_bounds(0, %s)", (after,))
                self.assertIsNotNone(cur.fetchone()[1], "the call read the batch's bounds")
                cur.execute("SELECT * FROM outbox.batch_bounds(%s, %s)", (after, after + 1))
                cur.execute("SELECT funcname, calls FROM pg_stat_xact_user_functions"
                            " WHERE schemaname = 'outbox' ORDER BY funcname")
                calls = dict(cur.fetchall())
        finally:
            conn.rollback()
            conn.close()
        self.assertEqual(calls.get("tick_bounds"), 1, calls)  # the calls are counted
        self.assertNotIn("finished_runs", calls)

    def test_an_aborted_transaction_is_in_no_batch(self):
        gone = self.pg.connect(autocommit=False)
        try:
            insert(gone)
            kept = insert(self.db)
            self.assertEqual(tick(self.db), 2)
            gone.rollback()
        finally:
            gone.close()
        kept += insert(self.db)
        self.assertEqual(tick(self.db), 3)
        self.assertEqual([i for _, i in batch(self.db, 1, 3)], kept)

    def test_every_committed_row_in_exactly_one_batch(self):
        stop = threading.Event()
        committed, errors = [], []
        lock = threading.Lock()

        def produce(seed):
            rng = random.Random(seed)
            conn = self.pg.connect(autocommit=False)
            try:
                while not stop.is_set():
                    ids = insert(conn, topic=f"t{rng.randrange(3)}", n=rng.randint(1, 5))
                    if rng.random() < 0.1:
                        conn.rollback()
                        continue
                    if rng.random() < 0.2:
                        time.sleep(rng.random() * 0.05)  # open across ticks
                    conn.commit()
                    with lock:
                        committed.extend(ids)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                conn.close()

        def ticker():
            conn = self.pg.connect()
            try:
                while not stop.is_set():
                    tick(conn)
                    time.sleep(0.002)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            finally:
                conn.close()

        told = []  # (after, tick, lo, hi) of outbox.tick_bounds, as the relay calls it

        def bounding_ticker():
            conn = self.pg.connect()
            try:
                after = scalar(conn, "SELECT max(tick_id) FROM outbox.ticks")
                while not stop.is_set():
                    with conn.cursor() as cur:
                        cur.execute("SELECT tick, lo, hi FROM outbox.tick_bounds(0, %s)",
                                    (after,))
                        k, lo, hi = cur.fetchone()
                    told.append((after, k, lo, hi))
                    after = k
                    time.sleep(0.002)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            finally:
                conn.close()

        threads = [threading.Thread(target=produce, args=(s,)) for s in range(6)]
        threads += [threading.Thread(target=ticker), threading.Thread(target=bounding_ticker)]
        for t in threads:
            t.start()
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join(30)
        self.assertEqual(errors, [])
        last = tick(self.db)
        seen = []
        for k in range(2, last + 1):
            whole = batch(self.db, k - 1, k)
            self.assertEqual(whole, sorted(whole, key=lambda r: r[1]))
            # In chunks of 7, each after the last id read.
            chunks, after = [], None
            while True:
                part = batch(self.db, k - 1, k, after, 7)
                if not part:
                    break
                chunks += part
                after = part[-1][1]
            self.assertEqual(chunks, whole)
            seen += [i for _, i in whole]
        print(f"{len(committed)} rows committed, {last - 1} batches")
        self.assertGreater(last, 10)
        self.assertEqual(len(seen), len(set(seen)), "a row in two batches")
        self.assertEqual(sorted(seen), sorted(committed))
        # The bounds a tick read with itself are the batch's, read afterwards;
        # none where the latest tick was not the one after the lead named.
        bounded = 0
        for after, k, lo, hi in told:
            if k == after + 1 and lo is not None:
                bounded += 1
                self.assertEqual((lo, hi), bounds(self.db, after, k), f"batch ({after}, {k}]")
            elif k != after + 1:
                self.assertEqual((lo, hi), (None, None), f"tick {k} after {after}")
        print(f"{bounded} of {len(told)} ticks read their batch's bounds")
        self.assertGreater(bounded, 5)

    def test_a_batch_is_read_off_the_index(self):
        insert(self.db, n=2000)
        tick(self.db)
        insert(self.db, n=10)
        tick(self.db)
        with self.db.cursor() as cur:
            cur.execute("ANALYZE outbox.messages")
            cur.execute("EXPLAIN SELECT * FROM outbox.batch_bounds(2, 3)")
            plan = "\n".join(r[0] for r in cur.fetchall())
            self.assertTrue(harness.plan_uses_index(self.db, plan, "messages_txid_idx"), plan)
            self.assertEqual(harness.plan_scans_rows(self.db, plan), [], plan)
            cur.execute("EXPLAIN SELECT * FROM outbox.batch_rows(2, 3, 2000, 2010, 500)")
            plan = "\n".join(r[0] for r in cur.fetchall())
        self.assertTrue(harness.plan_uses_index(self.db, plan, "messages_pkey"), plan)
        self.assertEqual(harness.plan_scans_rows(self.db, plan), [], plan)

    def record(self, tick, streams=(), entry_ids=(), quarantined=(), errors=(), lead=True,
               advanced=(), met=()):
        """streams, advanced, met: "topic" or "topic:p" for partition p."""
        def split(names):
            return ([n.split(":")[0] for n in names],
                    [int(n.split(":")[1]) if ":" in n else -1 for n in names])
        topics, partitions = split(streams)
        adv_topics, adv_partitions = split(advanced)
        met_topics, met_partitions = split(met)
        return scalar(self.db, "SELECT outbox.record_batch(%s, %s, %s::text[], %s::integer[],"
                      " %s::text[], %s::text[], %s::integer[], %s::text[], %s::integer[],"
                      " %s::bigint[], %s::text[])",
                      (tick, lead, topics, partitions, list(entry_ids), adv_topics,
                       adv_partitions, met_topics, met_partitions, list(quarantined),
                       list(errors)))

    def positions(self):
        """(stream, tick, entry id) of each stream, the lead as "" first."""
        with self.db.cursor() as cur:
            cur.execute("SELECT topic || CASE WHEN partition >= 0 THEN ':' || partition ELSE ''"
                        " END, tick, entry_id FROM outbox.stream_positions ORDER BY 1")
            return cur.fetchall()

    def unsent(self):
        with self.db.cursor() as cur:
            cur.execute("SELECT id FROM outbox.unsent ORDER BY id")
            return [r[0] for r in cur.fetchall()]

    def test_retention_takes_the_ticks_no_stream_needs(self):
        for _ in range(6):
            insert(self.db)
            tick(self.db)  # ticks 2..7
        self.record(7, ["orders"], ["70-0"])
        self.record(4, ["slow"], ["40-0"], lead=False)  # a stream far behind: from 4
        scalar(self.db, "SELECT busy FROM outbox.rotate(interval '0')")
        with self.db.cursor() as cur:
            cur.execute("SELECT tick_id FROM outbox.ticks ORDER BY 1")
            self.assertEqual([r[0] for r in cur.fetchall()], [4, 5, 6, 7],
                             "the ticks below every position went; the slow stream's stayed")
        self.assertEqual(self.unsent(), [], "what the positions passed is still sent")

    def test_positions_move_forward_only(self):
        for _ in range(4):
            insert(self.db)
            tick(self.db)
        self.assertEqual(self.record(3, ["a", "b:2"], ["30-0", "30-4"]), 0)
        self.assertEqual(self.positions(), [("", 3, "0-0"), ("a", 3, "30-0"), ("b:2", 3, "30-4")])
        self.record(4, ["a"], ["40-1"])
        self.assertEqual(self.positions(), [("", 4, "0-0"), ("a", 4, "40-1"), ("b:2", 3, "30-4")])
        # An earlier batch recorded late (another relay's) moves nothing back.
        self.record(2, ["a", "b:2"], ["20-0", "20-0"])
        self.assertEqual(self.positions(), [("", 4, "0-0"), ("a", 4, "40-1"), ("b:2", 3, "30-4")])
        # The same tick again (the batch read again after a failure): its ids.
        self.record(4, ["a"], ["40-2"])
        self.assertEqual(self.positions()[1], ("a", 4, "40-2"))
        for bad in ((99, ["a"], ["1-0"]), (4, ["a", "b"], ["1-0"]), (None, [], [])):
            with self.subTest(bad=bad), self.assertRaises(psycopg2.errors.InvalidParameterValue):
                self.record(*bad)

    def test_streams_caught_up_met_and_moved_along(self):
        for _ in range(6):
            insert(self.db)
            tick(self.db)
        self.record(3, ["a", "p"], ["30-0", "30-0"])
        # A batch of streams catching up moves them, and not the lead.
        self.record(2, ["c"], ["20-1"], lead=False, advanced=["d"])
        self.assertEqual(self.positions(), [("", 3, "0-0"), ("a", 3, "30-0"), ("c", 2, "20-1"),
                                            ("d", 2, "0-0"), ("p", 3, "30-0")])
        # The lead's batch: p was met and not published (paused): it keeps its
        # place; e has none yet and gets the tick before the batch; a is moved
        # along with the lead without a row in the batch, keeping its id.
        self.record(5, ["b"], ["50-0"], met=["p", "e:1"], advanced=["a"])
        self.assertEqual(self.positions(), [("", 5, "0-0"), ("a", 5, "30-0"), ("b", 5, "50-0"),
                                            ("c", 2, "20-1"), ("d", 2, "0-0"), ("e:1", 4, "0-0"),
                                            ("p", 3, "30-0")])
        # A stream named twice counts once: appended to wins over moved along.
        self.record(6, ["b"], ["60-0"], advanced=["b", "a"])
        self.assertEqual(self.positions()[1:3], [("a", 6, "30-0"), ("b", 6, "60-0")])

    def test_unsent_are_the_rows_past_their_streams_position(self):
        a1 = insert(self.db, "a") + insert(self.db, "b")
        tick(self.db)  # 2
        a2 = insert(self.db, "a")
        tick(self.db)  # 3
        self.assertEqual(self.unsent(), a1 + a2)
        self.record(2, ["a"], ["2-0"])  # b's row of batch 2 not recorded: still unsent
        self.assertEqual(self.unsent(), a1[1:] + a2)
        self.record(3, ["a", "b"], ["3-0", "2-0"])
        self.assertEqual(self.unsent(), [])
        (q,) = insert(self.db, "c")
        tick(self.db)
        self.record(4, quarantined=[q], errors=["bad"])
        self.assertEqual(self.unsent(), [])

    def backlog(self, topics=None):
        with self.db.cursor() as cur:
            cur.execute("SELECT topic, pending, oldest_created_at FROM outbox.backlog(%s)"
                        " ORDER BY topic", (topics,))
            return cur.fetchall()

    def unsent_by_topic(self):
        with self.db.cursor() as cur:
            cur.execute("SELECT topic, count(*), min(created_at) FROM outbox.unsent"
                        " GROUP BY topic ORDER BY topic")
            return cur.fetchall()

    def test_backlog_counts_the_unsent_rows_of_every_topic(self):
        for topic in ("a", "b", "a"):
            insert(self.db, topic)
        tick(self.db)  # 2
        # b was met and not published (paused): it stands at the tick before.
        self.record(2, ["a"], ["2-0"], met=["b"])
        # c is never published, its rows between those of others: its count
        # is its rows, not the span of their ids.
        for topic in ("c", "a", "c", "b"):
            insert(self.db, topic)
        (q,) = insert(self.db, "c")
        tick(self.db)  # 3
        self.record(3, quarantined=[q], errors=["bad"], lead=False)
        expected = self.unsent_by_topic()
        self.assertEqual([(t, n) for t, n, _ in expected], [("a", 1), ("b", 2), ("c", 2)])
        self.assertEqual(self.backlog(), expected)
        self.assertEqual(self.backlog(["c", "none", "b"]),
                         [("b",) + expected[1][1:], ("c",) + expected[2][1:], ("none", 0, None)])
        # Every row published: every topic with a position, nothing waiting.
        self.record(3, ["a", "b", "c"], ["3-0", "3-1", "3-2"])
        self.assertEqual([(t, n, o) for t, n, o in self.backlog()],
                         [("a", 0, None), ("b", 0, None), ("c", 0, None)])

    def test_quarantine_copies_the_row_once(self):
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload, headers)"
                        " VALUES ('bad topic', 'k', '\\xff00', '{\"h\": \"v\"}') RETURNING id")
            (bad,) = cur.fetchone()
        (ok,) = insert(self.db)
        tick(self.db)
        self.assertEqual(self.record(2, quarantined=[bad], errors=["topic not allowed"]), 1)
        self.assertEqual(self.record(2, quarantined=[bad, 424242], errors=["again", "none"]), 0)
        with self.db.cursor() as cur:
            cur.execute("SELECT q.id, q.topic, q.partition_key, q.payload, q.headers, q.error,"
                        " q.message_id = m.message_id, q.txid = m.txid"
                        " FROM outbox.quarantine AS q JOIN outbox.messages AS m USING (id)")
            rows = cur.fetchall()
        self.assertEqual(len(rows), 1)
        self.assertEqual(rows[0][:3], (bad, "bad topic", "k"))
        self.assertEqual(bytes(rows[0][3]), b"\xff\x00")
        self.assertEqual(rows[0][4:], ({"h": "v"}, "topic not allowed", True, True))

    def test_roles(self):
        insert(self.db)
        relay = self.pg.connect(user="relay_login")
        producer = self.pg.connect(user="producer_login")
        try:
            self.assertEqual(tick(relay), 2)
            self.assertEqual(len(batch(relay, 1, 2)), 1)
            with relay.cursor() as cur:
                cur.execute("SELECT outbox.record_batch(2, true, '{s}', '{-1}', '{2-0}', '{}', '{}', '{}', '{}',"
                            " '{}', '{}')")
                cur.execute("SELECT * FROM outbox.stream_positions, outbox.quarantine,"
                            " outbox.unsent")
            for sql in ("SELECT outbox.tick()", "SELECT * FROM outbox.ticks",
                        "SELECT * FROM outbox.stream_positions", "SELECT * FROM outbox.quarantine",
                        "SELECT * FROM outbox.unsent",
                        "SELECT outbox.record_batch(2, true, '{s}', '{-1}', '{2-0}', '{}', '{}', '{}', '{}',"
                            " '{}', '{}')"):
                with self.subTest(sql=sql), self.assertRaises(psycopg2.errors.InsufficientPrivilege):
                    with producer.cursor() as cur:
                        cur.execute(sql)
            for sql in ("DELETE FROM outbox.ticks", "UPDATE outbox.stream_positions SET tick = 9",
                        "DELETE FROM outbox.quarantine"):
                with self.subTest(sql=sql), self.assertRaises(psycopg2.errors.InsufficientPrivilege):
                    with relay.cursor() as cur:
                        cur.execute(sql)
        finally:
            relay.close()
            producer.close()


if __name__ == "__main__":
    unittest.main()
