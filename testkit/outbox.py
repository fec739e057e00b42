"""Rows and streams: outbox rows written and counted, the relay's dedup records,
and the entries of the streams it publishes to."""

import datetime

import psycopg2
import psycopg2.extras

from .common import wait_until

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


def small_partitions(conn, width=1000, ahead=2):
    """Gives the (empty) outbox table small partitions: one below the
    transaction counter's, from 0, then partitions of width transaction ids
    from base, the counter rounded down to width, instead of the 2^20 a
    database starts with, so that a test sees rows fill partitions and the
    relay drop them (outbox.rotate; the relay makes its own above these).
    Returns base."""
    with conn.cursor() as cur:
        cur.execute("SELECT part::text FROM outbox.message_partitions() WHERE lo IS NOT NULL")
        for (part,) in cur.fetchall():
            cur.execute(f"DROP TABLE {part}")
        cur.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        base = cur.fetchone()[0] // width * width
        if base > 0:
            cur.execute("CREATE TABLE outbox.messages_0 (LIKE outbox.messages INCLUDING DEFAULTS)")
            cur.execute(f"ALTER TABLE outbox.messages ATTACH PARTITION outbox.messages_0"
                        f" FOR VALUES FROM ('0') TO ('{base}')")
        cur.execute("SELECT outbox.rotate_create(%s, %s)", (width, ahead))
    if not conn.autocommit:
        conn.commit()
    return base


def traffic(conn, ids=None):
    """A row of topic 'later', as traffic would bring (its message_id added to
    ids, when given): each batch of the relay's lead moves the streams that
    follow it (every 2 s), so that no idle stream's position holds a partition
    of the outbox back. True, for use inside a wait's condition."""
    message_id = insert(conn, "later", b"traffic")
    if ids is not None:
        ids.append(message_id)
    return True


def burn_xids(conn, n):
    """Commits n empty transactions that each take a transaction id, so that
    the counter passes the bounds of small partitions."""
    with conn.cursor() as cur:
        cur.execute("CREATE OR REPLACE PROCEDURE pg_temp.burn(n integer) LANGUAGE plpgsql AS"
                    " $$ BEGIN FOR i IN 1..n LOOP PERFORM pg_current_xact_id(); COMMIT;"
                    " END LOOP; END $$")
        cur.execute("CALL pg_temp.burn(%s)", (n,))


def partitions(conn):
    """The outbox table's ranged partitions, as (lo, hi) pairs in order."""
    with conn.cursor() as cur:
        cur.execute("SELECT lo::text::bigint, hi::text::bigint FROM outbox.message_partitions()"
                    " WHERE lo IS NOT NULL ORDER BY lo")
        return cur.fetchall()


def scalar(conn, sql, args=None):
    with conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchone()[0]


SENT = ("NOT EXISTS (SELECT FROM outbox.unsent AS u WHERE u.id = m.id)"
        " AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id)")


def count_sent(conn, where="TRUE", args=None):
    """Rows in their stream (past its recorded position, not quarantined) that
    match where, a condition on outbox.messages AS m."""
    return scalar(conn, f"SELECT count(*) FROM outbox.messages AS m WHERE ({where}) AND {SENT}",
                  args)


def count_unsent(conn):
    """Rows not yet sent and not quarantined."""
    return scalar(conn, "SELECT count(*) FROM outbox.unsent")


def wait_all_sent(conn, timeout=30, relay=None):
    """Waits until every row is sent (or quarantined)."""
    wait_until(lambda: count_unsent(conn) == 0, timeout=timeout, interval=0.1, relay=relay,
               message="every outbox row to be sent")


def reset(pg_conn, redis_client=None):
    """Empties the outbox and Redis between tests (the relay's function stays loaded)."""
    with pg_conn.cursor() as cur:
        cur.execute("TRUNCATE outbox.messages RESTART IDENTITY; TRUNCATE outbox.topics;"
                    " TRUNCATE outbox.quarantine, outbox.stream_positions, outbox.ticks;"
                    " INSERT INTO outbox.ticks (tick_id, snap, ms)"
                    " VALUES (1, pg_current_snapshot(), 1);"
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
