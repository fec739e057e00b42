-- outbox-relay consumer side, part 3: purge the processed table in batches.
--
-- outbox_consumer.processed gains a row per message a group handled.
-- purge_processed (001) deleted every row older than its interval in one
-- statement: after a long pause, millions of rows in one transaction. It now
-- deletes the rows handled more than older_than ago, oldest first, at most
-- max_rows per call (so each call is one short transaction), and returns how
-- many it deleted: call it again while it returns max_rows, for example from
-- cron:
--
--   SELECT outbox_consumer.purge_processed(interval '30 days');
--
-- As before it refuses an interval under 1 day.
-- older_than must stay longer than the time within which a message can come
-- again (docs/CONSUMERS.md, "Purging the processed table"): its redeliveries
-- (the sum of the consumer's backoff steps over max_deliveries), and the
-- relay's stream_retention. A row deleted earlier lets a late duplicate
-- through as a new message.
--
-- Idempotent like every file here.

DROP FUNCTION IF EXISTS outbox_consumer.purge_processed(interval);

CREATE OR REPLACE FUNCTION outbox_consumer.purge_processed(
    older_than interval,
    max_rows   integer DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_deleted bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '1 day' THEN
        RAISE EXCEPTION 'outbox_consumer.purge_processed: retention % is shorter than 1 day',
                coalesce(older_than::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Keep processed rows longer than any redelivery can come: the retry '
                         'backoffs (about 19 minutes by default), the relay''s stream_retention, '
                         'and as long as dead letters are kept before a replay. 30 days is the '
                         'recommended default.';
    END IF;
    IF max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION 'outbox_consumer.purge_processed: max_rows must be 1 or more'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Oldest first, through processed_handled_at_idx.
    DELETE FROM outbox_consumer.processed AS p
    USING (SELECT q.consumer, q.message_id FROM outbox_consumer.processed AS q
           WHERE q.handled_at < now() - older_than
           ORDER BY q.handled_at LIMIT max_rows) AS old
    WHERE p.consumer = old.consumer AND p.message_id = old.message_id;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END
$$;

COMMENT ON FUNCTION outbox_consumer.purge_processed(interval, integer) IS
    'Deletes up to max_rows processed rows handled more than older_than ago, oldest first; returns how many. Call again while it returns max_rows.';

REVOKE EXECUTE ON FUNCTION outbox_consumer.purge_processed(interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_consumer.purge_processed(interval, integer) TO outbox_consumer;

INSERT INTO outbox_consumer.schema_version (version, name)
VALUES (3, '003_purge_processed.sql')
ON CONFLICT (version) DO NOTHING;
