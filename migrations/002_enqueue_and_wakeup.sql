-- outbox-relay schema, part 2: the producers' enqueue function and the wake-up.

-- outbox.enqueue: one well-tested path for producers in any language. Call it
-- inside the transaction that writes the business change. Returns the message_id.
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic         text,
    p_partition_key text,
    p_payload       bytea,
    p_headers       jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE sql
VOLATILE
AS $$
    INSERT INTO outbox.messages (topic, partition_key, payload, headers)
    VALUES (p_topic, p_partition_key, p_payload, p_headers)
    RETURNING message_id
$$;

-- Text payloads are stored as their UTF-8 bytes.
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic         text,
    p_partition_key text,
    p_payload       text,
    p_headers       jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE sql
VOLATILE
AS $$
    SELECT outbox.enqueue(p_topic, p_partition_key, convert_to(p_payload, 'UTF8'), p_headers)
$$;

-- JSON payloads are stored as their canonical jsonb text.
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic         text,
    p_partition_key text,
    p_payload       jsonb,
    p_headers       jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE sql
VOLATILE
AS $$
    SELECT outbox.enqueue(p_topic, p_partition_key, convert_to(p_payload::text, 'UTF8'), p_headers)
$$;

-- The wake-up: one NOTIFY per inserting statement, not per row. A notification
-- is only a latency hint (the relay also polls); PostgreSQL folds identical
-- notifications of one transaction into one.
CREATE OR REPLACE FUNCTION outbox.notify_relay()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', '');
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS messages_notify ON outbox.messages;
CREATE TRIGGER messages_notify
    AFTER INSERT ON outbox.messages
    FOR EACH STATEMENT
    EXECUTE FUNCTION outbox.notify_relay();
