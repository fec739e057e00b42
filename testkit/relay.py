"""The relay, and our daemons as processes: the daemon's binary and environment,
one-shot runs of it (the tools), Daemon and Relay, its /metrics, its log lines."""

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from .cleanup import keep_log, keep_text, register, unregister
from .common import SKIP, SOURCE_DIR, free_port, tail, wait_until
from .redis_server import redis_on_port

SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "LeakSanitizer", "runtime error:",
                     # valgrind memcheck (scripts/analyze.sh runs the relay under it)
                     "Invalid read of size", "Invalid write of size", "Invalid free()",
                     "Conditional jump or move depends on uninitialised",
                     "Use of uninitialised value", "Syscall param", "are definitely lost in")

# OUTBOX_RELAY_VALGRIND=1: the relay runs under valgrind memcheck, whose
# reports fail the test like a sanitizer's (scripts/analyze.sh).
VALGRIND = ["valgrind", "--tool=memcheck", "--leak-check=full", "--show-leak-kinds=definite",
            "--errors-for-leak-kinds=definite", "--track-origins=yes", "--num-callers=30",
            "-q"] if os.environ.get("OUTBOX_RELAY_VALGRIND") == "1" else []


def relay_binary():
    path = os.environ.get("OUTBOX_RELAY_BIN") or os.path.join(SOURCE_DIR, "build", "outbox-relay")
    return os.path.abspath(path)


def require_relay():
    """Exits the test file with 77 (CTest: skipped) when the daemon is not built."""
    path = relay_binary()
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        print(f"SKIP: relay binary {path} not found (build it, or set OUTBOX_RELAY_BIN)",
              file=sys.stderr)
        sys.exit(SKIP)
    return path


def relay_env(pg=None, redis=None, extra=None):
    """The environment for the daemon: ours without OUTBOX_RELAY_* and PG* variables,
    plus OUTBOX_RELAY_POSTGRES/REDIS for the given servers and extra (None removes)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OUTBOX_RELAY_") and not k.startswith("PG")}
    if pg is not None:
        env["OUTBOX_RELAY_POSTGRES"] = pg.dsn()
    if redis is not None:
        env["OUTBOX_RELAY_REDIS"] = redis.url()
    # A port of its own for the metrics endpoint, so relays of tests that run
    # at the same time never compete for the default one.
    env["OUTBOX_RELAY_METRICS_LISTEN"] = f"127.0.0.1:{free_port()}"
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def flag_args(flags):
    """{'poll_interval': '200ms'} -> ['--poll-interval', '200ms']."""
    argv = []
    for key, value in flags.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def sanitizer_report(text):
    """The part of text from the first sanitizer report on, or None."""
    positions = [text.find(m) for m in SANITIZER_MARKERS if m in text]
    if not positions:
        return None
    start = text.rfind("\n", 0, min(positions)) + 1
    return text[start:start + 6000]


@dataclasses.dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self):
        return self.stdout + self.stderr


def _tools_url(url):
    """The operator commands run as the tools' user of docs/OPERATIONS.md:
    a URL of a harness Redis for the relay's user becomes one for theirs."""
    m = re.match(r"redis://outbox-relay:[^@]*@127\.0\.0\.1:(\d+)(/.*)?$", url or "")
    server = redis_on_port(int(m.group(1))) if m else None
    if server is None:
        return url
    return server.url("outbox-tools")[:-2] + (m.group(2) or "")


def run_relay(args=(), env=None, timeout=20):
    """Runs the daemon to completion (--help, --check-config, bad config...).

    Fails on a timeout or a sanitizer report; returns the code and the output.
    """
    argv = [*VALGRIND, require_relay(), *args]
    env = dict(env) if env is not None else relay_env()
    if args and args[0] in ("dlq", "status", "failed") and env.get("OUTBOX_RELAY_REDIS"):
        env["OUTBOX_RELAY_REDIS"] = _tools_url(env.get("OUTBOX_RELAY_REDIS"))
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(argv)} did not exit within {timeout}s\n"
                             + (e.stderr or b"").decode(errors="replace")) from None
    done = Completed(proc.returncode, proc.stdout.decode(errors="replace"),
                     proc.stderr.decode(errors="replace"))
    keep_text(done.stdout + done.stderr, "tool")
    report = sanitizer_report(done.stderr)
    if report:
        raise AssertionError(f"sanitizer report from {' '.join(argv)}:\n{report}")
    return done


class Daemon:
    """One of our daemons (the relay, the example consumer) as a child process.

    Daemon(argv, env, label) runs argv with exactly the environment env, in a
    temporary directory of its own that also holds its log: its stdout and
    stderr in one file, kept across start() after kill() and removed on exit.
    label names it in messages ("relay", "consumer c1"). As a context manager
    it starts on entry; on exit it gets SIGTERM (then SIGKILL after
    stop_timeout), and a sanitizer report in its log fails the test.
    """

    _count = 0

    def __init__(self, argv, env, label, stop_timeout=30):
        self.argv = list(argv)
        self.env = env
        self.label = label
        self.stop_timeout = stop_timeout
        self.proc = None
        Daemon._count += 1
        kind = label.split()[0]
        self.dir = tempfile.mkdtemp(prefix=f"outbox-{kind}-log-")
        self.log_path = os.path.join(self.dir,
                                     f"{'-'.join(label.split())}-{Daemon._count}.log")
        # Closed at exit even if never entered: a test may start() it by
        # hand, and fail before it closes it.
        register(self)

    # -- lifecycle
    def __enter__(self):
        register(self)
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        failed = exc_type is not None
        try:
            self.stop()
            report = sanitizer_report(self.log())
            if failed:
                print(f"\n--- {self.label} output ({self.log_path}), last lines ---\n"
                      f"{self.log_tail()}", file=sys.stderr)
            if report and not failed:
                raise AssertionError(f"sanitizer report in the {self.label}'s output:\n{report}")
            if report:
                print(f"--- sanitizer report ---\n{report}", file=sys.stderr)
        finally:
            self.close()
        return False

    def start(self):
        """Starts the program (again, after kill(): its log goes on in the same file)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, env=self.env, cwd=self.dir)
        return self

    def stop(self):
        """SIGTERM, wait stop_timeout, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self):
        """Kills the process if it still runs and removes its directory and log."""
        unregister(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        keep_log(self.log_path, "daemon")
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- control
    @property
    def pid(self):
        return self.proc.pid

    @property
    def returncode(self):
        return self.proc.poll()

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        """Sends sig; with SIGKILL also waits for the process to be gone."""
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def terminate(self, timeout=20):
        """Sends SIGTERM and returns the exit code; fails if it does not exit in time."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout=20):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the {self.label} did not exit within {timeout:g}s; killed\n"
                                 + self.log_tail()) from None

    # -- its log
    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines=40):
        return f"--- {self.label} output, last {lines} lines ---\n{tail(self.log(), lines)}"

    def mark(self):
        """The current length of the log, for wait_for_log(since=...)."""
        return len(self.log())

    def wait_for_log(self, regex, timeout=10, since=0, flags=re.MULTILINE):
        """Waits until regex matches the log (from offset since on); returns the match.
        Fails at once, with the log, if the process exits first."""
        pattern = re.compile(regex, flags)

        def found():
            return pattern.search(self.log(), since)
        try:
            return wait_until(found, timeout=timeout, interval=0.05, relay=self,
                              message=f"{self.label} log line matching {regex!r}")
        except AssertionError:
            match = found()  # it may have logged it just before it exited
            if match:
                return match
            raise


class Relay(Daemon):
    """The relay daemon under test, as a context manager (see Daemon).

    Relay(pg, redis, poll_interval='200ms', batch_size=100) runs
    `outbox-relay --poll-interval 200ms --batch-size 100` with
    OUTBOX_RELAY_POSTGRES=pg.dsn() and OUTBOX_RELAY_REDIS=redis.url().
    args are put on the command line before the flags; env adds to (None:
    removes from) the environment of relay_env(). prefix is put in front of
    the whole command (valgrind's too): a wrapper that execs the rest, as
    `unshare -m sh -c '... && exec "$@"'` for a mount namespace of its own.
    """

    # The suite's relays keep sent rows for an hour (the default, 0, deletes
    # each row as it is published), so that a test can compare the rows with
    # the stream entries (Verifier) and see when each was marked sent.
    # test_retention.py covers the default; the benchmark clears this.
    test_defaults = {"sent_retention": "1h"}

    def __init__(self, pg=None, redis=None, args=(), env=None, stop_timeout=30, prefix=(),
                 **flags):
        self.binary = require_relay()
        flags = {**self.test_defaults, **flags}
        super().__init__([*prefix, *VALGRIND, self.binary, *args, *flag_args(flags)],
                         relay_env(pg, redis, env), "relay", stop_timeout=stop_timeout)


# Log lines: "2026-11-30T11:35:14.123Z WARNING redis: text". A problem is a
# WARNING or ERROR line; a (re)connection is an INFO or DEBUG line that says so.
LOG_PROBLEM = r"^\S+ (?:WARNING|ERROR) {component}: "
LOG_CONNECTED = (r"^\S+ (?:INFO|DEBUG) {component}: .*(?i:\b(?:re)?connected\b"
                 r"|\bconnection (?:re)?established\b|\bis back\b|\bready\b)")


def problem_lines(log, component):
    """The WARNING and ERROR lines of one component (pg, redis, relay, config)."""
    return re.findall(LOG_PROBLEM.format(component=component) + ".*$", log, re.MULTILINE)


def metric(text, name, **labels):
    """The value of one sample of a /metrics page, or None. Anchored at the
    line's start, so "# TYPE <name> counter" never passes for a sample."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = ("^" + re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "")
               + r" (\S+)$")
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else None


def metrics_text(daemon, timeout=5):
    """The /metrics page of a relay started with relay_env() (its own port)."""
    import urllib.request
    url = f"http://{daemon.env['OUTBOX_RELAY_METRICS_LISTEN']}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()
