-- outbox-relay schema, part 21: the runs of finished transactions planned
-- with the statements that read them.
--
-- outbox.finished_runs (016) carried "SET search_path", which keeps
-- PostgreSQL from inlining a SQL function: each call went through the
-- function manager, which parses and plans its body anew. A busy relay's
-- cycle made two such calls, one in outbox.tick and one in
-- outbox.batch_bounds, about a quarter of what PostgreSQL spent on the
-- cycle's tick (docs/PERFORMANCE.md, "The tick's cost"). Without the
-- setting, and with every name in its body in pg_catalog, written so, the
-- planner inlines it into outbox.tick, whose own search_path is
-- pg_catalog's. outbox.batch_bounds passed it sub-selects (the ticks'
-- snapshots), which also rule out inlining: it now joins the two ticks and
-- passes their columns. Both return what they returned before.
--
-- One transaction (BEGIN ... COMMIT below), idempotent like every file here.

BEGIN;

CREATE OR REPLACE FUNCTION outbox.finished_runs(p_from xid8, p_snap pg_snapshot)
RETURNS TABLE (after xid8, before xid8)
LANGUAGE sql
IMMUTABLE
ROWS 4
AS $$
    SELECT c.x, coalesce(lead(c.x) OVER (ORDER BY c.x), pg_catalog.pg_snapshot_xmax(p_snap))
      FROM (SELECT ((p_from::pg_catalog.text::pg_catalog.numeric OPERATOR(pg_catalog.-) 1)
                    ::pg_catalog.text)::pg_catalog.xid8 AS x
            UNION ALL
            SELECT x FROM pg_catalog.pg_snapshot_xip(p_snap) AS x
             WHERE x OPERATOR(pg_catalog.>=) p_from
               AND x OPERATOR(pg_catalog.<) pg_catalog.pg_snapshot_xmax(p_snap)) AS c
$$;

COMMENT ON FUNCTION outbox.finished_runs(xid8, pg_snapshot) IS
    'Runs of transaction ids from p_from on that a snapshot shows as finished: open intervals (after, before).';

CREATE OR REPLACE FUNCTION outbox.batch_bounds(p_prev bigint, p_next bigint)
RETURNS TABLE (lo bigint, hi bigint)
LANGUAGE sql
STABLE
AS $$
    SELECT min(r.lo), max(r.hi) FROM (
        -- The transactions that began after p_prev, in runs between those
        -- still running at p_next, whose entries are not read.
        SELECT b.lo, b.hi
          FROM outbox.ticks AS tp
          JOIN outbox.ticks AS tn ON tn.tick_id = p_next
          CROSS JOIN LATERAL outbox.finished_runs(pg_catalog.pg_snapshot_xmax(tp.snap),
                                                  tn.snap) AS f
          CROSS JOIN LATERAL (
              -- "id + 0": min(id) and max(id) would be planned as walks of
              -- the primary key from either end, filtered, which read the
              -- whole table for a run of few rows.
              SELECT min(m.id + 0) AS lo, max(m.id + 0) AS hi FROM outbox.messages AS m
               WHERE m.txid > f.after AND m.txid < f.before
                 AND pg_catalog.pg_visible_in_snapshot(m.txid, tn.snap)) AS b
         WHERE tp.tick_id = p_prev
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

INSERT INTO outbox.schema_version (version, name)
VALUES (21, '021_inline_runs.sql')
ON CONFLICT (version) DO NOTHING;

COMMIT;
