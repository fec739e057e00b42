"""The README's "Using it" runs as written, in order, on a fresh database.

Every fenced block of that section is taken from README.md and run, in the
README's order, from a copy of the source tree (what a user has after
cloning), against this test's own throwaway PostgreSQL and Redis. One
message goes all the way: the order step 4 commits is published by the
relay of step 5 and recorded by the consumer group of step 6.

How each block runs (the section must hold exactly these, in this order;
a block added, moved or removed fails the test until this list follows):

  step 1, sh   verbatim (bash -e -o pipefail, as every sh block), in the
               copy, with DESTDIR set to a temporary directory: deps.sh
               build (which only checks, when the packages are there), the
               Release build (no tests, so no cmocka) and the install, into
               DESTDIR/usr/local
  step 2, sh   verbatim: createdb app, then the migrations
  step 3, sql  on the standard input of psql -X -v ON_ERROR_STOP=1 -d app,
               as the superuser postgres
  step 4, sql  the same, as order_service, the role step 3 creates
  step 5, sh   verbatim, in the background: writes relay.conf and runs the
               relay, which must publish step 4's message to "orders"
  step 6, ```  (no info string) each line one redis-cli command, which must
               answer OK
  step 6, c    written to app.c and compiled with the README's own command
               ("Build it with `cc ...`") against the install; run last of
               step 6, after the consumer below handled the message (so the
               two do not race for it), it must be reading as a consumer of
               group email; it runs until killed, as written
  step 6, sh   verbatim, in the background: createdb email, its schema, and
               outbox-email-consumer, which must record order 9001 in emails
  step 7, sh   verbatim: status, failed list and dlq list with relay.conf,
               and curl of the metrics, which must count the message

The commands reach the throwaway servers through the environment, as a
user's would: PGHOST, PGPORT and PGUSER (postgres; order_service for step 4);
PATH starts with the install's bin/, PKG_CONFIG_PATH and LD_LIBRARY_PATH name
its lib/; OUTBOX_RELAY_METRICS_LISTEN gives the relay a free port.

The only departures from what a user types, on purpose and nowhere else:
  - "127.0.0.1:6379" (Redis's default address) becomes the test Redis's
    address and "127.0.0.1:9479" (the metrics default) the relay's metrics
    address: tests run side by side, and Debian's own Redis may hold 6379.
  - ldconfig (step 1) is a no-op: the install goes to DESTDIR, which the
    loader never searches; LD_LIBRARY_PATH points there instead (so the test
    cannot tell whether a user needs that ldconfig: in /usr/local/lib, they do).
Comments (# in sh, -- in SQL) run as what they are, comments.

Builds the tree once (Release, -j2, as step 1 says, without the tests): about
half a minute. The sanitizer pass leaves it out: it builds its own tree,
without sanitizers.
"""

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from testkit import harness
from testkit.harness import wait_until

harness.set_deadline(1200)

README = os.path.join(harness.SOURCE_DIR, "README.md")

# (step, info string) of every fenced block of "Using it", in order.
EXPECTED_BLOCKS = [(1, "sh"), (2, "sh"), (3, "sql"), (4, "sql"), (5, "sh"), (6, ""),
                   (6, "c"), (6, "sh"), (7, "sh")]

STEP4_PAYLOAD = b'{"order":9001,"total":42.50}'

for tool in ("cmake", "cc", "psql", "createdb", "redis-cli", "curl", "pkg-config"):
    if shutil.which(tool) is None:
        print(f"SKIP: {tool} not found (scripts/deps.sh test installs it)", file=sys.stderr)
        sys.exit(harness.SKIP)


def using_it(text):
    """[(step, info, body)] of the fenced blocks of "## Using it", bodies
    without the list item's indentation; and the section's text."""
    m = re.search(r"(?ms)^## Using it\n(.*?)(?=^## )", text)
    if m is None:
        raise AssertionError('README.md has no "## Using it" section')
    section = m.group(1)
    blocks, step, lines, i = [], None, section.split("\n"), 0
    while i < len(lines):
        item = re.match(r"(\d+)\. ", lines[i])
        if item:
            step = int(item.group(1))
        fence = re.fullmatch(r"( *)```(\S*)\s*", lines[i])
        if fence:
            indent, body = fence.group(1), []
            i += 1
            while not re.fullmatch(r" *```\s*", lines[i]):
                line = lines[i]
                body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
                i += 1
            blocks.append((step, fence.group(2), "\n".join(body) + "\n"))
        i += 1
    return blocks, section


def copy_source(dst):
    """The source tree as a clone has it: without build directories and caches."""
    def ignore(directory, names):
        top = os.path.abspath(directory) == os.path.abspath(harness.SOURCE_DIR)
        return {n for n in names
                if n in ("__pycache__", ".git") or n.endswith(".pyc")
                or (top and (n.startswith("build") or n == "compile_commands.json"))}
    shutil.copytree(harness.SOURCE_DIR, dst, symlinks=True, ignore=ignore)


class Background:
    """A README block run by bash in the background, in a session of its own,
    so that close() reaches the command it runs, not only the shell."""

    def __init__(self, argv, env, cwd, log_path, label):
        self.label = label
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True)
        harness.register(self)

    def alive(self):
        return self.proc.poll() is None

    @property
    def returncode(self):
        return self.proc.poll()

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def log_tail(self):
        return f"--- {self.label} output, last lines ---\n{harness.tail(self.log())}"

    def close(self):
        """SIGTERM to the whole session, then SIGKILL after 20 s: the shell
        goes at once, what it runs finishes as on a user's Ctrl-C."""
        harness.unregister(self)
        for sig, seconds in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                self.proc.poll()  # reaps the shell, which would count as alive
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                continue
            break
        self.proc.wait()
        harness.keep_log(self.log_path, "readme")


class ReadmeTest(harness.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # A server with no database "app": step 2 creates it.
        cls.pg = cls.enterClassContext(harness.Postgres(migrations=False, database="harness"))
        cls.redis = cls.enterClassContext(harness.Redis())
        cls.r = cls.redis.client()
        cls.addClassCleanup(cls.r.close)

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="outbox-readme-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.src = os.path.join(self.tmp, "outbox-relay")
        copy_source(self.src)
        self.destdir = os.path.join(self.tmp, "destdir")
        self.prefix = os.path.join(self.destdir, "usr", "local")
        self.metrics = f"127.0.0.1:{harness.free_port()}"
        shim = os.path.join(self.tmp, "shim")
        os.makedirs(shim)
        with open(os.path.join(shim, "ldconfig"), "w") as f:
            f.write("#!/bin/sh\n# the install went to DESTDIR: nothing to cache\nexit 0\n")
        os.chmod(os.path.join(shim, "ldconfig"), 0o755)
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("PG", "OUTBOX_", "ASAN_", "UBSAN_"))
                and k not in ("DESTDIR", "PKG_CONFIG_PATH", "LD_LIBRARY_PATH")}
        base.update(PATH=os.pathsep.join([os.path.join(self.prefix, "bin"), shim,
                                          os.environ.get("PATH", "/usr/bin:/bin")]),
                    PGHOST="127.0.0.1", PGPORT=str(self.pg.port), PGUSER="postgres",
                    OUTBOX_RELAY_METRICS_LISTEN=self.metrics)
        self.env = base

    # -- running the blocks
    def text(self, body):
        """The block with the two default addresses made the test's (see above)."""
        return (body.replace("127.0.0.1:6379", f"127.0.0.1:{self.redis.port}")
                .replace("127.0.0.1:9479", self.metrics))

    def bash(self, body):
        """A shell block as bash runs it: stopping at the first command that fails."""
        return ["bash", "-e", "-o", "pipefail", "-c", self.text(body)]

    def sh(self, step, body, env=None, cwd=None, timeout=120):
        proc = subprocess.run(self.bash(body),
                              env=env or self.env, cwd=cwd or self.src, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        harness.keep_text(proc.stdout + proc.stderr, "readme")
        self.assertEqual(proc.returncode, 0,
                         f"README step {step} failed (exit {proc.returncode}):\n{body}\n"
                         f"--- output ---\n{harness.tail(proc.stdout + proc.stderr, 60)}")
        return proc.stdout

    def sql(self, step, body, user):
        env = dict(self.env, PGUSER=user)
        proc = subprocess.run(["psql", "-X", "-v", "ON_ERROR_STOP=1", "-d", "app"],
                              input=self.text(body), env=env, cwd=self.src,
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0,
                         f"README step {step}'s SQL failed as {user}:\n{body}\n"
                         f"--- psql ---\n{proc.stdout}{proc.stderr}")

    def background(self, label, argv, cwd=None):
        bg = Background(argv, self.env, cwd or self.src,
                        os.path.join(self.tmp, f"{label}.log"), label)
        self.addCleanup(bg.close)
        return bg

    # -- the test
    def test_using_it_runs_as_written(self):
        with open(README, encoding="utf-8") as f:
            blocks, section = using_it(f.read())
        self.assertEqual([(s, i) for s, i, _ in blocks], EXPECTED_BLOCKS,
                         'the fenced blocks of "Using it" changed: make this test run the '
                         "new ones (EXPECTED_BLOCKS and the docstring)")
        b = {}
        for step, info, body in blocks:
            b.setdefault((step, info), body)
        compile_cmd = re.search(r"Build it with `(cc [^`]*)`", section)
        self.assertIsNotNone(compile_cmd, "step 6 no longer says how to build the C program")
        # How long each step takes a newcomer, printed at the end.
        laps, started = [], [time.monotonic()]

        def lap(what):
            now = time.monotonic()
            laps.append(f"{what} {now - started[0]:.1f} s")
            started[0] = now
        self.addCleanup(lambda: print("readme: " + "; ".join(laps), file=sys.stderr, flush=True))

        # 1: the user's build and install, into DESTDIR.
        self.sh(1, b[1, "sh"], env=dict(self.env, DESTDIR=self.destdir), timeout=900)
        with open(os.path.join(self.src, "build", "CMakeCache.txt")) as f:
            cache = f.read()
        self.assertIn("RELAY_TESTS:BOOL=OFF", cache, "a user's build should not build the tests")
        self.assertNotIn("CMOCKA", cache, "a user's build should not look for cmocka")
        for exe in ("outbox-relay", "outbox-email-consumer"):
            found = shutil.which(exe, path=self.env["PATH"])
            self.assertEqual(found, os.path.join(self.prefix, "bin", exe))
        pcs = glob.glob(os.path.join(self.prefix, "lib*", "**", "outbox-consumer.pc"),
                        recursive=True)
        self.assertEqual(len(pcs), 1, pcs)
        libdir = os.path.dirname(os.path.dirname(pcs[0]))
        self.env.update(PKG_CONFIG_PATH=os.path.dirname(pcs[0]), LD_LIBRARY_PATH=libdir)
        # What step 2 says of an install: the same migrations.
        installed = os.path.join(self.prefix, "share", "outbox-relay", "migrations")
        self.assertEqual(sorted(os.listdir(installed)),
                         sorted(os.listdir(os.path.join(self.src, "migrations"))))

        lap("1 build and install")
        # 2-4: the database, the roles, a message.
        self.sh(2, b[2, "sh"])
        self.sql(3, b[3, "sql"], "postgres")
        self.sql(4, b[4, "sql"], "order_service")
        lap("2-4 database, roles, a message")

        # 5: the relay publishes it.
        relay = self.background("relay", self.bash(b[5, "sh"]))

        def published():
            return [f for _, f in self.r.xrange("orders") if f.get(b"payload") == STEP4_PAYLOAD]
        (entry,) = wait_until(published, timeout=30, relay=relay,
                              message="the relay of step 5 to publish step 4's message")
        self.assertEqual(entry[b"key"], b"9001")
        self.assertEqual(entry[b"h.content-type"], b"application/json")
        lap("5 relay started to message in Redis")

        # 6: the groups, the C program, the example consumer.
        for line in b[6, ""].splitlines():
            if not line.strip():
                continue
            proc = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.redis.port),
                                   *shlex.split(self.text(line))],
                                  capture_output=True, text=True, timeout=30)
            self.assertEqual((proc.returncode, proc.stdout.strip()), (0, "OK"),
                             f"README step 6: {line}: {proc.stdout}{proc.stderr}")
        app = os.path.join(self.tmp, "app")
        os.makedirs(app)
        with open(os.path.join(app, "app.c"), "w") as f:
            f.write(self.text(b[6, "c"]))
        self.sh(6, compile_cmd.group(1), cwd=app)
        consumer = self.background("consumer", self.bash(b[6, "sh"]))
        email = None
        self.addCleanup(lambda: email is not None and email.close())

        def recorded():
            nonlocal email
            try:
                if email is None:
                    email = self.pg.connect(dbname="email")
                return harness.scalar(email, "SELECT count(*) FROM emails WHERE order_id = 9001")
            except Exception:  # the database or the table is not there yet
                return 0
        wait_until(recorded, timeout=60, relay=consumer,
                   message="outbox-email-consumer of step 6 to record order 9001")
        self.assertEqual(harness.scalar(email, "SELECT count(*) FROM emails"), 1)
        lap("6 groups, C program built, message consumed")

        program = self.background("app", [os.path.join(app, "a.out")], cwd=app)

        # Its consumer name is <host>-<pid>; with nothing new to read, Redis
        # lists it among the group's consumers only once it gets an entry,
        # so its reading connection shows that it is in: blocked in XREADGROUP.
        def reading():
            return [c for c in self.r.client_list()
                    if c["name"].endswith(f"-{program.proc.pid}:read")
                    and c["cmd"] == "xreadgroup"]
        wait_until(reading, timeout=30, relay=program,
                   message="the C program of step 6 to read as a consumer of group email")

        # 7: the operator's commands.
        out = self.sh(7, b[7, "sh"])
        lap("6-7 C program reading, operator commands")
        self.assertRegex(out, r"(?m)^orders +email +\S+s +0 +0 +0 ")  # status: all read
        self.assertIn("no quarantined rows", out)
        self.assertIn("no dead letters in {orders}.email.dlq", out)
        self.assertRegex(out, r"(?m)^outbox_relay_messages_published_total(\{[^}]*\})? 1$")

        for bg in (program, consumer, relay):
            self.assertTrue(bg.alive(), bg.log_tail())
        self.assertNotRegex(relay.log(), r"(?m)^\S+ ERROR ", relay.log_tail())


if __name__ == "__main__":
    unittest.main()
