"""What Redis keeps is up to Redis: the relay's start-up check (the README's table, "What Redis keeps is up to Redis").

Promises tested (each with its own redis-server):
- appendonly no: exactly one WARNING at start-up, saying acknowledged messages
  can be lost and to set appendonly yes + appendfsync always;
- appendonly yes + appendfsync everysec: exactly one WARNING naming everysec and
  what a crash can lose;
- appendonly yes + appendfsync always: no warning, one INFO line saying that
  acknowledged messages survive a crash;
- maxmemory-policy allkeys-lru (with appendfsync always): one WARNING that
  says to set maxmemory-policy noeviction;
- a Redis user whose ACL forbids CONFIG: one WARNING that the relay could not
  check, and the relay still publishes;
- the check runs again after every reconnect: after a Redis restart with other
  settings, and after the server drops the relay's connection (CLIENT KILL)
  once the settings were changed with CONFIG SET, the new verdict is logged;
- AUTH with a wrong password (in the URL, with and without a user, or in
  redis_password_file): an ERROR that says to check the user and password, the
  relay keeps retrying, and no password (wrong or right) is ever in the log.
"""

import os
import re
import tempfile
import time
import unittest

from testkit import harness
from testkit.harness import insert

harness.require_relay()
harness.set_deadline(180)

RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="500ms",
                   connect_timeout="2s")
DURABILITY = r"^\S+ (\w+) redis: durability: (.*)$"


def durability_lines(log, since=0):
    """[(level, text)] of the relay's durability verdicts."""
    return re.findall(DURABILITY, log[since:], re.MULTILINE)


class DurabilityTest(harness.PostgresTestCase):
    """The class's PostgreSQL; each test starts a Redis of its own."""

    def redis(self, **options):
        redis = self.enterContext(harness.Redis(**options))
        client = redis.client()
        self.addCleanup(client.close)
        return redis, client

    def start_relay(self, redis, env=None, **flags):
        relay = self.enterContext(harness.Relay(self.pg, redis, env=env,
                                                **{**RELAY_FLAGS, **flags}))
        relay.wait_for_log(r"^\S+ INFO redis: .*ready", timeout=20)
        return relay

    def assert_publishes(self, relay, client):
        mid = insert(self.db, "orders", b"durability check")
        harness.wait_all_sent(self.db, timeout=20, relay=relay)
        self.assertIn(mid, harness.entries_by_message_id(client))

    def assert_one_verdict(self, relay, level, phrases, since=0):
        """Exactly one durability line since `since`, at `level`, with every phrase;
        waits a moment (and publishes) so that a repeated line would show."""
        time.sleep(0.5)
        lines = durability_lines(relay.log(), since)
        self.assertEqual(len(lines), 1, f"durability lines: {lines}\n{relay.log_tail()}")
        got_level, text = lines[0]
        self.assertEqual(got_level, level, text)
        for phrase in phrases:
            self.assertIn(phrase, text)
        print(f"{got_level} durability: {text}", flush=True)
        return text

    # ---- the verdicts at start-up ----------------------------------------

    def test_appendonly_no(self):
        redis, client = self.redis(appendonly=False)
        relay = self.start_relay(redis)
        self.assert_publishes(relay, client)
        self.assert_one_verdict(relay, "WARNING", ["appendonly is off", "can lose",
                                                   "appendonly yes and appendfsync always"])

    def test_appendfsync_everysec(self):
        redis, client = self.redis(appendonly=True, appendfsync="everysec")
        relay = self.start_relay(redis)
        self.assert_publishes(relay, client)
        self.assert_one_verdict(relay, "WARNING", ["appendfsync is everysec", "1-2 s",
                                                   "appendfsync always"])

    def test_appendfsync_always(self):
        redis, client = self.redis(appendonly=True, appendfsync="always")
        relay = self.start_relay(redis)
        self.assert_publishes(relay, client)
        self.assert_one_verdict(relay, "INFO", ["appendonly yes, appendfsync always",
                                                "acknowledged messages survive a crash"])
        self.assertEqual(harness.problem_lines(relay.log(), "redis"), [],
                         "no warning when Redis keeps what it acknowledged")

    def test_eviction_policy(self):
        redis, client = self.redis(appendonly=True, appendfsync="always")
        client.config_set("maxmemory-policy", "allkeys-lru")
        relay = self.start_relay(redis)
        self.assert_publishes(relay, client)
        text = self.assert_one_verdict(relay, "WARNING", ["maxmemory-policy",
                                                          "set maxmemory-policy noeviction"])
        self.assertNotIn("survive a crash", text, "a warning, not the all-clear")

    def test_acl_forbids_config(self):
        redis, client = self.redis(appendonly=True, appendfsync="always")
        client.execute_command("ACL", "SETUSER", "relay", "on", ">pw", "~*", "&*", "+@all",
                               "-config")
        url = f"redis://relay:pw@127.0.0.1:{redis.port}/0"
        relay = self.start_relay(redis, env={"OUTBOX_RELAY_REDIS": url})
        self.assert_publishes(relay, client)
        self.assert_one_verdict(relay, "WARNING", ["could not check", "NOPERM",
                                                   "appendfsync always"])
        self.assertNotIn(":pw@", relay.log())

    # ---- again after every reconnect -------------------------------------

    def test_check_runs_again_after_restart_and_reconnect(self):
        redis, client = self.redis(appendonly=False)
        relay = self.start_relay(redis)
        self.assert_one_verdict(relay, "WARNING", ["appendonly is off"])

        # A restart with durable settings: the all-clear after the reconnect.
        client.close()
        redis.stop()
        redis.appendonly, redis.appendfsync = True, "always"
        mark = relay.mark()
        redis.start()
        relay.wait_for_log(r"^\S+ INFO redis: .*is back", since=mark, timeout=20)
        self.assert_one_verdict(relay, "INFO", ["acknowledged messages survive a crash"],
                                since=mark)
        self.assert_publishes(relay, redis.client())

        # Settings changed at run time are seen at the next reconnect.
        client = redis.client()
        self.addCleanup(client.close)
        client.config_set("appendfsync", "everysec")
        mark = relay.mark()
        killed = client.client_kill_filter(_type="normal", skipme=True)
        self.assertGreaterEqual(killed, 1)
        relay.wait_for_log(r"^\S+ INFO redis: .*is back", since=mark, timeout=20)
        self.assert_one_verdict(relay, "WARNING", ["appendfsync is everysec"], since=mark)
        self.assert_publishes(relay, client)

    # ---- a wrong password is reported, never logged ----------------------

    def test_wrong_password(self):
        right = "Right-Pa55word-77"
        redis, client = self.redis(password=right)
        client.execute_command("ACL", "SETUSER", "relay", "on", ">Relay-Pa55-88", "~*", "&*",
                               "+@all")
        secret_file = tempfile.NamedTemporaryFile("w", suffix=".pw", delete=False)
        secret_file.write("File-Wrong-Pa55-66\n")
        secret_file.close()
        self.addCleanup(os.unlink, secret_file.name)
        cases = [
            ("password in the URL", {"OUTBOX_RELAY_REDIS":
                                     f"redis://:Wrong-Pa55-11@127.0.0.1:{redis.port}/0"}),
            ("user and password in the URL", {"OUTBOX_RELAY_REDIS":
                                              f"redis://relay:Wrong-Pa55-22@127.0.0.1:"
                                              f"{redis.port}/0"}),
            ("redis_password_file", {"OUTBOX_RELAY_REDIS": f"redis://127.0.0.1:{redis.port}/0",
                                     "OUTBOX_RELAY_REDIS_PASSWORD_FILE": secret_file.name}),
        ]
        secrets = [right, "Relay-Pa55-88", "Wrong-Pa55-11", "Wrong-Pa55-22",
                   "File-Wrong-Pa55-66"]
        for name, env in cases:
            with self.subTest(name):
                with harness.Relay(self.pg, redis, env=env, **RELAY_FLAGS) as relay:
                    line = relay.wait_for_log(
                        r"^\S+ ERROR redis: .*AUTH.*check the user and password.*$",
                        timeout=20).group(0)
                    print(f"{name}: {line}", flush=True)
                    time.sleep(1.5)  # several retries
                    self.assertTrue(relay.alive(), "the relay keeps retrying\n"
                                    + relay.log_tail())
                    log = relay.log()
                    for secret in secrets:
                        self.assertNotIn(secret, log, f"a password is in the log ({name})")
                    # Once by the publishing connection; the observation
                    # thread says it once more for its own connection.
                    self.assertEqual(len(re.findall(r"(?m)^\S+ ERROR redis: .*check the user "
                                                    r"and password", log)), 1,
                                     "logged once, not once per retry")
                    self.assertLessEqual(len(re.findall(r"(?m)^\S+ WARNING observe: .*check "
                                                        r"the user and password", log)), 1,
                                         "the observation says it once, not once per retry")


if __name__ == "__main__":
    unittest.main()
