"""Throwaway PostgreSQL clusters, and PgBouncer in front of one."""

import contextlib
import glob
import os
import shutil
import signal
import subprocess

import psycopg2

from .cleanup import keep_log, register, unregister
from .common import SOURCE_DIR, free_port, run_command, spawn_listening, temp_dir

MIGRATIONS_DIR = os.path.join(SOURCE_DIR, "migrations")


def pg_bindir():
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


# --------------------------------------------------------------------------
# PostgreSQL.

class Postgres:
    """A throwaway PostgreSQL cluster with database `app` and the migrations applied."""

    def __init__(self, port=None, migrations=True, database="app", tls=None, encoding="UTF8"):
        self.port = port or free_port()
        self.encoding = encoding  # of database `app` (the cluster has no locale)
        self.tls = tls  # (certificate, key) files: TCP connections must use TLS
        self.database = database
        self.migrations = migrations
        self.bindir = pg_bindir()
        self.dir = None
        self.datadir = None
        self.logfile = None
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    # -- lifecycle
    def __enter__(self):
        register(self)
        try:
            self.dir = temp_dir("outbox-pg-", for_postgres=True)
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
                conn.cursor().execute(f'CREATE DATABASE "{self.database}" TEMPLATE template0'
                                      f" ENCODING '{self.encoding}'")
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
        unregister(self)
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
        return run_command(argv, what, timeout=timeout, cwd=self.dir)

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

    def set_xid_epoch(self, epoch):
        """Stops the server, sets the epoch of its transaction ids (pg_resetwal
        -e: the xid8 values go on from epoch * 2^32), and starts it, as a
        database that has run for years has it."""
        self._stop("fast")
        self._pg(["pg_resetwal", "-e", str(epoch), self.datadir], "pg_resetwal -e")
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
        return run_command(argv, "psql", cwd=self.dir)

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
        register(self)
        try:
            binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
            if not os.access(binary, os.X_OK):
                raise RuntimeError("pgbouncer not found: run scripts/deps.sh")
            self.dir = temp_dir("outbox-pgbouncer-", for_postgres=True)
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
        unregister(self)
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
