"""Configuration and start-up, as an operator meets them.

Promises tested (docs/CONFIGURATION.md; the README's "Run the relay"):
- --check-config with a good file exits 0 and connects to nothing;
- an unknown key or a bad value exits 78 and names the file and line; a bad
  command-line or environment value exits 78 too; a missing -c argument is a
  usage error (64);
- a file with several mistakes gets every one reported in one run, each on a
  line of its own, at most 20 and then how many more;
- a mistyped option, command or verb is a usage error (64), never taken for
  a configuration key, and names the nearest known one;
- --print-config shows every key's effective value, passwords as ***, as a
  file that reads back;
- a malformed redis URL that carries a password exits 78 and never prints the
  password;
- with no file, OUTBOX_RELAY_POSTGRES / OUTBOX_RELAY_REDIS are enough to run;
- --help exits 0 and lists every key; --version prints the project version;
- pipeline, dedup_ttl and max_attempts are accepted with no effect:
  --check-config and the daemon at start give one warning per key set, which
  says it can be removed, and the relay publishes as without them;
- servers unreachable at start: the relay keeps running, logs each failure
  once per state change rather than once per try, and delivers once they are up;
- a database without the schema: the log names 001_outbox_schema.sql, no crash;
- the passwords of the postgres conninfo and of the redis URL never appear in
  the log, whatever happens (debug level, reconnects, a refused password).
"""

import os
import re
import select
import shutil
import signal
import sys
import socket
import tempfile
import time
import unittest
import urllib.error
import urllib.request

from testkit import harness
from testkit.harness import insert, run_relay, wait_until

harness.require_relay()
harness.set_deadline(300)

KEYS = ("postgres", "redis", "redis_password_file", "stream_prefix", "batch_size",
        "max_attempts", "max_payload_bytes", "listen", "poll_interval", "connect_timeout",
        "publish_timeout", "statement_timeout", "reconnect_min", "reconnect_max",
        "drain_timeout", "dedup_ttl", "log_level", "log_format")
EX_USAGE = 64
EX_CONFIG = 78
PG_SECRET = "s3cr3t-pg"
REDIS_SECRET = "r3d1s-pw-Zq"
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)


def project_version():
    with open(os.path.join(harness.SOURCE_DIR, "CMakeLists.txt")) as f:
        return re.search(r"project\(\s*outbox-relay\s+VERSION\s+([\d.]+)", f.read()).group(1)


class Listener:
    """A loopback port that accepts connections but never answers: shows who connected."""

    def __enter__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        return self

    def __exit__(self, *exc):
        self.sock.close()

    def connected(self):
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)


class ConfigFileTest(harness.TestCase):
    """The daemon run to completion: no servers needed."""

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix="outbox-config-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.pg_port = self.enterContext(Listener())
        self.redis_port = self.enterContext(Listener())

    def write(self, text, name="relay.conf"):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def good_config(self, extra=""):
        return (
            "# outbox-relay test configuration\n"
            f"postgres = host=127.0.0.1 port={self.pg_port.port} dbname=app user=postgres"
            f" password={PG_SECRET} connect_timeout=1\n"
            f"redis = redis://relay:{REDIS_SECRET}@127.0.0.1:{self.redis_port.port}/0\n"
            "\n"
            "batch_size = 100\n"
            "poll_interval = 200ms\n"
            "reconnect_min = 50ms\n"
            "reconnect_max = 2s\n"
            "drain_timeout = 5s\n"
            "listen = off\n"
            "stream_prefix = t.\n"
            "log_level = debug\n" + extra)

    def assert_no_secret(self, done):
        for secret in (PG_SECRET, REDIS_SECRET, "hunter2-secret"):
            self.assertNotIn(secret, done.output, "a password was printed")

    def assert_connected_nowhere(self):
        self.assertFalse(self.pg_port.connected(), "connected to the postgres address")
        self.assertFalse(self.redis_port.connected(), "connected to the redis address")

    def test_check_config_good_file(self):
        path = self.write(self.good_config())
        done = run_relay(["-c", path, "--check-config"])
        self.assertEqual(done.returncode, 0, done.output)
        self.assert_connected_nowhere()
        self.assert_no_secret(done)
        done = run_relay(["-c", path, "--check-config", "--batch-size=50", "--poll-interval",
                          "2m"], env=harness.relay_env(extra={"OUTBOX_RELAY_DEDUP_TTL": "5s"}))
        self.assertEqual(done.returncode, 0, done.output)
        self.assert_connected_nowhere()

    def test_keys_without_effect_warn_once_each(self):
        """pipeline, dedup_ttl and max_attempts are still accepted (deployed
        files keep working) but have no effect since the relay publishes by
        the batch: --check-config names each one the file holds, once, and
        says it can be removed; a file without them gets no warning. The
        values that used to break a rule against another key (dedup_ttl below
        publish_timeout) are accepted too."""
        path = self.write(self.good_config(
            "pipeline = off\ndedup_ttl = 1s\npublish_timeout = 10s\nmax_attempts = 3\n"))
        done = run_relay(["-c", path, "--check-config"])
        self.assertEqual(done.returncode, 0, done.output)
        self.assert_connected_nowhere()
        warnings = re.findall(r"^outbox-relay: warning: (.*)$", done.stderr, re.MULTILINE)
        print("\n".join(warnings), flush=True)
        self.assertEqual(len(warnings), 3, done.stderr)
        for key in ("pipeline", "dedup_ttl", "max_attempts"):
            said = [w for w in warnings if w.startswith(f"{key} no longer has an effect")]
            self.assertEqual(len(said), 1, f"{key}: {done.stderr}")
            self.assertTrue(said[0].endswith("; remove it"), said[0])
        self.assertIn("the relay keeps no record per message",
                      next(w for w in warnings if w.startswith("dedup_ttl")))
        done = run_relay(["-c", self.write(self.good_config(), "clean.conf"), "--check-config"])
        self.assertEqual(done.returncode, 0, done.output)
        self.assertNotIn("warning", done.stderr)

    def test_unknown_key_names_file_and_line(self):
        path = self.write(self.good_config().replace("batch_size = 100\n",
                                                     "batch_size = 100\nno_such_key = 1\n"))
        line = self.good_config().splitlines().index("batch_size = 100") + 2
        done = run_relay(["-c", path, "--check-config"])
        self.assertEqual(done.returncode, EX_CONFIG, done.output)
        self.assertIn(f"relay.conf:{line}", done.stderr)
        self.assertIn("no_such_key", done.stderr)
        self.assert_no_secret(done)
        done = run_relay(["-c", path])  # the same without --check-config
        self.assertEqual(done.returncode, EX_CONFIG, done.output)
        self.assert_connected_nowhere()

    def test_bad_values_exit_78(self):
        path = self.write(self.good_config().replace("batch_size = 100", "batch_size = 0"))
        line = self.good_config().splitlines().index("batch_size = 100") + 1
        done = run_relay(["-c", path, "--check-config"])
        self.assertEqual(done.returncode, EX_CONFIG, done.output)
        self.assertIn(f"relay.conf:{line}", done.stderr)
        self.assertIn("batch_size", done.stderr)

        good = self.write(self.good_config(), name="good.conf")
        for args, env in ((["--poll-interval", "soon"], {}),
                          (["--log-level=loud"], {}),
                          (["--log-format=xml"], {}),
                          ([], {"OUTBOX_RELAY_LOG_FORMAT": "JSON"}),
                          ([], {"OUTBOX_RELAY_BATCH_SIZE": "0"}),
                          ([], {"OUTBOX_RELAY_LISTEN": "maybe"})):
            with self.subTest(args=args, env=env):
                done = run_relay(["-c", good, "--check-config", *args],
                                 env=harness.relay_env(extra=env))
                self.assertEqual(done.returncode, EX_CONFIG, done.output)
                for name in env:
                    self.assertIn(name, done.stderr, "the message names the variable")

    def test_missing_option_argument_is_usage_error(self):
        done = run_relay(["-c"])
        self.assertEqual(done.returncode, EX_USAGE, done.output)

    def test_every_mistake_reported_at_once(self):
        lines = self.good_config().splitlines()
        bad = {lines.index("batch_size = 100"): "batch_size = 0",
               lines.index("poll_interval = 200ms"): "poll_interval = soon",
               lines.index("listen = off"): "listen off"}
        path = self.write("".join(bad.get(i, line) + "\n" for i, line in enumerate(lines))
                          + "no_such_key = 1\n")
        for args in (["--check-config"], []):  # and at start-up
            with self.subTest(args=args):
                done = run_relay(["-c", path, *args])
                self.assertEqual(done.returncode, EX_CONFIG, done.output)
                errors = done.stderr.splitlines()
                want = [f"relay.conf:{i + 1}:" for i in sorted(bad)]
                want.append(f"relay.conf:{len(lines) + 1}:")
                self.assertEqual([os.path.basename(e.split(" ")[1]) for e in errors], want,
                                 done.stderr)
                for text in ("batch_size", "poll_interval", "missing \"=\"", "no_such_key"):
                    self.assertIn(text, done.stderr)
                self.assert_no_secret(done)
        self.assert_connected_nowhere()

        # Past 20, the count of the rest.
        path = self.write(self.good_config() + "".join(f"key_{i} = 1\n" for i in range(25)))
        done = run_relay(["-c", path, "--check-config"])
        self.assertEqual(done.returncode, EX_CONFIG, done.output)
        errors = done.stderr.splitlines()
        self.assertEqual(len(errors), 21, done.stderr)
        self.assertEqual(errors[-1], "outbox-relay: and 5 more errors")

    def test_mistyped_words_are_usage_errors(self):
        path = self.write(self.good_config())
        for args, near in ((["--check-confg"], "--check-config"),
                           (["-c", path, "--check-confg"], "--check-config"),
                           (["--check-confg", "-c", path], "--check-config"),
                           (["-c", path, "--batchsize", "5", "--check-config"], "--batch-size"),
                           (["-c", path, "--pritn-config"], "--print-config"),
                           (["-c", path, "staus"], "status"),
                           (["-c", path, "dlq", "lst", "orders", "email"], "list"),
                           (["dlq", "lst", "orders", "email"], "list"),  # before the config
                           (["failed", "lsit"], "list"),
                           (["-c", path, "status", "--jsn"], "--json")):
            with self.subTest(args=args):
                done = run_relay(args)
                self.assertEqual(done.returncode, EX_USAGE, done.output)
                self.assertIn(f"did you mean {near}?", done.stderr)
        # A command's own arguments are bad usage too, checked before any
        # configuration is read (none is set here).
        for args, said in ((["dlq", "list", "orders", "email", "--count", "0"], "--count"),
                           (["dlq", "show", "orders", "email", "not-an-id"], "not an entry id"),
                           (["dlq", "migrate", "orders", "email", "extra"], "only"),
                           (["failed", "retry", "abc"], "not a row id"),
                           (["failed", "drop", "7", "-1"], "not a row id"),
                           (["failed", "list", "--limit", "x"], "unexpected")):
            with self.subTest(args=args):
                done = run_relay(args, env={"PATH": os.environ["PATH"]})
                self.assertEqual(done.returncode, EX_USAGE, done.output)
                self.assertIn(said, done.stderr)
                self.assertNotIn("is not set", done.stderr)
        done = run_relay(["-c", path, "--frobnicate"])
        self.assertEqual(done.returncode, EX_USAGE, done.output)
        self.assertIn("unknown option --frobnicate", done.stderr)
        self.assertNotIn("did you mean", done.stderr)
        self.assert_connected_nowhere()

    def test_each_command_explains_itself_without_a_configuration(self):
        # "<command> --help" prints that command's usage and succeeds, with no
        # configuration at all, as "--help" does for the daemon.
        for tool, said in (("dlq", "dlq list"), ("failed", "failed retry"),
                           ("status", "status [--json]")):
            for flag in ("--help", "-h"):
                with self.subTest(tool=tool, flag=flag):
                    done = run_relay([tool, flag], env={"PATH": os.environ["PATH"]})
                    self.assertEqual(done.returncode, 0, done.output)
                    self.assertIn(said, done.stdout)
                    self.assertEqual(done.stderr, "")
        self.assert_connected_nowhere()

    def test_print_config(self):
        path = self.write(self.good_config())
        env = harness.relay_env()  # one metrics_listen for both runs
        done = run_relay(["-c", path, "--print-config", "--batch-size", "42"], env=env)
        self.assertEqual(done.returncode, 0, done.output)
        self.assert_no_secret(done)
        self.assert_connected_nowhere()
        shown = dict(line.split(" = ", 1) for line in done.stdout.splitlines())
        for key in KEYS:
            self.assertIn(key, shown)
        self.assertEqual(shown["batch_size"], "42")
        self.assertEqual(shown["poll_interval"], "200ms")
        self.assertIn("password=***", shown["postgres"])
        self.assertIn("relay:***@", shown["redis"])
        # It reads back, and shows the same again.
        again = self.write(done.stdout, name="again.conf")
        redone = run_relay(["-c", again, "--print-config"], env=env)
        self.assertEqual(redone.returncode, 0, redone.output)
        self.assertEqual(redone.stdout, done.stdout)
        # A bad configuration: the errors, no dump.
        bad = run_relay(["-c", path, "--print-config", "--batch-size", "0"])
        self.assertEqual(bad.returncode, EX_CONFIG, bad.output)
        self.assertEqual(bad.stdout, "")

    def test_malformed_redis_url_hides_password(self):
        urls = ("redis://user:hunter2-secret@127.0.0.1:notaport/0",
                "redis://user:hunter2-secret@127.0.0.1:99999/0",
                "redis://:hunter2-secret@/0",
                "http://user:hunter2-secret@127.0.0.1:6379/0",
                "redis://user:hunter2-secret@127.0.0.1:6379/zero")
        path = self.write(self.good_config())
        for url in urls:
            with self.subTest(url=url):
                for how in ("flag", "env", "file"):
                    if how == "flag":
                        done = run_relay(["-c", path, "--check-config", "--redis", url])
                    elif how == "env":
                        done = run_relay(["-c", path, "--check-config"],
                                         env=harness.relay_env(extra={"OUTBOX_RELAY_REDIS": url}))
                    else:
                        text = re.sub(r"(?m)^redis = .*$", lambda m: f"redis = {url}",
                                      self.good_config())
                        bad = self.write(text, "bad.conf")
                        done = run_relay(["-c", bad])
                    self.assertEqual(done.returncode, EX_CONFIG, f"{how}: {done.output}")
                    self.assertIn("redis", done.stderr)
                    self.assert_no_secret(done)
        self.assert_connected_nowhere()

    def test_help_lists_every_key(self):
        done = run_relay(["--help"])
        self.assertEqual(done.returncode, 0, done.output)
        for key in KEYS:
            self.assertTrue(key in done.output or key.replace("_", "-") in done.output,
                            f"--help does not mention {key}")

    def test_version(self):
        done = run_relay(["--version"])
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn(project_version(), done.output)


class StartupTest(harness.TestCase):
    """The daemon against real servers, or none."""

    def test_environment_alone_is_enough(self):
        with harness.Postgres() as pg, harness.Redis() as redis:
            db = pg.connect()
            self.addCleanup(db.close)
            mid = insert(db, "orders", b"from env config")
            with harness.Relay(pg, redis, poll_interval="200ms") as relay:
                harness.wait_all_sent(db, timeout=30, relay=relay)
                self.assertIn(mid, harness.entries_by_message_id(redis.client()))
                self.assertEqual(relay.terminate(), 0, relay.log_tail())

    def test_keys_without_effect_logged_at_start(self):
        """A deployed file that still sets pipeline, dedup_ttl and max_attempts
        starts the relay as before: one WARNING per key at start, and the rows
        go out as they would without them."""
        conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
        self.addCleanup(os.unlink, conf.name)
        conf.write("pipeline = on\ndedup_ttl = 24h\nmax_attempts = 1\n")
        conf.close()
        with harness.Postgres() as pg, harness.Redis() as redis:
            db = pg.connect()
            self.addCleanup(db.close)
            with harness.Relay(pg, redis, args=("-c", conf.name), poll_interval="200ms") as relay:
                mids = [insert(db, "orders", b"row %d" % i) for i in range(5)]
                harness.wait_all_sent(db, timeout=30, relay=relay)
                found = harness.entries_by_message_id(redis.client())
                self.assertEqual([len(found.get(m, [])) for m in mids], [1] * 5)
                self.assertEqual(relay.terminate(), 0, relay.log_tail())
                log = relay.log()
            lines = harness.problem_lines(log, "config")
            print("\n".join(lines), flush=True)
            self.assertEqual(len(lines), 3, log)
            for key in ("pipeline", "dedup_ttl", "max_attempts"):
                self.assertEqual(
                    sum(1 for ln in lines
                        if re.search(rf" WARNING config: {key} no longer has an effect: .*"
                                     r"; remove it$", ln)), 1, f"{key}: {lines}")

    def test_unreachable_servers_at_start(self):
        pg_port, redis_port = harness.free_port(), harness.free_port()
        env = {
            "OUTBOX_RELAY_POSTGRES": f"host=127.0.0.1 port={pg_port} dbname=app user=postgres"
                                     f" password={PG_SECRET}",
            "OUTBOX_RELAY_REDIS": f"redis://:{REDIS_SECRET}@127.0.0.1:{redis_port}/0",
        }
        with harness.Relay(env=env, reconnect_min="50ms", reconnect_max="200ms",
                           connect_timeout="1s", poll_interval="200ms") as relay:
            time.sleep(3)  # about 15 connection attempts to each server at this backoff
            self.assertTrue(relay.alive(), "the relay gave up\n" + relay.log_tail())
            log = relay.log()
            for component in ("pg", "redis"):
                lines = harness.problem_lines(log, component)
                self.assertGreaterEqual(len(lines), 1, f"the {component} failure is logged\n{log}")
                # Once per connection: PostgreSQL has four (listen, owner and
                # two claiming), Redis one (and the observer's own, logged once).
                self.assertLessEqual(len(lines), 4 if component == "pg" else 3,
                                     f"{component} failure logged once per connection, not per"
                                     f" try:\n" + "\n".join(lines))
            with harness.Postgres(port=pg_port) as pg, \
                    harness.Redis(port=redis_port, password=REDIS_SECRET) as redis:
                db = pg.connect()
                self.addCleanup(db.close)
                mid = insert(db, "orders", b"after the servers came up")
                harness.wait_all_sent(db, timeout=30, relay=relay)
                self.assertIn(mid, harness.entries_by_message_id(redis.client()))
                self.assertEqual(relay.terminate(), 0, relay.log_tail())
            log = relay.log()
            self.assertNotIn(PG_SECRET, log)
            self.assertNotIn(REDIS_SECRET, log)

    def test_database_without_schema(self):
        with harness.Postgres(migrations=False) as pg, harness.Redis() as redis:
            with harness.Relay(pg, redis, poll_interval="200ms", reconnect_min="50ms",
                               reconnect_max="500ms") as relay:
                relay.wait_for_log(r"001_outbox_schema\.sql", timeout=15)
                time.sleep(1)  # a crash right after the message would show here
                code = relay.returncode
                if code is not None:
                    self.assertGreaterEqual(code, 0, "killed by a signal\n" + relay.log_tail())
                    self.assertNotIn(-code, CRASH_SIGNALS)
                    self.assertNotEqual(code, 0, "a missing schema is no clean exit")

    def test_schema_missing_the_newest_migration(self):
        # Every migration but the newest: the relay must not run on it, and
        # must name the file that is missing.
        with harness.Postgres(migrations=False) as pg, harness.Redis() as redis:
            files = pg.migration_files()
            newest = os.path.basename(files[-1])
            pg.apply_migrations(files[:-1])
            with harness.Relay(pg, redis, poll_interval="200ms", reconnect_min="50ms",
                               reconnect_max="500ms") as relay:
                line = relay.wait_for_log(r"ERROR pg: .*needs version.*$", timeout=15).group(0)
                print(f"without {newest}: {line}", flush=True)
                self.assertIn(newest, line)
                db = pg.connect()
                self.addCleanup(db.close)
                mid = insert(db, "orders", b"must wait for the schema")
                time.sleep(1)
                # outbox.unsent comes with the newest file: what reached
                # Redis is what tells.
                self.assertNotIn(mid, harness.entries_by_message_id(redis.client()),
                                 "published on an old schema")
                self.assertTrue(relay.alive(), relay.log_tail())
                pg.apply_migrations(files[-1:])
                harness.wait_all_sent(db, timeout=30, relay=relay)

    def old_schema_relay(self, pg, redis, applied):
        """A relay on a database with only the first `applied` migrations, for 4 s:
        (its log, /readyz's answer, status's output)."""
        pg.apply_migrations(pg.migration_files()[:applied])
        port = harness.free_port()
        with harness.Relay(pg, redis, poll_interval="200ms", reconnect_min="50ms",
                           reconnect_max="1s", log_level="debug",
                           metrics_listen=f"127.0.0.1:{port}") as relay:
            time.sleep(4)
            self.assertTrue(relay.alive(), "the relay gave up\n" + relay.log_tail())
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5):
                pass
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                    ready = (r.status, r.read().decode())
            except urllib.error.HTTPError as e:
                ready = (e.code, e.read().decode())
            log = relay.log()
        status = run_relay(["status"], env=harness.relay_env(pg, redis))
        return log, ready, status

    def assert_old_schema_reported(self, log, ready, status, version, file):
        # Each PostgreSQL connection (listen, owner, two claiming) says once
        # what to apply, and backs off: no raw SQL error, no quick loop.
        errors = [line for line in log.splitlines() if " ERROR pg: " in line]
        self.assertTrue(errors, "the old schema is logged\n" + log[-3000:])
        self.assertLessEqual(len(errors), 4, "logged once per connection:\n" + "\n".join(errors))
        for line in errors:
            self.assertIn(file, line)
            self.assertNotIn("does not exist", line)
        roles = {re.search(r"ERROR pg: (\w+) connection", line).group(1) for line in errors}
        self.assertEqual(roles, {"listen", "owner", "claim"}, "\n".join(errors))
        observed = [line for line in log.splitlines() if " observe: " in line and "PostgreSQL" in line]
        self.assertLessEqual(len(observed), 1, "the observer says it once:\n" + "\n".join(observed))
        for line in observed:
            self.assertIn(file, line)
        retries = [int(m) for m in re.findall(r"DEBUG pg: owner connection .* retrying in (\d+) ms",
                                              log)]
        self.assertLessEqual(len(retries), 10, f"the owner connection's retries in 4 s: {retries}")
        # /readyz and status name the version and the file.
        self.assertEqual(ready[0], 503, ready)
        self.assertIn(file, ready[1])
        self.assertIn(version, ready[1])
        self.assertIn("schema is behind", status.output)
        self.assertIn(file, status.output)
        self.assertIn(version, status.output)
        print(f"old schema: {len(errors)} ERROR lines, the owner's retries {retries} ms\n"
              f"{errors[0]}\n/readyz: {ready[1].strip()}\nstatus: "
              f"{status.output.strip()[:300]}", file=sys.stderr, flush=True)

    def test_old_schema_is_reported_once_per_connection(self):
        with harness.Postgres(migrations=False) as pg, harness.Redis() as redis:
            log, ready, status = self.old_schema_relay(pg, redis, 10)
        self.assert_old_schema_reported(log, ready, status, "version 10", "011_partitions.sql")

    def test_schema_before_its_version_table_names_004(self):
        with harness.Postgres(migrations=False) as pg, harness.Redis() as redis:
            log, ready, status = self.old_schema_relay(pg, redis, 3)
        self.assert_old_schema_reported(log, ready, status, "version 4", "004_schema_version.sql")
        self.assertNotIn("001_outbox_schema.sql", log)

    def test_passwords_never_logged(self):
        with harness.Postgres() as pg, harness.Redis(password=REDIS_SECRET) as redis:
            db = pg.connect()
            self.addCleanup(db.close)
            env = {"OUTBOX_RELAY_POSTGRES": pg.dsn() + f" password={PG_SECRET}"}
            with harness.Relay(pg, redis, env=env, log_level="debug", poll_interval="200ms",
                               reconnect_min="50ms", reconnect_max="500ms") as relay:
                insert(db, "orders", b"one")
                harness.wait_all_sent(db, timeout=30, relay=relay)
                mark = relay.mark()
                redis.stop()
                redis.start()
                relay.wait_for_log(harness.LOG_CONNECTED.format(component="redis"), since=mark,
                                   timeout=20)
                insert(db, "orders", b"two")
                harness.wait_all_sent(db, timeout=30, relay=relay)
                self.assertEqual(relay.terminate(), 0, relay.log_tail())
                log = relay.log()
            wrong = {"OUTBOX_RELAY_REDIS": f"redis://:wr0ng-pw-9@127.0.0.1:{redis.port}/0"}
            with harness.Relay(pg, env=wrong, log_level="debug", reconnect_min="50ms",
                               reconnect_max="200ms") as refused:
                wait_until(lambda: harness.problem_lines(refused.log(), "redis"), timeout=15,
                           relay=refused, message="the refused password in the log")
                refused_log = refused.log()
        for secret in (PG_SECRET, REDIS_SECRET):
            self.assertNotIn(secret, log, f"{secret} in the log")
        self.assertNotIn("wr0ng-pw-9", refused_log)


if __name__ == "__main__":
    unittest.main()
