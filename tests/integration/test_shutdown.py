"""Shutdown: SIGTERM drains and exits 0; a second signal exits at once; nothing is lost either way.

Promises tested (docs/DESIGN.md, "The claim cycle": drain; P1 and P2):
- SIGTERM (and SIGINT) while idle: exit code 0, promptly;
- SIGTERM under load: the batch in flight is finished or abandoned, the
  relay exits 0 within drain_timeout, every row its recorded positions have
  passed is in Redis, and a new relay then delivers everything exactly once;
- SIGTERM while the batch in flight cannot finish (Redis hung): the relay
  still exits within drain_timeout;
- a second SIGTERM during the drain exits at once, and still nothing is lost
  or doubled after a restart;
- the drain finishes the batch it has in flight: a batch of 200 sent to a
  frozen Redis that answers after SIGTERM is published and recorded before
  the relay exits (none of its rows is left for the next relay to read
  again), and Redis holds nothing but the streams (no record per message).
"""

import signal
import time
import unittest

from testkit import harness
from testkit.harness import insert, scalar, wait_until

harness.require_relay()
harness.set_deadline(300)

CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
SLACK = 5  # seconds allowed beyond drain_timeout for the process to go


def relay_sessions(conn):
    """The relay's sessions on the server."""
    return scalar(conn, "SELECT count(*) FROM pg_stat_activity"
                        " WHERE application_name LIKE 'outbox-relay%%'")


class ShutdownTest(harness.ServerTestCase):

    def ready_relay(self, **flags):
        """A relay that has published one row, so it is connected and idle."""
        relay = self.relay(poll_interval="200ms", **flags)
        insert(self.db, "orders", b"warm-up")
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        return relay

    def assert_not_crashed(self, code, relay):
        self.assertNotIn(-code, CRASH_SIGNALS, "crashed\n" + relay.log_tail())

    def deliver_the_rest(self, label):
        relay = self.relay(poll_interval="200ms")
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.verifier().report(label).assert_exactly_once(self)
        self.assertEqual(relay.terminate(), 0)

    def test_sigterm_while_idle(self):
        relay = self.ready_relay()
        self.assertEqual(relay.terminate(timeout=10), 0, relay.log_tail())
        relay = self.ready_relay()
        relay.kill(signal.SIGINT)
        self.assertEqual(relay.wait(timeout=10), 0, "SIGINT too\n" + relay.log_tail())

    def test_sigterm_under_load(self):
        drain = 5
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        for _ in range(6):
            harness.insert_many(conn, [("orders", b"backlog %d" % i) for i in range(5000)])
        producer = harness.Producer(self.pg, rows=10**9, tx_rows=(1, 20), rate=2000,
                                    topics=("orders", "billing"), name="load")
        producer.start()
        self.addCleanup(producer.stop)
        relay = self.relay(poll_interval="200ms", batch_size=200,
                           drain_timeout=f"{drain}s")
        # Busy: it has published a part of the backlog (the streams' lengths
        # are cheap to read at short intervals) and rows still wait for it.
        # One look is not enough: a fast relay can drain the whole backlog
        # between two looks, and then the producer's rows keep it busy.
        wait_until(lambda: (self.r.xlen("orders") + self.r.xlen("billing") >= 1000
                            and harness.count_unsent(self.db) > 0),
                   timeout=30, interval=0.01, relay=relay, message="the relay to be busy")
        code = relay.terminate(timeout=drain + SLACK)
        self.assertEqual(code, 0, relay.log_tail())
        fig = self.verifier().figures()  # the rest is still pending
        self.assertEqual((fig.sent_but_absent, fig.duplicates, fig.stray), (0, 0, 0),
                         "a row recorded as sent is in Redis, once")
        producer.stop()
        self.deliver_the_rest("after restart")

    def freeze_redis_mid_batch(self, relay, rows, stream="orders"):
        """Inserts rows in one transaction and freezes Redis once their batch
        has begun to reach the stream: the rest of its calls are in flight
        (or still to send) and stay unanswered. (A relay does not start a
        batch while Redis does not answer, so Redis is frozen mid-batch.)"""
        before = self.r.xlen(stream)
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        harness.insert_many(conn, [(stream, b"in flight %d" % i) for i in range(rows)])
        wait_until(lambda: self.r.xlen(stream) > before, timeout=30, interval=0.002,
                   relay=relay, message="the batch to begin reaching the stream")
        self.redis.pause()
        self.addCleanup(self.redis.resume)
        self.assertGreater(harness.count_unsent(self.db), 0,
                           "the batch was recorded before Redis could be frozen")

    def hang_a_batch(self, **flags):
        """A relay whose batch is stuck: Redis hangs while the relay publishes it."""
        relay = self.ready_relay(publish_timeout="60s", batch_size=100, **flags)
        self.freeze_redis_mid_batch(relay, 20000)
        return relay

    def test_sigterm_with_batch_that_cannot_finish(self):
        drain = 2
        relay = self.hang_a_batch(drain_timeout=f"{drain}s")
        relay.kill(signal.SIGTERM)
        code = relay.wait(timeout=drain + SLACK)
        print(f"exit code after the drain deadline: {code}", flush=True)
        self.assert_not_crashed(code, relay)
        wait_until(lambda: relay_sessions(self.db) == 0, timeout=10,
                   message="the sessions of the exited relay to end")
        self.redis.resume()
        self.deliver_the_rest("after drain deadline")

    def test_drain_records_the_batch_in_flight(self):
        # A batch in flight (Redis frozen while the relay publishes it),
        # SIGTERM, then Redis answers: the batch is published and recorded
        # during the drain, before the relay exits, so no relay reads it
        # again; and the stream is all Redis holds of it.
        relay = self.ready_relay(publish_timeout="60s", batch_size=500)
        self.freeze_redis_mid_batch(relay, 20000)
        time.sleep(0.2)  # more of its calls are written to the frozen Redis
        relay.kill(signal.SIGTERM)
        time.sleep(0.5)
        self.redis.resume()
        code = relay.wait(timeout=30)
        self.assertEqual(code, 0, relay.log_tail())
        self.assertEqual(harness.count_unsent(self.db), 0,
                         "the drain left rows of its batch unrecorded\n" + relay.log_tail())
        keys = sorted(self.r.scan_iter(count=1000))
        self.assertEqual(keys, [b"orders"], "Redis holds the stream and nothing else")
        self.verifier().report("after the drain").assert_exactly_once(self)

    def test_second_sigterm_exits_at_once(self):
        relay = self.hang_a_batch(drain_timeout="60s")
        relay.kill(signal.SIGTERM)
        time.sleep(1)  # the relay now waits for its batch, up to 60 s
        self.assertTrue(relay.alive(), "the first SIGTERM should drain, not exit\n"
                        + relay.log_tail())
        relay.kill(signal.SIGTERM)
        code = relay.wait(timeout=SLACK)
        self.assert_not_crashed(code, relay)
        self.redis.resume()
        self.deliver_the_rest("after second SIGTERM")


if __name__ == "__main__":
    unittest.main()
