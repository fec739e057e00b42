-- outbox-relay schema, part 10: sent rows are deleted, by the relay, and only them.
--
-- Without this, nothing deletes a sent row: at 1,000 messages a second the
-- table gains 86 million rows a day, and every vacuum of it reads them all.
-- The relay now deletes sent rows itself (its key sent_retention, see
-- docs/CONFIGURATION.md), through two functions that run as the owner of
-- schema outbox (SECURITY DEFINER, search_path pinned, every name
-- schema-qualified). Its role, outbox_relay, gets EXECUTE on them and no
-- DELETE on the table:
--
--   outbox.purge_sent(older_than, after_id, max_rows)
--     deletes up to max_rows rows that were sent more than older_than ago,
--     walking the primary key upward from after_id. Never a pending row,
--     never a quarantined one (neither has sent_at). It stops at the first
--     sent row younger than that, so a call reads about as many rows as it
--     deletes and never walks the rows it must keep; a row sent out of id
--     order is deleted once the rows in front of it are (later, never
--     earlier than older_than). Returns how many rows it deleted, the id to
--     go on from, and whether it reached the young rows (caught up).
--     One call is one short transaction: the relay calls it again while it
--     deletes full batches. oldest_kept is the sent time of the row it
--     stopped at: about the oldest sent row kept, for the relay's metrics.
--
--   outbox.delete_published(ids)
--     for sent_retention = 0: deletes, in the caller's transaction, the rows
--     it names that are neither sent nor quarantined: the rows the relay
--     claimed and has just published, instead of marking them sent. It
--     gives the relay no power it did not have: marking a row sent without
--     publishing it loses the message just as surely.
--
-- Idempotent like every file here.

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
DECLARE
    v_cutoff  timestamptz;
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
    v_cutoff := statement_timestamp() - p_older_than;
    caught_up := true;
    -- Pending and quarantined rows are stepped over, but only so many: a
    -- paused topic's backlog at the head of the table must not make one
    -- call long. The next call goes on from where this one stopped.
    FOR v_row IN
        SELECT m.id, m.sent_at FROM outbox.messages AS m
        WHERE m.id > v_last ORDER BY m.id
    LOOP
        IF v_row.sent_at IS NOT NULL AND v_row.sent_at >= v_cutoff THEN
            oldest_kept := v_row.sent_at;
            EXIT;
        END IF;
        IF v_row.sent_at IS NOT NULL THEN
            v_ids := v_ids || v_row.id;
        END IF;
        v_last := v_row.id;
        v_scanned := v_scanned + 1;
        IF cardinality(v_ids) >= p_max_rows OR v_scanned >= 10 * p_max_rows THEN
            caught_up := false;
            EXIT;
        END IF;
    END LOOP;
    DELETE FROM outbox.messages AS m
    WHERE m.id = ANY (v_ids) AND m.sent_at IS NOT NULL AND m.sent_at < v_cutoff;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    next_after_id := v_last;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.purge_sent(interval, bigint, integer) IS
    'Deletes up to max_rows rows sent more than older_than ago, from after_id upward; never a pending or quarantined row. The relay calls it for sent_retention.';

CREATE OR REPLACE FUNCTION outbox.delete_published(p_ids bigint[])
RETURNS integer
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH gone AS (
        DELETE FROM outbox.messages AS m
        WHERE m.id = ANY (p_ids) AND m.sent_at IS NULL AND m.failed_at IS NULL
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;

COMMENT ON FUNCTION outbox.delete_published(bigint[]) IS
    'With sent_retention = 0: deletes the rows the relay has just published, in its transaction, instead of marking them sent.';

-- Owned by the schema's owner, whoever applies this file.
DO $$
DECLARE
    v_schema_owner regrole;
    v_fn           regprocedure;
BEGIN
    SELECT nspowner::regrole INTO v_schema_owner FROM pg_namespace WHERE nspname = 'outbox';
    FOREACH v_fn IN ARRAY ARRAY['outbox.purge_sent(interval, bigint, integer)'::regprocedure,
                                'outbox.delete_published(bigint[])'::regprocedure]
    LOOP
        IF (SELECT proowner FROM pg_proc WHERE oid = v_fn) <> v_schema_owner THEN
            EXECUTE format('ALTER FUNCTION %s OWNER TO %s', v_fn, v_schema_owner);
        END IF;
    END LOOP;
END
$$;

REVOKE EXECUTE ON FUNCTION
    outbox.purge_sent(interval, bigint, integer),
    outbox.delete_published(bigint[])
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox.purge_sent(interval, bigint, integer),
    outbox.delete_published(bigint[])
    TO outbox_relay;

INSERT INTO outbox.schema_version (version, name)
VALUES (10, '010_retention.sql')
ON CONFLICT (version) DO NOTHING;
