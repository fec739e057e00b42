-- outbox-relay schema, part 22: no per-topic index for the producers to write.
--
-- messages_pending_topic_idx (005), on (topic, id), served two reads of
-- outbox.backlog (017) and nothing else: the topics that have rows (a skip
-- scan, when asked for every topic) and the span of ids of a topic never
-- published. Every producer's row paid for it, one more index entry: with one
-- producer and commits not waiting for the disk, the outbox took 0.80 of the
-- rate of a plain table with the index and 0.94 without it
-- (bench/extra/producer_cost.py, docs/PERFORMANCE.md "What each addition
-- costs the producers").
--
-- outbox.backlog now counts every topic in one walk of messages_txid_idx, as
-- it already counted the topics that have a recorded position. The walk
-- starts at the lowest xmin among the snapshots of the asked topics' streams
-- and of the lead (the stream_positions row of topic ''). That covers a
-- stream without a position too: every batch records the streams it had rows
-- of at the tick before it if they have none yet (016, outbox.record_batch),
-- so a stream without a position has no row at or below the lead. Its rows
-- are counted one by one, where the index gave an estimate from the span of
-- their ids. With every topic asked for (NULL), the topics are those with a
-- recorded position and those met in the walk.
--
-- What a walk reads: the rows written since the oldest of those positions,
-- of every topic. While the relays keep up that is a few seconds of rows;
-- behind a paused or stalled stream, and before any relay ran, it is every
-- row written since, which is the backlog and what the other topics wrote
-- meanwhile. A published past is never read, and never the whole table.
--
-- DROP INDEX holds outbox.messages exclusively for a moment: producers wait
-- for this transaction, as for the ALTER TABLE of 016.
--
-- One transaction (BEGIN ... COMMIT below), idempotent like every file here.

BEGIN;

CREATE OR REPLACE FUNCTION outbox.backlog(p_topics text[])
RETURNS TABLE (topic text, pending bigint, oldest_created_at timestamptz)
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_all  boolean := p_topics IS NULL;
    v_xmin xid8;
BEGIN
    PERFORM FROM outbox.messages LIMIT 0; -- the lock order (017)
    SELECT min(pg_snapshot_xmin(k.snap)) INTO v_xmin
      FROM outbox.stream_positions AS p JOIN outbox.ticks AS k ON k.tick_id = p.tick
     WHERE p.topic = '' OR v_all OR p.topic = ANY (p_topics);
    -- No position at all (016 records the lead, so only after a hand edit):
    -- from the first transaction, which reads the whole table.
    v_xmin := coalesce(v_xmin, '1'::xid8);
    RETURN QUERY
    WITH asked AS (
        SELECT DISTINCT u.name FROM unnest(p_topics) AS u(name) WHERE u.name IS NOT NULL),
    walked AS (
        SELECT m.topic AS name, count(*) AS pending, min(m.created_at) AS oldest
          FROM outbox.messages AS m
         WHERE m.txid >= v_xmin
           AND (v_all OR m.topic IN (SELECT a.name FROM asked AS a))
           AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id)
           AND NOT EXISTS (SELECT FROM outbox.stream_positions AS p
                             JOIN outbox.ticks AS k ON k.tick_id = p.tick
                            WHERE p.topic = m.topic AND p.partition = coalesce(m.partition_no, -1)
                              AND pg_visible_in_snapshot(m.txid, k.snap))
         GROUP BY m.topic),
    named AS (
        SELECT a.name FROM asked AS a
        UNION
        SELECT p.topic FROM outbox.stream_positions AS p WHERE v_all AND p.topic <> ''
        UNION
        SELECT w.name FROM walked AS w)
    SELECT n.name, coalesce(w.pending, 0), w.oldest
      FROM named AS n LEFT JOIN walked AS w ON w.name = n.name;
END
$$;

COMMENT ON FUNCTION outbox.backlog(text[]) IS
    'Per topic (every topic when NULL): rows not yet in their stream, and the oldest one''s created_at; one walk of the rows written since the oldest position asked about (migration 022).';

DROP INDEX IF EXISTS outbox.messages_pending_topic_idx;

INSERT INTO outbox.schema_version (version, name)
VALUES (22, '022_no_topic_index.sql')
ON CONFLICT (version) DO NOTHING;

COMMIT;
