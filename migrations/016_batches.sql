-- outbox-relay schema, part 16: batches from snapshots (docs/DESIGN.md,
-- "Batches from snapshots").
--
-- Every row records the transaction that wrote it, and the relay records
-- ticks, each a snapshot of which transactions had committed. The batch of
-- tick k is every row whose transaction tick k sees as committed and tick
-- k - 1 does not: the transactions that committed between the two. A batch is
-- fixed once its tick exists, the same for every reader and after any crash,
-- and a transaction still open, however old, is in none yet: it joins the
-- batch of the first tick taken after it commits. Producers only append and
-- the relay only reads the outbox: where each stream stands is one row per
-- stream (outbox.stream_positions), written once per batch.
--
--   outbox.messages.txid        the writing transaction (pg_current_xact_id())
--   messages_txid_idx           (txid, id): a batch's bounds, and the tick's
--                               test for anything new, off one index
--   outbox.ticks                the ticks: number, snapshot, and the time
--                               part of the entry ids of the tick's batch
--   outbox.tick(min_ms)         takes a tick if anything committed since the
--                               last one; returns the latest tick either way
--   outbox.batch_bounds(...)    the lowest and highest row id of a batch
--   outbox.batch_rows(...)      a chunk of the batch between two ticks
--   outbox.stream_positions     per stream: the last tick whose batch is all
--                               in the stream, and its last entry id there
--   outbox.quarantine           rows the relay could not publish, and why
--   outbox.record_batch(...)    a published batch's positions and quarantine
--
-- Rows that were pending when this file was applied belong to its own
-- transaction, so they form the batch of the first tick after it, in id
-- order; rows sent before it, and quarantined ones, carry txid 3, which every
-- snapshot sees as committed long ago, so no batch holds them.
--
-- Stop every relay before applying this file, and start relays of this
-- version after it: a relay of an earlier version marks rows sent, which no
-- longer takes a row out of its batch.
--
-- One transaction (BEGIN ... COMMIT below), idempotent like every file here.

BEGIN;

CREATE TABLE IF NOT EXISTS outbox.ticks (
    tick_id  bigint      PRIMARY KEY,
    snap     pg_snapshot NOT NULL,
    -- The time part of the entry ids of the tick's batch, in Unix ms:
    -- strictly increasing from tick to tick whatever the clock does.
    ms       bigint      NOT NULL CHECK (ms > 0),
    taken_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

COMMENT ON TABLE outbox.ticks IS
    'Snapshots the relay took; the batch of tick k is the rows committed between tick k-1 and tick k.';

CREATE TABLE IF NOT EXISTS outbox.stream_positions (
    -- The stream: a topic, and its partition in a partitioned topic (-1 for
    -- a topic of one partition). Topic '' is the relays' lead: the last tick
    -- whose batch is published for every stream.
    topic      text        NOT NULL,
    partition  integer     NOT NULL DEFAULT -1,
    -- The last tick whose batch is all in the stream.
    tick       bigint      NOT NULL,
    -- The stream's last entry id written by the relay ("<ms>-<seq>"), or
    -- '0-0' when none: a Redis that comes back behind it lost entries.
    entry_id   text        NOT NULL DEFAULT '0-0',
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
);

COMMENT ON TABLE outbox.stream_positions IS
    'Where each stream stands: the last tick whose batch is all in the stream.';

-- The transactions from p_from on that snapshot p_snap shows as finished,
-- as runs of transaction ids: each row (after, before) is the open interval
-- between two transactions p_snap shows as running (the first run begins
-- just below p_from, the last ends at the snapshot's xmax). A range
-- condition "txid > after AND txid < before" on messages_txid_idx then reads
-- the entries of finished transactions only: those of one still running,
-- however many, are never walked.
CREATE OR REPLACE FUNCTION outbox.finished_runs(p_from xid8, p_snap pg_snapshot)
RETURNS TABLE (after xid8, before xid8)
LANGUAGE sql
IMMUTABLE
ROWS 4
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.x, coalesce(lead(c.x) OVER (ORDER BY c.x), pg_snapshot_xmax(p_snap))
      FROM (SELECT ((p_from::text::numeric - 1)::text)::xid8 AS x
            UNION ALL
            SELECT x FROM pg_snapshot_xip(p_snap) AS x
             WHERE x >= p_from AND x < pg_snapshot_xmax(p_snap)) AS c
$$;

COMMENT ON FUNCTION outbox.finished_runs(xid8, pg_snapshot) IS
    'Runs of transaction ids from p_from on that a snapshot shows as finished: open intervals (after, before).';

-- Takes a tick if anything committed since the last one, and returns the
-- latest tick's number either way (0 for none). Ticks are taken one at a time
-- (a lock that readers of the table do not wait for), and the snapshot is
-- read once the lock is held, so tick numbers follow snapshot order even with
-- several relays ticking: a higher number with an older snapshot would make
-- the next batch repeat transactions of the one before. Nothing new is a few
-- probes of messages_txid_idx: no row of a transaction that finished since
-- the last tick, whether it began after that tick's xmax or was running at
-- it. A transaction still running is never looked into (its entries are
-- skipped by the ranges, not read and filtered), so a long one that writes
-- many rows costs each poll nothing until it commits. min_ms raises the
-- tick's ms, so that the first batch's entry ids lie above what a stream
-- already holds.
CREATE OR REPLACE FUNCTION outbox.tick(p_min_ms bigint DEFAULT 0)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id   bigint;
    v_snap pg_snapshot;
    v_ms   bigint;
    v_now  pg_snapshot;
BEGIN
    LOCK TABLE outbox.ticks IN SHARE ROW EXCLUSIVE MODE;
    v_now := pg_current_snapshot();
    SELECT t.tick_id, t.snap, t.ms INTO v_id, v_snap, v_ms
      FROM outbox.ticks AS t ORDER BY t.tick_id DESC LIMIT 1;
    IF v_id IS NOT NULL
       -- Scalar subqueries with LIMIT, not EXISTS: a semi join may be
       -- planned as a walk of the whole index filtered by the runs.
       AND NOT EXISTS (SELECT FROM outbox.finished_runs(pg_snapshot_xmax(v_snap), v_now) AS f
                        WHERE (SELECT m.txid FROM outbox.messages AS m
                                WHERE m.txid > f.after AND m.txid < f.before
                                  AND pg_visible_in_snapshot(m.txid, v_now)
                                ORDER BY m.txid LIMIT 1) IS NOT NULL)
       AND NOT EXISTS (SELECT FROM pg_snapshot_xip(v_snap) AS x
                        WHERE pg_visible_in_snapshot(x, v_now)
                          AND (SELECT m.txid FROM outbox.messages AS m
                                WHERE m.txid >= x AND m.txid <= x
                                ORDER BY m.txid LIMIT 1) IS NOT NULL) THEN
        RETURN v_id;
    END IF;
    v_id := coalesce(v_id, 0) + 1;
    INSERT INTO outbox.ticks (tick_id, snap, ms)
    VALUES (v_id, v_now,
            greatest(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint,
                     coalesce(v_ms, 0) + 1, coalesce(p_min_ms, 0)));
    RETURN v_id;
END
$$;

COMMENT ON FUNCTION outbox.tick(bigint) IS
    'Takes a tick if anything committed since the last one; returns the latest tick.';

-- The column, then the first tick and the rows pending now, in this one
-- transaction (the file's BEGIN): the first tick's snapshot must not see this
-- transaction, so that the pending rows, which carry its id, are the batch of
-- the tick after it. PostgreSQL leaves a transaction's own id out of its
-- snapshot's running list, which reads as committed once a later transaction
-- has committed (producers run while this file waits for its locks): so the
-- first tick lists this transaction as running itself. Producers wait for the
-- table's lock meanwhile; a producer transaction that wrote something else
-- first is running in the first tick's snapshot, so its row too lands in a
-- later batch.
ALTER TABLE outbox.messages ADD COLUMN IF NOT EXISTS txid xid8;

COMMENT ON COLUMN outbox.messages.txid IS
    'The transaction that wrote the row (pg_current_xact_id()): what places it in a batch.';

DO $$
DECLARE
    v_snap pg_snapshot := pg_current_snapshot();
    v_self xid8 := pg_current_xact_id();
BEGIN
    IF NOT EXISTS (SELECT FROM outbox.ticks) THEN
        IF pg_visible_in_snapshot(v_self, v_snap) THEN
            SELECT format('%s:%s:%s', least(pg_snapshot_xmin(v_snap), v_self),
                          pg_snapshot_xmax(v_snap),
                          string_agg(x::text, ',' ORDER BY x))::pg_snapshot
              INTO v_snap
              FROM (SELECT pg_snapshot_xip(v_snap) AS x UNION SELECT v_self) AS r;
        END IF;
        INSERT INTO outbox.ticks (tick_id, snap, ms)
        VALUES (1, v_snap, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint);
    END IF;
    -- Only the first application fills the column: afterwards every row has it.
    UPDATE outbox.messages
       SET txid = CASE WHEN sent_at IS NULL AND failed_at IS NULL
                       THEN pg_current_xact_id() ELSE '3'::xid8 END
     WHERE txid IS NULL;
END
$$;

ALTER TABLE outbox.messages ALTER COLUMN txid SET DEFAULT pg_current_xact_id();
ALTER TABLE outbox.messages ALTER COLUMN txid SET NOT NULL;

CREATE INDEX IF NOT EXISTS messages_txid_idx ON outbox.messages (txid, id);

-- A batch is the rows whose transaction tick p_next sees as committed and
-- tick p_prev does not (any two ticks, p_prev the lower). As
-- pgq.batch_event_sql draws them, in two parts: the transactions that began
-- after p_prev's snapshot are a range of transaction ids, [xmax of p_prev,
-- xmax of p_next), filtered by visibility, read in the runs between the
-- transactions still running at p_next (outbox.finished_runs), so that a
-- long transaction's rows are read once, by the batch it commits in, not by
-- every batch while it runs; those that were running at p_prev and
-- committed by p_next are few, listed. The ticks are read by subqueries,
-- which the planner makes index conditions.
--
-- A batch goes out in id order, not transaction-id order: a producer that
-- takes a lock before inserting (its aggregate's row, P8) may have been given
-- its transaction id before the one it waited for, but its row's id is drawn
-- after that one committed. So outbox.batch_bounds reads the batch's lowest
-- and highest row id once, off messages_txid_idx (only the index entries of
-- the batch), and outbox.batch_rows reads it in chunks of the primary key
-- between them, each after the last id read: a chunk costs its rows and the
-- rows of other batches that lie between them by id (a transaction that
-- stayed open long spans the rows committed meanwhile, once).
CREATE OR REPLACE FUNCTION outbox.batch_bounds(p_prev bigint, p_next bigint)
RETURNS TABLE (lo bigint, hi bigint)
LANGUAGE sql
STABLE
AS $$
    SELECT min(r.lo), max(r.hi) FROM (
        -- The transactions that began after p_prev, in runs between those
        -- still running at p_next, whose entries are not read.
        SELECT b.lo, b.hi
          FROM outbox.finished_runs(
                   (SELECT pg_catalog.pg_snapshot_xmax(t.snap) FROM outbox.ticks AS t
                     WHERE t.tick_id = p_prev),
                   (SELECT t.snap FROM outbox.ticks AS t WHERE t.tick_id = p_next)) AS f
          CROSS JOIN LATERAL (
              -- "id + 0": min(id) and max(id) would be planned as walks of
              -- the primary key from either end, filtered, which read the
              -- whole table for a run of few rows.
              SELECT min(m.id + 0) AS lo, max(m.id + 0) AS hi FROM outbox.messages AS m
               WHERE m.txid > f.after AND m.txid < f.before
                 AND pg_catalog.pg_visible_in_snapshot(m.txid, (SELECT t.snap FROM outbox.ticks AS t
                                                                 WHERE t.tick_id = p_next))) AS b
        UNION ALL
        -- Each transaction of the list: two probes of the index ("txid >= x
        -- AND txid <= x": with "txid = x" the planner may walk the primary
        -- key instead, filtered, when the statistics show few transactions).
        SELECT (SELECT m.id FROM outbox.messages AS m WHERE m.txid >= x AND m.txid <= x
                 ORDER BY m.txid, m.id LIMIT 1),
               (SELECT m.id FROM outbox.messages AS m WHERE m.txid >= x AND m.txid <= x
                 ORDER BY m.txid DESC, m.id DESC LIMIT 1)
          FROM pg_catalog.pg_snapshot_xip((SELECT t.snap FROM outbox.ticks AS t
                                            WHERE t.tick_id = p_prev)) AS x
         WHERE pg_catalog.pg_visible_in_snapshot(x, (SELECT t.snap FROM outbox.ticks AS t
                                                      WHERE t.tick_id = p_next))
    ) AS r
$$;

COMMENT ON FUNCTION outbox.batch_bounds(bigint, bigint) IS
    'The lowest and highest row id of the batch between two ticks (NULL when it is empty).';

-- The rows of the batch between ticks p_prev and p_next with an id above
-- p_after_id and at most p_upto_id, in id order, at most p_limit: a chunk.
-- Whether a row is in the batch is its snapshots' word alone, which no index
-- answers: the walk is the primary key's, from p_after_id, and stops at
-- p_limit rows. A plain SQL function, so the planner inlines it into the
-- caller's query.
CREATE OR REPLACE FUNCTION outbox.batch_rows(p_prev bigint, p_next bigint,
    p_after_id bigint, p_upto_id bigint, p_limit integer)
RETURNS SETOF outbox.messages
LANGUAGE sql
STABLE
AS $$
    SELECT m.* FROM outbox.messages AS m
     WHERE m.id > p_after_id AND m.id <= p_upto_id
       AND pg_catalog.pg_visible_in_snapshot(m.txid, (SELECT t.snap FROM outbox.ticks AS t
                                                       WHERE t.tick_id = p_next))
       AND NOT pg_catalog.pg_visible_in_snapshot(m.txid, (SELECT t.snap FROM outbox.ticks AS t
                                                           WHERE t.tick_id = p_prev))
     ORDER BY m.id
     LIMIT p_limit
$$;

COMMENT ON FUNCTION outbox.batch_rows(bigint, bigint, bigint, bigint, integer) IS
    'A chunk of the batch between two ticks: its rows with an id in (after, upto], in id order, at most a limit.';

-- Rows the relay could not publish and moved past (docs/DESIGN.md, "Rows
-- that cannot be published"): a copy of the row as the producer wrote it,
-- and why. outbox-relay failed lists them; failed retry writes a row again
-- as a new one, which a later batch publishes; failed drop removes it.
CREATE TABLE IF NOT EXISTS outbox.quarantine (
    id             bigint      PRIMARY KEY,
    txid           xid8        NOT NULL,
    message_id     uuid        NOT NULL,
    topic          text        NOT NULL,
    partition_key  text,
    payload        bytea       NOT NULL,
    headers        jsonb,
    created_at     timestamptz NOT NULL,
    error          text        NOT NULL,
    quarantined_at timestamptz NOT NULL DEFAULT now()
);

-- A keyed row of a partitioned topic waits behind a quarantined row of its
-- key (P8): the batch statement probes this index for each such row.
CREATE INDEX IF NOT EXISTS quarantine_key_idx
    ON outbox.quarantine (topic, partition_key, id);

COMMENT ON TABLE outbox.quarantine IS
    'Rows the relay could not publish and moved past, with why (outbox-relay failed).';

-- Copies rows into the quarantine with why, each once: a row quarantined
-- already (its batch read again) stays as it was. Returns how many it
-- copied. The relay calls it through outbox.record_batch, and with the read
-- of a batch's next chunk for the rows of the chunks before, so that a batch
-- of many bad rows records them as it goes.
CREATE OR REPLACE FUNCTION outbox.quarantine_rows(p_ids bigint[], p_errors text[])
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_copied integer := 0;
BEGIN
    IF cardinality(p_ids) IS DISTINCT FROM cardinality(p_errors) THEN
        RAISE EXCEPTION 'outbox.quarantine_rows: the arrays differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Most calls (every chunk's read) name no row: nothing to plan or run.
    IF coalesce(cardinality(p_ids), 0) = 0 THEN
        RETURN 0;
    END IF;
    -- One probe of the primary key per row named, in id order: sorted on
    -- the short list, never a walk of the outbox.
    INSERT INTO outbox.quarantine (id, txid, message_id, topic, partition_key, payload, headers,
                                   created_at, error)
    SELECT m.id, m.txid, m.message_id, m.topic, m.partition_key, m.payload, m.headers,
           m.created_at, q.error
      FROM (SELECT * FROM unnest(p_ids, p_errors) AS u(id, error) ORDER BY u.id) AS q
      CROSS JOIN LATERAL (SELECT * FROM outbox.messages AS m1 WHERE m1.id = q.id) AS m
    ON CONFLICT (id) DO NOTHING;
    GET DIAGNOSTICS v_copied = ROW_COUNT;
    RETURN v_copied;
END
$$;

COMMENT ON FUNCTION outbox.quarantine_rows(bigint[], text[]) IS
    'Copies rows the relay cannot publish into the quarantine, with why.';

-- A batch is all in its streams: records, in one call, where each stream it
-- published now stands. Three lists of streams, each a topic and a partition
-- (-1 for a topic of one partition):
--   p_topics, p_partitions, p_entry_ids   the streams the batch appended to,
--                                         and the last entry id each holds
--   p_advance_topics, p_advance_partitions
--                                         streams the relay publishes whose
--                                         rows up to p_tick are all in them,
--                                         whether or not the batch had any
--   p_met_topics, p_met_partitions        streams the batch had rows of that
--                                         the relay did not publish (paused,
--                                         behind, another relay's): recorded
--                                         at p_tick - 1 if they have no
--                                         position yet, so that every stream
--                                         met at or below the lead has one
-- With p_lead (the batch of the relay's lead, not of a stream catching up),
-- the lead (topic '') moves to p_tick: a stream that has no position has no
-- row in any batch up to the lead. Then the rows the batch quarantined,
-- with why. A position only moves forward (another relay may have recorded
-- a later batch), and streams are written in key order, so that relays
-- recording at once cannot deadlock. A quarantined row already recorded
-- (its batch was read again after a failure) stays as it was. Returns how
-- many rows it quarantined now.
CREATE OR REPLACE FUNCTION outbox.record_batch(p_tick bigint, p_lead boolean,
    p_topics text[], p_partitions integer[], p_entry_ids text[],
    p_advance_topics text[], p_advance_partitions integer[],
    p_met_topics text[], p_met_partitions integer[],
    p_quarantined bigint[], p_errors text[])
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_tick IS NULL OR NOT EXISTS (SELECT FROM outbox.ticks AS t WHERE t.tick_id = p_tick) THEN
        RAISE EXCEPTION 'outbox.record_batch: there is no tick %', p_tick
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(p_topics) IS DISTINCT FROM cardinality(p_partitions)
       OR cardinality(p_topics) IS DISTINCT FROM cardinality(p_entry_ids)
       OR cardinality(p_advance_topics) IS DISTINCT FROM cardinality(p_advance_partitions)
       OR cardinality(p_met_topics) IS DISTINCT FROM cardinality(p_met_partitions)
       OR cardinality(p_quarantined) IS DISTINCT FROM cardinality(p_errors) THEN
        RAISE EXCEPTION 'outbox.record_batch: the arrays of a group differ in length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO outbox.stream_positions AS p (topic, partition, tick, entry_id, updated_at)
    SELECT DISTINCT ON (u.topic, u.partition) u.topic, u.partition, p_tick, u.entry_id, now()
      FROM (SELECT '' AS topic, -1 AS partition, '0-0' AS entry_id, 0 AS how WHERE p_lead
            UNION ALL
            SELECT a.t, a.p, a.e, 1
              FROM unnest(p_topics, p_partitions, p_entry_ids) AS a(t, p, e)
            UNION ALL
            SELECT a.t, a.p, '0-0', 2
              FROM unnest(p_advance_topics, p_advance_partitions) AS a(t, p)) AS u
     ORDER BY u.topic, u.partition, u.how
    ON CONFLICT (topic, partition) DO UPDATE
       SET tick = excluded.tick,
           entry_id = CASE WHEN excluded.entry_id = '0-0' THEN p.entry_id
                           ELSE excluded.entry_id END,
           updated_at = excluded.updated_at
     WHERE p.tick < excluded.tick
        OR (p.tick = excluded.tick AND excluded.entry_id <> '0-0'
            AND p.entry_id IS DISTINCT FROM excluded.entry_id);
    -- A stream met only where it has no position yet: one that has one
    -- keeps it, however far behind.
    INSERT INTO outbox.stream_positions (topic, partition, tick, entry_id, updated_at)
    SELECT DISTINCT a.t, a.p, p_tick - 1, '0-0', now()
      FROM unnest(p_met_topics, p_met_partitions) AS a(t, p)
     ORDER BY 1, 2
    ON CONFLICT (topic, partition) DO NOTHING;
    RETURN outbox.quarantine_rows(p_quarantined, p_errors);
END
$$;

COMMENT ON FUNCTION outbox.record_batch(bigint, boolean, text[], integer[], text[], text[],
                                        integer[], text[], integer[], bigint[], text[]) IS
    'Records where the streams of a published batch stand, and the rows it quarantined.';

-- The rows not yet in their stream: neither in a batch their stream's
-- recorded position has passed nor quarantined. (Every batch that publishes
-- a row of a stream records the stream's position, so a stream's own row is
-- never behind its rows that are published and recorded.)
CREATE OR REPLACE VIEW outbox.unsent AS
SELECT m.*
  FROM outbox.messages AS m
 WHERE NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id)
   AND NOT EXISTS (SELECT FROM outbox.stream_positions AS p
                     JOIN outbox.ticks AS t ON t.tick_id = p.tick
                    WHERE p.topic = m.topic AND p.partition = coalesce(m.partition_no, -1)
                      AND pg_visible_in_snapshot(m.txid, t.snap));

COMMENT ON VIEW outbox.unsent IS
    'Rows not yet published to their stream and not quarantined.';

-- What the relays before this file left: every stream that has rows stands
-- at the first tick (its sent rows are in it, its pending ones are the batch
-- after it), and so does the lead; a row they quarantined (failed_at) is in
-- the quarantine with its last error. The relay reads each stream's last id
-- in Redis before its first batch, and the first entry ids it writes lie
-- above those the relays before it wrote there.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM outbox.stream_positions) THEN
        INSERT INTO outbox.stream_positions (topic, partition, tick, entry_id)
        SELECT DISTINCT m.topic, coalesce(m.partition_no, -1), 1, '0-0'
          FROM outbox.messages AS m
         WHERE m.topic ~ '^[A-Za-z0-9._-]{1,200}$'
        UNION ALL
        SELECT '', -1, 1, '0-0'
        ON CONFLICT DO NOTHING;
        INSERT INTO outbox.quarantine (id, txid, message_id, topic, partition_key, payload,
                                       headers, created_at, error)
        SELECT m.id, m.txid, m.message_id, m.topic, m.partition_key, m.payload, m.headers,
               m.created_at, coalesce(m.last_error, 'quarantined before the upgrade to 016')
          FROM outbox.messages AS m
         WHERE m.failed_at IS NOT NULL AND m.sent_at IS NULL
        ON CONFLICT (id) DO NOTHING;
    END IF;
END
$$;

-- A producer in REPEATABLE READ or SERIALIZABLE reads outbox.topics in its
-- snapshot, so one taken before outbox.set_partitions changed the topic's
-- count would stamp its row with the count before, while the relay publishes
-- the row by the count in force. So such a producer locks the topic's row
-- (FOR SHARE; FOR KEY SHARE would lock the old version of a row whose key an
-- update left alone): in these isolation levels PostgreSQL refuses to lock a row version
-- that a transaction invisible to the snapshot has replaced, with a
-- serialization failure, which such producers retry; a topic whose row the
-- snapshot does not hold at all was partitioned after it, and is refused the
-- same way. A producer in READ COMMITTED reads the count in force anyway
-- (each statement of this function takes a new snapshot) and locks nothing.
-- The lock needs UPDATE on outbox.topics, which producers do not have: it is
-- taken as the schema's owner.
CREATE OR REPLACE FUNCTION outbox.lock_topic_count(p_topic text)
RETURNS boolean
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT FROM outbox.topics AS t WHERE t.topic = p_topic FOR SHARE)
$$;

COMMENT ON FUNCTION outbox.lock_topic_count(text) IS
    'Locks the topic''s row of outbox.topics as the snapshot sees it (serialization failure if its count changed since); false when the snapshot has no row.';

CREATE OR REPLACE FUNCTION outbox.set_partition_no()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed'
       AND NOT outbox.lock_topic_count(NEW.topic) THEN
        RAISE EXCEPTION 'outbox: topic % was partitioned after this transaction''s snapshot was taken; its row would go to a partition of the count before',
                        NEW.topic
            USING ERRCODE = 'serialization_failure',
                  HINT = 'Retry the transaction, as for any serialization failure. See docs/PARTITIONS.md.';
    END IF;
    NEW.partition_no := outbox.row_partition(NEW.topic, NEW.partition_key, NEW.id);
    RETURN NEW;
END
$$;

-- A topic's partition count changes only while none of its rows waits: the
-- rows' place in their stream is now outbox.unsent's, not sent_at's.
CREATE OR REPLACE FUNCTION outbox.set_partitions(p_topic text, p_partitions integer)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_before integer;
    v_unsent bigint;
    v_total bigint;
BEGIN
    IF p_topic IS NULL OR p_topic !~ '^[A-Za-z0-9._-]{1,200}$' THEN
        RAISE EXCEPTION 'outbox.set_partitions: topic % is not a topic name', quote_nullable(p_topic)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A topic is 1 to 200 characters of A-Z a-z 0-9 . _ -';
    END IF;
    IF p_partitions IS NULL OR p_partitions < 1 OR p_partitions > 1000 THEN
        RAISE EXCEPTION 'outbox.set_partitions: % partitions is out of range', coalesce(p_partitions::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A topic has 1 to 1000 partitions.';
    END IF;
    PERFORM set_config('lock_timeout', '10s', true);
    LOCK TABLE outbox.topics IN SHARE ROW EXCLUSIVE MODE;
    -- Keeps inserts out (and lets the trigger be rewritten) until commit.
    LOCK TABLE outbox.messages IN SHARE ROW EXCLUSIVE MODE;
    SELECT t.partitions INTO v_before FROM outbox.topics AS t WHERE t.topic = p_topic;
    v_before := coalesce(v_before, 1);
    IF v_before = p_partitions THEN
        RETURN v_before;
    END IF;
    IF p_partitions > 1 THEN
        SELECT coalesce(sum(t.partitions), 0) + p_partitions INTO v_total
        FROM outbox.topics AS t
        WHERE t.partitions > 1 AND t.topic <> p_topic;
        IF v_total > 4096 THEN
            RAISE EXCEPTION 'outbox.set_partitions: % partitions for topic % would make % in all', p_partitions, p_topic, v_total
                USING ERRCODE = 'program_limit_exceeded',
                      HINT = 'The relays divide at most 4096 partitions among themselves, over all topics; '
                             'the rows of the others would never be claimed. Lower this count or another '
                             'topic''s. See docs/PARTITIONS.md.';
        END IF;
    END IF;
    -- Unsent: not yet in its stream, or quarantined (a retry would publish it
    -- under the new count, out of order with its key's rows before it).
    SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox.unsent AS m
                                   WHERE m.topic = p_topic LIMIT 1000000) AS u)
         + (SELECT count(*) FROM (SELECT 1 FROM outbox.quarantine AS q
                                   WHERE q.topic = p_topic LIMIT 1000000) AS u)
      INTO v_unsent;
    IF v_unsent > 0 THEN
        RAISE EXCEPTION 'outbox.set_partitions: topic % has % unsent rows; changing its partitions now could reorder a key', p_topic, v_unsent
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Stop the topic''s producers, let the relay publish what is left (outbox-relay status), '
                         'retry or drop its quarantined rows (outbox-relay failed), then call again. '
                         'See docs/PARTITIONS.md.';
    END IF;
    INSERT INTO outbox.topics (topic, partitions, changed_at)
    VALUES (p_topic, p_partitions, now())
    ON CONFLICT (topic) DO UPDATE SET partitions = excluded.partitions, changed_at = excluded.changed_at;
    PERFORM outbox.sync_partition_trigger();
    RETURN v_before;
END
$$;

REVOKE EXECUTE ON FUNCTION outbox.set_partitions(text, integer) FROM PUBLIC;

REVOKE EXECUTE ON FUNCTION outbox.quarantine_rows(bigint[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.quarantine_rows(bigint[], text[]) TO outbox_relay;
REVOKE EXECUTE ON FUNCTION outbox.tick(bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox.batch_rows(bigint, bigint, bigint, bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.batch_rows(bigint, bigint, bigint, bigint, integer) TO outbox_relay;
REVOKE EXECUTE ON FUNCTION outbox.batch_bounds(bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.batch_bounds(bigint, bigint) TO outbox_relay;
GRANT EXECUTE ON FUNCTION outbox.tick(bigint) TO outbox_relay;
REVOKE EXECUTE ON FUNCTION outbox.record_batch(bigint, boolean, text[], integer[], text[], text[], integer[], text[], integer[], bigint[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.record_batch(bigint, boolean, text[], integer[], text[], text[], integer[], text[], integer[], bigint[], text[]) TO outbox_relay;
GRANT SELECT ON outbox.ticks TO outbox_relay;
GRANT SELECT ON outbox.quarantine TO outbox_relay;
GRANT SELECT ON outbox.unsent TO outbox_relay;
GRANT SELECT ON outbox.stream_positions TO outbox_relay;

INSERT INTO outbox.schema_version (version, name)
VALUES (16, '016_batches.sql')
ON CONFLICT (version) DO NOTHING;

COMMIT;
