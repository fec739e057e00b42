"""Integration-test harness: throwaway servers, the relay under test, and checks.

Every test file drives the real daemon against its own PostgreSQL and Redis,
started here on free loopback ports in temporary directories and always
stopped and removed at the end: on success, on failure, on an exception, on
SIGTERM or SIGINT of the test, and on the per-file deadline.

    Postgres()  initdb + pg_ctl, database "app" with migrations/*.sql applied
    PgBouncer() pgbouncer in front of a Postgres(), session or transaction mode
    Redis()     redis-server on 127.0.0.1, no RDB, AOF configurable; with
                OUTBOX_REDIS_SERVER=valkey-server, Valkey instead
    Daemon()    one of our daemons as a process: command line, environment, log
                file, start/stop/kill/wait, wait_for_log, sanitizer reports fail
    Relay()     the outbox-relay binary as a Daemon
    Producer    a thread committing outbox rows at a steady rate, surviving
                restarts (Producers: several at once)
    Verifier    every outbox row against every stream: one line of figures;
                optionally duplicates across all streams and payloads compared

Only the standard library, psycopg2 and redis-py (Debian's python3-psycopg2
and python3-redis) are used. Run the files with /usr/bin/python3.
"""

import atexit
import contextlib
import dataclasses
import datetime
import glob
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import psycopg2
import psycopg2.extras
import redis as redis_py

SOURCE_DIR = os.environ.get("OUTBOX_RELAY_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))
MIGRATIONS_DIR = os.path.join(SOURCE_DIR, "migrations")
SKIP = 77  # CTest SKIP_RETURN_CODE

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

# Where the suite keeps every log it produced (the daemons', the tools', the
# servers'), and the passwords it handed out, for tests/integration/
# test_secrets.py to check that no password reached a log. Unset: nothing kept.
LOG_DIR = os.environ.get("OUTBOX_TEST_LOG_DIR")
_kept = 0


def keep_log(path, kind):
    """Copies a log into LOG_DIR (if set) before its directory goes."""
    global _kept
    if not LOG_DIR or not path or not os.path.exists(path):
        return
    os.makedirs(LOG_DIR, exist_ok=True)
    _kept += 1
    name = f"{kind}-{os.getpid()}-{_kept}-{os.path.basename(path)}"
    with contextlib.suppress(OSError):
        shutil.copyfile(path, os.path.join(LOG_DIR, name))


def keep_text(text, kind):
    """Writes output that never was a file (a tool's) into LOG_DIR."""
    global _kept
    if not LOG_DIR or not text:
        return
    os.makedirs(LOG_DIR, exist_ok=True)
    _kept += 1
    with open(os.path.join(LOG_DIR, f"{kind}-{os.getpid()}-{_kept}.log"), "w",
              encoding="utf-8", errors="replace") as f:
        f.write(text)


def keep_secret(secret):
    """Records a password the suite uses, for the final check of its logs."""
    if not LOG_DIR or not secret:
        return
    os.makedirs(LOG_DIR, exist_ok=True)
    with open(os.path.join(LOG_DIR, "secrets.txt"), "a", encoding="utf-8") as f:
        f.write(secret + "\n")


# --------------------------------------------------------------------------
# Process-wide cleanup: signals, deadline, atexit.

_live = []            # servers and relays still running, newest last
_results = []         # unittest results to stop when a signal arrives
_handlers_installed = False


def _register(obj):
    _install_signal_handlers()
    if not any(o is obj for o in _live):
        _live.append(obj)


def _unregister(obj):
    with contextlib.suppress(ValueError):
        _live.remove(obj)


def _cleanup_all():
    while _live:
        obj = _live.pop()
        with contextlib.suppress(BaseException):
            obj.close()


def _on_signal(signum, frame):
    name = signal.Signals(signum).name
    print(f"\nharness: {name} received: stopping the tests and every server",
          file=sys.stderr, flush=True)
    for result in _results:
        result.stop()  # unittest runs no further test, but still the cleanups
    raise SystemExit(128 + signum)


def _install_signal_handlers():
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
        signal.signal(sig, _on_signal)
    atexit.register(_cleanup_all)
    _handlers_installed = True


def set_deadline(seconds):
    """Fails the whole file (cleanly, servers stopped) if it runs longer than this."""
    _install_signal_handlers()
    signal.alarm(int(seconds))


# --------------------------------------------------------------------------
# Small helpers.

_ports_given = set()


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on, not handed out before."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports_given:
            _ports_given.add(port)
            return port
    raise RuntimeError("no free port found")


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


def port_open(port, host="127.0.0.1"):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_until(pred, timeout=30.0, interval=0.05, message=None, relay=None):
    """Calls pred until it returns something true and returns that; fails after timeout.

    With relay given (a Daemon: the relay or a consumer), fails at once, with
    its log, if that process exits.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if relay is not None and not relay.alive():
            raise AssertionError(
                f"{message or 'condition'}: the {relay.label} exited with code {relay.returncode}"
                f" while waiting\n{relay.log_tail()}")
        if time.monotonic() >= deadline:
            detail = f"\n{relay.log_tail()}" if relay is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for "
                                 f"{message or getattr(pred, '__name__', 'condition')}{detail}")
        time.sleep(interval)


def tail(text, lines=40):
    return "\n".join(text.splitlines()[-lines:])


def _run(argv, what, timeout=120, **kwargs):
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed with code {proc.returncode}: {' '.join(argv)}\n"
                           + proc.stdout.decode(errors="replace"))
    return proc.stdout.decode(errors="replace")


def _pg_bindir():
    env = os.environ.get("OUTBOX_RELAY_PG_BINDIR")
    if env:
        return env
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if candidates:
        return os.path.dirname(candidates[-1])
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(found)
    raise RuntimeError("PostgreSQL server binaries not found: run scripts/deps.sh")


def _temp_dir(prefix, for_postgres=False):
    """A private temporary directory; owned by the postgres user when we are root."""
    path = tempfile.mkdtemp(prefix=prefix)
    if for_postgres and os.geteuid() == 0:
        # PostgreSQL refuses to run as root: hand the directory over, and make
        # sure the postgres user can reach it through its parents.
        parent = os.path.dirname(path)
        probe = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", parent])
        if probe.returncode != 0:
            os.rmdir(path)
            path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        import pwd
        pw = pwd.getpwnam("postgres")
        os.chown(path, pw.pw_uid, pw.pw_gid)
    os.chmod(path, 0o700)
    return path


# --------------------------------------------------------------------------
# PostgreSQL.

class Postgres:
    """A throwaway PostgreSQL cluster with database `app` and the migrations applied."""

    def __init__(self, port=None, migrations=True, database="app", tls=None):
        self.port = port or free_port()
        self.tls = tls  # (certificate, key) files: TCP connections must use TLS
        self.database = database
        self.migrations = migrations
        self.bindir = _pg_bindir()
        self.dir = None
        self.datadir = None
        self.logfile = None
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    # -- lifecycle
    def __enter__(self):
        _register(self)
        try:
            self.dir = _temp_dir("outbox-pg-", for_postgres=True)
            self.datadir = os.path.join(self.dir, "data")
            self.logfile = os.path.join(self.dir, "postgres.log")
            self._pg(["initdb", "-D", self.datadir, "-A", "trust", "-U", "postgres",
                      "--no-sync", "-E", "UTF8", "--no-locale"], "initdb")
            with open(os.path.join(self.datadir, "postgresql.conf"), "a") as conf:
                conf.write(
                    "\n# outbox-relay integration tests\n"
                    f"port = {self.port}\n"
                    "listen_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.dir}'\n"
                    "fsync = off\n"
                    "full_page_writes = off\n"
                    "max_connections = 100\n"
                    "timezone = 'UTC'\n")
            if self.tls:
                self._setup_tls()
            self.start()
            with contextlib.closing(self.connect(dbname="postgres")) as conn:
                conn.cursor().execute(f'CREATE DATABASE "{self.database}"')
            if self.migrations:
                self.apply_migrations()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Stops the server (immediately) and removes its directory."""
        _unregister(self)
        if self.dir is None:
            return
        try:
            if os.path.exists(os.path.join(self.datadir or "", "postmaster.pid")):
                self._stop("immediate", must=False)
        finally:
            pid = self._postmaster_pid()
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            keep_log(self.logfile, "postgres")
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def _setup_tls(self):
        """TLS with the given certificate; TCP without TLS is refused, and a
        role with a password logs in with SCRAM (the others: trust)."""
        cert, key = self.tls
        for src, name in ((cert, "server.crt"), (key, "server.key")):
            dst = os.path.join(self.datadir, name)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o600)
            if os.geteuid() == 0:
                shutil.chown(dst, "postgres", "postgres")
        with open(os.path.join(self.datadir, "postgresql.conf"), "a") as conf:
            conf.write("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n"
                       "password_encryption = 'scram-sha-256'\n")
        with open(os.path.join(self.datadir, "pg_hba.conf"), "w") as hba:
            hba.write("local all all trust\n"
                      "hostssl all postgres 127.0.0.1/32 trust\n"
                      "hostssl all all 127.0.0.1/32 scram-sha-256\n"
                      "hostnossl all all 0.0.0.0/0 reject\n")

    def _pg(self, argv, what, timeout=120):
        argv = self._as_postgres + [os.path.join(self.bindir, argv[0])] + argv[1:]
        return _run(argv, what, timeout=timeout, cwd=self.dir)

    def _postmaster_pid(self):
        try:
            with open(os.path.join(self.datadir, "postmaster.pid")) as f:
                return int(f.readline().strip())
        except (OSError, ValueError, TypeError):
            return None

    def start(self):
        self._pg(["pg_ctl", "-D", self.datadir, "-l", self.logfile, "-w", "-t", "60",
                  "start"], "pg_ctl start")

    def _stop(self, mode, must=True):
        try:
            self._pg(["pg_ctl", "-D", self.datadir, "-m", mode, "-w", "-t", "60", "stop"],
                     f"pg_ctl stop -m {mode}")
        except (RuntimeError, subprocess.TimeoutExpired):
            if must:
                raise

    def stop(self, mode="fast"):
        self._stop(mode)

    def restart(self, mode="immediate"):
        """Stops the server ('immediate': as a crash would, 'fast': cleanly) and starts it."""
        assert mode in ("immediate", "fast"), mode
        self._stop(mode)
        self.start()

    # -- access
    def dsn(self, dbname=None, user="postgres"):
        return f"host=127.0.0.1 port={self.port} dbname={dbname or self.database} user={user}"

    def connect(self, autocommit=True, dbname=None, user="postgres", connect_timeout=10,
                statement_timeout=60000, application_name=None):
        """A psycopg2 connection; statements give up after statement_timeout ms (60 s)
        so no test hangs on a lock."""
        extra = {"application_name": application_name} if application_name else {}
        conn = psycopg2.connect(self.dsn(dbname, user), connect_timeout=connect_timeout,
                                options=f"-c statement_timeout={statement_timeout}", **extra)
        conn.autocommit = autocommit
        return conn

    def psql(self, *args, dbname=None):
        argv = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
                "-p", str(self.port), "-U", "postgres", "-d", dbname or self.database, *args]
        argv[0] = os.path.join(self.bindir, "psql")
        return _run(argv, "psql", cwd=self.dir)

    def migration_files(self):
        files = sorted(glob.glob(os.path.join(MIGRATIONS_DIR, "*.sql")))
        if not files:
            raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
        return files

    def apply_migrations(self, files=None):
        for path in files or self.migration_files():
            self.psql("-f", path)

    def log(self):
        with open(self.logfile, errors="replace") as f:
            return f.read()


# --------------------------------------------------------------------------
# PgBouncer.

class PgBouncer:
    """PgBouncer on a free loopback port in front of a Postgres(), in pool_mode
    (session or transaction), trusting the clients (auth_type = trust). It runs
    as the postgres user when we are root (it refuses to run as root) and is
    always stopped. dsn() is the Postgres dsn() through the pooler."""

    def __init__(self, pg, pool_mode="session", port=None, pool_size=20):
        self.pg = pg
        self.pool_mode = pool_mode
        self.port = port or free_port()
        self.pool_size = pool_size
        self.dir = None
        self.proc = None
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def __enter__(self):
        _register(self)
        try:
            binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
            if not os.access(binary, os.X_OK):
                raise RuntimeError("pgbouncer not found: run scripts/deps.sh")
            self.dir = _temp_dir("outbox-pgbouncer-", for_postgres=True)
            self.logfile = os.path.join(self.dir, "pgbouncer.log")
            userlist = os.path.join(self.dir, "userlist.txt")
            ini = os.path.join(self.dir, "pgbouncer.ini")
            with open(userlist, "w") as f:
                f.write('"postgres" ""\n')
            with open(ini, "w") as f:
                f.write(
                    "[databases]\n"
                    f"* = host=127.0.0.1 port={self.pg.port}\n"
                    "[pgbouncer]\n"
                    "listen_addr = 127.0.0.1\n"
                    f"listen_port = {self.port}\n"
                    "unix_socket_dir =\n"
                    "auth_type = trust\n"
                    f"auth_file = {userlist}\n"
                    f"pool_mode = {self.pool_mode}\n"
                    f"default_pool_size = {self.pool_size}\n"
                    f"logfile = {self.logfile}\n"
                    f"pidfile = {os.path.join(self.dir, 'pgbouncer.pid')}\n"
                    "admin_users = postgres\n")
            if os.geteuid() == 0:
                import pwd
                pw = pwd.getpwnam("postgres")
                for path in (userlist, ini):
                    os.chown(path, pw.pw_uid, pw.pw_gid)
            self.proc = spawn_listening(self._as_postgres + [binary, ini], self.port,
                                        "pgbouncer", self.log, cwd=self.dir, timeout=30)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Stops the pooler (SIGINT, then SIGKILL) and removes its directory."""
        _unregister(self)
        # As root, self.proc is runuser, which does not pass SIGINT on and
        # leaves the pooler running: signal the pooler itself, by its pidfile.
        pid = None
        with contextlib.suppress(OSError, ValueError, TypeError):
            with open(os.path.join(self.dir, "pgbouncer.pid")) as f:
                pid = int(f.read().split()[0])
        if pid is not None and self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.kill(pid, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def dsn(self, dbname=None, user="postgres", port=None):
        """The dsn through the pooler, or through a proxy at port in front of it."""
        return (f"host=127.0.0.1 port={port or self.port} dbname={dbname or self.pg.database}"
                f" user={user}")

    def log(self):
        try:
            with open(self.logfile, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


# --------------------------------------------------------------------------
# Redis.

# The server the tests run against: redis-server (Redis 7.0), or another
# binary that speaks its protocol and takes its options, such as
# valkey-server (Valkey 8). A server asked for and missing fails the test.
REDIS_SERVER = os.environ.get("OUTBOX_REDIS_SERVER") or "redis-server"


def redis_server_binary():
    """The server binary's path; raises when it is not installed."""
    found = shutil.which(REDIS_SERVER)
    if found is None:
        raise RuntimeError(f"{REDIS_SERVER} not found: OUTBOX_REDIS_SERVER names a server "
                           "that is not installed (scripts/deps.sh installs redis-server and "
                           "valkey-server)")
    return found

def _acl_rules():
    """{user: [rules]} of the Redis users docs/OPERATIONS.md ("Redis users")
    documents, read from its ACL SETUSER block, the password placeholder
    left in."""
    with open(os.path.join(SOURCE_DIR, "docs", "OPERATIONS.md"), encoding="utf-8") as f:
        text = f.read()
    users = {}
    for line in text.splitlines():
        if line.startswith("ACL SETUSER outbox-"):
            words = line.split()
            users[words[2]] = words[3:]
    if set(users) != {"outbox-relay", "outbox-consumer", "outbox-tools"}:
        raise RuntimeError(f"docs/OPERATIONS.md should give three ACL users, not {sorted(users)}")
    return users


ACL_USERS = _acl_rules()
_REDIS_BY_PORT = {}  # port -> Redis, for run_relay to give a tool its own user


class Redis:
    """A throwaway redis-server on 127.0.0.1; restartable on the same port and dir.

    Besides the default user (the tests' own client), it has the three users
    of docs/OPERATIONS.md ("Redis users"), with exactly their rules: url()
    names the relay's by default, url("outbox-consumer") a consumer's and
    url("outbox-tools") the operator commands'. At close, a command Redis
    refused one of them (ACL LOG) fails the test.
    """

    acl_users = True  # the documented users (a Sentinel has none)

    def __init__(self, port=None, appendonly=False, appendfsync="everysec", password=None,
                 extra_args=()):
        self.port = port or free_port()
        _REDIS_BY_PORT[self.port] = self
        self.extra_args = list(extra_args)  # more options, e.g. ["--replicaof", host, port]
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        # A test that sets a password checks that it never reaches a log:
        # every user then has it.
        self.passwords = {user: password or f"{user}-{random.getrandbits(48):012x}"
                          for user in ACL_USERS}
        for secret in {password, *self.passwords.values()}:
            keep_secret(secret)
        self.dir = None
        self.proc = None
        self.paused = False

    def __enter__(self):
        _register(self)
        try:
            self.dir = _temp_dir("outbox-redis-")
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def refusals(self):
        """What Redis refused the documented users (ACL LOG), as text lines."""
        with contextlib.closing(self.client(socket_timeout=5)) as c:
            entries = c.execute_command("ACL", "LOG", "128")
        out = []
        for entry in entries:
            e = dict(zip(entry[::2], entry[1::2]))
            user = e.get(b"username", b"").decode()
            # CLIENT SETINFO (Redis 7.2, Valkey): client libraries such as
            # ioredis send it at connect and go on when it is refused.
            if user in ACL_USERS and e.get(b"object") != b"client|setinfo":
                out.append(f"{user}: {e.get(b'reason', b'').decode()} "
                           f"{e.get(b'object', b'').decode()} (context {e.get(b'context', b'').decode()})")
        return out

    def close(self):
        _unregister(self)
        if self.dir is None:
            return
        refused = []
        try:
            if self.acl_users and self.proc and self.proc.poll() is None and not self.paused:
                try:
                    refused = self.refusals()
                except redis_py.exceptions.RedisError:
                    pass
            if self.proc and self.proc.poll() is None:
                self.resume()
                self.stop()
        finally:
            if self.proc and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            keep_log(os.path.join(self.dir, "redis.log"), "redis")
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if refused:
            raise AssertionError("Redis refused commands of the users docs/OPERATIONS.md "
                                 "documents (fix the rules there):\n" + "\n".join(refused))

    def command(self):
        """The server's command line."""
        argv = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.dir, "--save", "", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync,
                "--logfile", os.path.join(self.dir, "redis.log")]
        if self.password:
            argv += ["--requirepass", self.password, "--masterauth", self.password]
        # The users exist from the first connection on, also after a restart.
        for user, rules in ACL_USERS.items():
            argv += ["--user", user, *[">" + self.passwords[user] if r == ">CHANGE-ME" else r
                                       for r in rules]]
        return argv + self.extra_args

    def start(self):
        """Starts the server and waits until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "redis is already running"
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=self.dir)
        self.paused = False

        def answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{REDIS_SERVER} exited with {self.proc.returncode}\n"
                                   + tail(self.log()))
            try:
                with contextlib.closing(self.client(socket_timeout=1)) as c:
                    return c.ping()
            except redis_py.exceptions.RedisError:
                return False
        wait_until(answers, timeout=20, message=f"{REDIS_SERVER} to answer PING")

    def stop(self):
        """A clean shutdown (SIGTERM: no RDB is written, the AOF is flushed)."""
        if self.proc and self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self):
        """Dies as in a crash: SIGKILL."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.paused = False

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        if self.paused and self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def url(self, user="outbox-relay"):
        """The URL for one of the documented users; user=None: the default user."""
        if user is None:
            auth = f":{self.password}@" if self.password else ""
        else:
            auth = f"{user}:{self.passwords[user]}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, socket_timeout=30):
        return redis_py.Redis(host="127.0.0.1", port=self.port, db=0, password=self.password,
                              decode_responses=False, socket_timeout=socket_timeout,
                              socket_connect_timeout=5)

    def log(self):
        try:
            with open(os.path.join(self.dir, "redis.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def wait_replica_synced(replica, timeout=30):
    """Waits until the replica's link to its primary is up (its full sync done)."""
    def up():
        with contextlib.closing(replica.client(socket_timeout=2)) as c:
            return c.info("replication").get("master_link_status") == "up"
    wait_until(up, timeout=timeout, message="the replica's link to its primary")


class RedisCluster:
    """A throwaway Redis Cluster on 127.0.0.1: `primaries` primaries, each with
    `replicas` replicas, every node append-only, made with redis-cli --cluster
    create and stopped and removed at the end.

        with RedisCluster(3, 1) as cluster:
            cluster.url()            # "redis://127.0.0.1:p1,127.0.0.1:p2,..."
            cluster.reader()         # scan_iter/xrange over every primary (Verifier)
            cluster.primaries()      # {port: Redis} of the primaries now
    """

    def __init__(self, primaries=3, replicas=1, node_timeout_ms=2000):
        self.count = primaries * (1 + replicas)
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes = []

    def __enter__(self):
        try:
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--repl-diskless-sync-delay", "0"]
            for _ in range(self.count):
                # The bus port is its own (cluster-port): port + 10000, the
                # default, may be taken or past 65535.
                node = Redis(appendonly=True,
                             extra_args=args + ["--cluster-port", str(free_port())])
                node.__enter__()
                self.nodes.append(node)
            cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
            _run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                  "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                 "redis-cli --cluster create", timeout=120)
            self.wait_ok()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        for node in self.nodes:
            node.close()
        self.nodes = []

    def node(self, port):
        return next(n for n in self.nodes if n.port == port)

    def wait_ok(self, timeout=60):
        """Waits until every running node says cluster_state:ok and agrees on
        the primaries of all 16384 slots."""
        def ok():
            maps = []
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                try:
                    with contextlib.closing(n.client(socket_timeout=2)) as c:
                        if c.execute_command("CLUSTER", "INFO").decode().find(
                                "cluster_state:ok") < 0:
                            return False
                        maps.append(sorted((s[0], s[1], s[2][1])
                                           for s in c.execute_command("CLUSTER", "SLOTS")))
                except redis_py.exceptions.RedisError:
                    return False
            return bool(maps) and all(m == maps[0] for m in maps) and \
                sum(s[1] - s[0] + 1 for s in maps[0]) == 16384
        wait_until(ok, timeout=timeout, interval=0.2, message="the cluster to be ok")

    def slots(self):
        """[(first, last, primary port)] as a running node sees them."""
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                with contextlib.closing(n.client(socket_timeout=5)) as c:
                    return sorted((s[0], s[1], s[2][1])
                                  for s in c.execute_command("CLUSTER", "SLOTS"))
        raise RuntimeError("no cluster node is running")

    def primaries(self):
        return {port: self.node(port) for port in sorted({s[2] for s in self.slots()})}

    def primary_of(self, key):
        slot = self.keyslot(key)
        return self.node(next(p for lo, hi, p in self.slots() if lo <= slot <= hi))

    def keyslot(self, key):
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                with contextlib.closing(n.client(socket_timeout=5)) as c:
                    return int(c.execute_command("CLUSTER", "KEYSLOT", key))
        raise RuntimeError("no cluster node is running")

    def node_id(self, node):
        with contextlib.closing(node.client(socket_timeout=5)) as c:
            return c.execute_command("CLUSTER", "MYID").decode()

    def add_primary(self):
        """A new empty primary joined to the cluster (redis-cli --cluster
        add-node), holding no slot until one is migrated to it."""
        node = Redis(appendonly=True,
                     extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                 "--cluster-node-timeout", str(self.node_timeout_ms),
                                 "--repl-diskless-sync-delay", "0",
                                 "--cluster-port", str(free_port())])
        node.__enter__()
        self.nodes.append(node)
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        _run([cli, "--cluster", "add-node", f"127.0.0.1:{node.port}",
              f"127.0.0.1:{self.nodes[0].port}"], "redis-cli --cluster add-node", timeout=60)
        new_id = self.node_id(node)

        def known():
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                with contextlib.closing(n.client(socket_timeout=2)) as c:
                    if new_id not in c.execute_command("CLUSTER", "NODES").decode():
                        return False
            return True
        wait_until(known, timeout=30, interval=0.2, message="every node to know the new one")
        self.wait_ok()
        return node

    def migrate_slot(self, slot, source, target, pause=0.1):
        """Moves a slot's keys from source to target, 10 at a time with a
        pause between (the MIGRATING/IMPORTING states, then SETSLOT NODE on
        every primary): (keys moved, seconds it took)."""
        started = time.monotonic()
        src_id, dst_id = self.node_id(source), self.node_id(target)
        moved = 0
        with contextlib.closing(source.client()) as src, contextlib.closing(target.client()) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while True:
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10)
                if not keys:
                    break
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                                    "KEYS", *keys)
                moved += len(keys)
                time.sleep(pause)  # the migration lasts, and publishes meet it
        owners = {source.port, target.port, *self.primaries()}
        for port in owners:
            with contextlib.closing(self.node(port).client()) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return moved, time.monotonic() - started

    def url(self):
        return "redis://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def reader(self):
        return ClusterReader(self)


class ClusterReader:
    """What Verifier and stream_names need of a client, over every primary of a
    cluster: scan_iter yields each key once (from the primary that holds it),
    and xrange reads a stream from that primary."""

    def __init__(self, cluster):
        self.clients = {port: node.client() for port, node in cluster.primaries().items()}
        self.owner = {}

    def scan_iter(self, **kwargs):
        for port, c in self.clients.items():
            for key in c.scan_iter(**kwargs):
                self.owner[key] = c
                yield key

    def owner_xlen(self, stream):
        """XLEN on the primary of the stream's slot (0 when it does not exist)."""
        key = stream if isinstance(stream, bytes) else stream.encode()
        if key not in self.owner:
            for c in self.clients.values():
                try:
                    n = c.xlen(key)
                except redis_py.exceptions.ResponseError:  # MOVED: another primary's
                    continue
                self.owner[key] = c
                return n
            return 0
        return self.owner[key].xlen(key)

    def xrange(self, stream, **kwargs):
        key = stream if isinstance(stream, bytes) else stream.encode()
        return self.owner[key].xrange(stream, **kwargs)

    def close(self):
        for c in self.clients.values():
            c.close()


def spawn_listening(argv, port, what, log, cwd, timeout=20):
    """Starts a server process (its output in its own log) and waits until it
    listens on port; raises with the end of log() when it exits first."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=cwd)
    wait_until(lambda: port_open(port) or proc.poll() is not None, timeout=timeout,
               message=f"{what} to listen")
    if proc.poll() is not None:
        raise RuntimeError(f"{what} exited with code {proc.returncode}\n" + tail(log()))
    return proc


def make_ca(directory, name):
    """A throwaway certificate authority (openssl): (certificate, key) paths."""
    crt, key = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
    _run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
          "-nodes", "-days", "2", "-subj", f"/CN={name}", "-keyout", key, "-out", crt],
         "openssl req (CA)", timeout=30)
    return crt, key


def make_cert(directory, ca, name, hosts=("localhost", "127.0.0.1")):
    """A server certificate signed by ca for hosts (names and IP addresses in
    subjectAltName): (certificate, key) paths."""
    crt, key = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
    csr, ext = os.path.join(directory, f"{name}.csr"), os.path.join(directory, f"{name}.ext")
    sans = ",".join(("IP:" if re.fullmatch(r"[0-9.]+", h) else "DNS:") + h for h in hosts)
    with open(ext, "w") as f:
        f.write(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n")
    _run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
          "-nodes", "-subj", f"/CN={hosts[0]}", "-keyout", key, "-out", csr],
         "openssl req (server)", timeout=30)
    _run(["openssl", "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1],
          "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", crt],
         "openssl x509 (sign)", timeout=30)
    return crt, key


class Stunnel:
    """stunnel (Debian's stunnel4) on 127.0.0.1, one service, in the foreground.

        Stunnel(server=(crt, key), connect=redis.port)       TLS in, plain out
        Stunnel(client_ca=ca_crt, connect=port, host="localhost")
                                                             plain in, TLS out,
                                                             the peer verified
    .port is where it accepts; its log is kept with the suite's.
    """

    def __init__(self, connect, server=None, client_ca=None, host="localhost"):
        assert (server is None) != (client_ca is None)
        self.connect_port = connect
        self.server = server
        self.client_ca = client_ca
        self.host = host
        self.port = free_port()
        self.dir = None
        self.proc = None

    def __enter__(self):
        _register(self)
        try:
            self.dir = _temp_dir("outbox-stunnel-")
            conf = os.path.join(self.dir, "stunnel.conf")
            lines = ["foreground = yes", "pid =", f"output = {self.dir}/stunnel.log",
                     "debug = info", "[redis]", f"accept = 127.0.0.1:{self.port}",
                     f"connect = 127.0.0.1:{self.connect_port}"]
            if self.server:
                lines += [f"cert = {self.server[0]}", f"key = {self.server[1]}"]
            else:
                lines += ["client = yes", f"CAfile = {self.client_ca}", "verifyChain = yes",
                          f"checkHost = {self.host}"]
            with open(conf, "w") as f:
                f.write("\n".join(lines) + "\n")
            self.proc = spawn_listening([shutil.which("stunnel4") or "stunnel", conf],
                                        self.port, "stunnel", self.log, cwd=self.dir)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def log(self):
        try:
            with open(os.path.join(self.dir, "stunnel.log"), errors="replace") as f:
                return f.read()
        except (OSError, TypeError):
            return ""

    def close(self):
        _unregister(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir is not None:
            keep_log(os.path.join(self.dir, "stunnel.log"), "stunnel")
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class Sentinel(Redis):
    """A throwaway Redis Sentinel on 127.0.0.1 that monitors one primary.

        Sentinel(primary, master="mymaster", quorum=2, down_after_ms=1000)

    It writes its own config file (Sentinel rewrites it) in its directory.
    With password, the Sentinel asks its clients and the other Sentinels for it
    (requirepass, sentinel sentinel-pass). With user, it also has an ACL user
    of that name whose password is user_password.
    """

    acl_users = False

    def __init__(self, primary, master="mymaster", quorum=2, down_after_ms=1000,
                 failover_timeout_ms=10000, password=None, user=None, user_password=None):
        super().__init__(password=password)
        self.user = user
        self.user_password = user_password
        if user_password:
            keep_secret(user_password)
        self.primary_port = primary.port
        self.master = master
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def command(self):
        conf = os.path.join(self.dir, "sentinel.conf")
        if not os.path.exists(conf):  # Sentinel rewrites it: written once
            with open(conf, "w") as f:
                f.write(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
                        f"logfile {os.path.join(self.dir, 'redis.log')}\n"
                        f"sentinel monitor {self.master} 127.0.0.1 {self.primary_port}"
                        f" {self.quorum}\n"
                        f"sentinel down-after-milliseconds {self.master} {self.down_after_ms}\n"
                        f"sentinel failover-timeout {self.master} {self.failover_timeout_ms}\n"
                        f"sentinel parallel-syncs {self.master} 1\n")
                if self.password:
                    f.write(f"requirepass {self.password}\n"
                            f"sentinel sentinel-pass {self.password}\n")
                if self.user:
                    f.write(f"user {self.user} on >{self.user_password} ~* &* +@all\n")
        return [redis_server_binary(), conf, "--sentinel"]

    def primary(self):
        """The primary's port as this Sentinel names it now."""
        with contextlib.closing(self.client(socket_timeout=2)) as c:
            host, port = c.execute_command("SENTINEL", "get-master-addr-by-name", self.master)
        return int(port)

    def address(self):
        return f"127.0.0.1:{self.port}"


# --------------------------------------------------------------------------
# The relay, and our daemons as processes.

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
    server = _REDIS_BY_PORT.get(int(m.group(1))) if m else None
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
        _register(self)

    # -- lifecycle
    def __enter__(self):
        _register(self)
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
        _unregister(self)
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
    removes from) the environment of relay_env().
    """

    # The suite's relays keep sent rows for an hour (the default, 0, deletes
    # each row as it is published), so that a test can compare the rows with
    # the stream entries (Verifier) and see when each was marked sent.
    # test_retention.py covers the default; the benchmark clears this.
    test_defaults = {"sent_retention": "1h"}

    def __init__(self, pg=None, redis=None, args=(), env=None, stop_timeout=30, **flags):
        self.binary = require_relay()
        flags = {**self.test_defaults, **flags}
        super().__init__([*VALGRIND, self.binary, *args, *flag_args(flags)],
                         relay_env(pg, redis, env), "relay", stop_timeout=stop_timeout)


# Log lines: "2026-11-30T11:35:14.123Z WARNING redis: text". A problem is a
# WARNING or ERROR line; a (re)connection is an INFO or DEBUG line that says so.
LOG_PROBLEM = r"^\S+ (?:WARNING|ERROR) {component}: "
LOG_CONNECTED = (r"^\S+ (?:INFO|DEBUG) {component}: .*(?i:\b(?:re)?connected\b"
                 r"|\bconnection (?:re)?established\b|\bis back\b|\bready\b)")


def problem_lines(log, component):
    """The WARNING and ERROR lines of one component (pg, redis, relay, config)."""
    return re.findall(LOG_PROBLEM.format(component=component) + ".*$", log, re.MULTILINE)


# --------------------------------------------------------------------------
# Rows and streams.

def insert(conn, topic, payload, key=None, headers=None, commit=True):
    """Inserts one outbox row with a plain INSERT; returns its message_id (text).

    On a non-autocommit connection the row is committed unless commit=False.
    """
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO outbox.messages (topic, partition_key, payload, headers)"
            " VALUES (%s, %s, %s, %s) RETURNING message_id::text",
            (topic, key, psycopg2.Binary(payload),
             psycopg2.extras.Json(headers) if headers is not None else None))
        message_id = cur.fetchone()[0]
    if commit and not conn.autocommit:
        conn.commit()
    return message_id


def insert_many(conn, rows, commit=True):
    """Inserts (topic, payload[, key[, headers]]) tuples in one statement; returns ids."""
    values = []
    for row in rows:
        topic, payload, key, headers = (tuple(row) + (None, None))[:4]
        values.append((topic, key, psycopg2.Binary(payload),
                       psycopg2.extras.Json(headers) if headers is not None else None))
    with conn.cursor() as cur:
        ids = psycopg2.extras.execute_values(
            cur, "INSERT INTO outbox.messages (topic, partition_key, payload, headers)"
                 " VALUES %s RETURNING message_id::text", values, page_size=len(values) or 1,
            fetch=True)
    if commit and not conn.autocommit:
        conn.commit()
    return [r[0] for r in ids]


def scalar(conn, sql, args=None):
    with conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchone()[0]


def count_unsent(conn):
    """Rows not yet sent and not quarantined."""
    return scalar(conn, "SELECT count(*) FROM outbox.messages"
                        " WHERE sent_at IS NULL AND failed_at IS NULL")


def wait_all_sent(conn, timeout=30, relay=None):
    """Waits until every row is sent (or quarantined)."""
    wait_until(lambda: count_unsent(conn) == 0, timeout=timeout, interval=0.1, relay=relay,
               message="every outbox row to be sent")


def reset(pg_conn, redis_client=None):
    """Empties the outbox and Redis between tests (the relay's function stays loaded)."""
    with pg_conn.cursor() as cur:
        cur.execute("TRUNCATE outbox.messages RESTART IDENTITY; TRUNCATE outbox.topics;"
                    " SELECT outbox.sync_partition_trigger()")
    if not pg_conn.autocommit:
        pg_conn.commit()
    if redis_client is not None:
        redis_client.flushall()


def publish_calls(redis_client):
    """Rows the relay's publish functions took since the last CONFIG RESETSTAT:
    each row makes exactly one GET (its dedup check), in a call of its own or
    in a call of several rows, the relay's other functions (retire, trim)
    none, and commands a function runs count in commandstats."""
    return redis_client.info("commandstats").get("cmdstat_get", {}).get("calls", 0)


def dedup_records(redis_client, match="*:dedup:*"):
    """{key: time to live in ms} of the relay's dedup records (-1: none set)."""
    keys = list(redis_client.scan_iter(match=match, count=10000))
    pipe = redis_client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    return {k: t for k, t in zip(keys, pipe.execute()) if t != -2}


def unretired_dedup_records(redis_client, publish_timeout_ms, match="*:dedup:*"):
    """The dedup records that outlive a committed batch's retirement: the
    relay removes a committed batch's records publish_timeout after the
    commit, or at shutdown leaves them to expire by then (docs/DESIGN.md,
    "The publish deadline"). Read publish_timeout after the last commit; a
    longer life means a batch whose outcome the relay does not know, or a
    record it forgot."""
    return sorted(k for k, t in dedup_records(redis_client, match).items()
                  if t < 0 or t > publish_timeout_ms)


def max_sent_within(conn, seconds):
    """The most rows marked sent within any window of the given length: what
    retired dedup records can add to those of the batches in flight."""
    return scalar(conn, "SELECT coalesce(max(n), 0) FROM (SELECT sum(c) OVER (ORDER BY s"
                        " RANGE BETWEEN CURRENT ROW AND %s FOLLOWING) AS n FROM (SELECT"
                        " sent_at AS s, count(*) AS c FROM outbox.messages WHERE sent_at"
                        " IS NOT NULL GROUP BY sent_at) AS g) AS w",
                  (datetime.timedelta(seconds=seconds),))


def stream_names(redis_client):
    """Every stream key, without the relay's dedup records."""
    names = []
    for key in redis_client.scan_iter(count=1000, _type="stream"):
        if b":dedup:" not in key:
            names.append(key)
    return sorted(names)


def stream_entries(redis_client, stream):
    """The whole stream as [(entry_id, {field bytes: value bytes})], read 10000 at a time."""
    entries = []
    start = "-"
    while True:
        chunk = redis_client.xrange(stream, min=start, max="+", count=10000)
        entries.extend((eid.decode(), fields) for eid, fields in chunk)
        if len(chunk) < 10000:
            return entries
        start = "(" + chunk[-1][0].decode()


def all_entries(redis_client):
    """{stream name (bytes): entries} for every stream."""
    return {name: stream_entries(redis_client, name) for name in stream_names(redis_client)}


def entries_by_message_id(redis_client):
    """{message_id text: [(stream, entry_id, fields)]} over every stream."""
    found = {}
    for stream, entries in all_entries(redis_client).items():
        for entry_id, fields in entries:
            mid = fields.get(b"id", b"").decode(errors="replace")
            found.setdefault(mid, []).append((stream, entry_id, fields))
    return found


# SQLSTATE classes that mean "the server or the connection went away", not "your SQL is wrong".
_CONNECTION_CLASSES = ("08", "57")
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz0123456789 {}\":,"
_PRINTABLE = bytes(_ALPHABET[i % len(_ALPHABET)] for i in range(256))


def connection_trouble(exc, conn=None):
    """Whether a psycopg2 error means the server or the connection went away."""
    if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
        return True
    if conn is not None and conn.closed:
        return True
    code = getattr(exc, "pgcode", None) or ""
    return code[:2] in _CONNECTION_CLASSES


class Producer(threading.Thread):
    """Commits outbox rows from its own connection until it has committed `rows`
    (None: no limit) or is stopped.

    Each transaction holds a random number of rows in tx_rows (inclusive), each
    with a random topic of topics and a random payload of payload_bytes
    (inclusive) bytes: random binary, or with text_payloads half of them
    printable text. With rate (rows per second) it keeps to that pace, also
    after an outage. connect: keyword arguments for Postgres.connect.

    Connection failures (a PostgreSQL restart, a terminated session) are
    counted and survived: it reconnects and goes on. A COMMIT that failed that
    way has an unknown outcome; its rows are counted in `unknown`, and the
    Verifier reads the table, so it counts what really committed. Any other
    error ends the thread and is reported by check() and stop().
    """

    def __init__(self, pg, rows=None, topics=("orders",), tx_rows=(1, 1), payload_bytes=(0, 300),
                 rate=None, seed=0, name=None, text_payloads=False, connect=None):
        super().__init__(name=name, daemon=True)
        self.pg = pg
        self.rows = rows
        self.topics = list(topics)
        self.tx_rows = tx_rows
        self.payload_bytes = payload_bytes
        self.rate = rate
        self.text_payloads = text_payloads
        self.connect_options = dict(connect or {})
        self.random = random.Random(seed)
        self.committed = 0          # rows whose COMMIT succeeded
        self.unknown = 0            # rows whose COMMIT failed with the outcome unknown
        self.transactions = 0
        self.connection_errors = 0
        self.error = None
        self._stop_event = threading.Event()

    def _payload(self):
        data = self.random.randbytes(self.random.randint(*self.payload_bytes))
        if self.text_payloads and self.random.random() >= 0.5:
            return data.translate(_PRINTABLE)
        return data  # binary: NUL bytes and invalid UTF-8 included

    def _done(self):
        return self._stop_event.is_set() or (self.rows is not None
                                             and self.committed >= self.rows)

    def run(self):
        conn = None
        started = time.monotonic()
        try:
            while not self._done():
                if self.rate:
                    ahead = ((self.committed + self.unknown) / self.rate
                             - (time.monotonic() - started))
                    if ahead > 0:
                        self._stop_event.wait(min(ahead, 0.5))
                        continue
                if conn is None:
                    try:
                        conn = self.pg.connect(autocommit=False, **self.connect_options)
                    except psycopg2.Error:
                        self.connection_errors += 1
                        self._stop_event.wait(0.05)
                        continue
                n = self.random.randint(*self.tx_rows)
                if self.rows is not None:
                    n = min(n, self.rows - self.committed)
                batch = [(self.random.choice(self.topics), self._payload()) for _ in range(n)]
                committing = False
                try:
                    insert_many(conn, batch, commit=False)
                    committing = True
                    conn.commit()
                except psycopg2.Error as e:
                    if not connection_trouble(e, conn):
                        raise
                    self.connection_errors += 1
                    if committing:
                        self.unknown += n   # may or may not be in the table
                    with contextlib.suppress(Exception):
                        conn.close()
                    conn = None
                    continue
                self.committed += n
                self.transactions += 1
        except BaseException as e:  # reported by check()
            self.error = e
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def signal_stop(self):
        """Asks the thread to stop after its current transaction; see stop()."""
        self._stop_event.set()

    def stop(self, timeout=60):
        self.signal_stop()
        self.join(timeout)
        self.check()

    def check(self):
        if self.error is not None:
            raise AssertionError(f"producer {self.name} failed: {self.error!r}")
        if self.is_alive():
            raise AssertionError(f"producer {self.name} did not stop")


class Producers:
    """n Producers at once, each on its own connection, until stop().

    rate (rows per second) is for all of them together; producer i is seeded
    with seed * 1000 + i; the other options are Producer's.
    """

    def __init__(self, pg, n=4, rate=None, seed=0, name="producer", **options):
        self.threads = [Producer(pg, rate=rate / n if rate else None, seed=seed * 1000 + i,
                                 name=f"{name}-{i}", **options) for i in range(n)]

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def stop(self, timeout=60):
        """Stops every thread; fails if one failed for another reason than the connection."""
        for t in self.threads:
            t.signal_stop()
        for t in self.threads:
            t.join(timeout)
        for t in self.threads:
            t.check()

    @property
    def committed(self):
        return sum(t.committed for t in self.threads)

    @property
    def unknown(self):
        return sum(t.unknown for t in self.threads)

    @property
    def connection_errors(self):
        return sum(t.connection_errors for t in self.threads)

    def alive(self):
        return all(t.is_alive() for t in self.threads)

    def failed(self):
        """The first thread's error as a message, or None."""
        for t in self.threads:
            if t.error is not None:
                return f"producer {t.name} failed: {t.error!r}"
        return None


@dataclasses.dataclass
class Figures:
    committed: int = 0
    published: int = 0
    lost: int = 0
    duplicates: int = 0
    sent_but_absent: int = 0
    unsent: int = 0
    stray: int = 0    # entries whose id is no row's, or in another topic's stream
    corrupt: int = 0  # entries whose payload, topic or outbox_id differ from the row's
    lost_ids: list = dataclasses.field(default_factory=list)
    duplicate_ids: list = dataclasses.field(default_factory=list)

    def line(self):
        text = (f"rows committed={self.committed} published={self.published} lost={self.lost}"
                f" duplicates={self.duplicates} sent_but_absent={self.sent_but_absent}"
                f" unsent={self.unsent}")
        if self.stray:
            text += f" stray={self.stray}"
        if self.corrupt:
            text += f" corrupt={self.corrupt}"
        return text

    def assert_exactly_once(self, test):
        """Every row sent and published once, as written, nothing else in the streams."""
        test.assertEqual((self.lost, self.duplicates, self.sent_but_absent, self.unsent,
                          self.stray, self.corrupt), (0, 0, 0, 0, 0, 0),
                         f"{self.line()}; lost e.g. {self.lost_ids[:5]},"
                         f" duplicated e.g. {self.duplicate_ids[:5]}")


class Verifier:
    """Compares every row of outbox.messages with every stream.

    lost:            rows with no entry in their topic's stream
    duplicates:      entries beyond the first for one message id in the row's
                     stream (across_streams=True: in all streams together)
    sent_but_absent: rows with sent_at set but no entry
    unsent:          rows with sent_at NULL
    stray:           entries of no row, or in another topic's stream
    corrupt:         with compare_payloads=True, entries in the row's stream
                     whose payload bytes, topic or outbox_id differ from the row's
    Reads every row and every stream once.
    """

    def __init__(self, pg_conn, redis_client, stream_prefix="", across_streams=False,
                 compare_payloads=False):
        self.pg = pg_conn
        self.redis = redis_client
        self.prefix = stream_prefix.encode()
        self.across_streams = across_streams
        self.compare_payloads = compare_payloads

    def figures(self):
        payload = "payload" if self.compare_payloads else "NULL"
        with self.pg.cursor() as cur:
            cur.execute(f"SELECT message_id::text, id, topic, {payload}, sent_at IS NOT NULL"
                        " FROM outbox.messages ORDER BY id")
            rows = cur.fetchall()
        if not self.pg.autocommit:
            self.pg.commit()
        found = entries_by_message_id(self.redis)
        fig = Figures(committed=len(rows))
        known = set()
        for message_id, outbox_id, topic, payload, sent in rows:
            known.add(message_id)
            stream = self.prefix + topic.encode()
            entries = found.get(message_id, [])
            here = [e for e in entries if e[0] == stream]
            fig.stray += len(entries) - len(here)
            if here:
                fig.published += 1
            else:
                fig.lost += 1
                fig.lost_ids.append(message_id)
                if sent:
                    fig.sent_but_absent += 1
            copies = len(entries) if self.across_streams else len(here)
            if copies > 1:
                fig.duplicates += copies - 1
                fig.duplicate_ids.append(message_id)
            if not sent:
                fig.unsent += 1
            if self.compare_payloads:
                for _, _, fields in here:
                    if (fields.get(b"payload") != bytes(payload)
                            or fields.get(b"topic") != topic.encode()
                            or fields.get(b"outbox_id") != str(outbox_id).encode()):
                        fig.corrupt += 1
        fig.stray += sum(len(v) for k, v in found.items() if k not in known)
        return fig

    def report(self, suffix=""):
        """Computes the figures and prints their one line (with suffix)."""
        fig = self.figures()
        print(fig.line() + (f" {suffix}" if suffix else ""), file=sys.stderr, flush=True)
        return fig


def duplicate_detail(redis_client, message_ids, limit=3):
    """Where the entries of some duplicated message ids are, for a failure message."""
    found = entries_by_message_id(redis_client)
    lines = []
    for mid in message_ids[:limit]:
        for stream, entry_id, fields in found.get(mid, []):
            lines.append(f"  {mid}: {stream.decode()} {entry_id}"
                         f" outbox_id={fields.get(b'outbox_id', b'?').decode()}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Test-case bases.

class TestCase(unittest.TestCase):
    """Lets a SIGTERM/SIGINT/deadline stop the run cleanly (cleanups still run)."""

    def run(self, result=None):
        if result is not None and result not in _results:
            _results.append(result)
        return super().run(result)


class PostgresTestCase(TestCase):
    """One PostgreSQL for the whole class, and no Redis: pg, and db (an
    autocommit connection as postgres). Each test starts with outbox.messages
    empty, unless the class sets reset_outbox = False (a database without the
    outbox schema, or a test that empties what it needs itself).

    Subclasses may set pg_options (keyword arguments of Postgres).
    """

    pg_options = {}
    reset_outbox = True

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.pg = cls.enterClassContext(Postgres(**cls.pg_options))
        cls.db = cls.pg.connect()
        cls.addClassCleanup(cls.db.close)

    def setUp(self):
        super().setUp()
        if self.reset_outbox:
            reset(self.db)


class ServerTestCase(PostgresTestCase):
    """One PostgreSQL and one Redis for the whole class; each test starts empty.

    Subclasses may set pg_options / redis_options (keyword arguments).
    """

    redis_options = {}

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.redis = cls.enterClassContext(Redis(**cls.redis_options))
        cls.r = cls.redis.client()
        cls.addClassCleanup(cls.r.close)

    def setUp(self):
        super().setUp()
        self.r.flushall()

    def relay(self, **kwargs):
        """Starts a relay on this class's servers for the rest of the test."""
        return self.enterContext(Relay(self.pg, self.redis, **kwargs))

    def verifier(self, **kwargs):
        return Verifier(self.db, self.r, **kwargs)


def parse_rfc3339_utc(text):
    """'2026-11-30T11:35:14.123456Z' -> (aware datetime, digits of fraction), else None."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z", text)
    if not m:
        return None
    base = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").replace(
        tzinfo=datetime.timezone.utc)
    frac = m.group(2) or ""
    micro = int((frac + "000000")[:6]) if frac else 0
    return base.replace(microsecond=micro), len(frac)
