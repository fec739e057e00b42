-- outbox-relay schema, part 12: several relays share the partitions.
--
-- Each row of a partitioned topic records its partition when it is written,
-- so that a relay's claim can take the rows of the partitions it owns
-- without hashing every pending key (docs/DESIGN.md, "Several relays"):
--
--   outbox.messages.partition_no   the row's partition (docs/PARTITIONS.md),
--                                  NULL in a topic of one partition
--   messages_partition             the BEFORE INSERT trigger that sets it
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

DROP TRIGGER IF EXISTS messages_partition ON outbox.messages;
CREATE TRIGGER messages_partition
    BEFORE INSERT ON outbox.messages
    FOR EACH ROW EXECUTE FUNCTION outbox.set_partition_no();

-- Rows written before this file, in topics already partitioned.
UPDATE outbox.messages AS m
SET partition_no = outbox.row_partition(m.topic, m.partition_key, m.id)
WHERE m.sent_at IS NULL AND m.partition_no IS NULL
  AND m.topic IN (SELECT t.topic FROM outbox.topics AS t WHERE t.partitions > 1);

INSERT INTO outbox.schema_version (version, name)
VALUES (12, '012_partition_owners.sql')
ON CONFLICT (version) DO NOTHING;
