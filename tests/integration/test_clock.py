"""Publish deadlines that hold through clock steps and slow connects.

Promises tested (docs/DESIGN.md, "The publish deadline"):
- the relay's wall clock stepped back 10 s in the middle of a run (an NTP
  step, a VM resume) does not stop publishing: rows written after the step
  reach their streams within a few seconds, exactly once;
- the clock stepped forward 10 s does not make the deadline late: every
  publish the relay sends carries a deadline no later than publish_timeout
  after Redis's own clock at the moment Redis receives it;
- a Redis connect that takes 2.5 s (a proxy that holds each new connection)
  with publish_timeout = 1s still publishes: the clock is measured on a
  connection that is up, not from the moment the connect began;
- whole-batch failures that repeat (Redis refusing every write) turn /readyz
  red and show in outbox_relay_batch_failures_in_row; both recover once Redis
  accepts writes again.

The step is made by tests/shim/clockstep.c, loaded with LD_PRELOAD into the
relay alone: it moves CLOCK_REALTIME and leaves CLOCK_MONOTONIC alone, as the
kernel does. Redis runs on the same host and keeps the true time.
"""

import contextlib
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

from testkit import faults
from testkit import harness
from testkit.harness import insert

harness.require_relay()
harness.set_deadline(300)

STEP_MS = 10_000
PUBLISH_TIMEOUT_MS = 1000


def clockstep_lib():
    path = os.environ.get("OUTBOX_CLOCKSTEP_LIB", "")
    if not os.path.isfile(path):
        print(f"SKIP: clock-step shim {path!r} not built (set OUTBOX_CLOCKSTEP_LIB)",
              file=sys.stderr)
        sys.exit(harness.SKIP)
    return path


def scrape(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet
        return 0, str(e)


class Monitor(threading.Thread):
    """Records (server time, deadline) of every publish Redis receives, via
    MONITOR: a call of one row or of several, FCALL <function> <numkeys>
    <keys...> <ttl> <deadline> ..."""

    LINE = re.compile(rb'^\+(\d+\.\d+) \[\d+ [^\]]*\] "FCALL" (.*)$')
    ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')

    def __init__(self, port):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"MONITOR\r\n")
        self.samples = []
        self.lock = threading.Lock()
        self.stopping = False

    def run(self):
        buf = b""
        with contextlib.suppress(OSError):
            while not self.stopping:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                buf += chunk
                *lines, buf = buf.split(b"\r\n")
                for line in lines:
                    m = self.LINE.match(line)
                    if not m:
                        continue
                    args = self.ARG.findall(m.group(2))
                    if len(args) < 2 or not args[1].isdigit():
                        continue
                    nkeys = int(args[1])
                    if not args[0].startswith(b"outbox_relay_publish") or \
                            len(args) < nkeys + 4 or not args[nkeys + 3].isdigit():
                        continue
                    with self.lock:
                        self.samples.append((float(m.group(1)), int(args[nkeys + 3])))

    def take(self):
        with self.lock:
            out, self.samples = self.samples, []
        return out

    def close(self):
        self.stopping = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.join(5)


class ClockTest(harness.ServerTestCase):

    def write_step(self, ms):
        with open(self.step_file, "w") as f:
            f.write(str(ms))
        time.sleep(0.1)  # the shim rereads the file every 20 ms

    def stepped_relay(self, **flags):
        tmp = tempfile.mkdtemp(prefix="outbox-clockstep-")
        self.addCleanup(shutil.rmtree, tmp, True)
        self.step_file = os.path.join(tmp, "step")
        self.write_step(0)
        env = {"LD_PRELOAD": clockstep_lib(), "OUTBOX_CLOCKSTEP_FILE": self.step_file,
               # An ASan build wants its runtime first; the shim only wraps clocks.
               "ASAN_OPTIONS": "verify_asan_link_order=0:"
                               + os.environ.get("ASAN_OPTIONS", "detect_leaks=1")}
        return self.relay(env=env, **flags)

    def publish_some(self, relay, n, label):
        """Commits n rows and returns how long until all are published (s)."""
        started = time.monotonic()
        for i in range(n):
            insert(self.db, "clock", f"{label} {i}".encode())
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        return time.monotonic() - started

    def test_wall_clock_steps(self):
        monitor = Monitor(self.redis.port)
        monitor.start()
        self.addCleanup(monitor.close)
        relay = self.stepped_relay(publish_timeout=f"{PUBLISH_TIMEOUT_MS}ms",
                                   poll_interval="200ms", reconnect_max="1s")
        took = self.publish_some(relay, 20, "before")
        print(f"before any step: 20 rows in {took * 1000:.0f} ms", file=sys.stderr)

        self.write_step(-STEP_MS)
        took = self.publish_some(relay, 20, "after a step back")
        print(f"after stepping back {STEP_MS} ms: 20 rows in {took * 1000:.0f} ms",
              file=sys.stderr)
        self.assertLess(took, 10, "publishing did not resume after the clock stepped back")

        monitor.take()
        self.write_step(+STEP_MS)
        took = self.publish_some(relay, 20, "after a step forward")
        print(f"after stepping forward {STEP_MS} ms: 20 rows in {took * 1000:.0f} ms",
              file=sys.stderr)
        time.sleep(0.2)
        samples = monitor.take()
        self.assertTrue(samples, "MONITOR saw no publish")
        # How far after Redis's own clock each deadline fell.
        late = max(deadline - received * 1000 for received, deadline in samples)
        print(f"after the forward step: {len(samples)} publishes, deadline at most "
              f"{late:.0f} ms after Redis received it (publish_timeout {PUBLISH_TIMEOUT_MS} ms)",
              file=sys.stderr)
        self.assertLessEqual(late, PUBLISH_TIMEOUT_MS + 50,
                             "a publish carried a deadline later than publish_timeout")
        self.verifier().report().assert_exactly_once(self)

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
