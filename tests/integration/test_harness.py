"""The harness stops what it starts, also when a test does not.

Promise tested (testkit/cleanup.py, "Process-wide cleanup"): a
harness.Daemon that a test starts by hand rather than in a `with` block
(test_ordered starts and restarts its consumers so) is stopped, and its
temporary directory removed, when the test process exits, even if the test
failed before it could close it; a Daemon made and never started leaves no
directory behind either. A harness.PgBouncer, which runs under runuser when
the tests run as root, is gone once closed: the pooler, not only runuser.
"""

import os
import subprocess
import sys
import textwrap
import time
import types
import unittest

from testkit import harness

# A test process that starts one daemon by hand, makes another it never
# starts, prints their pid and directories, and fails. It finds the harness
# as this file does: through PYTHONPATH, which it inherits.
SCRIPT = textwrap.dedent("""
    from testkit import harness
    env = {"PATH": "/usr/bin:/bin"}
    started = harness.Daemon(["sleep", "300"], env, "probe started")
    started.start()
    unstarted = harness.Daemon(["sleep", "300"], env, "probe unstarted")
    print(started.pid, started.dir, unstarted.dir, flush=True)
    raise SystemExit(1)
""")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class HarnessTest(unittest.TestCase):

    def test_daemons_not_closed_by_the_test_are_closed_at_exit(self):
        proc = subprocess.run([sys.executable, "-c", SCRIPT],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 1, proc.stderr)
        pid, started_dir, unstarted_dir = proc.stdout.split()
        pid = int(pid)
        self.addCleanup(lambda: alive(pid) and os.kill(pid, 9))
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertFalse(alive(pid), "the daemon started by hand outlived the test process")
        self.assertFalse(os.path.exists(started_dir), "its directory is left behind")
        self.assertFalse(os.path.exists(unstarted_dir),
                         "the directory of a daemon never started is left behind")

    def test_a_closed_pgbouncer_is_gone(self):
        # It does not connect to PostgreSQL before a client does: a port is enough.
        pg = types.SimpleNamespace(port=harness.free_port(), database="app")
        with harness.PgBouncer(pg) as bouncer:
            ini = os.path.join(bouncer.dir, "pgbouncer.ini")
            pids = [p for p in os.listdir("/proc") if p.isdigit() and pooler(p, ini)]
            self.assertEqual(len(pids), 1, "one pgbouncer for the ini")
        pid = int(pids[0])
        self.addCleanup(lambda: alive(pid) and os.kill(pid, 9))
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertFalse(alive(pid), "pgbouncer outlived its close()")


def pooler(pid, ini):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return os.path.basename(argv[0]) == b"pgbouncer" and ini.encode() in argv


if __name__ == "__main__":
    unittest.main()
