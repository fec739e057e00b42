"""Rotation: published rows go a table partition at a time (docs/DESIGN.md,
"Retention"; migrations/019_rotation.sql).

The tests give the table partitions of a few hundred transaction ids
(harness.small_partitions) and move the transaction counter past them
(harness.burn_xids); the relay makes its own partitions above them.

Promises tested:
- the relay keeps partitions made ahead of the transaction counter;
- a partition whose rows every stream has passed, sent_retention ago, is
  dropped whole, the partitions above it stay, every message is in its stream
  once, and no row was deleted one at a time;
- with a long sent_retention no partition is dropped;
- a paused stream keeps the partitions that hold its rows: the other streams'
  published rows in them go one at a time, the paused stream's stay; once it
  is resumed and published, the partition goes;
- rows of transactions beyond every partition land in the DEFAULT partition
  (no producer's insert fails), are published once, partitions are made above
  them, and the DEFAULT partition is emptied once every stream passed them;
- a quarantined row goes with its partition and stays in the quarantine,
  from which failed retry writes it again;
- a DROP waits at most its lock timeout for a producer's transaction, is
  counted busy, and is done at the next pass after it;
- one pass at a time: another relay's pass meanwhile does nothing, busy;
- the upgrade to 019 keeps every row, its id and message_id; rows pending at
  the upgrade are published once, and ids go on above the last one; on a
  database whose transaction ids are past epoch 0 it makes a handful of
  partitions, not one per width from 0.
"""

import os
import time
import unittest
import urllib.request

from testkit import harness
from testkit.harness import Postgres, insert, scalar, wait_until

harness.require_relay()
harness.set_deadline(400)

WIDTH = 500


class RotationTest(harness.ServerTestCase):

    def setUp(self):
        super().setUp()
        self.base = harness.small_partitions(self.db, WIDTH, ahead=2)

    def start_relay(self, **flags):
        self.port = harness.free_port()
        flags.setdefault("observe_interval", "200ms")
        flags.setdefault("poll_interval", "200ms")
        flags.setdefault("stream_retention", "0")
        relay = self.relay(metrics_listen=f"127.0.0.1:{self.port}", **flags)
        wait_until(lambda: harness.port_open(self.port), timeout=15, relay=relay,
                   message="the metrics endpoint to listen")
        return relay

    def metric(self, name):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return harness.metric(r.read().decode(), name)

    def rows(self, where="true"):
        return scalar(self.db, f"SELECT count(*) FROM outbox.messages WHERE {where}")

    def fill(self, topics, partitions_to_fill=3, per_tx=20):
        """Rows of topics, a transaction of per_tx rows each, spread over the
        first partitions_to_fill small partitions; returns their message_ids."""
        ids = []
        top = self.base + partitions_to_fill * WIDTH
        while scalar(self.db, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint") < top:
            for topic in topics:
                ids += harness.insert_many(self.db, [(topic, b"r%d" % len(ids))] * per_tx)
            harness.burn_xids(self.db, 40)
        return ids

    def all_sent(self, relay, timeout=30):
        """Waits for every row to be published; shows the relay's state if not."""
        try:
            harness.wait_all_sent(self.db, timeout=timeout, relay=relay)
        except AssertionError:
            with self.db.cursor() as cur:
                for sql in ("SELECT id, txid::text, topic FROM outbox.unsent LIMIT 20",
                            "SELECT topic, partition, tick FROM outbox.stream_positions",
                            "SELECT tick_id, snap::text, taken_at::text FROM outbox.ticks"
                            " ORDER BY tick_id DESC LIMIT 3",
                            "SELECT pid, application_name, state, wait_event_type, wait_event,"
                            " left(query, 160) FROM pg_stat_activity WHERE datname = 'app'"):
                    cur.execute(sql)
                    print(sql.split()[1], cur.fetchall(), flush=True)
            print("partitions", harness.partitions(self.db), flush=True)
            raise

    def assert_each_once(self, ids, besides=()):
        """Every message of ids in its stream once, and nothing else but the
        streams besides."""
        found = {m: e for m, e in harness.entries_by_message_id(self.r).items()
                 if e[0][0] not in besides}
        self.assertEqual(sorted(found), sorted(ids), "every message, and nothing else")
        self.assertEqual([m for m, e in found.items() if len(e) != 1], [], "no duplicate")

    def lowest_live(self):
        """The lowest partition's lower bound, counted in partitions from base
        (-1: the one below base)."""
        parts = harness.partitions(self.db)
        if not parts:  # every partition dropped and none made yet: not "above"
            return -2
        lo = parts[0][0]
        return -1 if lo < self.base else (lo - self.base) // WIDTH

    def below(self, n):
        """A condition on rows: in the first n partitions from base, or below."""
        return f"txid < '{self.base + n * WIDTH}'"

    def test_partitions_are_made_ahead_and_dropped_once_published(self):
        relay = self.start_relay(sent_retention="0")
        ids = self.fill(["orders", "billing"])
        self.all_sent(relay, timeout=60)
        # Ahead: four partitions beyond the counter's, the relay's of at least
        # 2^10 ids among them.
        now = scalar(self.db, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        wait_until(lambda: (p := harness.partitions(self.db)) and p[-1][1] >= now + 4 * 1024,
                   timeout=15, relay=relay, message="partitions ahead of the counter")
        # Past the filled ones: the counter moves on, the relay's ticks with it.
        harness.burn_xids(self.db, WIDTH)
        ids.append(insert(self.db, "orders", b"moves the ticks"))
        wait_until(lambda: harness.traffic(self.db, ids) and self.lowest_live() >= 3, timeout=30,
                   interval=0.5, relay=relay, message="the filled partitions to be dropped")
        self.assertEqual(self.rows(self.below(3)), 0)
        # The scrape shows the drops with the next observation.
        wait_until(lambda: self.metric("outbox_relay_outbox_partitions_dropped_total") >= 3,
                   timeout=15, relay=relay, message="the drops in the scrape")
        self.assertEqual(self.metric("outbox_relay_sent_rows_deleted_total"), 0,
                         "no row was deleted one at a time")
        self.all_sent(relay)
        self.assert_each_once(ids)
        self.assertEqual(relay.terminate(), 0)
        self.assertEqual([line for line in harness.problem_lines(relay.log(), "relay")], [])

    def test_long_sent_retention_drops_nothing(self):
        relay = self.start_relay(sent_retention="1h")
        self.fill(["orders"], partitions_to_fill=2)
        harness.burn_xids(self.db, WIDTH)
        insert(self.db, "orders", b"moves the ticks")
        self.all_sent(relay, timeout=60)
        time.sleep(2)  # several retention passes
        self.assertEqual(self.lowest_live(), -1 if self.base else 0)
        self.assertEqual(self.metric("outbox_relay_outbox_partitions_dropped_total"), 0)

    def test_paused_stream_keeps_its_partitions(self):
        relay = self.start_relay(sent_retention="0", pause_lag_entries="5",
                                 resume_lag_entries="1")
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        lagging = [insert(self.db, "orders", b"lagging") for _ in range(6)]
        self.all_sent(relay)
        relay.wait_for_log(r"stream orders paused", timeout=15)
        ids = self.fill(["orders", "billing"], partitions_to_fill=2)
        harness.burn_xids(self.db, WIDTH)
        ids.append(insert(self.db, "billing", b"moves the ticks"))
        wait_until(lambda: harness.count_sent(self.db, "m.topic = 'billing'") ==
                   self.rows("topic = 'billing'"), timeout=30, relay=relay)
        # billing's published rows in the kept partitions go one at a time;
        # orders' rows wait in them.
        wait_until(lambda: harness.traffic(self.db, ids) and
                   self.rows(f"topic = 'billing' AND {self.below(2)}") == 0, timeout=40,
                   interval=0.5, relay=relay, message="billing's rows in the kept partitions")
        held = self.rows(f"topic = 'orders' AND {self.below(2)}")
        self.assertGreater(held, 0)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.unsent"
                                         " WHERE topic = 'orders'"), held)
        self.assertLessEqual(self.lowest_live(), 0, "the paused stream's partitions stay")
        wait_until(lambda: self.metric("outbox_relay_sent_rows_deleted_total") > 0, timeout=15,
                   relay=relay, message="the deletions in the scrape")
        # The group catches up: the stream resumes, its rows are published,
        # and the partitions go.
        while True:
            reply = self.r.xreadgroup("email", "c1", {"orders": ">"}, count=1000)
            got = [entry_id for _, entries in reply for entry_id, _ in entries]
            if got:
                self.r.xack("orders", "email", *got)
            if harness.count_unsent(self.db) == 0:
                break
            time.sleep(0.2)
        harness.burn_xids(self.db, 10)
        ids.append(insert(self.db, "billing", b"moves the ticks again"))
        wait_until(lambda: harness.traffic(self.db, ids) and self.lowest_live() >= 2,
                   timeout=30, interval=0.5, relay=relay,
                   message="the partitions to go once the stream resumed")
        self.all_sent(relay)
        self.assert_each_once(ids + lagging)

    def test_rows_beyond_every_partition_go_to_default(self):
        # No partition ahead (as after a relay was down while the counter
        # passed them): the producers' rows land in DEFAULT.
        for lo, _ in harness.partitions(self.db):
            with self.db.cursor() as cur:
                cur.execute(f"DROP TABLE outbox.messages_{lo}")
        ids = [insert(self.db, "orders", b"in default %d" % i) for i in range(20)]
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages_default"), 20)
        top = scalar(self.db, "SELECT max(txid)::text::bigint FROM outbox.messages_default")
        # Producers keep writing while the relay makes partitions over the
        # ranges they route into DEFAULT: not one of their inserts may fail.
        producer = harness.Producer(self.pg, topics=("steady",), rate=400, name="steady")
        producer.start()
        self.addCleanup(producer.stop)
        relay = self.start_relay(sent_retention="0")
        self.all_sent(relay)
        # Partitions are made above DEFAULT's rows, never over them, from the
        # counter on.
        wait_until(lambda: harness.partitions(self.db), timeout=15, relay=relay,
                   message="partitions above the rows in DEFAULT")
        counter = scalar(self.db, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        first = harness.partitions(self.db)[0][0]
        self.assertGreater(first, top)
        # Not at a bound of the width beyond the counter: the rows written
        # from then on leave DEFAULT at once. (The counter moves with the
        # producer and the relay's own ticks, so no fixed distance from top.)
        self.assertLessEqual(first, counter)
        later = [insert(self.db, "orders", b"later %d" % i) for i in range(5)]
        wait_until(lambda: harness.traffic(self.db, later) and
                   scalar(self.db, "SELECT count(*) FROM outbox.messages_default") == 0,
                   timeout=30, interval=0.5, relay=relay, message="DEFAULT to be emptied")
        producer.stop()  # raises if an insert failed
        self.all_sent(relay)
        self.assert_each_once(ids + later, besides=(b"steady",))
        steady = harness.stream_entries(self.r, "steady")
        self.assertEqual(len(steady), producer.committed)
        self.assertEqual(len({f[b"id"] for _, f in steady}), producer.committed, "no duplicate")

    def test_quarantined_row_goes_with_its_partition_and_can_be_retried(self):
        relay = self.start_relay(sent_retention="0")
        insert(self.db, "bad topic!", b"never")
        wait_until(lambda: scalar(self.db, "SELECT count(*) FROM outbox.quarantine") == 1,
                   timeout=30, relay=relay)
        bad = scalar(self.db, "SELECT id FROM outbox.quarantine")
        self.fill(["orders"], partitions_to_fill=1)
        harness.burn_xids(self.db, WIDTH)
        insert(self.db, "orders", b"moves the ticks")
        wait_until(lambda: harness.traffic(self.db) and self.lowest_live() >= 1,
                   timeout=30, interval=0.5, relay=relay,
                   message="the partition with the quarantined row to go")
        self.assertEqual(self.rows(f"id = {bad}"), 0)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.quarantine"), 1)
        self.assertEqual(scalar(self.db, "SELECT retried FROM outbox.quarantine_retry(false,"
                                         " ARRAY[%s]::bigint[])", (bad,)), 1)
        self.assertEqual(self.rows("topic = 'bad topic!'"), 1, "written again from the copy")

    def test_drop_waits_briefly_for_a_producer_and_goes_later(self):
        # No relay: outbox.rotate, as the retention pass calls it.
        insert(self.db, "orders", b"published")
        harness.burn_xids(self.db, WIDTH + 10)
        with self.db.cursor() as cur:
            cur.execute("SELECT outbox.tick()")
            cur.execute("INSERT INTO outbox.stream_positions (topic, partition, tick)"
                        " SELECT t, -1, (SELECT max(tick_id) FROM outbox.ticks)"
                        " FROM unnest(ARRAY['', 'orders']) AS t"
                        " ON CONFLICT (topic, partition) DO UPDATE SET tick = excluded.tick")
        producer = self.pg.connect(autocommit=False)
        self.addCleanup(producer.close)
        insert(producer, "orders", b"an open transaction", commit=False)
        started = time.monotonic()
        with self.db.cursor() as cur:
            cur.execute("SELECT dropped, busy FROM outbox.rotate('0', %s, 2)", (WIDTH,))
            self.assertEqual(cur.fetchone(), (0, 1))
        self.assertLess(time.monotonic() - started, 5, "the pass did not wait for the producer")
        self.assertEqual(self.rows(), 1)
        producer.commit()
        with self.db.cursor() as cur:
            cur.execute("SELECT dropped, busy FROM outbox.rotate('0', %s, 2)", (WIDTH,))
            dropped, busy = cur.fetchone()
        self.assertGreaterEqual(dropped, 1)
        self.assertEqual(busy, 0)
        self.assertGreaterEqual(self.lowest_live(), 1)
        self.assertEqual(self.rows(), 1, "the open transaction's row, in a partition above")

    def test_one_rotation_at_a_time(self):
        # A relay's pass in progress (its transaction open): another relay's
        # pass does nothing and says so, rather than racing it to the same
        # partition names.
        first = self.pg.connect(autocommit=False)
        self.addCleanup(first.close)
        with first.cursor() as cur:
            cur.execute("SELECT busy FROM outbox.rotate('0', %s, 2)", (WIDTH,))
            self.assertEqual(cur.fetchone(), (0,))
        with self.db.cursor() as cur:
            cur.execute("SELECT created, dropped, busy FROM outbox.rotate('0', %s, 8)", (WIDTH,))
            self.assertEqual(cur.fetchone(), (0, 0, 1))
        first.commit()
        with self.db.cursor() as cur:
            cur.execute("SELECT created, busy FROM outbox.rotate('0', %s, 8)", (WIDTH,))
            created, busy = cur.fetchone()
        self.assertEqual(busy, 0)
        self.assertGreater(created, 0, "the partitions up to 8 ahead")


class UpgradeTest(unittest.TestCase):
    """019 applied to a database with rows: each kept, the pending ones
    published once by a relay of this version."""

    def test_rows_are_kept_and_pending_ones_published_once(self):
        with Postgres(migrations=False) as pg, harness.Redis() as redis:
            files = pg.migration_files()
            before = [f for f in files if os.path.basename(f) < "019"]
            pg.apply_migrations(before)
            db = pg.connect()
            pending = [insert(db, "orders", b"before %d" % i) for i in range(30)]
            with db.cursor() as cur:
                cur.execute("SELECT id, message_id::text, txid::text FROM outbox.messages"
                            " ORDER BY id")
                rows = cur.fetchall()
            pg.apply_migrations([f for f in files if f not in before])
            pg.apply_migrations([f for f in files if f not in before])  # idempotent
            with db.cursor() as cur:
                cur.execute("SELECT id, message_id::text, txid::text FROM outbox.messages"
                            " ORDER BY id")
                self.assertEqual(cur.fetchall(), rows)
            self.assertEqual(scalar(db, "SELECT pg_get_partkeydef('outbox.messages'::regclass)"),
                             "RANGE (txid)")
            r = redis.client()
            with harness.Relay(pg, redis, poll_interval="100ms") as relay:
                later = [insert(db, "orders", b"after %d" % i) for i in range(5)]
                wait_until(lambda: scalar(db, "SELECT count(*) FROM outbox.unsent") == 0,
                           timeout=30, relay=relay, message="every row")
            self.assertGreater(scalar(db, "SELECT min(id) FROM outbox.messages"
                                          " WHERE payload::text LIKE '%%6166746572%%'"),
                               rows[-1][0], "ids go on above the last one")
            found = harness.entries_by_message_id(r)
            self.assertEqual(sorted(found), sorted(pending + later))
            self.assertEqual([m for m, e in found.items() if len(e) != 1], [])
            db.close()

    def test_an_old_database_gets_a_handful_of_partitions(self):
        # Transaction ids past epoch 3 (about 12.9 billion): one partition
        # takes everything before the counter's, not one per width from 0.
        with Postgres(migrations=False) as pg:
            pg.set_xid_epoch(3)
            files = pg.migration_files()
            before = [f for f in files if os.path.basename(f) < "019"]
            pg.apply_migrations(before)
            db = pg.connect()
            ids = [insert(db, "orders", b"before %d" % i) for i in range(5)]
            pg.apply_migrations([f for f in files if f not in before])
            parts = harness.partitions(db)
            self.assertGreater(scalar(db, "SELECT pg_current_xact_id()::text::bigint"), 3 * 2**32)
            self.assertLessEqual(len(parts), 7, parts)
            self.assertEqual(parts[0][0], 0)
            self.assertEqual(sorted(scalar(db, "SELECT array_agg(message_id::text)"
                                               " FROM outbox.messages")), sorted(ids))
            db.close()


if __name__ == "__main__":
    unittest.main()
