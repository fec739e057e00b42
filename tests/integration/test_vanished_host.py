"""A relay host that vanishes releases its sessions and the wake-up lock within about 30 s.

The relay runs in a network namespace of its own, reaching PostgreSQL over a
veth pair (addresses of this test's own namespace, on this machine only).
While it is busy, and so holds the wake-up lock on its LISTEN connection, the
relay is frozen (SIGSTOP) and its link is taken down: the host is gone without
a FIN or a reset, as after a power loss or a partition. Promise tested
(docs/DESIGN.md, "The wake-up protocol"):

- the server ends every session of the vanished relay, and with them the
  wake-up lock, within 45 s (server-side keepalives and tcp_user_timeout set
  by the relay; PostgreSQL's default would keep them about two hours), so
  producers notify again.

Needs root and iproute2 (`ip netns`); skipped without them.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

from testkit import harness
from testkit.harness import insert, scalar

harness.require_relay()
harness.set_deadline(300)

LOCK_HELD = ("SELECT count(*) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted"
             " AND l.mode = 'ExclusiveLock'"
             " AND (l.classid::bigint << 32) + l.objid::bigint = 122550254464888")
RELAY_SESSIONS = ("SELECT count(*) FROM pg_stat_activity"
                  " WHERE application_name LIKE 'outbox-relay%%' AND client_addr = %s")


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class VanishedHostTest(harness.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise unittest.SkipTest("needs root and iproute2 for a network namespace")
        tag = os.getpid() % 200 + 20
        cls.ns = f"outbox-vanish-{os.getpid()}"
        cls.host_if, cls.ns_if = f"obxh{os.getpid() % 100000}", f"obxn{os.getpid() % 100000}"
        cls.host_ip, cls.ns_ip = f"10.231.{tag}.1", f"10.231.{tag}.2"
        try:
            ip("netns", "add", cls.ns)
        except subprocess.CalledProcessError as e:
            raise unittest.SkipTest(f"cannot make a network namespace: {e.stderr.strip()}")
        cls.addClassCleanup(ip, "netns", "delete", cls.ns, check=False)
        ip("link", "add", cls.host_if, "type", "veth", "peer", "name", cls.ns_if)
        cls.addClassCleanup(ip, "link", "delete", cls.host_if, check=False)
        ip("link", "set", cls.ns_if, "netns", cls.ns)
        ip("addr", "add", f"{cls.host_ip}/30", "dev", cls.host_if)
        ip("link", "set", cls.host_if, "up")
        ip("netns", "exec", cls.ns, "ip", "addr", "add", f"{cls.ns_ip}/30", "dev", cls.ns_if)
        ip("netns", "exec", cls.ns, "ip", "link", "set", cls.ns_if, "up")
        ip("netns", "exec", cls.ns, "ip", "link", "set", "lo", "up")

        cls.pg = cls.enterClassContext(harness.Postgres())
        with open(os.path.join(cls.pg.datadir, "postgresql.conf"), "a") as conf:
            conf.write(f"listen_addresses = '127.0.0.1,{cls.host_ip}'\n")
        with open(os.path.join(cls.pg.datadir, "pg_hba.conf"), "a") as hba:
            hba.write(f"host all all {cls.ns_ip}/32 trust\n")
        cls.pg.restart("fast")
        cls.db = cls.pg.connect()
        cls.addClassCleanup(cls.db.close)

    def spawn_in_ns(self, argv, env=None, log=None):
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv],
                                stdin=subprocess.DEVNULL, stdout=log or subprocess.DEVNULL,
                                stderr=log or subprocess.DEVNULL, env=env)

        def stop():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(10)
        self.addCleanup(stop)
        return proc

    def wait_gone(self):
        def remaining():
            with self.db.cursor() as cur:
                cur.execute("SELECT application_name, state, backend_start FROM pg_stat_activity"
                            " WHERE client_addr = %s AND application_name IN"
                            " ('outbox-relay', 'outbox-relay listen', 'outbox-relay observe')", (self.ns_ip,))
                return cur.fetchall()
        try:
            harness.wait_until(lambda: scalar(self.db, LOCK_HELD) == 0 and not remaining(),
                               timeout=90, interval=0.5,
                               message="the vanished relay's sessions and lock to end")
        except AssertionError as e:
            raise AssertionError(f"{e}; still there: {remaining()}, lock held:"
                                 f" {scalar(self.db, LOCK_HELD)}") from None

    def test_sessions_and_lock_of_a_vanished_relay_end(self):
        tmp = tempfile.mkdtemp(prefix="outbox-vanish-")
        self.addCleanup(shutil.rmtree, tmp, True)
        redis_port = harness.free_port()
        self.spawn_in_ns(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                          "--save", "", "--dir", tmp])
        env = harness.relay_env(extra={
            "OUTBOX_RELAY_POSTGRES": f"host={self.host_ip} port={self.pg.port} dbname=app"
                                     " user=postgres",
            "OUTBOX_RELAY_REDIS": f"redis://127.0.0.1:{redis_port}/0",
            "OUTBOX_RELAY_METRICS_LISTEN": "",
            "OUTBOX_RELAY_POLL_INTERVAL": "200ms",
            "OUTBOX_RELAY_BATCH_SIZE": "10"})
        log_path = os.path.join(tmp, "relay.log")
        log = open(log_path, "wb")
        self.addCleanup(log.close)
        relay = self.spawn_in_ns([harness.require_relay()], env=env, log=log)

        def relay_log():
            with open(log_path, errors="replace") as f:
                return f.read()

        def wait_for(pred, message, timeout, interval=0.05, detail=lambda: ""):
            """wait_until, with what a failure needs read when it fails, not
            when the wait began: whether the relay runs, anything detail adds,
            and the relay's log."""
            try:
                harness.wait_until(pred, timeout=timeout, interval=interval, message=message)
            except AssertionError as e:
                state = ("running" if relay.poll() is None
                         else f"exited with code {relay.returncode}")
                raise AssertionError(f"{e}\nthe relay: {state}{detail()}\n"
                                     f"relay log:\n{relay_log()}") from None

        def reachable():
            reach = ip("netns", "exec", self.ns, sys.executable, "-c",
                       "import socket; socket.create_connection("
                       f"('{self.host_ip}', {self.pg.port}), 5).close(); print('reachable')",
                       check=False)
            return f"\nPostgreSQL from the namespace: {(reach.stdout + reach.stderr).strip()}"

        wait_for(lambda: relay.poll() is not None
                 or scalar(self.db, RELAY_SESSIONS, (self.ns_ip,)) >= 3,
                 "the relay's three sessions", timeout=60, detail=reachable)
        self.assertIsNone(relay.poll(), "the relay exited before the test began\n" + relay_log())
        # Keep it busy: it claims on its own and holds the wake-up lock.
        stop = threading.Event()

        def produce():
            conn = self.pg.connect()
            with contextlib.closing(conn):
                while not stop.is_set():
                    insert(conn, "busy", b"x")
                    time.sleep(0.002)
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        self.addCleanup(producer.join, 10)
        self.addCleanup(stop.set)
        # Freeze it while it holds the lock: a busy relay may release it for a
        # moment between two claims, so check after the freeze and try again.
        for _ in range(50):
            wait_for(lambda: scalar(self.db, LOCK_HELD) == 1,
                     "the busy relay to hold the wake-up lock", timeout=30, interval=0.01)
            relay.send_signal(signal.SIGSTOP)
            time.sleep(0.05)  # anything it had sent is answered by now
            if scalar(self.db, LOCK_HELD) == 1:
                break
            relay.send_signal(signal.SIGCONT)
        self.assertEqual(scalar(self.db, LOCK_HELD), 1,
                         "no freeze caught the relay holding the lock")
        ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "down")
        gone_at = time.monotonic()
        stop.set()
        self.wait_gone()
        took = time.monotonic() - gone_at
        print(f"vanished relay: sessions and wake-up lock ended {took:.1f} s after its host "
              f"went away", file=sys.stderr, flush=True)
        self.assertLess(took, 45)


if __name__ == "__main__":
    unittest.main(verbosity=2)
