-- The prototype of "batches from snapshots, and a fenced cursor that moves with
-- the entries", in a schema of its own (cursor_proto) beside outbox.*, which it
-- does not touch. bench/extra/snapshot_cursor.c is its relay loop,
-- bench/extra/snapshot_cursor.lua its Redis function, and
-- bench/extra/snapshot_cursor.py and snapshot_cursor_check.py measure and check
-- it. Idempotent, like the migrations:
--
--   psql -v ON_ERROR_STOP=1 -f bench/extra/snapshot_cursor.sql
--   SELECT cursor_proto.register('bench');   -- once, before the first row
--
-- Producers only append; the relay only reads the outbox:
--   * every row carries the id of the transaction that wrote it (txid, an xid8
--     defaulting to pg_current_xact_id());
--   * the relay records ticks, each a snapshot (pg_current_snapshot()), in
--     cursor_proto.ticks, numbered 1, 2, 3, ... in the order of their snapshots;
--   * the batch of tick k is every row whose transaction is visible in tick k's
--     snapshot and not in tick k-1's: the transactions that committed between
--     the two. It is fixed once tick k exists, the same after any crash and for
--     any reader, and a transaction still open (however old) is simply not in it
--     yet: it joins the batch of the first tick taken after its commit;
--   * a batch is read in (txid, id) order, in chunks that each resume after the
--     last (txid, id) read, so that no chunk holds a transaction open;
--   * a batch is marked done with one row per stream it touched
--     (cursor_proto.positions) and the consumer's last tick (cursor_proto.state):
--     no UPDATE or DELETE of an outbox row. Old rows would go by partition
--     rotation (not prototyped).
--
-- Left out of outbox.messages here: sent_at, attempts, last_error, retry_at,
-- failed_at and partition_no. Nothing updates a row, so a row that cannot be
-- published (too large, a bad topic) needs another home (a skip list of its
-- own), which the prototype does not have.

CREATE SCHEMA IF NOT EXISTS cursor_proto;

CREATE TABLE IF NOT EXISTS cursor_proto.messages (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    uuid        NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    topic         text        NOT NULL,
    partition_key text,
    payload       bytea       NOT NULL,
    headers       jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- The writing transaction: what places the row in a batch.
    txid          xid8        NOT NULL DEFAULT pg_current_xact_id()
);

-- The batch query reads a range of transaction ids and a list of them, and
-- returns rows in (txid, id) order: this index serves both without a sort, so a
-- chunk of a batch costs O(chunk) whatever the table holds.
CREATE INDEX IF NOT EXISTS messages_txid_idx ON cursor_proto.messages (txid, id);

CREATE TABLE IF NOT EXISTS cursor_proto.ticks (
    tick_id  bigint      PRIMARY KEY,
    snap     pg_snapshot NOT NULL,
    -- The tick's time in Unix ms, strictly increasing from tick to tick: with
    -- bench-cursor --publish ids, the ms part of its batch's entry ids.
    ms       bigint      NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The consumer's last tick whose batch is fully published.
CREATE TABLE IF NOT EXISTS cursor_proto.state (
    name      text   PRIMARY KEY,
    last_tick bigint NOT NULL
);

-- Where each stream's cursor in Redis stood at the end of the last batch that
-- touched it: "<tick>:<txid>:<id>" in Redis, these three columns here. Redis's
-- cursor is the truth; this row only lets a relay that starts expect the right
-- value at once (a wrong expectation costs one refused call, which returns it).
CREATE TABLE IF NOT EXISTS cursor_proto.positions (
    stream  text   PRIMARY KEY,
    tick    bigint NOT NULL,
    txid    xid8   NOT NULL,
    id      bigint NOT NULL
);

-- Takes a tick if anything committed since the last one; returns the last
-- tick's number either way. Ticks are taken one at a time (the table lock, which
-- readers do not wait for), and the snapshot is read after the lock is held, so
-- tick numbers follow snapshot order even with several relays ticking: without
-- that, a tick with the higher number but the older snapshot would make the
-- next batch repeat transactions of the one before. A tick when nothing
-- committed is skipped, so an idle relay writes nothing (the check is one
-- probe of messages_txid_idx above the last tick's xmax, and one for the
-- transactions that were running then).
CREATE OR REPLACE FUNCTION cursor_proto.tick() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    last_id   bigint;
    last_snap pg_snapshot;
    last_ms   bigint;
BEGIN
    LOCK TABLE cursor_proto.ticks IN SHARE ROW EXCLUSIVE MODE;
    SELECT t.tick_id, t.snap, t.ms INTO last_id, last_snap, last_ms
      FROM cursor_proto.ticks AS t ORDER BY t.tick_id DESC LIMIT 1;
    IF last_id IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM cursor_proto.messages AS m
                        WHERE m.txid >= pg_snapshot_xmax(last_snap))
       AND NOT EXISTS (SELECT 1 FROM cursor_proto.messages AS m
                        WHERE m.txid = ANY (ARRAY(SELECT pg_snapshot_xip(last_snap)))) THEN
        RETURN last_id;
    END IF;
    last_id := coalesce(last_id, 0) + 1;
    INSERT INTO cursor_proto.ticks (tick_id, snap, ms)
        VALUES (last_id, pg_current_snapshot(),
                greatest(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint,
                         coalesce(last_ms, 0) + 1));
    RETURN last_id;
END;
$$;

-- A consumer starts at the tick taken now: rows committed after it are its own.
CREATE OR REPLACE FUNCTION cursor_proto.register(consumer text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    t bigint := cursor_proto.tick();
BEGIN
    INSERT INTO cursor_proto.state (name, last_tick) VALUES (consumer, t)
        ON CONFLICT (name) DO NOTHING;
    RETURN (SELECT s.last_tick FROM cursor_proto.state AS s WHERE s.name = consumer);
END;
$$;

-- The bounds of the batch of tick next_tick (prev_tick = next_tick - 1), as
-- pgq.batch_event_sql draws them: the transactions that started after the
-- earlier snapshot are a range, [lo, hi) = [xmax of prev, xmax of next),
-- filtered by visibility; those that were running at the earlier snapshot and
-- committed by the later one are few, listed in older. Reading only these
-- keeps a batch from scanning everything above the oldest open transaction.
CREATE OR REPLACE FUNCTION cursor_proto.batch_bounds(prev_tick bigint, next_tick bigint,
    OUT lo xid8, OUT hi xid8, OUT older xid8[], OUT prev_snap pg_snapshot,
    OUT next_snap pg_snapshot, OUT next_ms bigint)
LANGUAGE sql STABLE AS $$
    SELECT pg_snapshot_xmax(p.snap), pg_snapshot_xmax(n.snap),
           ARRAY(SELECT x FROM pg_snapshot_xip(p.snap) AS x
                  WHERE pg_visible_in_snapshot(x, n.snap) ORDER BY x),
           p.snap, n.snap, n.ms
      FROM cursor_proto.ticks AS p, cursor_proto.ticks AS n
     WHERE p.tick_id = prev_tick AND n.tick_id = next_tick
$$;

-- One chunk of a batch: up to n rows after (after_txid, after_id), in (txid,
-- id) order, with the entry's fields formatted as the relay formats them
-- (relay/pgsrc.c): created_at as RFC 3339 UTC with microseconds, and headers
-- as one text of netstrings, "<len>:<name><len>:<value>..." sorted by name
-- (string values verbatim, others as JSON text; NULL when there are none). Two
-- index scans of messages_txid_idx, each already in order, merged: the range
-- of new transactions, and the older ones listed.
CREATE OR REPLACE FUNCTION cursor_proto.batch_rows(b_lo xid8, b_hi xid8, b_older xid8[],
    b_prev pg_snapshot, b_next pg_snapshot, after_txid xid8, after_id bigint, n integer)
RETURNS TABLE (txid xid8, id bigint, message_id text, topic text, partition_key text,
               payload bytea, created_at text, headers text)
LANGUAGE sql STABLE AS $$
    SELECT r.txid, r.id, r.message_id::text, r.topic, r.partition_key, r.payload,
           to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
           CASE WHEN jsonb_typeof(r.headers) = 'object' THEN
               (SELECT string_agg(octet_length(k) || ':' || k || octet_length(v) || ':' || v, '' ORDER BY k)
                  FROM (SELECT h.key AS k,
                               CASE WHEN jsonb_typeof(h.value) = 'string' THEN h.value #>> '{}'
                                    ELSE h.value::text END AS v
                          FROM jsonb_each(r.headers) AS h) AS hv)
           END
      FROM ((SELECT m.* FROM cursor_proto.messages AS m
              WHERE m.txid >= b_lo AND m.txid < b_hi
                AND (m.txid, m.id) > (after_txid, after_id)
                AND pg_visible_in_snapshot(m.txid, b_next)
                AND NOT pg_visible_in_snapshot(m.txid, b_prev)
              ORDER BY m.txid, m.id LIMIT n)
            UNION ALL
            (SELECT m.* FROM cursor_proto.messages AS m
              WHERE m.txid = ANY (b_older)
                AND (m.txid, m.id) > (after_txid, after_id)
              ORDER BY m.txid, m.id LIMIT n)) AS r
     ORDER BY r.txid, r.id
     LIMIT n
$$;

-- A batch is done: each stream it touched records where its cursor now stands
-- (in the batch's tick, or in a later one when another relay was found ahead),
-- never moving back, since another relay may have recorded a later batch; the
-- consumer's last tick moves to the batch's tick; and the next tick is taken:
-- one transaction, one commit. Streams are locked in name order, so two relays
-- finishing at once cannot deadlock. Returns the consumer's last tick (higher
-- than done_tick when another relay got further) and the latest tick.
CREATE OR REPLACE FUNCTION cursor_proto.finish_batch(consumer text, done_tick bigint,
    streams text[], ticks bigint[], txids xid8[], ids bigint[], OUT last_tick bigint,
    OUT latest_tick bigint)
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO cursor_proto.positions AS p (stream, tick, txid, id)
        SELECT s, t, x, i FROM unnest(streams, ticks, txids, ids) AS u(s, t, x, i) ORDER BY s
        ON CONFLICT (stream) DO UPDATE SET tick = excluded.tick, txid = excluded.txid,
                                           id = excluded.id
        WHERE (p.tick, p.txid, p.id) < (excluded.tick, excluded.txid, excluded.id);
    UPDATE cursor_proto.state AS s SET last_tick = greatest(s.last_tick, done_tick)
     WHERE s.name = consumer RETURNING s.last_tick INTO last_tick;
    latest_tick := cursor_proto.tick();
END;
$$;
