-- outbox-relay schema, part 11: partitioned topics, for order per key.
--
-- A topic has 1 partition unless outbox.topics says otherwise. The relay
-- publishes a row of a topic with n partitions to the stream of the row's
-- partition (docs/PARTITIONS.md):
--
--   n = 1   "<stream_prefix><topic>"                 (as before)
--   n > 1   "<stream_prefix><topic>:<ppp>"           ppp = partition, 3 digits
--
--   partition = fnv1a32(UTF-8 bytes of partition_key) mod n
--               id mod n when partition_key is NULL (spread, no order)
--
-- FNV-1a 32: h = 2166136261; for each byte b: h = (h xor b) * 16777619
-- mod 2^32. The same function in any language gives the same partition;
-- docs/PARTITIONS.md has test vectors.
--
--   outbox.set_partitions(topic, n)   the owner's: sets a topic's count;
--                                     refused while the topic has unsent rows
--   outbox.partition_of(topic, key)   the partition a key's rows go to
--   outbox.fnv1a32(bytes)             the hash itself
--   messages_held_idx                 the rows that hold back their key
--
-- Idempotent like every file here.

CREATE TABLE IF NOT EXISTS outbox.topics (
    topic      text        PRIMARY KEY CHECK (topic ~ '^[A-Za-z0-9._-]{1,200}$'),
    partitions integer     NOT NULL CHECK (partitions BETWEEN 1 AND 1000),
    changed_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE outbox.topics IS
    'Partition counts of topics; a topic not listed has 1 partition. Change with outbox.set_partitions.';

CREATE OR REPLACE FUNCTION outbox.fnv1a32(p_data bytea)
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    h bigint := 2166136261;
BEGIN
    FOR i IN 0 .. length(p_data) - 1 LOOP
        h := ((h # get_byte(p_data, i)) * 16777619) & 4294967295;
    END LOOP;
    RETURN h;
END
$$;

COMMENT ON FUNCTION outbox.fnv1a32(bytea) IS
    'FNV-1a 32 of the bytes, as a bigint in [0, 2^32): the hash of partition keys.';

-- NULL for a NULL key: the relay spreads such rows by id, with no order.
CREATE OR REPLACE FUNCTION outbox.partition_of(p_topic text, p_key text)
RETURNS integer
LANGUAGE sql
STABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN p_key IS NOT NULL THEN
        (outbox.fnv1a32(convert_to(p_key, 'UTF8'))
         % coalesce((SELECT t.partitions FROM outbox.topics AS t WHERE t.topic = p_topic), 1))::integer
    END
$$;

COMMENT ON FUNCTION outbox.partition_of(text, text) IS
    'The partition the rows of this partition key go to: fnv1a32(UTF-8 key) mod the topic''s partitions.';

-- Changing the count moves keys to other partitions. Refused while the topic
-- has a row not yet sent (pending, being published, waiting to retry or
-- quarantined), so that every row of a key published before the change is in
-- its stream before the first one after it is claimed. The check and the
-- change hold a SHARE lock on outbox.messages: no row is inserted between
-- them. Returns the count before.
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
    LOCK TABLE outbox.messages IN SHARE MODE;
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
    RETURN v_before;
END
$$;

COMMENT ON FUNCTION outbox.set_partitions(text, integer) IS
    'Sets the number of partitions of a topic (1 to 1000); refused while the topic has unsent rows. Returns the count before.';

-- Order per key holds through failures: in a partitioned topic, a row that
-- is quarantined or waiting to retry holds back the later rows of its key
-- (the relay's claim skips them) until it is published, retried or dropped
-- (outbox-relay failed retry | drop). This index holds only such rows, so the
-- claim's check costs one probe of an almost empty index per row.
CREATE INDEX IF NOT EXISTS messages_held_idx
    ON outbox.messages (topic, partition_key, id)
    WHERE sent_at IS NULL AND (failed_at IS NOT NULL OR retry_at IS NOT NULL);

REVOKE EXECUTE ON FUNCTION outbox.set_partitions(text, integer) FROM PUBLIC;
-- Partition counts are no secret: consumers in any language read them to
-- compute partitions, and outbox-relay status reads them as any role.
GRANT SELECT ON outbox.topics TO PUBLIC;

INSERT INTO outbox.schema_version (version, name)
VALUES (11, '011_partitions.sql')
ON CONFLICT (version) DO NOTHING;
