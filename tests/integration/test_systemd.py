"""The daemon behaves as systemd expects (DESIGN.md 4, STYLE.md rule 10).

- Both units pass `systemd-analyze verify` and rate an exposure of 2.0 or
  lower in `systemd-analyze security --offline=true`.
- The sd_notify protocol, tested against a datagram socket that this test
  listens on (NOTIFY_SOCKET): READY=1 once the loop runs, STATUS= lines,
  WATCHDOG=1 at half of WATCHDOG_USEC while healthy (none when WATCHDOG_PID
  names another process), RELOADING=1 with MONOTONIC_USEC then READY=1 on
  SIGHUP, STOPPING=1 on SIGTERM.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

import harness
from harness import insert

harness.require_relay()
harness.set_deadline(120)

UNITS = ("outbox-relay.service", "outbox-relay@.service")
UNIT_DIR = os.path.join(harness.SOURCE_DIR, "systemd")


def local_units(tmp):
    """Copies of the units whose ExecStart names the binary under test (verify
    checks that it exists and is executable)."""
    paths = []
    for unit in UNITS:
        with open(os.path.join(UNIT_DIR, unit)) as f:
            text = f.read().replace("/usr/local/bin/outbox-relay", harness.relay_binary())
        name = unit.replace("@.", "@orders.")
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


@unittest.skipUnless(shutil.which("systemd-analyze"), "systemd-analyze not installed")
class UnitFileTest(harness.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="outbox-relay-units-")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def test_units_verify(self):
        for path in local_units(self.tmp):
            proc = subprocess.run(["systemd-analyze", "verify", path], capture_output=True,
                                  text=True, timeout=60)
            # verify also lints unrelated system units it loads; only our file counts.
            ours = [l for l in (proc.stdout + proc.stderr).splitlines()
                    if os.path.basename(path) in l]
            self.assertEqual(proc.returncode, 0, f"{path}:\n{proc.stdout}{proc.stderr}")
            self.assertEqual(ours, [], f"{path}: {ours}")

    def test_exposure_at_most_2(self):
        for path in local_units(self.tmp):
            proc = subprocess.run(["systemd-analyze", "security", "--offline=true", path],
                                  capture_output=True, text=True, timeout=60)
            m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
            self.assertIsNotNone(m, proc.stdout + proc.stderr)
            score = float(m.group(1))
            print(f"{os.path.basename(path)}: exposure {score}")
            self.assertLessEqual(score, 2.0)


class Notifications:
    """A NOTIFY_SOCKET that collects what the daemon sends."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="outbox-relay-notify-")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages = []  # (monotonic time, text)
        self.cursor = 0  # wait_for looks at messages from here on

    def poll(self, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def wait_for(self, pattern, timeout=10):
        """The next notification after the previous match that matches pattern."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for i in range(self.cursor, len(self.messages)):
                if re.search(pattern, self.messages[i][1]):
                    self.cursor = i + 1
                    return self.messages[i][1]
            self.poll(0.1)
        raise AssertionError(f"no notification matching {pattern!r}; got "
                             f"{[t for _, t in self.messages]}")

    def count(self, pattern, since=0.0):
        return sum(1 for t, text in self.messages if t >= since and re.search(pattern, text))

    def close(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class NotifyTest(harness.ServerTestCase):

    def start(self, **env):
        n = Notifications()
        self.addCleanup(n.close)
        env = {"NOTIFY_SOCKET": n.path, **env}
        relay = self.relay(env=env, poll_interval="200ms")
        return n, relay

    def test_ready_status_watchdog_reload_stopping(self):
        n, relay = self.start(WATCHDOG_USEC="400000")
        n.wait_for(r"^READY=1$")
        n.wait_for(r"^STATUS=.*published.*PostgreSQL up, Redis up")
        insert(self.db, "orders", b"x")
        harness.wait_all_sent(self.db, relay=relay)
        # Half of 400 ms: about 5 pings a second.
        start = time.monotonic()
        n.poll(1.5)
        pings = n.count(r"^WATCHDOG=1$", since=start)
        print(f"watchdog pings in 1.5 s at WATCHDOG_USEC=400000: {pings}")
        self.assertGreaterEqual(pings, 4)

        relay.kill(signal.SIGHUP)
        text = n.wait_for(r"RELOADING=1")
        self.assertRegex(text, r"RELOADING=1\nMONOTONIC_USEC=\d+")
        n.wait_for(r"^READY=1$")

        relay.kill(signal.SIGTERM)
        n.wait_for(r"^STOPPING=1$")
        self.assertEqual(relay.wait(), 0)

    def test_no_watchdog_for_another_pid(self):
        n, relay = self.start(WATCHDOG_USEC="200000", WATCHDOG_PID="1")
        n.wait_for(r"^READY=1$")
        n.poll(1.0)
        self.assertEqual(n.count(r"^WATCHDOG=1$"), 0)
        self.assertEqual(relay.terminate(), 0)


if __name__ == "__main__":
    unittest.main()
