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

This module is the one namespace the tests use (harness.Relay,
harness.wait_until, ...): it holds the test-case bases and names what the
other modules of the package define:

    common     SOURCE_DIR, free ports, wait_until, run_command, spawn_listening
    cleanup    what is stopped at exit, on a signal or the deadline; kept logs
    postgres   Postgres, PgBouncer
    redis_server  Redis, RedisCluster, Sentinel
    tls        a throwaway CA and certificates, Stunnel
    relay      the daemon's binary and environment, run_relay, Daemon, Relay,
               its /metrics and log lines
    outbox     rows and streams: insert, scalar, stream_entries, dedup records
    producers  Producer, Producers
    verify     Verifier and its Figures

Only the standard library, psycopg2 and redis-py (Debian's python3-psycopg2
and python3-redis) are used. Run the files with /usr/bin/python3 and the
repository root on PYTHONPATH (see testkit/__init__.py).
"""

import datetime
import re
import unittest

# Names re-exported from the other modules, for harness.<name>.
from .cleanup import (LOG_DIR, keep_log, keep_secret, keep_text,  # noqa: F401
                      register, set_deadline, stop_on_signal, unregister)
from .common import (SKIP, SOURCE_DIR, free_port, http_get, port_open,  # noqa: F401
                     reserve_port, run_command, spawn_listening, tail, temp_dir, wait_until)
from .outbox import (all_entries, burn_xids, count_sent, count_unsent,  # noqa: F401
                     dedup_records, entries_by_message_id, insert, insert_many,
                     max_sent_within, partitions, publish_calls, reset, scalar,
                     small_partitions, stream_entries, stream_names, traffic,
                     unretired_dedup_records, wait_all_sent)
from .postgres import MIGRATIONS_DIR, PgBouncer, Postgres, pg_bindir  # noqa: F401
from .producers import Producer, Producers, connection_trouble  # noqa: F401
from .redis_server import (ACL_USERS, REDIS_SERVER, ClusterReader, Redis,  # noqa: F401
                           RedisCluster, Sentinel, redis_on_port, redis_server_binary,
                           wait_replica_synced)
from .relay import (LOG_CONNECTED, LOG_PROBLEM, SANITIZER_MARKERS, VALGRIND,  # noqa: F401
                    Completed, Daemon, Relay, flag_args, metric, metrics_text,
                    problem_lines, relay_binary, relay_env, require_relay, run_relay,
                    sanitizer_report)
from .tls import Stunnel, make_ca, make_cert  # noqa: F401
from .verify import Figures, Verifier, duplicate_detail  # noqa: F401


# --------------------------------------------------------------------------
# Test-case bases.

class TestCase(unittest.TestCase):
    """Lets a SIGTERM/SIGINT/deadline stop the run cleanly (cleanups still run)."""

    def run(self, result=None):
        if result is not None:
            stop_on_signal(result)
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


def quarantine_row(conn, topic, payload=b"x", error="quarantined by the test", key=None,
                   created_at=None):
    """A row in outbox.messages and its copy in outbox.quarantine, as the relay's
    outbox.record_batch leaves a row it could not publish. Returns its id."""
    with conn.cursor() as cur:
        cur.execute("WITH m AS (INSERT INTO outbox.messages (topic, partition_key, payload,"
                    "  created_at) VALUES (%s, %s, %s, coalesce(%s, now())) RETURNING *)"
                    " INSERT INTO outbox.quarantine (id, txid, message_id, topic, partition_key,"
                    "  payload, headers, created_at, error)"
                    " SELECT id, txid, message_id, topic, partition_key, payload, headers,"
                    "  created_at, %s FROM m RETURNING id",
                    (topic, key, payload, created_at, error))
        return cur.fetchone()[0]


def mark_published(conn, topic):
    """Records every stream of topic as past every row committed so far, as
    another relay that published them would (a tick, then the streams'
    positions at it): the rows leave outbox.unsent without this test's relay."""
    with conn.cursor() as cur:
        cur.execute("SELECT outbox.tick()")
        tick = cur.fetchone()[0]
        cur.execute("INSERT INTO outbox.stream_positions (topic, partition, tick)"
                    " SELECT DISTINCT topic, coalesce(partition_no, -1), %s FROM outbox.messages"
                    " WHERE topic = %s"
                    " ON CONFLICT (topic, partition) DO UPDATE SET tick = excluded.tick"
                    " WHERE outbox.stream_positions.tick < excluded.tick",
                    (tick, topic))


# --------------------------------------------------------------------------
# Rows as the batch design records them: a row is sent once its stream's
# recorded position has passed it (it is in outbox.unsent no more) and it is
# not quarantined; a row that can never be published is in outbox.quarantine
# with the error that says why.

def unsent_ids(conn):
    """The ids of the rows in outbox.unsent, sorted."""
    with conn.cursor() as cur:
        cur.execute("SELECT id FROM outbox.unsent ORDER BY id")
        return [r[0] for r in cur.fetchall()]


def is_sent(conn, row_id):
    """Whether row row_id (the bigint id) is in its stream: not in
    outbox.unsent and not quarantined."""
    return scalar(conn, "SELECT EXISTS (SELECT FROM outbox.messages AS m WHERE m.id = %s)"
                        " AND NOT EXISTS (SELECT FROM outbox.unsent AS u WHERE u.id = %s)"
                        " AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = %s)",
                  (row_id, row_id, row_id))


def sent_message_ids(conn):
    """The message_id (text) of every row that is sent: past its stream's
    recorded position and not quarantined."""
    with conn.cursor() as cur:
        cur.execute("SELECT m.message_id::text FROM outbox.messages AS m"
                    " WHERE NOT EXISTS (SELECT FROM outbox.unsent AS u WHERE u.id = m.id)"
                    "   AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id)")
        return {r[0] for r in cur.fetchall()}


def quarantined(conn):
    """{message_id text: error} of the rows in outbox.quarantine."""
    with conn.cursor() as cur:
        cur.execute("SELECT message_id::text, error FROM outbox.quarantine")
        return dict(cur.fetchall())


def index_reads(conn, index):
    """(idx_scan, idx_tup_read) of an index of the outbox, e.g. 'messages_txid_idx':
    of a partitioned index, the sums over its partitions' indexes."""
    with conn.cursor() as cur:
        cur.execute("SELECT coalesce(sum(idx_scan), 0)::bigint,"
                    " coalesce(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes WHERE indexrelid IN"
                    " (SELECT relid FROM pg_partition_tree(%s::regclass))", ("outbox." + index,))
        return tuple(cur.fetchone())


def index_names(conn, index):
    """The names of an index of the outbox and of its partitions' indexes, as
    plans show them (outbox.messages is partitioned: a plan names the index
    of each partition it reads)."""
    with conn.cursor() as cur:
        cur.execute("SELECT c.relname FROM pg_partition_tree(%s::regclass) AS t"
                    " JOIN pg_class AS c ON c.oid = t.relid", ("outbox." + index,))
        return [r[0] for r in cur.fetchall()]


def plan_uses_index(conn, plan, index):
    """Whether a plan's text reads an index of the outbox or one of its partitions'."""
    return any(re.search(r"\b%s\b" % re.escape(n), plan) for n in index_names(conn, index))


def plan_scans_rows(conn, plan):
    """The partitions of outbox.messages that hold rows and that a plan's text
    reads whole (a sequential scan of an empty partition costs nothing)."""
    with conn.cursor() as cur:
        cur.execute("SELECT part::text FROM outbox.message_partitions()")
        parts = [r[0] for r in cur.fetchall()]
        full = []
        for part in parts:
            cur.execute(f"SELECT EXISTS (SELECT FROM {part})")
            name = part.split(".")[-1]
            if cur.fetchone()[0] and re.search(r"Seq Scan on %s\b" % re.escape(name), plan):
                full.append(name)
        return full
