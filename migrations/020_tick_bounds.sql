-- outbox-relay schema, part 20: a tick and the bounds of its batch in one
-- round trip.
--
-- A row committed while the relay publishes waits for the next tick, then
-- for every statement between that tick and its publish: the tick, the
-- batch's bounds, its chunk and its calls to Redis, one after the other.
-- outbox.tick_bounds takes the tick and, when it is the one after the lead
-- the relay names, reads the bounds of that batch in the same call, so a
-- busy relay's cycle is a round trip shorter (docs/DESIGN.md, "Batches from
-- snapshots"; the figures: docs/PERFORMANCE.md, "The batch relay against
-- PgQ").
--
-- One transaction (BEGIN ... COMMIT below), idempotent like every file here.

BEGIN;

-- The bounds are read by a statement of their own, after the tick: a
-- statement's snapshot is taken when it starts, and one that began before the
-- tick's snapshot would not see every row the tick counts as committed. In
-- a VOLATILE function each statement takes its own snapshot.
CREATE OR REPLACE FUNCTION outbox.tick_bounds(p_min_ms bigint, p_after bigint)
RETURNS TABLE (tick bigint, lo bigint, hi bigint)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    tick := outbox.tick(p_min_ms);
    IF p_after IS NOT NULL AND tick = p_after + 1 THEN
        SELECT b.lo, b.hi INTO lo, hi FROM outbox.batch_bounds(p_after, p_after + 1) AS b;
    END IF;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.tick_bounds(bigint, bigint) IS
    'outbox.tick(min_ms), and when the latest tick is the one after p_after the bounds of its batch (outbox.batch_bounds); NULL bounds otherwise.';

REVOKE EXECUTE ON FUNCTION outbox.tick_bounds(bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.tick_bounds(bigint, bigint) TO outbox_relay;

INSERT INTO outbox.schema_version (version, name)
VALUES (20, '020_tick_bounds.sql')
ON CONFLICT (version) DO NOTHING;

COMMIT;
