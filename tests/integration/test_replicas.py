"""Replica acknowledgement: with min_replicas, a row is marked sent only once a replica holds it.

Promises tested (README, "Redis replicas and Sentinel"; docs/DESIGN.md, "Replica
acknowledgement"):
- with min_replicas = 1 and the replica frozen (SIGSTOP), the relay publishes
  to the primary but marks nothing sent, logs why (the count WAIT returned and
  what to check) and counts the failures by kind "redis_replicas"; once the
  replica runs again every row is marked and each is in the stream once, on
  the primary and on the replica;
- a failover under load (the replica frozen for a second so that it falls
  behind, the primary killed with SIGKILL, the replica promoted, the address moved to it, the old primary back as the new one's
  replica): with min_replicas = 1 no row that the relay marked sent is
  missing from the new primary, and nothing is doubled;
- a replica_timeout longer than publish_timeout is accepted (the WAIT has a deadline of
  its own), and min_replicas above 16 is refused at start
  (exit 78) with a message that says why.
"""

import signal
import time
import unittest

from testkit import faults
from testkit import harness
from testkit.harness import insert, scalar, wait_until

harness.require_relay()
harness.set_deadline(240)

RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="500ms",
                   publish_timeout="2s", connect_timeout="1s", batch_size=50,
                   min_replicas=1, replica_timeout="300ms")


# No delay before a full sync (5 s by default): a replica catches up at once.
QUICK_SYNC = ["--repl-diskless-sync-delay", "0"]


def replica_of(primary):
    """A replica of primary (wait_synced waits for its link)."""
    return harness.Redis(appendonly=True,
                         extra_args=QUICK_SYNC + ["--replicaof", "127.0.0.1", str(primary.port)])


wait_synced = harness.wait_replica_synced


def sent_count(conn):
    """Rows the relay recorded as sent: their stream's recorded position has
    passed them (rows are no longer marked one by one)."""
    return harness.count_sent(conn)


class ReplicaTest(harness.PostgresTestCase):
    """The class's PostgreSQL; each test starts its own primary and replica."""

    def servers(self):
        primary = self.enterContext(harness.Redis(appendonly=True, extra_args=QUICK_SYNC))
        replica = self.enterContext(replica_of(primary))
        wait_synced(replica)
        return primary, replica

    def test_marked_only_once_a_replica_holds_the_batch(self):
        primary, replica = self.servers()
        p, rp = primary.client(), replica.client()
        self.addCleanup(p.close)
        self.addCleanup(rp.close)
        relay = self.enterContext(harness.Relay(self.pg, primary, **RELAY_FLAGS))
        for i in range(20):
            insert(self.db, "orders", b"before %d" % i)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        wait_until(lambda: rp.xlen("orders") == 20, timeout=10, message="20 entries on the replica")

        replica.pause()
        mark = relay.mark()
        for i in range(30):
            insert(self.db, "orders", b"frozen %d" % i)
        relay.wait_for_log(r"0 of min_replicas = 1 replicas acknowledged the batch within "
                           r"replica_timeout \(300 ms\)", since=mark, timeout=15)
        # The primary has the first frozen batch's entries (the batches after it
        # wait behind it); none is marked while no replica holds them.
        wait_until(lambda: p.xlen("orders") > 20, timeout=10,
                   message="the frozen batch's entries on the primary")
        time.sleep(1.5)
        self.assertEqual(sent_count(self.db), 20,
                         "a row was marked sent that no replica held\n" + relay.log_tail())
        text = harness.metrics_text(relay)
        self.assertGreater(harness.metric(text, "outbox_relay_publish_errors_total",
                                          kind="redis_replicas") or 0, 0)

        replica.resume()
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        fig = harness.Verifier(self.db, p, compare_payloads=True).report("replica frozen")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, 50)
        wait_until(lambda: rp.xlen("orders") == 50, timeout=10, message="50 entries on the replica")
        fig = harness.Verifier(self.db, rp).report("on the replica")
        fig.assert_exactly_once(self)

    def test_failover_under_load_loses_nothing_marked_sent(self):
        primary, replica = self.servers()
        rp = replica.client()
        self.addCleanup(rp.close)
        proxy = self.enterContext(faults.TcpProxy(primary.port, name="redis address"))
        relay = self.enterContext(harness.Relay(
            self.pg, None, env={"OUTBOX_RELAY_REDIS": f"redis://127.0.0.1:{proxy.port}/0"},
            **RELAY_FLAGS))
        producer = harness.Producer(self.pg, rows=10**9, tx_rows=(1, 10), rate=1500,
                                    topics=("orders", "invoices", "mail"))
        producer.start()
        self.addCleanup(producer.stop)
        wait_until(lambda: sent_count(self.db) >= 3000, timeout=60, relay=relay,
                   message="3,000 rows sent before the failover")

        # The replica falls behind (frozen for a second: a slow link, a busy
        # host), the primary dies, the replica is promoted without what it
        # missed, and the address moves to it.
        replica.pause()
        time.sleep(1.0)
        sent_before_kill = sent_count(self.db)
        primary.kill()
        replica.resume()
        rp.execute_command("REPLICAOF", "NO", "ONE")
        proxy.retarget(replica.port)
        proxy.cut()
        proxy.restore()
        # Until the promoted primary has a replica of its own, nothing is
        # marked sent; the old primary comes back as that replica.
        primary.extra_args = QUICK_SYNC + ["--replicaof", "127.0.0.1", str(replica.port)]
        primary.start()
        wait_synced(primary)
        # Everything marked sent up to the kill must be on the promoted replica.
        wait_until(lambda: sent_count(self.db) >= sent_before_kill + 3000, timeout=60,
                   relay=relay, message="3,000 more rows sent after the failover")
        producer.stop()
        producer.check()
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        fig = harness.Verifier(self.db, rp).report(
            f"failover after {sent_before_kill} sent")
        fig.assert_exactly_once(self)
        self.assertGreater(fig.committed, sent_before_kill + 3000)


class ReplicaConfigTest(harness.TestCase):
    def test_replica_timeout_is_its_own_deadline(self):
        """The WAIT for replicas has a deadline of its own (replica_timeout, then
        publish_timeout for an answer), so it need not fit inside publish_timeout."""
        done = harness.run_relay(["--check-config"], env=harness.relay_env(extra={
            "OUTBOX_RELAY_POSTGRES": "host=127.0.0.1 dbname=app",
            "OUTBOX_RELAY_REDIS": "redis://127.0.0.1:6379/0",
            "OUTBOX_RELAY_MIN_REPLICAS": "1",
            "OUTBOX_RELAY_REPLICA_TIMEOUT": "30s",
            "OUTBOX_RELAY_PUBLISH_TIMEOUT": "5s"}))
        self.assertEqual(done.returncode, 0, done.stderr)
        done = harness.run_relay(["--check-config"], env=harness.relay_env(extra={
            "OUTBOX_RELAY_POSTGRES": "host=127.0.0.1 dbname=app",
            "OUTBOX_RELAY_REDIS": "redis://127.0.0.1:6379/0",
            "OUTBOX_RELAY_MIN_REPLICAS": "17"}))
        self.assertEqual(done.returncode, 78, done.stderr)
        self.assertIn('MIN_REPLICAS = "17": must be between 0 and 16', done.stderr)


if __name__ == "__main__":
    unittest.main()
