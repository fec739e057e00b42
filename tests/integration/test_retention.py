"""Retention: bounded storage on both sides (docs/OPERATIONS.md, "Retention").

Promises tested:
- published rows (their stream's recorded position has passed them) are
  deleted once sent_retention has passed, and never a quarantined row; with a
  long sent_retention they stay;
- sent_retention = 0 deletes each row soon after its batch is recorded:
  every message is in its stream once, and no published row is kept;
- the relay's role may delete only published rows: no DELETE on the table,
  and outbox.purge_sent / outbox.delete_published touch neither a row
  outbox.unsent shows nor a quarantined one; purge_sent deletes only rows
  committed before the last tick taken older_than ago;
- stream trimming never removes an entry a consumer group has not
  acknowledged (pending or not yet delivered), removes acknowledged entries
  older than stream_retention, reports the group that holds trimming back,
  and trims everything once the group caught up;
- with stream_trim_max_hold set, the pending entries of a group that holds
  trimming back longer are trimmed, and the relay says so, but never an entry
  the group was not delivered yet;
- dead-letter streams are never trimmed; replay streams are trimmed once
  their group acknowledged them;
- with vacuum_dead_rows set, the relay runs VACUUM on the outbox itself once
  that many dead rows are there (a manual vacuum, not autovacuum's), or a
  tenth of that once the outbox is drained; a VACUUM still running when the
  relay exits is cancelled in the server; a role that does not own the table
  is told once, and the relay relays on;
- any stream_retention is accepted (there are no dedup records to outlive),
  and allow_short_stream_retention is logged as a key without an effect;
- the scrape carries the storage figures: outbox size, dead rows, oldest sent
  row kept, Redis memory of each stream.
"""

import re
import subprocess
import time
import unittest
import urllib.request

import psycopg2

from testkit import harness
from testkit.harness import scalar, wait_until

harness.require_relay()
harness.set_deadline(400)

WIDTH = 200  # transaction ids a partition of the outbox covers in these tests


metric = harness.metric


class RetentionTest(harness.ServerTestCase):

    def start_relay(self, **flags):
        self.port = harness.free_port()
        flags.setdefault("observe_interval", "200ms")
        flags.setdefault("poll_interval", "200ms")
        relay = self.relay(metrics_listen=f"127.0.0.1:{self.port}", **flags)
        wait_until(lambda: harness.port_open(self.port), timeout=15, relay=relay,
                   message="the metrics endpoint to listen")
        return relay

    def scrape(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return r.read().decode()

    def rows(self, where="true"):
        return scalar(self.db, f"SELECT count(*) FROM outbox.messages WHERE {where}")

    def insert_rows(self, topic, n):
        harness.insert_many(self.db, [(topic, b"m%d" % i) for i in range(n)])

    def quarantined(self):
        return scalar(self.db, "SELECT count(*) FROM outbox.quarantine")

    def quarantine_one(self):
        """A row the relay quarantines at its first attempt: its topic is not allowed."""
        harness.insert(self.db, "bad topic!", b"never")

    # -- sent rows ----------------------------------------------------------
    def test_sent_rows_are_deleted_after_sent_retention(self):
        harness.small_partitions(self.db, WIDTH)
        relay = self.start_relay(sent_retention="2s", stream_retention="0")
        self.quarantine_one()
        self.insert_rows("orders", 300)
        wait_until(lambda: self.r.xlen("orders") == 300, timeout=30, relay=relay,
                   message="300 entries in the stream")
        wait_until(lambda: self.quarantined() == 1, timeout=30, relay=relay)
        harness.burn_xids(self.db, WIDTH)  # the counter leaves their partition
        harness.insert(self.db, "later", b"moves the ticks")
        # Kept while younger than sent_retention...
        self.assertEqual(harness.count_sent(self.db, "m.topic = 'orders'"), 300)
        # ...dropped with their partition after it (once every stream's
        # position is past it); the quarantine keeps its copy.
        wait_until(lambda: harness.traffic(self.db) and
                   self.rows("topic IN ('orders', 'bad topic!')") == 0, timeout=30,
                   interval=0.5, relay=relay, message="the sent rows to be dropped")
        self.assertEqual(self.quarantined(), 1)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.unsent"
                                         " WHERE topic <> 'later'"), 0)
        text = wait_until(
            lambda: (t := self.scrape()) and
            (metric(t, "outbox_relay_outbox_partitions_dropped_total") or 0) >= 1 and t,
            timeout=15, relay=relay)
        self.assertEqual(metric(text, "outbox_relay_sent_rows_deleted_total"), 0)
        self.assertGreater(metric(text, "outbox_relay_outbox_bytes"), 0)
        self.assertIsNotNone(metric(text, "outbox_relay_outbox_dead_rows"))
        self.assertGreater(metric(text, "outbox_relay_stream_memory_bytes", stream="orders"), 0)
        self.assertGreater(metric(text, "outbox_relay_redis_used_memory_bytes"), 0)
        self.assertEqual(self.r.xlen("orders"), 300)  # sent_retention is the outbox's alone

    def test_long_sent_retention_keeps_rows(self):
        harness.small_partitions(self.db, WIDTH)
        relay = self.start_relay(sent_retention="1h", stream_retention="0")
        self.insert_rows("orders", 50)
        harness.burn_xids(self.db, WIDTH)
        wait_until(lambda: harness.count_sent(self.db) == 50, timeout=30, relay=relay)
        text = wait_until(
            lambda: (t := self.scrape()) and
            (metric(t, "outbox_relay_outbox_oldest_sent_age_seconds") or 0) > 0.5 and t,
            timeout=15, relay=relay, message="the oldest sent row's age to show")
        self.assertEqual(self.rows(), 50)
        self.assertEqual(metric(text, "outbox_relay_sent_rows_deleted_total"), 0)
        self.assertEqual(metric(text, "outbox_relay_outbox_partitions_dropped_total"), 0)

    def test_zero_sent_retention_deletes_rows_once_published(self):
        harness.small_partitions(self.db, WIDTH)
        relay = self.start_relay(sent_retention="0", stream_retention="0", batch_size=50)
        self.quarantine_one()
        ids = []
        for i in range(20):  # committed while the relay works
            ids += harness.insert_many(self.db, [("ab"[j % 2], b"p%d" % j) for j in range(100)])
        self.assertEqual(len(set(ids)), 2000)
        wait_until(lambda: self.r.xlen("a") + self.r.xlen("b") >= 2000, timeout=60, relay=relay,
                   message="2000 entries")
        harness.burn_xids(self.db, WIDTH)  # the counter leaves their partitions
        wait_until(lambda: harness.traffic(self.db) and self.rows("topic <> 'later'") == 0,
                   timeout=30, interval=0.5, relay=relay)
        found = {m: e for m, e in harness.entries_by_message_id(self.r).items()
                 if e[0][0] != b"later"}
        self.assertEqual(sorted(found), sorted(ids), "every message, and nothing else")
        self.assertEqual([m for m, e in found.items() if len(e) != 1], [], "no duplicate")
        # Every published row went with its partition once every stream
        # passed it; the quarantine keeps its copy of the quarantined one.
        self.assertEqual(self.quarantined(), 1)
        relay.stop()
        problems = [line for line in harness.problem_lines(relay.log(), "relay")
                    if "quarantined" not in line]
        self.assertEqual(problems, [])

    def published_before(self, topics, ago):
        """Takes a tick that sees every row committed so far, dates it `ago` back,
        and records the streams of topics at it, as a relay that published them
        then would have."""
        with self.db.cursor() as cur:
            cur.execute("SELECT outbox.tick()")
            tick = cur.fetchone()[0]
            cur.execute("UPDATE outbox.ticks SET taken_at = now() - %s::interval"
                        " WHERE tick_id = %s", (ago, tick))
            cur.execute("INSERT INTO outbox.stream_positions (topic, partition, tick)"
                        " SELECT t, -1, %s FROM unnest(%s::text[]) AS t"
                        " ON CONFLICT (topic, partition) DO UPDATE SET tick = excluded.tick",
                        (tick, topics))

    def test_relay_role_may_delete_only_sent_rows(self):
        # purge_sent deletes in the partitions that are due (outbox.rotate
        # drops the others): each group of rows leaves its partition first.
        harness.small_partitions(self.db, WIDTH)
        with self.db.cursor() as cur:
            cur.execute("DROP ROLE IF EXISTS retention_relay")
            cur.execute("CREATE ROLE retention_relay LOGIN IN ROLE outbox_relay")
            cur.execute("INSERT INTO outbox.messages (topic, payload, created_at)"
                        " SELECT 'old', 'x', now() - interval '2 hours'"
                        " FROM generate_series(1, 5)")
        harness.burn_xids(self.db, WIDTH)
        self.published_before(["old"], "2 hours")
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'young', 'x' FROM generate_series(1, 3)")
        harness.quarantine_row(self.db, "quarantined", created_at="2000-01-01T00:00:00Z")
        harness.burn_xids(self.db, WIDTH)
        self.published_before(["old", "young", "quarantined"], "0")
        with self.db.cursor() as cur:  # in no batch yet: outbox.unsent shows it
            cur.execute("INSERT INTO outbox.messages (topic, payload, created_at)"
                        " VALUES ('pending', 'x', now() - interval '3 hours')")
        self.addCleanup(lambda: self.db.cursor().execute("DROP ROLE IF EXISTS retention_relay"))
        conn = psycopg2.connect(self.pg.dsn(user="retention_relay"))
        conn.autocommit = True
        self.addCleanup(conn.close)
        cur = conn.cursor()
        with self.assertRaises(psycopg2.errors.InsufficientPrivilege):
            cur.execute("DELETE FROM outbox.messages WHERE topic = 'pending'")
        cur.execute("SELECT deleted, caught_up FROM outbox.purge_sent(interval '1 hour', 0, 100)")
        self.assertEqual(cur.fetchone(), (5, True))
        cur.execute("SELECT deleted FROM outbox.purge_sent(interval '0', 0, 100)")
        self.assertEqual(cur.fetchone(), (3,))
        # Nothing but published rows went.
        self.assertEqual(sorted(r[0] for r in self.db_rows("topic")), ["pending", "quarantined"])
        # delete_published: never a row outbox.unsent shows, nor a quarantined one.
        cur.execute("SELECT outbox.delete_published(array_agg(id)) FROM outbox.messages")
        self.assertEqual(cur.fetchone(), (0,))
        self.assertEqual(sorted(r[0] for r in self.db_rows("topic")), ["pending", "quarantined"])
        # Small batches: a call deletes at most max_rows and says it is not done.
        with self.db.cursor() as c2:
            c2.execute("INSERT INTO outbox.messages (topic, payload, created_at)"
                       " SELECT 'old', 'x', now() - interval '2 hours'"
                       " FROM generate_series(1, 25)")
        harness.burn_xids(self.db, WIDTH)
        self.published_before(["old"], "90 minutes")
        cur.execute("SELECT deleted, caught_up FROM outbox.purge_sent(interval '1 hour', 0, 10)")
        self.assertEqual(cur.fetchone(), (10, False))

    def db_rows(self, column):
        with self.db.cursor() as cur:
            cur.execute(f"SELECT {column} FROM outbox.messages ORDER BY id")
            return cur.fetchall()

    def autovacuum_off(self):
        """Only the relay vacuums the outbox, for the rest of the test."""
        with self.db.cursor() as cur:
            cur.execute("SELECT part::text FROM outbox.message_partitions()")
            parts = [r[0] for r in cur.fetchall()]
            for part in parts:
                cur.execute(f"ALTER TABLE {part} SET (autovacuum_enabled = off)")

        def reset():
            with self.db.cursor() as cur:
                for part in parts:
                    cur.execute(f"ALTER TABLE IF EXISTS {part} RESET (autovacuum_enabled)")
        self.addCleanup(reset)

    def vacuum_count(self):
        return scalar(self.db, "SELECT coalesce(sum(vacuum_count), 0) FROM pg_stat_all_tables"
                               " WHERE relid IN (SELECT relid FROM"
                               " pg_partition_tree('outbox.messages'::regclass))")

    def delete_published(self, n):
        """Publishes n rows and deletes them one at a time, as an operator's
        DELETE would (or the retention of a partition a paused stream keeps):
        n dead rows."""
        self.insert_rows("orders", n)
        wait_until(lambda: harness.count_unsent(self.db) == 0, timeout=60,
                   message=f"{n} rows published")
        with self.db.cursor() as cur:
            cur.execute("DELETE FROM outbox.messages")

    def test_relay_vacuums_the_outbox_after_many_dead_rows(self):
        self.autovacuum_off()
        before = self.vacuum_count()
        relay = self.start_relay(sent_retention="0", stream_retention="0",
                                 vacuum_dead_rows="2000")
        self.delete_published(5000)
        wait_until(lambda: self.vacuum_count() > before, timeout=60, relay=relay,
                   message="the relay's VACUUM")
        relay.wait_for_log(r"INFO retention: VACUUM of outbox.messages done", timeout=30)
        wait_until(lambda: (metric(self.scrape(), "outbox_relay_vacuums_total") or 0) >= 1,
                   timeout=15, relay=relay)
        self.assertEqual(self.rows(), 0)

    def test_relay_vacuums_a_drained_outbox_at_a_tenth(self):
        # 3,000 dead rows, fewer than vacuum_dead_rows: only the rule for a
        # drained outbox (a tenth of it) starts this VACUUM.
        self.autovacuum_off()
        before = self.vacuum_count()
        relay = self.start_relay(sent_retention="0", stream_retention="0",
                                 vacuum_dead_rows="20000")
        self.delete_published(3000)
        wait_until(lambda: self.vacuum_count() > before, timeout=60, relay=relay,
                   message="the relay's VACUUM of a drained outbox")

    def test_shutdown_cancels_a_running_vacuum(self):
        # A VACUUM slowed down to a crawl (cost-based delay, set for the
        # database) must not go on in the server once the relay has exited.
        self.autovacuum_off()
        with self.db.cursor() as cur:
            cur.execute("ALTER DATABASE app SET vacuum_cost_delay = '100ms'")
            cur.execute("ALTER DATABASE app SET vacuum_cost_limit = 1")
        self.addCleanup(lambda: self.db.cursor().execute(
            "ALTER DATABASE app RESET vacuum_cost_delay"))
        self.addCleanup(lambda: self.db.cursor().execute(
            "ALTER DATABASE app RESET vacuum_cost_limit"))

        def vacuums_running():
            return scalar(self.db, "SELECT count(*) FROM pg_stat_activity"
                                   " WHERE application_name = 'outbox-relay vacuum'"
                                   " AND query LIKE 'VACUUM%' AND state = 'active'")
        relay = self.start_relay(sent_retention="0", stream_retention="0",
                                 vacuum_dead_rows="2000")
        self.delete_published(20000)
        wait_until(lambda: vacuums_running() == 1, timeout=60, relay=relay,
                   message="the relay's VACUUM to run")
        self.assertEqual(relay.terminate(), 0, relay.log_tail())
        wait_until(lambda: vacuums_running() == 0, timeout=10,
                   message="the VACUUM to be cancelled when the relay exited")

    def test_vacuum_needs_the_owner(self):
        with self.db.cursor() as cur:
            cur.execute("DROP ROLE IF EXISTS retention_member")
            cur.execute("CREATE ROLE retention_member LOGIN IN ROLE outbox_relay")
        self.addCleanup(lambda: self.db.cursor().execute("DROP ROLE IF EXISTS retention_member"))
        self.port = harness.free_port()
        relay = self.enterContext(harness.Relay(
            self.pg, self.redis, env={"OUTBOX_RELAY_POSTGRES": self.pg.dsn(user="retention_member")},
            metrics_listen=f"127.0.0.1:{self.port}", sent_retention="0", stream_retention="0",
            vacuum_dead_rows="100", observe_interval="200ms", poll_interval="200ms"))
        self.delete_published(500)
        relay.wait_for_log(r"WARNING retention: the relay's role does not own outbox.messages",
                           timeout=30)
        self.delete_published(500)
        time.sleep(1)
        self.assertEqual(relay.log().count("does not own outbox.messages"), 1, "told once")
        self.assertEqual(self.rows(), 0)

    # -- streams ------------------------------------------------------------
    def test_trim_keeps_every_unacknowledged_entry(self):
        # Small stream nodes, so that "~" trimming has a fine grain.
        self.r.config_set("stream-node-max-entries", 10)
        self.addCleanup(self.r.config_set, "stream-node-max-entries", 100)
        self.r.xgroup_create("orders", "g1", id="$", mkstream=True)
        relay = self.start_relay(stream_retention="1s", dedup_ttl="1s",
                                 publish_timeout="1s")
        self.insert_rows("orders", 200)
        wait_until(lambda: self.r.xlen("orders") >= 200, timeout=30, relay=relay)
        all_ids = [e[0] for e in self.r.xrange("orders")]
        self.assertEqual(len(all_ids), 200)
        # g1 reads 120 and acknowledges the first 50: 70 pending, 80 undelivered.
        got = self.r.xreadgroup("g1", "c1", {"orders": ">"}, count=120)[0][1]
        self.r.xack("orders", "g1", *[e[0] for e in got[:50]])
        keep = set(all_ids[50:])
        time.sleep(1.5)  # past stream_retention
        # Trims run every 10 s: wait for one after the acknowledgements.
        text = wait_until(
            lambda: (t := self.scrape()) and
            (metric(t, "outbox_relay_stream_entries_trimmed_total") or 0) >= 40 and
            (metric(t, "outbox_relay_stream_trim_held_back_seconds", stream="orders",
                    group="g1") or 0) > 0 and t,
            timeout=30, relay=relay, message="a trim that g1 holds back")
        left = {e[0] for e in self.r.xrange("orders")}
        self.assertTrue(keep <= left, "an unacknowledged entry was trimmed")
        self.assertLessEqual(len(left), 160)  # acknowledged nodes went
        # Caught up: everything is acknowledged, everything old goes.
        rest = self.r.xreadgroup("g1", "c1", {"orders": ">"}, count=1000)[0][1]
        self.r.xack("orders", "g1", *[e[0] for e in got[50:] + rest])
        wait_until(lambda: self.r.xlen("orders") < 10, timeout=30, relay=relay,
                   message="the acknowledged stream to be trimmed")
        wait_until(lambda: metric(self.scrape(), "outbox_relay_stream_trim_held_back_seconds",
                                  stream="orders", group="g1") is None, timeout=20, relay=relay)

    def test_trim_max_hold_passes_a_stuck_groups_pending_entries_only(self):
        self.r.config_set("stream-node-max-entries", 10)
        self.addCleanup(self.r.config_set, "stream-node-max-entries", 100)
        self.r.xgroup_create("orders", "stuck", id="$", mkstream=True)
        relay = self.start_relay(stream_retention="1s", dedup_ttl="1s", publish_timeout="1s",
                                 stream_trim_max_hold="2s")
        self.insert_rows("orders", 100)
        wait_until(lambda: self.r.xlen("orders") >= 100, timeout=30, relay=relay)
        all_ids = [e[0] for e in self.r.xrange("orders")]
        # Read, never acknowledged: 60 pending; 40 never delivered to the group.
        self.r.xreadgroup("stuck", "c1", {"orders": ">"}, count=60)
        undelivered = set(all_ids[60:])
        wait_until(lambda: self.r.xlen("orders") <= 50, timeout=30, relay=relay,
                   message="the stuck group's pending entries to be passed over")
        wait_until(lambda: re.search(r"WARNING retention: trimmed orders past the pending"
                                     r" entries of group stuck", relay.log()),
                   timeout=10, relay=relay)
        # Past the hold, and trimmed again since: entries the group was never
        # delivered stay, since no consumer could record them as lost.
        wait_until(lambda: (metric(self.scrape(), "outbox_relay_stream_trim_held_back_seconds",
                                   stream="orders", group="stuck") or 0) > 3,
                   timeout=30, relay=relay, message="a trim held back past stream_trim_max_hold")
        left = {e[0] for e in self.r.xrange("orders")}
        self.assertTrue(undelivered <= left, "an entry not yet delivered to the group was trimmed")

    def test_dead_letters_never_trimmed_replays_trimmed_once_acknowledged(self):
        self.r.config_set("stream-node-max-entries", 10)
        self.addCleanup(self.r.config_set, "stream-node-max-entries", 100)
        self.r.xgroup_create("orders", "g1", id="$", mkstream=True)
        old = "1000-0"  # entries from long ago
        for i in range(30):
            self.r.xadd("{orders}.g1.dlq", {"f": "v"}, id=f"{1000 + i}-0")
            self.r.xadd("{orders}.g1.replay", {"f": "v"}, id=f"{1000 + i}-0")
        self.r.xgroup_create("{orders}.g1.replay", "g1", id="0")
        replayed = self.r.xreadgroup("g1", "c1", {"{orders}.g1.replay": ">"}, count=20)[0][1]
        self.r.xack("{orders}.g1.replay", "g1", *[e[0] for e in replayed])
        relay = self.start_relay(stream_retention="1s", dedup_ttl="1s",
                                 publish_timeout="1s")
        self.insert_rows("orders", 5)
        wait_until(lambda: self.r.xlen("{orders}.g1.replay") <= 10, timeout=30, relay=relay,
                   message="the acknowledged replays to be trimmed")
        left = [e[0].decode() for e in self.r.xrange("{orders}.g1.replay")]
        self.assertEqual(left[-10:], [f"{1000 + i}-0" for i in range(20, 30)])
        time.sleep(1.5)
        self.assertEqual(self.r.xlen("{orders}.g1.dlq"), 30)
        self.assertEqual(self.r.xrange("{orders}.g1.dlq", count=1)[0][0].decode(), old)

    def test_short_stream_retention_is_accepted(self):
        """stream_retention was refused below dedup_ttl, which records per
        message no longer need: any retention is accepted now, and
        allow_short_stream_retention is a key without an effect."""
        done = subprocess.run([harness.require_relay(), "--stream-retention", "1h",
                               "--check-config"], env=harness.relay_env(self.pg, self.redis),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=30)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertNotIn("dedup_ttl", done.stderr)
        relay = self.start_relay(stream_retention="1h", allow_short_stream_retention="on")
        wait_until(lambda: "allow_short_stream_retention no longer has an effect" in relay.log(),
                   timeout=10, relay=relay)

if __name__ == "__main__":
    unittest.main()
