-- outbox-relay schema, part 13: outbox.delete_published finds its rows by
-- primary key, whatever the statistics say.
--
-- Its DELETE named the rows by id and required them pending (sent_at and
-- failed_at NULL). That condition is the predicate of messages_pending_idx
-- and messages_pending_topic_idx, so the planner could also read one of
-- those partial indexes whole and filter on the id. With statistics taken
-- while the outbox was empty it did: a relay that started on an empty
-- outbox spent 500-600 ms deleting each batch of a 300,000-row burst until
-- autovacuum analysed the table, against 0.5 ms by primary key. Written
-- with num_nulls, the same condition matches no index predicate, and the
-- primary key is the only index that serves it.
--
-- Idempotent like every file here.

CREATE OR REPLACE FUNCTION outbox.delete_published(p_ids bigint[])
RETURNS integer
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH gone AS (
        DELETE FROM outbox.messages AS m
        WHERE m.id = ANY (p_ids) AND num_nulls(m.sent_at, m.failed_at) = 2
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;

COMMENT ON FUNCTION outbox.delete_published(bigint[]) IS
    'With sent_retention = 0: deletes the rows the relay has just published, in its transaction, instead of marking them sent.';

REVOKE EXECUTE ON FUNCTION outbox.delete_published(bigint[]) FROM PUBLIC;

INSERT INTO outbox.schema_version (version, name)
VALUES (13, '013_pinned_plans.sql')
ON CONFLICT (version) DO NOTHING;
