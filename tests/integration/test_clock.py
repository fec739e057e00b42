"""No clock in the publish's safety: entry ids come from PostgreSQL's ticks.

A row's entry id is `<its tick's ms>-<rank>`, where the tick's ms is taken
by PostgreSQL (outbox.tick(), strictly increasing from tick to tick), and the
relay sends every id explicitly: Redis's wall clock, and the relay's, decide
nothing (docs/DESIGN.md, "Batches from snapshots").

Promises tested:
- Redis's wall clock stepped back 60 s, then forward 60 s, in the middle of a
  run (an NTP step, a VM resume; TIME shows it) changes nothing: rows written
  after each step arrive within seconds, exactly once and in order, and every
  entry id's time is its tick's (outbox.ticks.ms), not Redis's clock;
- the relay's own wall clock stepped back 10 s does not stop publishing;
- a Redis Cluster whose primaries' clocks differ by 60 s either way (one
  true, one 60 s ahead, one 60 s behind): rows over topics on every primary
  arrive with nothing lost, nothing doubled, each stream in order, and no
  stall;
- a Redis connect that takes 2.5 s (a proxy that holds each new connection)
  with publish_timeout = 1s still publishes: the deadline of a chunk's calls
  starts when they are sent on a connection that is up;
- whole-batch failures that repeat (Redis refusing every write) turn /readyz
  red and show in outbox_relay_batch_failures_in_row; both recover once Redis
  accepts writes again.

Clocks are moved with tests/shim/clockstep.c (testkit/clocks.py), preloaded
into the server whose clock is off: CLOCK_REALTIME moves, CLOCK_MONOTONIC
does not, as the kernel does it.
"""

import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

from testkit import clocks
from testkit import faults
from testkit import harness
from testkit.harness import insert, insert_many

harness.require_relay()
harness.set_deadline(400)

PUBLISH_TIMEOUT_MS = 1000
STEP_MS = 60_000


def scrape(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet
        return 0, str(e)


def assert_in_order(test, reader):
    """Every stream's entries in outbox id order, their ids increasing."""
    for stream in harness.stream_names(reader):
        entries = harness.stream_entries(reader, stream)
        ids = [int(f[b"outbox_id"]) for _, f in entries]
        test.assertEqual(ids, sorted(ids), f"stream {stream!r} out of order")


def entry_ms(entry_id):
    return int(entry_id.split("-")[0])


class RedisClockTest(harness.PostgresTestCase):
    """Redis (or the relay) with a wall clock of its own."""

    def tick_ms(self):
        with self.db.cursor() as cur:
            cur.execute("SELECT ms FROM outbox.ticks")
            return {r[0] for r in cur.fetchall()}

    def publish(self, relay, r, n, label, topics=("clock", "other")):
        """Commits n rows and waits until all are sent (a stall fails the
        wait); returns how long it took, for the log."""
        started = time.monotonic()
        insert_many(self.db, [(topics[i % len(topics)], f"{label} {i}".encode(), f"k{i % 3}")
                              for i in range(n)])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        return time.monotonic() - started

    def test_redis_wall_clock_steps_change_nothing(self):
        with clocks.stepped_servers():
            redis = self.enterContext(harness.Redis())
        r = redis.client()
        self.addCleanup(r.close)
        relay = self.enterContext(harness.Relay(
            self.pg, redis, publish_timeout=f"{PUBLISH_TIMEOUT_MS}ms", poll_interval="200ms",
            reconnect_min="50ms", reconnect_max="1s"))
        relay.wait_for_log(r"^\S+ INFO redis: .*ready", timeout=30)
        took = self.publish(relay, r, 40, "before")
        print(f"before any step: 40 rows in {took * 1000:.0f} ms", file=sys.stderr)
        last = max(entry_ms(e[1]) for f in harness.entries_by_message_id(r).values() for e in f)

        for step in (-STEP_MS, +STEP_MS):
            clocks.set_step(redis.dir, step)
            off = clocks.redis_time_ms(r) - time.time() * 1000
            self.assertAlmostEqual(off, step, delta=5000, msg="Redis's clock did not move")
            took = self.publish(relay, r, 40, f"after a step of {step} ms")
            print(f"Redis's clock {off / 1000:+.1f} s off: 40 rows in {took * 1000:.0f} ms",
                  file=sys.stderr)
            found = harness.entries_by_message_id(r)
            newest = max(entry_ms(e[1]) for f in found.values() for e in f)
            self.assertGreater(newest, last, "entry ids went back with Redis's clock")
            last = newest

        ticks = self.tick_ms()
        found = harness.entries_by_message_id(r)
        strays = sorted({entry_ms(e[1]) for f in found.values() for e in f} - ticks)
        self.assertEqual(strays, [], "entry ids whose time is no tick's: Redis's clock")
        fig = harness.Verifier(self.db, r, compare_payloads=True).report("Redis clock steps")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, 120)
        assert_in_order(self, r)

    def test_relay_wall_clock_stepped_back(self):
        redis = self.enterContext(harness.Redis())
        r = redis.client()
        self.addCleanup(r.close)
        tmp = tempfile.mkdtemp(prefix="outbox-clockstep-")
        self.addCleanup(shutil.rmtree, tmp, True)
        env = {"LD_PRELOAD": clocks.clockstep_lib(),
               "OUTBOX_CLOCKSTEP_FILE": os.path.join(tmp, clocks.STEP_FILE),
               # An ASan build wants its runtime first; the shim only wraps clocks.
               "ASAN_OPTIONS": "verify_asan_link_order=0:"
                               + os.environ.get("ASAN_OPTIONS", "detect_leaks=1")}
        clocks.set_step(tmp, 0)
        relay = self.enterContext(harness.Relay(
            self.pg, redis, env=env, publish_timeout=f"{PUBLISH_TIMEOUT_MS}ms",
            poll_interval="200ms", reconnect_max="1s"))
        self.publish(relay, r, 20, "before")
        clocks.set_step(tmp, -10_000)
        took = self.publish(relay, r, 20, "after the relay's clock stepped back")
        print(f"after stepping the relay's clock back 10 s: 20 rows in {took * 1000:.0f} ms",
              file=sys.stderr)
        harness.Verifier(self.db, r).report("relay clock step").assert_exactly_once(self)
        assert_in_order(self, r)


class ClusterClockSkewTest(harness.PostgresTestCase):

    def test_primaries_60_s_apart(self):
        with clocks.stepped_servers():
            cluster = self.enterContext(harness.RedisCluster(primaries=3, replicas=0))
        primaries = list(cluster.primaries().items())
        skews = {}
        for (port, node), step in zip(primaries, (0, +STEP_MS, -STEP_MS)):
            clocks.set_step(node.dir, step)
            with contextlib.closing(node.client()) as c:
                skews[port] = (clocks.redis_time_ms(c) - time.time() * 1000) / 1000
        print(f"primaries' clocks off by (s): {skews}", file=sys.stderr)
        self.assertGreater(max(skews.values()) - min(skews.values()), 100)

        # Topics on every primary.
        topics, chosen = [], {port: 0 for port, _ in primaries}
        slots = cluster.slots()
        with contextlib.closing(cluster.nodes[0].client()) as c:
            i = 0
            while any(n < 2 for n in chosen.values()):
                topic = f"skew{i:03d}"
                i += 1
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", topic))
                port = next(p for lo, hi, p in slots if lo <= slot <= hi)
                if chosen[port] < 2:
                    chosen[port] += 1
                    topics.append(topic)
        relay = self.enterContext(harness.Relay(
            self.pg, None, env={"OUTBOX_RELAY_REDIS": cluster.url()}, poll_interval="200ms",
            reconnect_min="50ms", reconnect_max="500ms", publish_timeout="2s",
            connect_timeout="1s", batch_size=100))
        relay.wait_for_log(r"redis cluster of 3 primaries .* ready", timeout=30)
        producer = harness.Producer(self.pg, rows=4000, tx_rows=(1, 10), rate=500,
                                    topics=topics)
        producer.start()
        self.addCleanup(producer.stop)
        # No stall: the rows keep going out while the producer writes.
        seen = []
        for _ in range(4):
            time.sleep(1.5)
            seen.append(harness.count_sent(self.db))
        self.assertEqual(seen, sorted(set(seen)), f"publishing stalled: sent {seen}")
        producer.join(60)
        producer.check()
        self.assertEqual(producer.committed, 4000)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        reader = cluster.reader()
        self.addCleanup(reader.close)
        fig = harness.Verifier(self.db, reader, compare_payloads=True).report("clock skew")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, 4000)
        assert_in_order(self, reader)


class ConnectionTimeTest(harness.ServerTestCase):

    def publish_some(self, relay, n, label):
        """Commits n rows and returns how long until all are published (s)."""
        started = time.monotonic()
        for i in range(n):
            insert(self.db, "clock", f"{label} {i}".encode())
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        return time.monotonic() - started

    def test_slow_connect(self):
        proxy = faults.HoldingProxy(self.redis.port, lambda client: (2.5, b""))
        self.addCleanup(proxy.close)
        relay = self.enterContext(harness.Relay(
            self.pg, None, env={"OUTBOX_RELAY_REDIS": f"redis://127.0.0.1:{proxy.port}/0"},
            publish_timeout=f"{PUBLISH_TIMEOUT_MS}ms", connect_timeout="5s",
            poll_interval="200ms", reconnect_max="1s"))
        relay.wait_for_log(r"redis: .*ready", timeout=20)
        took = self.publish_some(relay, 20, "behind a slow connect")
        print(f"connect held 2.5 s, publish_timeout {PUBLISH_TIMEOUT_MS} ms: 20 rows in "
              f"{took * 1000:.0f} ms, {proxy.connections} Redis connection(s)", file=sys.stderr)
        self.verifier().report().assert_exactly_once(self)

    def test_repeated_batch_failures_turn_readyz_red(self):
        port = harness.free_port()
        relay = self.relay(metrics_listen=f"127.0.0.1:{port}", poll_interval="200ms",
                           reconnect_min="50ms", reconnect_max="200ms")
        harness.wait_until(lambda: scrape(port, "/readyz")[0] == 200, timeout=20, relay=relay,
                           message="/readyz to turn green")
        self.r.config_set("maxmemory", "1")  # every write is refused with OOM
        try:
            insert(self.db, "clock", b"refused for now")
            status, body = harness.wait_until(
                lambda: (lambda s: s if s[0] == 503 else None)(scrape(port, "/readyz")),
                timeout=20, relay=relay, message="/readyz to turn red while batches keep failing")
            print(f"/readyz while every batch fails: {status} {body.strip()}", file=sys.stderr)
            self.assertIn("failing", body)
            _, text = scrape(port, "/metrics")
            m = re.search(r"^outbox_relay_batch_failures_in_row (\S+)$", text, re.MULTILINE)
            self.assertTrue(m and float(m.group(1)) >= 3, "no outbox_relay_batch_failures_in_row")
        finally:
            self.r.config_set("maxmemory", "0")
        harness.wait_all_sent(self.db, timeout=20, relay=relay)
        harness.wait_until(lambda: scrape(port, "/readyz")[0] == 200, timeout=20, relay=relay,
                           message="/readyz to turn green again")
        _, text = scrape(port, "/metrics")
        self.assertRegex(text, r"(?m)^outbox_relay_batch_failures_in_row 0$")


if __name__ == "__main__":
    unittest.main(verbosity=2)
