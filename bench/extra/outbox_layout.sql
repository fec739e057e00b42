-- The outbox table of issue 40 (batches from snapshots), partitioned by the
-- writing transaction's id so that old rows go by dropping partitions, beside
-- the same table without what the relay adds, in a schema of its own
-- (layout_proto) that touches nothing of outbox.*. bench/extra/outbox_layout.py
-- measures the producers on both, the rotation under load and the batch query.
-- Idempotent:
--
--   psql -v ON_ERROR_STOP=1 -f bench/extra/outbox_layout.sql
--
--   layout_proto.plain      today's producer columns, PRIMARY KEY (id),
--                           UNIQUE (message_id), no trigger: the table
--                           without the relay's additions
--   layout_proto.full       the same columns + partition_no + txid, PARTITION
--                           BY RANGE (txid), PRIMARY KEY (txid, id), the
--                           wake-up trigger of migrations/007 and the
--                           partition_no trigger of migrations/012
--   layout_proto.parts      the partitions of full and their bounds [lo, hi)
--   layout_proto.rotate(w, k, how)  creates the partitions of width w up
--                           to k beyond the one the xid counter is in
--   layout_proto.due(x)     the partitions whose hi <= x, the xmin of the
--                           last finished tick; drop_done(x) drops them
--   layout_proto.batch_rows(...)  bench/extra/snapshot_cursor.sql's chunk
--                           query, on full; batch_rows_bounded the same
--                           with its second branch bounded, for pruning
--
-- Why the keys change: a unique constraint of a partitioned table must include
-- the partition key, so neither PRIMARY KEY (id) nor UNIQUE (message_id) can
-- stay global. full keeps PRIMARY KEY (txid, id), which is also the index the
-- batch query reads (snapshot_cursor.sql's messages_txid_idx): id stays unique
-- in practice (one identity sequence) but nothing enforces it, and message_id
-- is no longer unique at all.
--
-- Why the ranges are of transaction ids: a partition [lo, hi) can go once
-- the last finished tick's snapshot has xmin >= hi, for then every
-- transaction below hi has ended, each either aborted or in a published batch.
-- No scan decides it. The counter advances with every transaction of the
-- cluster that writes anything, not only the outbox's.

CREATE SCHEMA IF NOT EXISTS layout_proto;

CREATE TABLE IF NOT EXISTS layout_proto.plain (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    uuid        NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    topic         text        NOT NULL,
    partition_key text,
    payload       bytea       NOT NULL,
    headers       jsonb,
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS layout_proto.full (
    id            bigint      GENERATED ALWAYS AS IDENTITY,
    message_id    uuid        NOT NULL DEFAULT gen_random_uuid(),
    topic         text        NOT NULL,
    partition_key text,
    payload       bytea       NOT NULL,
    headers       jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    partition_no  integer,
    txid          xid8        NOT NULL DEFAULT pg_current_xact_id(),
    PRIMARY KEY (txid, id)
) PARTITION BY RANGE (txid);

-- The relay's two triggers, on full, with the functions the migrations
-- install (this file runs on a database that has them): the wake-up of
-- migrations/007, for which the producer pays one lock-table probe while a
-- relay holds advisory lock 122550254464888 and a NOTIFY otherwise; and the
-- partition_no of migrations/012, whose WHEN clause names the partitioned
-- topics as outbox.sync_partition_trigger writes it. One partitioned topic,
-- not the producers' ('bench'): the trigger exists, as it does wherever some
-- topic is partitioned, and costs the producers its WHEN clause.
SELECT outbox.set_partitions('orders', 8);

DROP TRIGGER IF EXISTS messages_notify ON layout_proto.full;
CREATE TRIGGER messages_notify
    AFTER INSERT ON layout_proto.full
    FOR EACH STATEMENT
    WHEN (pg_try_advisory_xact_lock_shared(122550254464888))
    EXECUTE FUNCTION outbox.notify_relay();

DROP TRIGGER IF EXISTS messages_partition ON layout_proto.full;
CREATE TRIGGER messages_partition
    BEFORE INSERT ON layout_proto.full
    FOR EACH ROW WHEN (NEW.topic IN ('orders'))
    EXECUTE FUNCTION outbox.set_partition_no();

-- The partitions of full with their bounds, from the catalog (no bookkeeping
-- table to keep in step): lo and hi are NULL for the DEFAULT partition.
CREATE OR REPLACE VIEW layout_proto.parts AS
SELECT c.relname::text AS name,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), $r$FROM \('(\d+)'\)$r$))[1]::xid8 AS lo,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), $r$TO \('(\d+)'\)$r$))[1]::xid8 AS hi
  FROM pg_inherits AS i
  JOIN pg_class AS c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'layout_proto.full'::regclass;

-- Creates partitions [n*w, (n+1)*w) from the highest bound there is (or from
-- the one the xid counter is in) until the one k beyond the counter's exists.
-- Reads the counter from a snapshot, so that it takes no transaction id when
-- there is nothing to create. how = 'create': CREATE TABLE ... PARTITION OF,
-- which takes an ACCESS EXCLUSIVE lock on full (and on its DEFAULT partition)
-- until commit; how = 'attach': CREATE TABLE (LIKE full), then ATTACH
-- PARTITION, which takes SHARE UPDATE EXCLUSIVE on full, a lock inserts do not
-- wait for (and ACCESS EXCLUSIVE on the DEFAULT partition, if any, which it
-- scans). A range that rows in the DEFAULT partition belong to cannot be
-- created either way (the DEFAULT partition's check refuses it): such a range
-- is skipped, left to DEFAULT, and counted in `skipped`.
CREATE OR REPLACE FUNCTION layout_proto.rotate(w bigint, k integer, how text DEFAULT 'create',
                                               OUT created integer, OUT skipped integer)
LANGUAGE plpgsql AS $$
DECLARE
    cur  bigint := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
    top  bigint := ((cur / w) + k + 1) * w;
    lo   bigint;
    name text;
BEGIN
    created := 0;
    skipped := 0;
    SELECT max(p.hi)::text::bigint INTO lo FROM layout_proto.parts AS p;
    lo := coalesce(lo, (cur / w) * w);
    WHILE lo < top LOOP
        name := 'full_' || lo;
        BEGIN
            IF how = 'attach' THEN
                EXECUTE format('CREATE TABLE layout_proto.%I (LIKE layout_proto.full)', name);
                EXECUTE format('ALTER TABLE layout_proto.full ATTACH PARTITION layout_proto.%I'
                               ' FOR VALUES FROM (%L) TO (%L)', name, lo, lo + w);
            ELSE
                EXECUTE format('CREATE TABLE layout_proto.%I PARTITION OF layout_proto.full'
                               ' FOR VALUES FROM (%L) TO (%L)', name, lo, lo + w);
            END IF;
            created := created + 1;
        EXCEPTION WHEN check_violation THEN
            skipped := skipped + 1;
        END;
        lo := lo + w;
    END LOOP;
END;
$$;

-- The partitions done with: every one whose upper bound is at or below xmin,
-- the xmin of the snapshot of the last tick whose batch every consumer has
-- published (and, in the relay, older than sent_retention), oldest first.
CREATE OR REPLACE FUNCTION layout_proto.due(xmin xid8) RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    SELECT p.name FROM layout_proto.parts AS p WHERE p.hi <= xmin ORDER BY p.hi
$$;

-- Drops them, in one transaction: DROP TABLE of a partition takes an ACCESS
-- EXCLUSIVE lock on full until commit. The other way, which inserts need not
-- wait for, is ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY and then
-- DROP TABLE, each a transaction of its own (so not in a function), and only
-- while full has no DEFAULT partition. Returns how many went.
CREATE OR REPLACE FUNCTION layout_proto.drop_done(xmin xid8) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    p text;
    n integer := 0;
BEGIN
    FOR p IN SELECT layout_proto.due(xmin) LOOP
        EXECUTE format('DROP TABLE layout_proto.%I', p);
        n := n + 1;
    END LOOP;
    RETURN n;
END;
$$;

-- bench/extra/snapshot_cursor.sql's cursor_proto.batch_rows, on full: one
-- chunk of a batch, up to n rows after (after_txid, after_id) in (txid, id)
-- order. Its range [b_lo, b_hi) lets the planner (or the executor, with a
-- generic plan) leave out the partitions outside it.
CREATE OR REPLACE FUNCTION layout_proto.batch_rows(b_lo xid8, b_hi xid8, b_older xid8[],
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
      FROM ((SELECT m.* FROM layout_proto.full AS m
              WHERE m.txid >= b_lo AND m.txid < b_hi
                AND (m.txid, m.id) > (after_txid, after_id)
                AND pg_visible_in_snapshot(m.txid, b_next)
                AND NOT pg_visible_in_snapshot(m.txid, b_prev)
              ORDER BY m.txid, m.id LIMIT n)
            UNION ALL
            (SELECT m.* FROM layout_proto.full AS m
              WHERE m.txid = ANY (b_older)
                AND (m.txid, m.id) > (after_txid, after_id)
              ORDER BY m.txid, m.id LIMIT n)) AS r
     ORDER BY r.txid, r.id
     LIMIT n
$$;

-- The same chunk, with the older transactions' branch bounded by the first and
-- last of them (batch_bounds lists them in order): `txid = ANY ($3)` alone
-- prunes nothing in a generic plan, which then probes every partition's index.
CREATE OR REPLACE FUNCTION layout_proto.batch_rows_bounded(b_lo xid8, b_hi xid8, b_older xid8[],
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
      FROM ((SELECT m.* FROM layout_proto.full AS m
              WHERE m.txid >= b_lo AND m.txid < b_hi
                AND (m.txid, m.id) > (after_txid, after_id)
                AND pg_visible_in_snapshot(m.txid, b_next)
                AND NOT pg_visible_in_snapshot(m.txid, b_prev)
              ORDER BY m.txid, m.id LIMIT n)
            UNION ALL
            (SELECT m.* FROM layout_proto.full AS m
              WHERE m.txid = ANY (b_older)
                AND m.txid >= b_older[1] AND m.txid <= b_older[cardinality(b_older)]
                AND (m.txid, m.id) > (after_txid, after_id)
              ORDER BY m.txid, m.id LIMIT n)) AS r
     ORDER BY r.txid, r.id
     LIMIT n
$$;
