-- outbox-relay schema, part 15: outbox.set_partitions refuses a count that
-- would take the partitions of all topics past 4096.
--
-- The relays divide at most 4096 partitions among themselves (UNITS_MAX in
-- relay/ownership_io.c, one advisory lock per partition in each owner session). A
-- topic past it was left out of the division: its rows recorded a partition
-- that no relay would take, and stayed unsent. The limit is now enforced
-- where counts are set, under the lock that already serialises them.
--
-- Idempotent like every file here. CREATE OR REPLACE keeps the function's
-- owner and grants.

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
    SELECT count(*) INTO v_unsent
    FROM (SELECT 1 FROM outbox.messages AS m
          WHERE m.topic = p_topic AND m.sent_at IS NULL LIMIT 1000000) AS u;
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

INSERT INTO outbox.schema_version (version, name)
VALUES (15, '015_partition_total.sql')
ON CONFLICT (version) DO NOTHING;
