"""The relay's observer thread: deadlines, shutdown, and producer admission.

Promises tested:
- the per-topic figures read the rows written since the oldest stream
  position they ask about, whatever the published past of the other topics
  (outbox-relay status runs the same reads);
- one observation walks them once: the outbox's totals, a limited topic's
  admission and the figures of the streams without limits share the walk;
- a stream the relay has never published to, paused while the lead moves past
  its rows, keeps them counted: each batch records it where it stands
  (outbox.record_batch's met streams), so the figures' walk from the lead
  finds them all;
- a relay whose PostgreSQL is partitioned (every connection, the claiming ones
  and the observer's, through a proxy that stops forwarding) still exits soon
  after SIGTERM: within drain_timeout and a few seconds, not when the
  partition ends;
- producer admission (outbox.observe_topic) is decided from PostgreSQL alone,
  for every topic in outbox.topic_limits:
  - a limited topic whose rows wait in the outbox but that has no stream in
    Redis yet is refused (OB503) while over its limit and admitted once
    drained;
  - with Redis stopped, admission still follows the outbox: refused over the
    limit, admitted once drained;
  - a refused topic whose limits are deleted is admitted again;
  - more limited topics than the observation lists (64) are all decided;
- status run as a role that may not read the limits still shows the rest;
- the streams are found without a SCAN of the whole keyspace at every
  observation and every trim: at the first observation, when a listed stream
  is gone, and every 12 observations, which also find the streams other
  processes create; a stream the relay first publishes to needs no scan.
"""

import json
import re
import signal
import subprocess
import time
import unittest
import urllib.request

import psycopg2

from testkit import faults
from testkit import harness
from testkit.harness import scalar, wait_until

harness.require_relay()
harness.set_deadline(420)


metric = harness.metric


class ObserverTest(harness.ServerTestCase):

    def setUp(self):
        super().setUp()
        with self.db.cursor() as cur:
            cur.execute("TRUNCATE outbox.topic_limits, outbox.topic_state")

    # -- helpers
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

    def limits(self, topic, max_pending, resume_pending):
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.topic_limits (topic, max_pending, resume_pending)"
                        " VALUES (%s, %s, %s)", (topic, max_pending, resume_pending))

    def hold_batches(self):
        """Holds the relay's next tick: outbox.tick() waits for this lock on
        outbox.ticks, so rows committed meanwhile are in no batch and wait in the
        outbox (outbox.unsent), as behind a stalled relay; the observer's reads do
        not wait for it. Returns the function that lets the relay go on."""
        conn = psycopg2.connect(self.pg.dsn())
        conn.cursor().execute("LOCK TABLE outbox.ticks IN SHARE ROW EXCLUSIVE MODE")

        def release():
            if not conn.closed:
                conn.rollback()
                conn.close()
        self.addCleanup(release)
        return release

    def insert_waiting(self, topic, n):
        """n rows of topic; they wait in the outbox while no relay runs or while
        hold_batches holds the relay's ticks."""
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT %s, 'waits' FROM generate_series(1, %s)", (topic, n))

    def admit(self, topic):
        """None when outbox.admit admits the topic, else the error it raised."""
        try:
            with self.db.cursor() as cur:
                cur.execute("SELECT outbox.admit(%s)", (topic,))
            return None
        except psycopg2.Error as e:
            return e

    def wait_refused(self, topic, relay, timeout=20):
        err = wait_until(lambda: self.admit(topic), timeout=timeout, relay=relay,
                         message=f"outbox.admit to refuse topic {topic}")
        self.assertEqual(err.pgcode, "OB503", str(err))
        return err

    def wait_admitted(self, topic, relay, timeout=20):
        wait_until(lambda: self.admit(topic) is None, timeout=timeout, relay=relay,
                   message=f"outbox.admit to admit topic {topic} again")

    def outbox_index_reads(self):
        """Index entries read so far from the primary key (the id order) and
        from messages_txid_idx (the transaction order)."""
        with self.db.cursor() as cur:
            cur.execute("SELECT pg_stat_clear_snapshot()")
        return {name: harness.index_reads(self.db, name)
                for name in ("messages_pkey", "messages_txid_idx")}

    # -- bounded reads
    def test_per_topic_figures_do_not_read_the_published_past(self):
        """100,000 rows of another topic published (its stream's position and
        the lead past them): the figures read the few rows written since."""
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'bulk', 'backlog' FROM generate_series(1, 100000)")
            cur.execute("SELECT outbox.tick(0)")
            tick = cur.fetchone()[0]
            cur.execute("SELECT outbox.record_batch(%s, true, '{bulk}', '{-1}', '{1-0}',"
                        " '{}', '{}', '{}', '{}', '{}', '{}')", (tick,))
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " VALUES ('orders', 'x'), ('other', 'y')")
            cur.execute("ANALYZE outbox.messages")
        self.limits("orders", 10, 5)    # figures with its admission
        self.r.xadd("other", {"seed": "1"})  # figures as a stream without limits
        before = self.outbox_index_reads()
        status = harness.run_relay(["status", "--json"],
                                   env=harness.relay_env(self.pg, self.redis))
        self.assertEqual(status.returncode, 0, status.output)
        data = json.loads(status.stdout)
        pending = {t["topic"]: t["outbox_pending"] for t in data["topics"]}
        self.assertEqual((pending.get("orders"), pending.get("other")), (1, 1), status.stdout)
        self.assertEqual(data["outbox"]["pending_estimate"], 2, status.stdout)

        def scans(reads):
            return reads["messages_txid_idx"][0]
        # One walk gives the outbox's figures and the topics'.
        after = wait_until(
            lambda: (lambda a: scans(a) >= scans(before) + 1 and a)(self.outbox_index_reads()),
            timeout=10, message="the status command's index statistics")
        read = {name: after[name][1] - before[name][1] for name in after}
        print(f"index entries read by one status with 100,000 rows of another topic"
              f" published: {read}")
        self.assertLess(sum(read.values()), 1000, read)

    def test_one_observation_walks_the_outbox_once(self):
        """The outbox's figures, a limited topic's admission and the figures
        of two streams without limits all come from one walk of the rows
        written since the oldest position."""
        # A connection of its own, closed before the count starts: a session
        # hands in its statistics when it ends, or up to seconds after.
        setup = self.pg.connect()
        with setup.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'bulk', 'backlog' FROM generate_series(1, 20000)")
            cur.execute("SELECT outbox.tick(0)")
            tick = cur.fetchone()[0]
            cur.execute("SELECT outbox.record_batch(%s, true, '{bulk}', '{-1}', '{1-0}',"
                        " '{}', '{}', '{}', '{}', '{}', '{}')", (tick,))
            cur.execute("INSERT INTO outbox.messages (topic, payload) VALUES ('orders', 'x'),"
                        " ('other', 'y'), ('other', 'z'), ('more', 'w')")
            cur.execute("ANALYZE outbox.messages")
        setup.close()
        self.limits("orders", 10, 5)
        for stream in ("other", "more"):
            self.r.xadd(stream, {"seed": "1"})
        before = self.outbox_index_reads()
        status = harness.run_relay(["status", "--json"],
                                   env=harness.relay_env(self.pg, self.redis))
        self.assertEqual(status.returncode, 0, status.output)
        data = json.loads(status.stdout)
        figures = {t["topic"]: (t["outbox_pending"], t["outbox_oldest_age_seconds"] is not None)
                   for t in data["topics"]}
        self.assertEqual({t: figures.get(t) for t in ("orders", "other", "more")},
                         {"orders": (1, True), "other": (2, True), "more": (1, True)},
                         status.stdout)
        self.assertEqual(data["outbox"]["pending_estimate"], 4, status.stdout)

        def read():
            return self.outbox_index_reads()["messages_txid_idx"][1] - \
                before["messages_txid_idx"][1]
        wait_until(lambda: read() >= 4, timeout=10,
                   message="the status command's index statistics")
        time.sleep(1.5)  # a second walk's statistics would have come by now
        # Each walk reads the index entries of the 4 rows written since.
        self.assertEqual(read(), 4, "entries of messages_txid_idx read by one status")

    def test_a_stream_never_published_and_paused_stays_counted(self):
        # Another process's entries and a group that has read none of them:
        # the stream lags 20 entries, and the relay pauses it at its first look.
        for n in range(1, 21):
            self.r.xadd("held", {"seed": str(n)}, id=f"1-{n}")
        self.r.xgroup_create("held", "g", id="0")
        relay = self.start_relay(pause_lag_entries="10", resume_lag_entries="2")
        relay.wait_for_log(r"stream held paused", timeout=30)
        for rnd in range(1, 6):  # five batches, the lead moving past each
            for topic in ("held", "flow", "held"):
                self.insert_waiting(topic, 1)
            wait_until(lambda rnd=rnd: self.r.xlen("flow") == rnd, timeout=30, relay=relay,
                       message=f"row {rnd} of flow in its stream")
        self.assertEqual(self.r.xlen("held"), 20, "nothing published to the paused stream")
        wait_until(lambda: harness.scalar(
                       self.db, "SELECT count(*) FROM outbox.stream_positions AS p"
                                " JOIN outbox.ticks AS k ON k.tick_id = p.tick"
                                " WHERE p.topic = '' AND pg_visible_in_snapshot("
                                " (SELECT max(txid) FROM outbox.messages), k.snap)") == 1,
                   timeout=30, relay=relay, message="the lead past every row")
        with self.db.cursor() as cur:
            cur.execute("SELECT topic, pending FROM outbox.backlog(NULL) ORDER BY topic")
            everything = cur.fetchall()
            cur.execute("SELECT pending FROM outbox.backlog('{held}')")
            held = cur.fetchone()[0]
        self.assertEqual(harness.scalar(self.db, "SELECT count(*) FROM outbox.unsent"
                                                 " WHERE topic = 'held'"), 10)
        self.assertEqual((held, everything), (10, [("flow", 0), ("held", 10)]))

    def test_status_as_a_role_that_may_not_read_the_limits(self):
        """status shows the rest of the observation, admission unknown."""
        with self.db.cursor() as cur:
            cur.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname ="
                        " 'watcher') THEN CREATE ROLE watcher LOGIN; END IF; END $$;"
                        " GRANT USAGE ON SCHEMA outbox TO watcher;"
                        " GRANT SELECT ON outbox.messages, outbox.stream_positions,"
                        " outbox.ticks, outbox.quarantine TO watcher")
        self.limits("orders", 5, 2)
        self.insert_waiting("orders", 3)
        self.r.xadd("orders", {"seed": "1"})
        dsn = f"host=127.0.0.1 port={self.pg.port} dbname={self.pg.database} user=watcher"
        status = harness.run_relay(["status", "--json"], env=harness.relay_env(
            None, self.redis, {"OUTBOX_RELAY_POSTGRES": dsn}))
        self.assertEqual(status.returncode, 0, status.output)
        data = json.loads(status.stdout)
        self.assertEqual([(t["topic"], t["outbox_pending"], t["admitting"])
                          for t in data["topics"]], [("orders", 3, None)])

    # -- shutdown during a partition
    def test_sigterm_while_postgres_is_partitioned(self):
        drain = 2
        proxy = self.enterContext(faults.TcpProxy(self.pg.port, name="pg-proxy"))
        dsn = f"host=127.0.0.1 port={proxy.port} dbname={self.pg.database} user=postgres"
        relay = self.enterContext(harness.Relay(
            None, self.redis, env={"OUTBOX_RELAY_POSTGRES": dsn}, poll_interval="200ms",
            observe_interval="200ms", drain_timeout=f"{drain}s"))
        harness.insert(self.db, "orders", b"warm-up")
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        wait_until(lambda: scalar(self.db, "SELECT count(*) FROM pg_stat_activity"
                                           " WHERE application_name = 'outbox-relay observe'"),
                   timeout=15, relay=relay, message="the observer to be connected")
        time.sleep(0.5)  # a few observations
        caught = proxy.live()
        proxy.blackhole()
        time.sleep(1.0)  # the observer's next query and the next claim now wait
        started = time.monotonic()
        relay.kill(signal.SIGTERM)
        try:
            code = relay.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - started
        print(f"exit after SIGTERM with PostgreSQL partitioned ({caught} connections held,"
              f" drain_timeout {drain}s): {took:.2f}s, code {code}", flush=True)
        proxy.restore(held="drop")
        self.assertIsNotNone(code, "the relay did not exit within 60 s\n" + relay.log_tail())
        self.assertLess(took, drain + 15, relay.log_tail())
        self.assertEqual(code, 0, relay.log_tail())

    # -- finding the streams
    def scans(self):
        return self.r.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)

    def listed(self, stream):
        return metric(self.scrape(), "outbox_relay_stream_memory_bytes", stream=stream) is not None

    def test_streams_are_found_without_scanning_the_keyspace_each_time(self):
        """SCAN visits every key, the dedup records too: the observer lists the streams
        at its first observation, after a listed stream is gone and every 12
        observations, not at every observation and every trim; a stream the relay
        first publishes to is handed over by name and needs no scan."""
        self.r.xadd("existing", {"seed": "1"})
        relay = self.start_relay(observe_interval="1s", stream_retention="1h", dedup_ttl="1h")
        wait_until(lambda: self.listed("existing"), timeout=15, relay=relay,
                   message="the stream there before the relay in the scrape")
        self.r.config_resetstat()
        started = time.monotonic()
        harness.insert(self.db, "orders", b"first")
        wait_until(lambda: self.listed("orders"), timeout=15, relay=relay,
                   message="the stream the relay created in the scrape")
        for i in range(30):  # the relay keeps publishing to a stream it knows
            harness.insert(self.db, "orders", b"more %d" % i)
            time.sleep(0.1)
        scans = self.scans()
        took = time.monotonic() - started
        self.assertGreater(self.r.xlen("orders"), 20)
        # Observations 1 s or more apart, the first scan up to about 2 s before
        # the count began: the next one is due 12 observations after it (one
        # call each: the keyspace is small). None for the new stream, none for
        # the trims (stream_retention is on).
        print(f"SCAN calls over {took:.1f} s of observations every second: {scans}")
        self.assertLessEqual(scans, int((took + 2) / 12), "the keyspace was scanned more often"
                             " than every 12 observations")
        # A stream another process created is found by the periodic scan.
        self.r.xadd("created.elsewhere", {"seed": "1"})
        wait_until(lambda: self.listed("created.elsewhere"), timeout=30, relay=relay,
                   message="a stream another process created in the scrape")
        # A listed stream that is gone leaves the list.
        self.r.delete("existing")
        wait_until(lambda: not self.listed("existing"), timeout=15, relay=relay,
                   message="the deleted stream to leave the scrape")
        self.assertEqual(harness.problem_lines(relay.log(), "relay"), [])

    # -- admission from PostgreSQL alone
    def test_limited_topic_without_a_stream(self):
        self.limits("nostream", 5, 2)
        relay = self.start_relay()
        release = self.hold_batches()
        for _ in range(3):  # a backlog that grows
            self.insert_waiting("nostream", 4)
            time.sleep(0.3)
        err = self.wait_refused("nostream", relay)
        print(f"refused without a stream: {err.pgerror.strip().splitlines()[0]}")
        self.assertNotIn(b"nostream", harness.stream_names(self.r), "no stream yet")
        wait_until(lambda: metric(self.scrape(), "outbox_relay_topic_admitting",
                                  topic="nostream") == 0, timeout=10, relay=relay,
                   message="the admitting metric of the stream-less topic to be 0")
        # The relay goes on and publishes them: the topic is drained.
        release()
        harness.wait_all_sent(self.db, relay=relay)
        self.wait_admitted("nostream", relay)
        print("admitted again once drained")

    def test_deleted_limits_release_a_refused_topic(self):
        self.limits("nostream", 5, 2)
        relay = self.start_relay()
        self.hold_batches()
        self.insert_waiting("nostream", 12)
        self.wait_refused("nostream", relay)
        with self.db.cursor() as cur:
            cur.execute("DELETE FROM outbox.topic_limits WHERE topic = 'nostream'")
        self.wait_admitted("nostream", relay)
        print("released once its limits were deleted, its backlog still there")

    def test_admission_while_redis_is_stopped(self):
        self.limits("orders", 5, 2)
        relay = self.start_relay()
        self.redis.stop()
        self.addCleanup(self.redis.start)
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'orders', 'Redis is down' FROM generate_series(1, 12)")
        err = self.wait_refused("orders", relay)
        print(f"refused with Redis stopped: {err.pgerror.strip().splitlines()[0]}")
        # The relay says what its observation cannot read, and what waits for it.
        relay.wait_for_log(r"WARNING observe: cannot read Redis \(.*\): queue age, "
                           r"consumer-group lag and stream backpressure wait for it", timeout=15)
        # Drained elsewhere (say, by another relay whose Redis is up): its
        # streams' positions are recorded past the rows.
        harness.mark_published(self.db, "orders")
        self.wait_admitted("orders", relay)
        print("admitted again once drained, Redis still stopped")
        status = harness.run_relay(["status", "--json"],
                                   env=harness.relay_env(self.pg, self.redis, {
                                       "OUTBOX_RELAY_CONNECT_TIMEOUT": "1s"}))
        data = json.loads(status.stdout)
        self.assertFalse(data["redis"]["up"])
        self.assertIn({"topic": "orders", "admitting": True},
                      [{"topic": t["topic"], "admitting": t["admitting"]}
                       for t in data["topics"]])

    def test_more_limited_topics_than_the_observation_lists(self):
        topics = [f"t{i:03d}" for i in range(80)]
        with self.db.cursor() as cur:
            cur.executemany("INSERT INTO outbox.topic_limits (topic, max_pending, resume_pending)"
                            " VALUES (%s, 3, 1)", [(t,) for t in topics])
        for t in topics:  # every topic has a stream, so a scan of Redis finds them all
            self.r.xadd(t, {"seed": "1"})
        relay = self.start_relay()
        release = self.hold_batches()
        for t in topics:
            self.insert_waiting(t, 5)

        def refused():
            return scalar(self.db, "SELECT count(*) FROM outbox.topic_state"
                                   " WHERE NOT admitting")
        try:
            wait_until(lambda: refused() == len(topics), timeout=30, relay=relay,
                       message=f"all {len(topics)} topics to be refused")
        finally:
            print(f"limited topics refused: {refused()} of {len(topics)}")
        self.assertEqual(self.admit(topics[-1]).pgcode, "OB503")
        status = harness.run_relay(["status", "--json"],
                                   env=harness.relay_env(self.pg, self.redis))
        data = json.loads(status.stdout)
        self.assertEqual(data["admission"], {"topics": len(topics), "refused": len(topics)})
        self.assertEqual(len(data["topics"]), 64, "the observation lists 64 topics")
        release()
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        wait_until(lambda: refused() == 0, timeout=30, relay=relay,
                   message="every topic to be admitted again")
        print(f"all {len(topics)} admitted again once drained")


if __name__ == "__main__":
    unittest.main()
