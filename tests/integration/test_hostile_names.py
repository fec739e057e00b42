"""Names read from Redis never break SQL, the claim, admission, status or a scrape.

Whoever can write to the Redis database can create streams and consumer
groups with any bytes in their names. Promises tested:

- streams that are not the relay's (quotes, backslash, newline, braces, bytes
  that are not UTF-8, a 1 KiB name), each with a lagging consumer group and
  pause_lag_entries set, change nothing: every claim works, the relay's own
  streams keep flowing, producer admission of a healthy topic stays open;
- consumer groups with such names on the relay's own stream are observed and
  exported with their label values escaped as the Prometheus text format
  requires: `promtool check metrics` accepts the scrape, and the escaped
  value reads back as the group's name;
- `outbox-relay status` and `status --json` exit 0 with such names present;
- a paused topic whose name has a dot is held back while other topics flow, and
  once its group catches up, its held rows arrive once, in order.
"""

import json
import os
import re
import shutil
import subprocess
import unittest
import urllib.request

from testkit import harness
from testkit.harness import insert

harness.require_relay()
harness.set_deadline(240)

HOSTILE = [b'audit"log', b"back\\slash", b"new\nline", b"{brace}", b"\xff\xfenot-utf8",
           b"x" * 1024, b'quote" and \\ and {', b"tab\there"]


def scrape(port, path="/metrics"):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        data = resp.read()
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise AssertionError(f"the scrape is not UTF-8 ({e})") from None


def unescape_label(value):
    """A Prometheus label value as written in the text format, read back."""
    return re.sub(r'\\(["\\n])', lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


class HostileNamesTest(harness.ServerTestCase):

    def make_lagging_group(self, stream, group):
        self.r.xadd(stream, {b"f": b"v"})
        self.r.xgroup_create(stream, group, id="0")
        for _ in range(5):
            self.r.xadd(stream, {b"f": b"v"})

    def test_hostile_names(self):
        for name in HOSTILE:
            self.make_lagging_group(name, name + b"-group")
        # The relay's own stream, with a healthy group of a hostile name.
        self.r.xgroup_create("orders", 'billing"eu', id="$", mkstream=True)
        self.r.xgroup_create("orders", b"g\\\n\xff", id="$")
        self.db.cursor().execute(
            "INSERT INTO outbox.topic_limits (topic, max_pending, resume_pending)"
            " VALUES ('orders', 100000, 1000)")
        port = harness.free_port()
        relay = self.relay(metrics_listen=f"127.0.0.1:{port}", observe_interval="200ms",
                           poll_interval="200ms", pause_lag_entries=3, resume_lag_entries=1)
        harness.wait_until(lambda: harness.port_open(port), timeout=15, relay=relay)
        for i in range(50):
            insert(self.db, "orders", b"healthy %d" % i)
        harness.wait_all_sent(self.db, timeout=20, relay=relay)
        self.assertEqual(harness.problem_lines(relay.log(), "relay"), [])
        self.assertEqual(harness.problem_lines(relay.log(), "pg"), [])
        # The topic has no state row until the relay first records one.
        admitting = harness.scalar(self.db, "SELECT (SELECT admitting FROM outbox.topic_state"
                                            " WHERE topic = 'orders')")
        self.assertIn(admitting, (None, True), "admission of a healthy topic closed")
        with self.db.cursor() as cur:
            cur.execute("SELECT outbox.admit('orders')")

        text = harness.wait_until(
            lambda: (lambda t: t if 'group="billing\\"eu"' in t else None)(scrape(port)),
            timeout=15, relay=relay, message="the hostile group in the scrape")
        labels = re.findall(r'^outbox_relay_group_pending_entries\{stream="orders",'
                            r'group="((?:[^"\\]|\\.)*)"\} ', text, re.MULTILINE)
        self.assertIn('billing"eu', [unescape_label(v) for v in labels])
        self.assertIn("g\\\n\ufffd", [unescape_label(v) for v in labels])
        for name in HOSTILE:
            self.assertNotIn(f'stream="{name.decode(errors="replace")}"', text)
        promtool = shutil.which("promtool")
        if promtool is None:
            self.skipTest("promtool not installed (Debian package prometheus)")
        proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=30)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

        env = harness.relay_env(self.pg, self.redis)
        for args in (["status"], ["status", "--json"]):
            done = harness.run_relay(args, env=env, timeout=60)
            self.assertEqual(done.returncode, 0, done.output)
        json.loads(harness.run_relay(["status", "--json"], env=env, timeout=60).stdout)

    def test_paused_topic_is_held_back_while_others_flow(self):
        self.r.xgroup_create("slow.topic", "lagging", id="$", mkstream=True)
        relay = self.relay(observe_interval="200ms", poll_interval="200ms",
                           pause_lag_entries=3, resume_lag_entries=1)
        for i in range(5):
            insert(self.db, "slow.topic", b"%d" % i)
        relay.wait_for_log(r"stream slow\.topic paused", timeout=20)
        for i in range(20):
            insert(self.db, "slow.topic", b"held %d" % i)
            insert(self.db, "fast-topic", b"flows %d" % i)

        def unsent(topic):
            return harness.scalar(self.db, "SELECT count(*) FROM outbox.unsent WHERE topic = %s",
                                  (topic,))
        harness.wait_until(lambda: unsent("fast-topic") == 0, timeout=20, relay=relay,
                           message="the unpaused topic to flow")
        self.assertGreater(unsent("slow.topic"), 0, "the paused topic was not held back")
        self.assertEqual(harness.problem_lines(relay.log(), "pg"), [])
        # The group catches up: the stream resumes from where it stood, and
        # every held row arrives once, in order.
        self.r.xgroup_setid("slow.topic", "lagging", id="$")
        relay.wait_for_log(r"stream slow\.topic resumed", timeout=20)
        harness.wait_until(lambda: unsent("slow.topic") == 0, timeout=20, relay=relay,
                           message="the held rows after the resume")
        payloads = [fields[b"payload"] for _, fields in self.r.xrange("slow.topic")]
        self.assertEqual(payloads, [b"%d" % i for i in range(5)] +
                         [b"held %d" % i for i in range(20)])


if __name__ == "__main__":
    unittest.main(verbosity=2)
