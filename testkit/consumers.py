"""Helpers for the consumer tests: the consumer schema and the example consumer as a process.

    apply_consumer_schema(pg)  migrations/consumer/*.sql, then examples/email_schema.sql
    Consumer(pg, redis, ...)   outbox-email-consumer as a harness.Daemon (one log file,
                               kill(sig), terminate() -> exit code, wait_for_log, and any
                               sanitizer report in its output fails the test), plus
                               stats(): the final stats line
    dlq_entries / pending_count / effects / effect_count   figures for the checks
    xadd_message               a contract-shaped entry written directly with XADD
    relay_tool                 `outbox-relay dlq ...` (and other one-shot commands)

Only the standard library, psycopg2 and redis-py are used.
"""

import contextlib
import datetime
import glob
import os
import re
import sys
import uuid

import redis as redis_py

from . import harness

CONSUMER_MIGRATIONS_DIR = os.path.join(harness.SOURCE_DIR, "migrations", "consumer")
EMAIL_SCHEMA = os.path.join(harness.SOURCE_DIR, "examples", "email_schema.sql")

# "consumer NAME: delivered=1 done=1 retried=0 dead_lettered=0 malformed=0 lost=0 reclaimed=0"
STATS_LINE = re.compile(r"^consumer (\S+): ((?:\w+=\d+ ?)+)$", re.MULTILINE)
# "2026-11-30T11:35:14.123Z INFO consumer: ..."
LOG_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z (\w+) (\w+): (.*)$")


def consumer_binary():
    path = os.environ.get("OUTBOX_EMAIL_CONSUMER_BIN") or os.path.join(
        harness.SOURCE_DIR, "build", "outbox-email-consumer")
    return os.path.abspath(path)


def require_consumer():
    """Exits the test file with 77 (CTest: skipped) when the example consumer is not built."""
    path = consumer_binary()
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        print(f"SKIP: consumer binary {path} not found (build outbox-email-consumer, or set"
              " OUTBOX_EMAIL_CONSUMER_BIN)", file=sys.stderr)
        sys.exit(harness.SKIP)
    return path


def consumer_migration_files():
    files = sorted(glob.glob(os.path.join(CONSUMER_MIGRATIONS_DIR, "*.sql")))
    if not files:
        raise RuntimeError(f"no consumer migrations found in {CONSUMER_MIGRATIONS_DIR}")
    return files


def apply_consumer_schema(pg):
    """The consumer side in pg's database: schema outbox_consumer, then the emails table."""
    pg.apply_migrations(consumer_migration_files() + [EMAIL_SCHEMA])


def reset_effects(conn):
    """Empties the consumer's tables (the emails and the processed records)."""
    with conn.cursor() as cur:
        cur.execute("TRUNCATE emails, outbox_consumer.processed RESTART IDENTITY")
    if not conn.autocommit:
        conn.commit()


class ConsumerTestCase(harness.ServerTestCase):
    """Servers with the consumer schema, and no effect left from the test before."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        apply_consumer_schema(cls.pg)

    def setUp(self):
        super().setUp()
        reset_effects(self.db)


def parse_log_time(text):
    """'2026-11-30T11:35:14.123' -> seconds since the epoch (float, UTC)."""
    dt = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f").replace(
        tzinfo=datetime.timezone.utc)
    return dt.timestamp()


def log_events(text, regex):
    """[(epoch seconds, match)] for every log line whose message matches regex."""
    pattern = re.compile(regex)
    events = []
    for line in text.splitlines():
        m = LOG_STAMP.match(line)
        if not m:
            continue
        found = pattern.search(m.group(4))
        if found:
            events.append((parse_log_time(m.group(1)), found))
    return events


class Consumer(harness.Daemon):
    """outbox-email-consumer on the given servers, as a context manager (see harness.Daemon).

    Consumer(pg, redis, consumer="c1", backoff="200ms,400ms", max_deliveries=4,
             block="100ms", group="email", stream="orders", fail_rate=0.1)
    None leaves a flag out (the program's default). Its stdout and stderr go to
    one file, removed on exit (read stats() and log() before); on exit it gets
    SIGTERM (then SIGKILL), and a sanitizer report in its output fails the test.
    """

    def __init__(self, pg, redis, consumer=None, group=None, stream=None, backoff=None,
                 max_deliveries=None, block=None, fail_rate=None, log_level=None, args=(),
                 redis_url=None, stop_timeout=20):
        self.binary = require_consumer()
        self.name = consumer
        self.group = group or "email"
        self.stream = stream or "orders"
        flags = {"redis": redis_url or redis.url("outbox-consumer"), "postgres": pg.dsn(), "stream": stream,
                 "group": group, "consumer": consumer, "backoff": backoff,
                 "max_deliveries": max_deliveries, "block": block, "fail_rate": fail_rate,
                 "log_level": log_level}
        argv = [self.binary, *args,
                *harness.flag_args({k: v for k, v in flags.items() if v is not None})]
        # No PG* or OUTBOX_RELAY_* variables of ours, and plain log lines with times.
        env = harness.relay_env(extra={"JOURNAL_STREAM": None})
        super().__init__(argv, env, f"consumer {consumer or 'x'}", stop_timeout=stop_timeout)

    def stats(self):
        """The final stats line as {name: int} (with "consumer": its name), or None."""
        matches = list(STATS_LINE.finditer(self.log()))
        if not matches:
            return None
        m = matches[-1]
        stats = {"consumer": m.group(1)}
        for pair in m.group(2).split():
            key, value = pair.split("=")
            stats[key] = int(value)
        return stats


# --------------------------------------------------------------------------
# Redis and PostgreSQL figures.

def dlq_name(stream="orders", group="email"):
    return f"{{{stream}}}.{group}.dlq"


def dlq_entries(redis_client, stream="orders", group="email"):
    """[(entry_id, {field: value})] of the dead-letter stream (bytes fields)."""
    return harness.stream_entries(redis_client, dlq_name(stream, group))


def pending_count(redis_client, stream="orders", group="email"):
    """Entries delivered to the group and not acknowledged (0 without the group)."""
    try:
        return redis_client.xpending(stream, group)["pending"]
    except redis_py.exceptions.ResponseError:
        return 0


def effects(conn, consumer="email"):
    """(rows, distinct message ids) of emails for one consumer group."""
    with conn.cursor() as cur:
        cur.execute("SELECT count(*), count(DISTINCT message_id) FROM emails WHERE consumer = %s",
                    (consumer,))
        return tuple(cur.fetchone())


def effect_count(conn, message_id, consumer="email"):
    return harness.scalar(conn, "SELECT count(*) FROM emails WHERE message_id = %s"
                                " AND consumer = %s", (message_id, consumer))


def xadd_message(redis_client, stream="orders", payload=b"{}", message_id=None, topic=None,
                 key=None, headers=None, outbox_id=1, created_at=None):
    """XADDs a contract-shaped entry (as the relay writes it); returns (entry_id, message_id)."""
    message_id = message_id or str(uuid.uuid4())
    created_at = created_at or datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")
    fields = {"id": message_id, "topic": topic or stream}
    if key is not None:
        fields["key"] = key
    fields["payload"] = payload
    fields["created_at"] = created_at
    fields["outbox_id"] = str(outbox_id)
    for name, value in (headers or {}).items():
        fields["h." + name] = value
    entry_id = redis_client.xadd(stream, fields)
    return entry_id.decode(), message_id


def relay_tool(args, redis=None, pg=None, timeout=30):
    """Runs `outbox-relay ARGS...` once (dlq list|show|replay|purge...) -> harness.Completed."""
    return harness.run_relay(list(args), env=harness.relay_env(pg, redis), timeout=timeout)


@contextlib.contextmanager
def table_locked(pg, table="emails", mode="EXCLUSIVE"):
    """Holds LOCK TABLE ... IN mode MODE from its own connection while the block runs."""
    conn = pg.connect(autocommit=False)
    try:
        with conn.cursor() as cur:
            cur.execute(f"LOCK TABLE {table} IN {mode} MODE")
        yield conn
    finally:
        with contextlib.suppress(Exception):
            conn.rollback()
        conn.close()
