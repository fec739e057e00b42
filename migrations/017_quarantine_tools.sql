-- outbox-relay schema, part 17: what operators see and do with the batch
-- design's tables (docs/DESIGN.md, "Batches from snapshots"; docs/OPERATIONS.md).
--
-- A row is published once its stream's recorded position (outbox.stream_positions)
-- has passed it; rows that can never be published are in outbox.quarantine.
-- No row carries sent_at, failed_at or attempts any more, so the operator's
-- commands, the relay's figures and retention read these tables instead:
--
--   outbox.quarantine_retry(all, ids)   "outbox-relay failed retry": writes
--                               quarantined rows again as new rows, in id
--                               order, in one transaction
--   outbox.quarantine_drop(ids)         "outbox-relay failed drop": gives
--                               quarantined rows up
--   outbox.backlog(topics)      per topic: the rows not yet in their stream
--                               (outbox.unsent) and the oldest one's
--                               created_at, without a scan of the table
--   outbox.purge_sent(...)      retention: deletes rows their stream passed
--                               more than sent_retention ago, never a row
--                               outbox.unsent shows nor a quarantined one
--   outbox.delete_published(ids) only rows already in their stream
--   ticks_taken_at_idx          the tick taken sent_retention ago, in one probe
--
-- Lock order: each function below takes outbox.messages before the other
-- tables of the outbox (its first statement reads it), as a TRUNCATE or
-- ALTER of several of them takes it first; otherwise such a statement and
-- one of these, each holding the table the other wants next, deadlock.
--
-- One transaction (BEGIN ... COMMIT below), idempotent like every file here.

BEGIN;

-- Retention looks for the last tick taken before a cutoff.
CREATE INDEX IF NOT EXISTS ticks_taken_at_idx ON outbox.ticks (taken_at);

-- The rows to write again: those named (every quarantined row with p_all),
-- and in a partitioned topic the later quarantined rows of the same key,
-- which the relay quarantined behind the first (a key's order holds: they
-- go back together, in their order). p_except: rows that are not to be
-- written again even if they follow (they are being dropped).
CREATE OR REPLACE FUNCTION outbox.quarantine_followers(p_all boolean, p_ids bigint[],
    p_except bigint[] DEFAULT '{}')
RETURNS SETOF bigint
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH named AS (
        SELECT q.id, q.topic, q.partition_key FROM outbox.quarantine AS q
         WHERE p_all OR q.id = ANY (p_ids))
    SELECT n.id FROM named AS n WHERE NOT (n.id = ANY (coalesce(p_except, '{}')))
    UNION
    SELECT f.id FROM named AS n
      JOIN outbox.topics AS t ON t.topic = n.topic AND t.partitions > 1
      JOIN outbox.quarantine AS f
        ON f.topic = n.topic AND f.partition_key = n.partition_key AND f.id > n.id
     WHERE NOT (f.id = ANY (coalesce(p_except, '{}')))
$$;

-- Writes the rows p_ids (quarantined) again as new rows, in id order, in the
-- caller's transaction: each as the producer wrote it (message_id, topic,
-- partition_key, payload, headers, created_at), with a new id and the
-- caller's transaction, so a later batch publishes them together and in
-- their order. The original rows go: a message_id is unique in the outbox.
-- Returns how many were written again.
CREATE OR REPLACE FUNCTION outbox.quarantine_requeue(p_ids bigint[])
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rows outbox.quarantine[];
    v_n    integer;
BEGIN
    -- Locked, so that two operators retrying at once write each row once.
    PERFORM FROM outbox.quarantine AS x WHERE x.id = ANY (p_ids) ORDER BY x.id FOR UPDATE;
    SELECT coalesce(array_agg(x ORDER BY x.id), '{}') INTO v_rows
      FROM outbox.quarantine AS x WHERE x.id = ANY (p_ids);
    DELETE FROM outbox.quarantine AS q WHERE q.id = ANY (ARRAY(SELECT r.id FROM unnest(v_rows) AS r));
    DELETE FROM outbox.messages AS m WHERE m.id = ANY (ARRAY(SELECT r.id FROM unnest(v_rows) AS r));
    INSERT INTO outbox.messages (message_id, topic, partition_key, payload, headers, created_at)
    SELECT r.message_id, r.topic, r.partition_key, r.payload, r.headers, r.created_at
      FROM unnest(v_rows) AS r
     ORDER BY r.id;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM pg_notify('outbox_relay', '');
    END IF;
    RETURN v_n;
END
$$;

-- "outbox-relay failed retry ID... | --all": the rows written again (with
-- the later quarantined rows of their keys in a partitioned topic), and the
-- ids named that are not quarantined.
CREATE OR REPLACE FUNCTION outbox.quarantine_retry(p_all boolean, p_ids bigint[])
RETURNS TABLE (retried integer, missing bigint[])
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM FROM outbox.messages LIMIT 0; -- the lock order (top of the file)
    missing := ARRAY(SELECT x FROM unnest(coalesce(p_ids, '{}')) AS x
                      WHERE NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = x)
                      ORDER BY x);
    retried := outbox.quarantine_requeue(ARRAY(
        SELECT outbox.quarantine_followers(coalesce(p_all, false), coalesce(p_ids, '{}'))));
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.quarantine_retry(boolean, bigint[]) IS
    'outbox-relay failed retry: writes quarantined rows again as new rows, in id order; a partitioned key''s later quarantined rows with them.';

-- "outbox-relay failed drop ID...": the rows named leave the quarantine and
-- the outbox, never published; in a partitioned topic the later quarantined
-- rows of their keys, held behind them, are written again (the key goes on
-- without the dropped row). Returns how many were dropped, how many written
-- again, and the ids named that are not quarantined.
CREATE OR REPLACE FUNCTION outbox.quarantine_drop(p_ids bigint[])
RETURNS TABLE (dropped integer, released integer, missing bigint[])
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_drop    bigint[];
    v_release bigint[];
BEGIN
    PERFORM FROM outbox.messages LIMIT 0; -- the lock order (top of the file)
    SELECT coalesce(array_agg(q.id ORDER BY q.id), '{}') INTO v_drop
      FROM (SELECT x.id FROM outbox.quarantine AS x WHERE x.id = ANY (coalesce(p_ids, '{}'))
             ORDER BY x.id FOR UPDATE) AS q;
    missing := ARRAY(SELECT x FROM unnest(coalesce(p_ids, '{}')) AS x
                      WHERE NOT (x = ANY (v_drop)) ORDER BY x);
    v_release := ARRAY(SELECT outbox.quarantine_followers(false, v_drop, v_drop));
    DELETE FROM outbox.quarantine AS q WHERE q.id = ANY (v_drop);
    DELETE FROM outbox.messages AS m WHERE m.id = ANY (v_drop);
    dropped := cardinality(v_drop);
    released := outbox.quarantine_requeue(v_release);
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.quarantine_drop(bigint[]) IS
    'outbox-relay failed drop: gives quarantined rows up; a partitioned key''s later quarantined rows are written again.';

-- The backlog of each topic of p_topics (every topic with rows when NULL):
-- how many rows are not yet in their stream (outbox.unsent) and the
-- created_at of the oldest. A row is in its stream once the snapshot of its
-- stream's recorded tick sees its transaction; every transaction below that
-- snapshot's xmin is seen. So:
--
--   * a topic some stream of which has a position: its unsent rows are among
--     those with txid at or above the lowest xmin of its streams' snapshots.
--     One walk of messages_txid_idx from there serves every such topic. It
--     reads the rows written since the oldest position of the topics asked
--     about, of every topic: while the relay keeps up that is a few seconds
--     of rows (the relay refreshes every stream's position every few
--     seconds); a stream paused or stalled makes it every row written since
--     it stopped, which is its backlog and what the others wrote meanwhile.
--     A partition of such a topic that has no position yet (no row of it was
--     ever published) counts only its rows in that range.
--   * a topic no stream of which has a position (never published): all its
--     rows wait. Counted as the span of their ids, from the two ends of the
--     (topic, id) index, as before this file: three probes, whatever the
--     backlog.
--
-- With p_topics NULL the topics are found by a skip scan of the (topic, id)
-- index: one probe per topic.
CREATE OR REPLACE FUNCTION outbox.backlog(p_topics text[])
RETURNS TABLE (topic text, pending bigint, oldest_created_at timestamptz)
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_topics text[] := p_topics;
    v_xmin   xid8;
BEGIN
    PERFORM FROM outbox.messages LIMIT 0; -- the lock order (top of the file)
    IF v_topics IS NULL THEN
        -- "sent_at IS NULL AND failed_at IS NULL" holds for every row written
        -- since schema 16 and lets messages_pending_topic_idx answer.
        WITH RECURSIVE t(name) AS (
            (SELECT m.topic FROM outbox.messages AS m
              WHERE m.sent_at IS NULL AND m.failed_at IS NULL ORDER BY m.topic LIMIT 1)
            UNION ALL
            SELECT (SELECT m.topic FROM outbox.messages AS m
                     WHERE m.topic > t.name AND m.sent_at IS NULL AND m.failed_at IS NULL
                     ORDER BY m.topic LIMIT 1)
              FROM t WHERE t.name IS NOT NULL)
        SELECT coalesce(array_agg(t.name), '{}') INTO v_topics FROM t WHERE t.name IS NOT NULL;
    END IF;
    SELECT min(pg_snapshot_xmin(k.snap)) INTO v_xmin
      FROM outbox.stream_positions AS p JOIN outbox.ticks AS k ON k.tick_id = p.tick
     WHERE p.topic = ANY (v_topics);
    RETURN QUERY
    WITH asked AS (
        SELECT DISTINCT u.name FROM unnest(v_topics) AS u(name) WHERE u.name IS NOT NULL),
    placed AS (
        SELECT a.name, min(pg_snapshot_xmin(k.snap)) AS xmin FROM asked AS a
          JOIN outbox.stream_positions AS p ON p.topic = a.name
          JOIN outbox.ticks AS k ON k.tick_id = p.tick
         GROUP BY a.name),
    recent AS (
        SELECT m.topic AS name, count(*) AS pending, min(m.created_at) AS oldest
          FROM outbox.messages AS m
          JOIN placed AS pl ON pl.name = m.topic AND m.txid >= pl.xmin
         WHERE m.txid >= v_xmin
           AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id)
           AND NOT EXISTS (SELECT FROM outbox.stream_positions AS p
                             JOIN outbox.ticks AS k ON k.tick_id = p.tick
                            WHERE p.topic = m.topic AND p.partition = coalesce(m.partition_no, -1)
                              AND pg_visible_in_snapshot(m.txid, k.snap))
         GROUP BY m.topic)
    SELECT pl.name, coalesce(r.pending, 0), r.oldest
      FROM placed AS pl LEFT JOIN recent AS r ON r.name = pl.name
    UNION ALL
    -- "topic >= t AND topic <= t ... ORDER BY topic, id": only the (topic, id)
    -- index answers it (with "topic = t" the planner may walk the id index).
    SELECT a.name,
           (SELECT coalesce(max(e.id) - min(e.id) + 1, 0) FROM (
               (SELECT m.id FROM outbox.messages AS m
                 WHERE m.topic >= a.name AND m.topic <= a.name
                   AND m.sent_at IS NULL AND m.failed_at IS NULL
                 ORDER BY m.topic, m.id LIMIT 1)
               UNION ALL
               (SELECT m.id FROM outbox.messages AS m
                 WHERE m.topic >= a.name AND m.topic <= a.name
                   AND m.sent_at IS NULL AND m.failed_at IS NULL
                 ORDER BY m.topic DESC, m.id DESC LIMIT 1)) AS e),
           (SELECT m.created_at FROM outbox.messages AS m
             WHERE m.topic >= a.name AND m.topic <= a.name
               AND m.sent_at IS NULL AND m.failed_at IS NULL
               AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id)
             ORDER BY m.topic, m.id LIMIT 1)
      FROM asked AS a
     WHERE NOT EXISTS (SELECT FROM placed AS pl WHERE pl.name = a.name);
END
$$;

COMMENT ON FUNCTION outbox.backlog(text[]) IS
    'Per topic (every topic when NULL): rows not yet in their stream, and the oldest one''s created_at; bounded reads, see the file.';

-- Retention (the relay's sent_retention): deletes up to p_max_rows rows that
-- their stream's recorded position has passed, and that were committed
-- before the last tick taken p_older_than ago (so published at least that
-- long ago, or, for a stream that was behind, as soon as it caught up),
-- walking the primary key upward from p_after_id. Never a row outbox.unsent
-- shows, never a quarantined one. It stops at the first row created after
-- the cutoff (its transaction began after that tick, so no row is
-- deletable from there on but for rows of older transactions with higher
-- ids, which a later pass from the start takes), and steps over at most
-- 10 * p_max_rows rows it must keep (a paused stream's backlog). Returns
-- how many rows it deleted, the id to go on from, whether it reached the
-- young rows, and the created_at of the oldest row it saw published and
-- kept, for the relay's oldest-sent-age metric. One short transaction.
CREATE OR REPLACE FUNCTION outbox.purge_sent(
    p_older_than interval,
    p_after_id   bigint,
    p_max_rows   integer)
RETURNS TABLE (deleted integer, next_after_id bigint, caught_up boolean,
               oldest_kept timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_cutoff  timestamptz;
    v_snap    pg_snapshot;
    v_ids     bigint[] := '{}';
    v_last    bigint := coalesce(p_after_id, 0);
    v_scanned integer := 0;
    v_row     record;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox.purge_sent: older_than must be an interval of 0 or more'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_max_rows IS NULL OR p_max_rows < 1 OR p_max_rows > 100000 THEN
        RAISE EXCEPTION 'outbox.purge_sent: max_rows must be between 1 and 100000'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM FROM outbox.messages LIMIT 0; -- the lock order (top of the file)
    v_cutoff := statement_timestamp() - p_older_than;
    SELECT k.snap INTO v_snap FROM outbox.ticks AS k
     WHERE k.taken_at <= v_cutoff ORDER BY k.taken_at DESC LIMIT 1;
    caught_up := true;
    FOR v_row IN
        SELECT m.id, m.created_at,
               s.snap IS NOT NULL AND pg_visible_in_snapshot(m.txid, s.snap)
               AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id) AS published,
               v_snap IS NOT NULL AND pg_visible_in_snapshot(m.txid, v_snap) AS old
          FROM outbox.messages AS m
          LEFT JOIN LATERAL (
              SELECT k.snap FROM outbox.stream_positions AS p
                JOIN outbox.ticks AS k ON k.tick_id = p.tick
               WHERE p.topic = m.topic AND p.partition = coalesce(m.partition_no, -1)) AS s ON true
         WHERE m.id > v_last
         ORDER BY m.id
    LOOP
        IF v_row.created_at >= v_cutoff THEN
            IF v_row.published AND oldest_kept IS NULL THEN
                oldest_kept := v_row.created_at;
            END IF;
            EXIT;
        END IF;
        IF v_row.published AND v_row.old THEN
            v_ids := v_ids || v_row.id;
        ELSIF v_row.published AND oldest_kept IS NULL THEN
            oldest_kept := v_row.created_at;
        END IF;
        v_last := v_row.id;
        v_scanned := v_scanned + 1;
        IF cardinality(v_ids) >= p_max_rows OR v_scanned >= 10 * p_max_rows THEN
            caught_up := false;
            EXIT;
        END IF;
    END LOOP;
    -- Positions only move forward: what was published still is. The
    -- quarantine is checked again, for a row quarantined meanwhile.
    DELETE FROM outbox.messages AS m
     WHERE m.id = ANY (v_ids)
       AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    -- Ticks go with the rows: those below every stream's position (nothing
    -- reads their batches again) and older than the cutoff, keeping the
    -- last tick at or before it, a slice at a time.
    IF caught_up THEN
        DELETE FROM outbox.ticks AS k
         WHERE k.tick_id IN (
               SELECT k2.tick_id FROM outbox.ticks AS k2
                WHERE k2.tick_id < (SELECT min(p.tick) FROM outbox.stream_positions AS p)
                  AND k2.tick_id < (SELECT max(k3.tick_id) FROM outbox.ticks AS k3
                                     WHERE k3.taken_at <= v_cutoff)
                ORDER BY k2.tick_id LIMIT 10000);
    END IF;
    next_after_id := v_last;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.purge_sent(interval, bigint, integer) IS
    'Deletes up to max_rows rows their stream passed before the last tick taken older_than ago, from after_id upward; never an unsent or quarantined row. The relay calls it for sent_retention.';

-- Only rows already in their stream, never one outbox.unsent shows nor a
-- quarantined one: the relay's role gets no power to lose a message.
CREATE OR REPLACE FUNCTION outbox.delete_published(p_ids bigint[])
RETURNS integer
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH gone AS (
        DELETE FROM outbox.messages AS m
        WHERE m.id = ANY (p_ids)
          AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id)
          AND EXISTS (SELECT FROM outbox.stream_positions AS p
                        JOIN outbox.ticks AS k ON k.tick_id = p.tick
                       WHERE p.topic = m.topic AND p.partition = coalesce(m.partition_no, -1)
                         AND pg_visible_in_snapshot(m.txid, k.snap))
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;

COMMENT ON FUNCTION outbox.delete_published(bigint[]) IS
    'Deletes the rows named that are already in their stream (never an unsent or quarantined one).';

-- Owned by the schema's owner, whoever applies this file, as in 010.
DO $$
DECLARE
    v_schema_owner regrole;
    v_fn           regprocedure;
BEGIN
    SELECT nspowner::regrole INTO v_schema_owner FROM pg_namespace WHERE nspname = 'outbox';
    FOREACH v_fn IN ARRAY ARRAY[
        'outbox.quarantine_requeue(bigint[])'::regprocedure,
        'outbox.quarantine_retry(boolean, bigint[])'::regprocedure,
        'outbox.quarantine_drop(bigint[])'::regprocedure,
        'outbox.purge_sent(interval, bigint, integer)'::regprocedure,
        'outbox.delete_published(bigint[])'::regprocedure]
    LOOP
        IF (SELECT proowner FROM pg_proc WHERE oid = v_fn) <> v_schema_owner THEN
            EXECUTE format('ALTER FUNCTION %s OWNER TO %s', v_fn, v_schema_owner);
        END IF;
    END LOOP;
END
$$;

REVOKE EXECUTE ON FUNCTION
    outbox.quarantine_requeue(bigint[]),
    outbox.quarantine_retry(boolean, bigint[]),
    outbox.quarantine_drop(bigint[]),
    outbox.quarantine_followers(boolean, bigint[], bigint[])
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox.quarantine_retry(boolean, bigint[]),
    outbox.quarantine_drop(bigint[])
    TO outbox_relay;
-- The backlog reads with the caller's rights: whoever may read the outbox's
-- tables may count it (outbox-relay status as a monitoring role).
GRANT EXECUTE ON FUNCTION outbox.backlog(text[]) TO PUBLIC;

INSERT INTO outbox.schema_version (version, name)
VALUES (17, '017_quarantine_tools.sql')
ON CONFLICT (version) DO NOTHING;

COMMIT;
