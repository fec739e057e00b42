"""The daemon behaves as systemd expects (docs/OPERATIONS.md, the systemd units).

- Both units pass `systemd-analyze verify` and rate an exposure of 2.0 or
  lower in `systemd-analyze security --offline=true`.
- The sd_notify protocol, tested against a datagram socket that this test
  listens on (NOTIFY_SOCKET): READY=1 once the loop runs, STATUS= lines,
  WATCHDOG=1 at half of WATCHDOG_USEC while healthy (none when WATCHDOG_PID
  names another process), RELOADING=1 with MONOTONIC_USEC then READY=1 on
  SIGHUP, STOPPING=1 on SIGTERM.
- The watchdog and a hung server: with the claim connections' PostgreSQL
  backends frozen (SIGSTOP), the stage's own deadline (statement_timeout +
  connect_timeout) fails the batch long before the stuck limit
  (publish_timeout + 2 * statement_timeout + connect_timeout): WATCHDOG=1
  keeps coming, no stuck warning, and the message is relayed on a new
  connection while the old backends are still frozen.
- The watchdog and a stuck cycle: no fault outside the relay keeps a stage
  running past the stuck limit (each stage's own deadline is shorter), so the
  test freezes the relay itself while its claim waits on a table lock, for
  longer than the limit. At the first watchdog tick after it resumes the
  claim is past the limit: the relay withholds WATCHDOG=1 and logs "a claim
  cycle is stuck past every deadline"; once the cycle has ended, WATCHDOG=1
  comes again and messages are relayed.
- SIGHUP with a configuration file: a new log_level is applied (DEBUG lines
  appear, then stop again); changed keys that need a restart are named in one
  WARNING line and keep their running value (chunks stay at the old
  batch_size); a file that does not validate is not applied (log_level stays)
  and the ERROR line names the file, the line and the rule; every reload
  sends RELOADING=1 then READY=1.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

from testkit import harness
from testkit.harness import insert, wait_until

harness.require_relay()
harness.set_deadline(300)

STUCK_WARNING = (r"^\S+ WARNING relay: a claim cycle is stuck past every deadline; "
                 r"not feeding the systemd watchdog$")

UNITS = ("outbox-relay.service", "outbox-relay@.service")
UNIT_DIR = os.path.join(harness.SOURCE_DIR, "systemd")


def local_units(tmp):
    """Copies of the units, configured from their templates as the build does,
    whose ExecStart names the binary under test (verify checks that it exists
    and is executable)."""
    paths = []
    for unit in UNITS:
        with open(os.path.join(UNIT_DIR, unit + ".in")) as f:
            text = f.read().replace("@CMAKE_INSTALL_FULL_BINDIR@/outbox-relay",
                                    harness.relay_binary())
        text = text.replace("@CMAKE_INSTALL_FULL_DOCDIR@", "/usr/local/share/doc/outbox-relay")
        text = text.replace("@RELAY_DOC_EXAMPLES_DIR@",
                            "/usr/local/share/doc/outbox-relay/examples")
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
            # --man=no: the units' man: pages exist once installed, not in the build tree.
            proc = subprocess.run(["systemd-analyze", "verify", "--man=no", path],
                                  capture_output=True, text=True, timeout=60)
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
    """A NOTIFY_SOCKET that collects what the daemon sends.

    A thread reads the socket all the time: sd_notify's sendto blocks while the
    receiver's queue is full (net.unix.max_dgram_qlen datagrams, 10 by
    default), and a daemon blocked there would look stuck to the test.
    """

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="outbox-relay-notify-")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages = []  # (monotonic time, text), appended by the reader thread
        self.cursor = 0  # wait_for looks at messages from here on
        self.closed = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while not self.closed.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def poll(self, seconds):
        """Lets seconds pass while the reader collects."""
        time.sleep(seconds)

    def skip(self):
        """wait_for looks only at what arrives from now on."""
        self.cursor = len(self.messages)

    def wait_for(self, pattern, timeout=10):
        """The next notification after the previous match that matches pattern."""
        end = time.monotonic() + timeout
        while True:
            messages = list(self.messages)
            for i in range(self.cursor, len(messages)):
                if re.search(pattern, messages[i][1]):
                    self.cursor = i + 1
                    return messages[i][1]
            if time.monotonic() >= end:
                raise AssertionError(f"no notification matching {pattern!r}; got "
                                     f"{[t for _, t in messages]}")
            time.sleep(0.05)

    def count(self, pattern, since=0.0):
        return sum(1 for t, text in list(self.messages) if t >= since and re.search(pattern, text))

    def close(self):
        self.closed.set()
        self.reader.join(5)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class NotifyTest(harness.ServerTestCase):

    def start(self, flags=None, args=(), servers=True, **env):
        n = Notifications()
        self.addCleanup(n.close)
        env = {"NOTIFY_SOCKET": n.path, **env}
        if servers:
            relay = self.relay(env=env, args=args, **{"poll_interval": "200ms", **(flags or {})})
        else:
            relay = self.enterContext(harness.Relay(env=env, args=args, **(flags or {})))
        return n, relay

    def claim_backends(self, waiting_on_a_lock=False):
        """The pids of the relay's claiming sessions (not its LISTEN session)."""
        with self.db.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-relay'"
                        + (" AND wait_event_type = 'Lock'" if waiting_on_a_lock else ""))
            return [row[0] for row in cur.fetchall()]

    def freeze(self, pid):
        """SIGSTOP pid until SIGCONT, which a cleanup sends in any case."""
        os.kill(pid, signal.SIGSTOP)

        def thaw():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.addCleanup(thaw)

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

    def test_watchdog_fed_while_postgres_hangs(self):
        # Stuck limit 0.5 + 2 * 1 + 1 = 3.5 s; a PostgreSQL command's own deadline 2 s.
        n, relay = self.start(WATCHDOG_USEC="400000",
                              flags={"publish_timeout": "500ms", "statement_timeout": "1s",
                                     "connect_timeout": "1s"})
        n.wait_for(r"^READY=1$")
        insert(self.db, "orders", b"before")
        harness.wait_all_sent(self.db, relay=relay)
        backends = self.claim_backends()
        self.assertTrue(backends, "the relay's claiming sessions")
        for pid in backends:
            self.freeze(pid)
        mark = relay.mark()
        hung_at = time.monotonic()
        mid = insert(self.db, "orders", b"while the backends hang")
        relay.wait_for_log(r"^\S+ ERROR pg: claim connection .*: server not answering: no answer "
                           r"within 2000 ms", since=mark, timeout=15)
        # Relayed on a new connection while the old backends are still frozen.
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertIn(mid, harness.entries_by_message_id(self.r))
        n.poll(1.0)
        pings = n.count(r"^WATCHDOG=1$", since=hung_at)
        print(f"watchdog pings while a backend hung: {pings} in "
              f"{time.monotonic() - hung_at:.1f} s", flush=True)
        self.assertGreater(pings, 0)
        self.assertIsNone(re.search(STUCK_WARNING, relay.log(), re.MULTILINE),
                          "a hung server is not a stuck cycle: its deadline ends the stage\n"
                          + relay.log_tail())
        for pid in backends:
            os.kill(pid, signal.SIGCONT)
        self.assertEqual(relay.terminate(), 0, relay.log_tail())

    def test_watchdog_withheld_while_a_cycle_is_stuck(self):
        # Stuck limit 0.5 + 2 * 2 + 1 = 5.5 s; the claim's own deadline 3 s
        # (lock_timeout = statement_timeout ends the wait for the lock at 2 s).
        limit = 5.5
        n, relay = self.start(WATCHDOG_USEC="400000",
                              flags={"publish_timeout": "500ms", "statement_timeout": "2s",
                                     "connect_timeout": "1s"})
        n.wait_for(r"^READY=1$")
        insert(self.db, "orders", b"before")
        harness.wait_all_sent(self.db, relay=relay)

        locker = self.pg.connect(autocommit=False)
        self.addCleanup(locker.close)
        with locker.cursor() as cur:
            cur.execute("LOCK TABLE outbox.messages IN ACCESS EXCLUSIVE MODE")
        # The next poll's claim waits for the lock: a stage in flight.
        wait_until(lambda: self.claim_backends(waiting_on_a_lock=True), timeout=10,
                   message="the relay's claim waiting for the table lock")
        self.freeze(relay.pid)
        time.sleep(limit + 1.5)
        self.assertIsNone(re.search(STUCK_WARNING, relay.log(), re.MULTILINE),
                          "a claim waiting for a lock within its deadline is not stuck")
        mark = relay.mark()
        n.skip()
        resumed_at = time.monotonic()
        os.kill(relay.pid, signal.SIGCONT)
        # The first watchdog tick after the freeze finds the claim past the limit.
        relay.wait_for_log(STUCK_WARNING, since=mark, timeout=10)
        locker.rollback()

        # The stuck cycle ended (its deadline passed long ago): pings again.
        n.wait_for(r"^WATCHDOG=1$", timeout=10)
        n.poll(1.0)
        print(f"watchdog pings in the {time.monotonic() - resumed_at:.1f} s after the resume: "
              f"{n.count(r'^WATCHDOG=1$', since=resumed_at)}", flush=True)
        self.assertGreaterEqual(n.count(r"^WATCHDOG=1$", since=resumed_at), 2)
        mid = insert(self.db, "orders", b"after")
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertIn(mid, harness.entries_by_message_id(self.r))
        self.assertEqual(relay.terminate(), 0, relay.log_tail())

    def test_sighup_applies_log_level_and_names_restart_keys(self):
        tmp = tempfile.mkdtemp(prefix="outbox-relay-reload-")
        self.addCleanup(shutil.rmtree, tmp, True)
        path = os.path.join(tmp, "relay.conf")

        def write(log_level, batch_size, poll_interval):
            with open(path + ".new", "w") as f:
                f.write(f"postgres = {self.pg.dsn()}\n"
                        f"redis = {self.redis.url()}\n"
                        f"poll_interval = {poll_interval}\n"
                        "listen = off\n"
                        f"batch_size = {batch_size}\n"
                        f"log_level = {log_level}\n")
            os.replace(path + ".new", path)

        def reload():
            relay.kill(signal.SIGHUP)
            self.assertRegex(n.wait_for(r"RELOADING=1"), r"RELOADING=1\nMONOTONIC_USEC=\d+")
            n.wait_for(r"^READY=1$")

        def batch_debug_lines(since):
            """The DEBUG lines of the batch loop since the mark."""
            return re.findall(r"^\S+ DEBUG batch: .*$", relay.log()[since:], re.MULTILINE)

        def exec_calls():
            return self.r.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)

        write("info", 100, "200ms")
        n, relay = self.start(args=["-c", path], servers=False)
        n.wait_for(r"^READY=1$")
        harness.insert_many(self.db, [("orders", b"a%d" % i) for i in range(120)])
        harness.wait_all_sent(self.db, relay=relay)
        self.assertNotRegex(relay.log(), r"(?m)^\S+ DEBUG ", "log_level info logs no DEBUG")

        # log_level and two keys that need a restart.
        write("debug", 10, "300ms")
        mark = relay.mark()
        reload()
        line = relay.wait_for_log(r"^\S+ WARNING config: .*$", since=mark).group(0)
        self.assertRegex(line, r"WARNING config: reloaded log_level; changed keys that need a "
                               r"restart: batch_size, poll_interval$")
        self.r.config_resetstat()
        harness.insert_many(self.db, [("orders", b"b%d" % i) for i in range(120)])
        harness.wait_all_sent(self.db, relay=relay)
        # One batch (one transaction), read in chunks of batch_size rows,
        # each chunk's rows of the stream in calls of at most 64: chunks of
        # the running 100 make 64 + 36 and 20, three EXECs; chunks of 10
        # would make twelve.
        self.assertEqual(exec_calls(), 3,
                         "batch_size needs a restart: chunks keep the running 100")
        wait_until(lambda: batch_debug_lines(mark), timeout=10, relay=relay,
                   message="DEBUG lines for the batch of the 120 rows")

        # A file that does not validate: nothing of it is applied.
        write("error", 0, "300ms")
        mark = relay.mark()
        reload()
        line = relay.wait_for_log(r"^\S+ ERROR config: .*$", since=mark).group(0)
        print(line, flush=True)
        self.assertRegex(line, r"ERROR config: reload failed, keeping the running "
                               r"configuration: .*relay\.conf:5: .*batch_size.*between 1 and")
        insert(self.db, "orders", b"c")
        harness.wait_all_sent(self.db, relay=relay)
        wait_until(lambda: batch_debug_lines(mark), timeout=10, relay=relay,
                   message="a DEBUG line: log_level debug is still in force")

        # Back to info, the restart keys as they run: only log_level changes.
        write("info", 100, "200ms")
        mark = relay.mark()
        reload()
        relay.wait_for_log(r"^\S+ INFO config: reloaded: log_level applied$", since=mark)
        mark = relay.mark()
        insert(self.db, "orders", b"d")
        harness.wait_all_sent(self.db, relay=relay)
        self.assertEqual(relay.terminate(), 0, relay.log_tail())
        self.assertNotRegex(relay.log()[mark:], r"(?m)^\S+ (DEBUG|WARNING) ",
                            "log_level info again: no DEBUG line, and no key to restart for")

    def test_no_watchdog_for_another_pid(self):
        n, relay = self.start(WATCHDOG_USEC="200000", WATCHDOG_PID="1")
        n.wait_for(r"^READY=1$")
        n.poll(1.0)
        self.assertEqual(n.count(r"^WATCHDOG=1$"), 0)
        self.assertEqual(relay.terminate(), 0)


if __name__ == "__main__":
    unittest.main()
