"""PostgreSQL restarts: the relay reconnects on its own and every committed row arrives once.

Promises tested (docs/DESIGN.md P1, P2, "The claim cycle"):
- PostgreSQL restarted as in a crash (pg_ctl -m immediate) and cleanly
  (-m fast) while a producer keeps committing rows: the relay logs the loss,
  reconnects (logged), and every row committed before, during and after the
  restart arrives exactly once;
- after the reconnect it LISTENs again and claims what was committed while it
  was away: the relay runs with a 30 s poll interval, and rows committed after
  the restart must arrive well before any poll would fetch them;
- PostgreSQL down for a few seconds: the relay keeps running and catches up.
"""

import time
import unittest

from testkit import harness
from testkit.harness import insert, scalar, wait_until

harness.require_relay()
harness.set_deadline(300)

RELAY_FLAGS = dict(poll_interval="30s", reconnect_min="50ms", reconnect_max="1s",
                   connect_timeout="2s", statement_timeout="5s", batch_size=100)
# Rows committed after the restart must arrive before the 30 s poll could help.
CATCH_UP_SECONDS = 20


class PgRestartTest(harness.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.redis = cls.enterClassContext(harness.Redis(appendonly=True))
        cls.r = cls.redis.client()
        cls.addClassCleanup(cls.r.close)

    def setUp(self):
        super().setUp()
        self.r.flushall()
        self.pg = self.enterContext(harness.Postgres())
        self.relay = self.enterContext(harness.Relay(self.pg, self.redis, **RELAY_FLAGS))

    def db(self):
        """A fresh connection (the old ones die with the server)."""
        conn = self.pg.connect()
        self.addCleanup(conn.close)
        return conn

    def sent_count(self, conn):
        return harness.count_sent(conn)

    def restart_under_load(self, mode):
        relay = self.relay
        conn = self.db()
        for i in range(50):
            insert(conn, "orders", b"before %d" % i)
        harness.wait_all_sent(conn, timeout=30, relay=relay)

        producer = harness.Producer(self.pg, rows=10**9, tx_rows=(1, 5), rate=500,
                                    topics=("orders", "billing"), name="load")
        producer.start()
        self.addCleanup(producer.stop)
        wait_until(lambda: producer.committed >= 200, timeout=30, message="producer started")
        mark = relay.mark()
        self.pg.restart(mode)
        committed = producer.committed
        wait_until(lambda: producer.committed >= committed + 200, timeout=30,
                   message="the producer to commit again after the restart")
        producer.stop()
        self.assertGreater(producer.connection_errors, 0, "the restart broke connections")

        conn = self.db()
        after = [insert(conn, "orders", b"after %d" % i) for i in range(20)]
        harness.wait_all_sent(conn, timeout=CATCH_UP_SECONDS, relay=relay)
        self.assertTrue(all(m in harness.entries_by_message_id(self.r) for m in after))
        relay.wait_for_log(harness.LOG_PROBLEM.format(component="pg"), since=mark)
        relay.wait_for_log(harness.LOG_CONNECTED.format(component="pg"), since=mark)
        fig = harness.Verifier(conn, self.r).report(f"restart={mode}")
        fig.assert_exactly_once(self)
        self.assertGreaterEqual(fig.committed, 50 + 400 + 20)

    def test_immediate_restart(self):
        self.restart_under_load("immediate")

    def test_fast_restart(self):
        self.restart_under_load("fast")

    def test_down_for_a_while(self):
        relay = self.relay
        conn = self.db()
        insert(conn, "orders", b"before")
        harness.wait_all_sent(conn, timeout=30, relay=relay)
        conn.close()
        mark = relay.mark()
        self.pg.stop("fast")
        wait_until(lambda: harness.problem_lines(relay.log()[mark:], "pg"), timeout=10,
                   relay=relay, message="a pg problem in the log")
        time.sleep(2)  # stays down across several reconnect attempts
        self.assertTrue(relay.alive(), "the relay exited while PostgreSQL was down\n"
                        + relay.log_tail())
        self.pg.start()
        conn = self.db()
        ids = [insert(conn, "orders", b"after %d" % i) for i in range(10)]
        harness.wait_all_sent(conn, timeout=CATCH_UP_SECONDS, relay=relay)
        found = harness.entries_by_message_id(self.r)
        self.assertTrue(all(m in found for m in ids))
        harness.Verifier(conn, self.r).report("down=2s").assert_exactly_once(self)


if __name__ == "__main__":
    unittest.main()
