"""Redis outages: nothing is marked sent while Redis is away, and nothing is lost or doubled after.

Promises tested (docs/DESIGN.md P1, P2, "The claim cycle"):
- Redis stopped for ~3 s while rows are committed: no row gets sent_at during
  the outage, the relay logs the problem, reconnects when Redis is back on the
  same port (logged), and every row arrives exactly once;
- Redis killed with SIGKILL under load (appendfsync always): after its
  restart every row arrives exactly once (the dedup function absorbs a batch
  whose outcome the relay never learnt);
- Redis's AOF torn inside the transaction of a publish the relay never heard
  back from (a crash cut its last write short): repaired before Redis starts
  as docs/GUARANTEES.md says (systemd/redis-aof-repair.conf), every row arrives
  exactly once, also after the restart that follows; left to Redis's own
  aof-load-truncated, that next restart would run the torn publish after all
  and double every row the relay published in between;
- Redis hung (SIGSTOP) for ~3 s: the relay's own publish timeout fires, no row
  is marked sent while it hangs, and after SIGCONT every row arrives exactly
  once although Redis then runs the commands of the abandoned batch;
- Redis hung in the middle of a batch of 20,000 rows: the calls the timeout
  cut off count as a timeout, never as a lost connection, the batch is read
  again, and every row arrives exactly once.
"""

import time
import unittest

from testkit import harness
from testkit.harness import insert, insert_many, scalar, wait_until

harness.require_relay()
harness.set_deadline(240)

RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="500ms",
                   publish_timeout="1s", connect_timeout="1s", batch_size=50)
OUTAGE_SECONDS = 3


class RedisOutageTest(harness.PostgresTestCase):
    """The class's PostgreSQL; each test starts a Redis of its own."""

    def start(self, appendfsync="everysec", **flags):
        self.redis = self.enterContext(harness.Redis(appendonly=True, appendfsync=appendfsync))
        self.r = self.redis.client()
        self.addCleanup(self.r.close)
        relay = self.enterContext(harness.Relay(self.pg, self.redis, **{**RELAY_FLAGS, **flags}))
        for i in range(10):
            insert(self.db, "orders", b"before %d" % i)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        return relay

    def sent_count(self):
        return harness.count_sent(self.db)

    def commit_rows_for(self, seconds, relay, sent_before):
        """Commits a row every 100 ms for `seconds`; checks that none gets sent meanwhile."""
        ids = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ids.append(insert(self.db, "orders", b"during %d" % len(ids)))
            self.assertEqual(self.sent_count(), sent_before,
                             "a row was marked sent while Redis was unavailable")
            self.assertTrue(relay.alive(), "relay exited during the outage\n" + relay.log_tail())
            time.sleep(0.1)
        return ids

    def test_redis_stopped_then_restarted(self):
        relay = self.start()
        sent_before = self.sent_count()
        mark = relay.mark()
        self.redis.stop()
        during = self.commit_rows_for(OUTAGE_SECONDS, relay, sent_before)
        relay.wait_for_log(harness.LOG_PROBLEM.format(component="redis"), since=mark,
                           timeout=10)
        self.assertEqual(harness.count_sent(self.db, "m.message_id::text = ANY(%s)", (during,)), 0)
        back = relay.mark()
        self.redis.start()
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        relay.wait_for_log(harness.LOG_CONNECTED.format(component="redis"), since=back,
                           timeout=10)
        fig = harness.Verifier(self.db, self.r).report("outage=stop")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, 10 + len(during))

    def test_redis_killed_under_load(self):
        relay = self.start(appendfsync="always")
        producer = harness.Producer(self.pg, rows=10**9, tx_rows=(1, 20), rate=2000,
                                    topics=("orders", "billing", "mail"), name="load")
        producer.start()
        self.addCleanup(producer.stop)
        wait_until(lambda: self.sent_count() > 500, timeout=30, relay=relay,
                   message="the relay to publish under load")
        mark = relay.mark()
        self.redis.kill()
        wait_until(lambda: harness.problem_lines(relay.log()[mark:], "redis"), timeout=10,
                   relay=relay, message="a redis problem in the log")
        back = relay.mark()
        self.redis.start()
        committed = producer.committed
        wait_until(lambda: producer.committed > committed + 500, timeout=30,
                   message="more rows committed after the restart")
        producer.stop()
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        relay.wait_for_log(harness.LOG_CONNECTED.format(component="redis"), since=back)
        harness.Verifier(self.db, self.r).report("outage=sigkill").assert_exactly_once(self)

    def test_torn_aof_tail_is_cut_before_redis_starts(self):
        self.redis = self.enterContext(harness.Redis(appendonly=True, appendfsync="always"))
        self.r = self.redis.client()
        self.addCleanup(self.r.close)
        ids = [insert(self.db, "torn", b"torn %d" % i) for i in range(3)]
        # What a relay whose reply never came left: the three rows' XADDs in
        # one MULTI / EXEC, as the relay sends a stream's rows, written to the
        # AOF as one transaction.
        with self.db.cursor() as cur:
            cur.execute("SELECT id, message_id::text, payload, created_at::text"
                        " FROM outbox.messages WHERE message_id::text = ANY(%s) ORDER BY id",
                        (ids,))
            rows = cur.fetchall()
        with self.r.pipeline(transaction=True) as pipe:
            for rank, (oid, mid, payload, created) in enumerate(rows, 1):
                pipe.xadd("torn", {"id": mid, "topic": "torn", "payload": bytes(payload),
                                   "created_at": created, "outbox_id": str(oid)},
                          id=f"1-{rank}")
            pipe.execute()
        self.redis.stop()
        # The crash: the write stops inside the transaction's last command.
        path = self.redis.aof_tail_file()
        with open(path, "rb") as f:
            data = f.read()
        end = data.rfind(b"*1\r\n$4\r\nEXEC\r\n")
        self.assertGreater(end, data.rfind(b"MULTI"), "the publish call's transaction ends the AOF")
        with open(path, "r+b") as f:
            f.truncate(end - 10)
        self.redis.start()
        self.assertEqual(self.r.xlen("torn") if self.r.exists("torn") else 0, 0,
                         "the torn transaction is not loaded")
        relay = self.enterContext(harness.Relay(self.pg, self.redis, **RELAY_FLAGS))
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.redis.stop()
        self.redis.start()
        found = harness.entries_by_message_id(self.r)
        for mid in ids:
            self.assertEqual(len(found.get(mid, [])), 1,
                             f"entries of {mid} after the second restart: {found.get(mid)}")

    def test_redis_hung(self):
        relay = self.start(publish_timeout="500ms")
        sent_before = self.sent_count()
        mark = relay.mark()
        self.redis.pause()
        during = self.commit_rows_for(OUTAGE_SECONDS, relay, sent_before)
        relay.wait_for_log(harness.LOG_PROBLEM.format(component="redis"), since=mark)
        self.redis.resume()
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        fig = harness.Verifier(self.db, self.r).report("outage=sigstop")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, 10 + len(during))


    def test_redis_hung_in_the_middle_of_a_batch(self):
        relay = self.start(publish_timeout="500ms")
        insert_many(self.db, [("orders", b"backlog %d" % i) for i in range(20000)])
        # One transaction: one batch, published chunk by chunk.
        wait_until(lambda: self.r.xlen("orders") >= 1000, timeout=30, relay=relay,
                   message="the batch half-way in its stream")
        mark = relay.mark()
        self.redis.pause()
        time.sleep(1.5)
        self.redis.resume()
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        text = harness.metrics_text(relay)
        errors = {kind: harness.metric(text, "outbox_relay_publish_errors_total", kind=kind)
                  for kind in ("redis_timeout", "redis_connection")}
        failed = [line for line in relay.log()[mark:].splitlines() if "not published" in line]
        print(f"hung in the middle of a batch: {errors}; " + " | ".join(failed), flush=True)
        self.assertGreaterEqual(errors["redis_timeout"], 1)
        self.assertEqual(errors["redis_connection"], 0,
                         "the calls the timeout cut off counted as a lost connection")
        self.assertTrue(any("publish_timeout" in line for line in failed), failed)
        fig = harness.Verifier(self.db, self.r).report("hung in the middle of a batch")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, 20010)

if __name__ == "__main__":
    unittest.main()
