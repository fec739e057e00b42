-- outbox-relay schema, part 12: several relays share the partitions.
--
-- Each row of a partitioned topic records its partition when it is written,
-- so that a relay's claim can take the rows of the partitions it owns
-- without hashing every pending key (docs/DESIGN.md, "Several relays"):
--
--   outbox.messages.partition_no   the row's partition (docs/PARTITIONS.md),
--                                  NULL in a topic of one partition
--   messages_partition             the BEFORE INSERT trigger that sets it,
--                                  for the partitioned topics alone
--   outbox.row_partition(t, k, id) the partition of a row: fnv1a32(key) mod
--                                  n, id mod n without a key, NULL when the
--                                  topic has one partition
--
-- The relays divide the partitions among themselves with session advisory
-- locks in the two-key form (pg_advisory_lock(int, int)); do not use these
-- first keys for anything else in this database:
--
--   1869770093  member slots: one per running relay
--   1869770100  partitions: held by the relay that owns one
--   1869770086  the takeover fence: shared by each claim of a partition,
--               taken alone by a relay that takes the partition over
--
-- Idempotent like every file here.

ALTER TABLE outbox.messages ADD COLUMN IF NOT EXISTS partition_no integer;

COMMENT ON COLUMN outbox.messages.partition_no IS
    'The row''s partition in a partitioned topic (set on insert), NULL in a topic of one partition.';

CREATE OR REPLACE FUNCTION outbox.row_partition(p_topic text, p_key text, p_id bigint)
RETURNS integer
LANGUAGE plpgsql
STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n integer;
    h bigint := 2166136261;
    b bytea;
BEGIN
    SELECT t.partitions INTO n FROM outbox.topics AS t WHERE t.topic = p_topic AND t.partitions > 1;
    IF n IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_key IS NULL THEN
        RETURN (p_id % n)::integer;
    END IF;
    -- fnv1a32, inline: a call per byte would double the cost of an insert.
    b := convert_to(p_key, 'UTF8');
    FOR i IN 0 .. length(b) - 1 LOOP
        h := ((h # get_byte(b, i)) * 16777619) & 4294967295;
    END LOOP;
    RETURN (h % n)::integer;
END
$$;

COMMENT ON FUNCTION outbox.row_partition(text, text, bigint) IS
    'The partition of a row: fnv1a32(UTF-8 key) mod partitions, id mod partitions without a key, NULL for a topic of one partition.';

CREATE OR REPLACE FUNCTION outbox.set_partition_no()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.partition_no := outbox.row_partition(NEW.topic, NEW.partition_key, NEW.id);
    RETURN NEW;
END
$$;

-- The trigger exists only while some topic is partitioned, and its WHEN
-- clause names those topics: a row of any other topic costs its producer a
-- comparison, not a function call (7 us a row). outbox.set_partitions
-- rewrites it, under the same lock that keeps inserts out while it runs.
CREATE OR REPLACE FUNCTION outbox.sync_partition_trigger()
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_topics text;
BEGIN
    SELECT string_agg(quote_literal(t.topic), ', ' ORDER BY t.topic) INTO v_topics
    FROM outbox.topics AS t WHERE t.partitions > 1;
    DROP TRIGGER IF EXISTS messages_partition ON outbox.messages;
    IF v_topics IS NOT NULL THEN
        EXECUTE format('CREATE TRIGGER messages_partition BEFORE INSERT ON outbox.messages'
                       ' FOR EACH ROW WHEN (NEW.topic IN (%s))'
                       ' EXECUTE FUNCTION outbox.set_partition_no()', v_topics);
    END IF;
END
$$;

COMMENT ON FUNCTION outbox.sync_partition_trigger() IS
    'Rewrites the trigger that records the partition of each new row, for the topics partitioned now.';

CREATE OR REPLACE FUNCTION outbox.set_partitions(p_topic text, p_partitions integer)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_before integer;
    v_unsent bigint;
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
REVOKE EXECUTE ON FUNCTION outbox.sync_partition_trigger() FROM PUBLIC;

SELECT outbox.sync_partition_trigger();

-- Rows written before this file, in topics already partitioned.
UPDATE outbox.messages AS m
SET partition_no = outbox.row_partition(m.topic, m.partition_key, m.id)
WHERE m.sent_at IS NULL AND m.partition_no IS NULL
  AND m.topic IN (SELECT t.topic FROM outbox.topics AS t WHERE t.partitions > 1);

INSERT INTO outbox.schema_version (version, name)
VALUES (12, '012_partition_owners.sql')
ON CONFLICT (version) DO NOTHING;
