"""Redis Sentinel: the relay finds the primary through Sentinel and follows failovers.

Promises tested (README, "Redis replicas and Sentinel"):
- with redis_sentinel and redis_master (and no redis address) the relay asks
  the Sentinels for the primary and publishes there; `outbox-relay status`
  finds it the same way;
- the primary killed with SIGKILL under load: the Sentinels promote the
  replica, the relay asks them again and goes on with the new primary, and
  with min_replicas = 1 nothing is lost or doubled;
- a manual failover under load (SENTINEL FAILOVER: the old primary stays up
  and becomes a replica): the relay moves to the new primary, nothing lost or
  doubled;
- Sentinels that cannot be reached, or that know no master of that name: the
  relay says so, naming the last answer and what to check, and keeps asking;
- Sentinels with a password of their own (requirepass): without
  redis_sentinel_password, or with a wrong one, the relay and `outbox-relay
  status` say which Sentinel refused and what to check, and publish nothing;
  with it they find the primary and the relay publishes; the password never
  reaches a log (test_secrets); a Sentinel without a password refuses AUTH and
  answers all the same, and its answer is what is reported;
- an ACL user of the Sentinels' own (redis_sentinel_user): its password alone,
  sent for the default user, is refused and reported; with the user the relay
  and status find the primary.
"""

import contextlib
import random
import time
import unittest

from testkit import harness
from testkit.harness import insert, scalar, wait_until

harness.require_relay()
harness.set_deadline(420)

MASTER = "orders-primary"
RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="500ms",
                   publish_timeout="2s", connect_timeout="1s", batch_size=50,
                   min_replicas=1, replica_timeout="300ms")


def sent_count(conn):
    """Rows the relay recorded as sent: their stream's recorded position has
    passed them (rows are no longer marked one by one)."""
    return harness.count_sent(conn)


class SentinelTest(harness.PostgresTestCase):
    """The class's PostgreSQL; each test starts a primary, a replica and three Sentinels."""

    def servers(self):
        # No delay before a full sync (5 s by default): replicas catch up at once.
        quick = ["--repl-diskless-sync-delay", "0"]
        primary = self.enterContext(harness.Redis(appendonly=True, extra_args=quick))
        replica = self.enterContext(harness.Redis(
            appendonly=True, extra_args=quick + ["--replicaof", "127.0.0.1", str(primary.port)]))
        harness.wait_replica_synced(replica)
        sentinels = [self.enterContext(harness.Sentinel(primary, master=MASTER))
                     for _ in range(3)]

        def ready():
            for s in sentinels:
                with contextlib.closing(s.client(socket_timeout=2)) as c:
                    m = c.execute_command("SENTINEL", "master", MASTER)
                    info = dict(zip(m[::2], m[1::2]))
                    if int(info[b"num-other-sentinels"]) != 2 or int(info[b"num-slaves"]) != 1:
                        return False
            return True
        wait_until(ready, timeout=60, interval=0.2,
                   message="three Sentinels that know each other and the replica")
        return primary, replica, sentinels

    def relay_for(self, sentinels, **flags):
        env = {"OUTBOX_RELAY_REDIS": None,
               "OUTBOX_RELAY_REDIS_SENTINEL": ",".join(s.address() for s in sentinels),
               "OUTBOX_RELAY_REDIS_MASTER": MASTER}
        return self.enterContext(harness.Relay(self.pg, None, env=env,
                                               **{**RELAY_FLAGS, **flags}))

    def under_load(self, relay, failover):
        """Rows committed at 1,000 a second across a failover; every one
        arrives once on the primary the Sentinels name at the end."""
        producer = harness.Producer(self.pg, rows=10**9, tx_rows=(1, 10), rate=1000,
                                    topics=("orders", "invoices"))
        producer.start()
        self.addCleanup(producer.stop)
        wait_until(lambda: sent_count(self.db) >= 2000, timeout=60, relay=relay,
                   message="2,000 rows sent before the failover")
        started = time.monotonic()
        new_port = failover()
        promoted = time.monotonic()
        before = sent_count(self.db)
        wait_until(lambda: sent_count(self.db) > before, timeout=60, relay=relay,
                   message="a row marked sent after the failover")
        print(f"failover: promoted {promoted - started:.1f} s after it began; rows marked sent"
              f" again {time.monotonic() - started:.1f} s after it began", flush=True)
        wait_until(lambda: sent_count(self.db) >= before + 2000, timeout=90, relay=relay,
                   message="2,000 more rows sent after the failover")
        producer.stop()
        producer.check()
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        rc = harness.Redis(port=new_port).client()
        self.addCleanup(rc.close)
        fig = harness.Verifier(self.db, rc).report(f"failover after {before} sent")
        fig.assert_exactly_once(self)
        return fig

    def test_primary_killed_under_load(self):
        primary, replica, sentinels = self.servers()
        relay = self.relay_for(sentinels)
        mark = relay.mark()

        def failover():
            primary.kill()
            wait_until(lambda: all(s.primary() == replica.port for s in sentinels), timeout=60,
                       interval=0.2, message="the Sentinels to promote the replica")
            # The old primary comes back and the Sentinels make it the new
            # primary's replica: with min_replicas = 1 nothing is marked
            # sent until then.
            primary.start()
            return replica.port
        self.under_load(relay, failover)
        relay.wait_for_log(rf"Sentinel 127\.0\.0\.1:\d+ names 127\.0\.0\.1:{replica.port} as the"
                           rf" primary of {MASTER}", since=mark, timeout=10)
        done = harness.run_relay(["status"], env=harness.relay_env(self.pg, extra={
            "OUTBOX_RELAY_REDIS_SENTINEL": ",".join(s.address() for s in sentinels),
            "OUTBOX_RELAY_REDIS_MASTER": MASTER}))
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def test_manual_failover_under_load(self):
        primary, replica, sentinels = self.servers()
        relay = self.relay_for(sentinels)

        def failover():
            with contextlib.closing(sentinels[0].client()) as c:
                c.execute_command("SENTINEL", "FAILOVER", MASTER)
            wait_until(lambda: all(s.primary() == replica.port for s in sentinels), timeout=60,
                       interval=0.2, message="the Sentinels to promote the replica")
            return replica.port
        self.under_load(relay, failover)

    def test_sentinels_that_cannot_answer(self):
        primary = self.enterContext(harness.Redis())
        sentinel = self.enterContext(harness.Sentinel(primary, master="another-name"))
        closed = harness.free_port()
        env = {"OUTBOX_RELAY_REDIS": None,
               "OUTBOX_RELAY_REDIS_SENTINEL": f"127.0.0.1:{closed},{sentinel.address()}",
               "OUTBOX_RELAY_REDIS_MASTER": MASTER}
        relay = self.enterContext(harness.Relay(self.pg, None, env=env, **RELAY_FLAGS))
        relay.wait_for_log(rf'no Sentinel named the primary of master "{MASTER}" \(2 asked; last:'
                           rf" Sentinel 127\.0\.0\.1:{sentinel.port} knows no master of that"
                           r" name\): check redis_sentinel and redis_master", timeout=15)
        insert(self.db, "orders", b"waits")
        time.sleep(1.0)
        self.assertTrue(relay.alive(), relay.log_tail())
        self.assertEqual(sent_count(self.db), 0)

    def test_sentinels_with_a_password_of_their_own(self):
        primary = self.enterContext(harness.Redis())
        password = f"sentinel-{random.getrandbits(48):012x}"
        sentinel = self.enterContext(harness.Sentinel(primary, master=MASTER, quorum=1,
                                                      password=password))
        hint = r"\(check redis_sentinel_user and redis_sentinel_password\)"

        def env(given):
            # The password in the environment, never on a command line.
            return {"OUTBOX_RELAY_REDIS": None,
                    "OUTBOX_RELAY_REDIS_SENTINEL": sentinel.address(),
                    "OUTBOX_RELAY_REDIS_MASTER": MASTER,
                    "OUTBOX_RELAY_REDIS_SENTINEL_PASSWORD": given,
                    "OUTBOX_RELAY_CONNECT_TIMEOUT": "1s"}

        for given, said in ((None, rf"Sentinel 127\.0\.0\.1:{sentinel.port} NOAUTH [^;]*{hint}"),
                            ("wrong-password", rf"Sentinel 127\.0\.0\.1:{sentinel.port}: Redis "
                                               rf"refused AUTH: WRONGPASS [^;]*{hint}")):
            with self.subTest(password=given):
                self.refused(env(given), said)
        self.publishes_through(primary, env(password), b"found through a Sentinel with a password")

    def refused(self, env, said):
        """Status and the relay both report the Sentinel's refusal, `said`."""
        status = harness.run_relay(["status"], env=harness.relay_env(self.pg, None, env))
        print(f"status:\n{status.stdout}{status.stderr}", flush=True)
        self.assertRegex(status.stdout + status.stderr, said)
        with harness.Relay(self.pg, None, env=env, **RELAY_FLAGS) as relay:
            relay.wait_for_log(rf"no Sentinel named the primary of master \"{MASTER}\" "
                               rf"\(1 asked; last: {said}", timeout=15)

    def publishes_through(self, primary, env, payload):
        """With env the relay publishes a row to `primary`, and status has no
        complaint about a Sentinel."""
        insert(self.db, "orders", payload)
        relay = self.enterContext(harness.Relay(self.pg, None, env=env,
                                                **{**RELAY_FLAGS, "min_replicas": 0}))
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        with contextlib.closing(primary.client()) as c:
            self.assertEqual(c.xlen("orders"), 1)
        status = harness.run_relay(["status"], env=harness.relay_env(self.pg, None, env))
        self.assertNotRegex(status.stdout + status.stderr, "Sentinel|NOAUTH|AUTH", status.stdout)

    def test_an_acl_user_of_the_sentinels_own(self):
        primary = self.enterContext(harness.Redis())
        user = "relay-watch"
        user_password = f"watch-{random.getrandbits(48):012x}"
        sentinel = self.enterContext(harness.Sentinel(
            primary, master=MASTER, quorum=1,
            password=f"default-{random.getrandbits(48):012x}",
            user=user, user_password=user_password))

        def env(given_user):
            return {"OUTBOX_RELAY_REDIS": None,
                    "OUTBOX_RELAY_REDIS_SENTINEL": sentinel.address(),
                    "OUTBOX_RELAY_REDIS_MASTER": MASTER,
                    "OUTBOX_RELAY_REDIS_SENTINEL_USER": given_user,
                    "OUTBOX_RELAY_REDIS_SENTINEL_PASSWORD": user_password,
                    "OUTBOX_RELAY_CONNECT_TIMEOUT": "1s"}

        said = (rf"Sentinel 127\.0\.0\.1:{sentinel.port}: Redis refused AUTH: WRONGPASS [^;]*"
                r"\(check redis_sentinel_user and redis_sentinel_password\)")
        self.refused(env(None), said)
        self.publishes_through(primary, env(user), b"found through a Sentinel's ACL user")

    def test_a_password_for_sentinels_that_have_none(self):
        """A Sentinel without a password refuses AUTH and answers all the same:
        its answer, not the refusal, is what the relay and status report."""
        primary = self.enterContext(harness.Redis())
        sentinel = self.enterContext(harness.Sentinel(primary, master="another-name", quorum=1))
        env = {"OUTBOX_RELAY_REDIS": None, "OUTBOX_RELAY_REDIS_SENTINEL": sentinel.address(),
               "OUTBOX_RELAY_REDIS_MASTER": MASTER,
               "OUTBOX_RELAY_REDIS_SENTINEL_PASSWORD": "not-needed-here",
               "OUTBOX_RELAY_CONNECT_TIMEOUT": "1s"}
        said = rf"last: Sentinel 127\.0\.0\.1:{sentinel.port} knows no master of that name\)"
        status = harness.run_relay(["status"], env=harness.relay_env(self.pg, None, env))
        self.assertRegex(status.stdout + status.stderr, said)
        with harness.Relay(self.pg, None, env=env, **RELAY_FLAGS) as relay:
            relay.wait_for_log(said, timeout=15)


if __name__ == "__main__":
    unittest.main()
