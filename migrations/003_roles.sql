-- outbox-relay schema, part 3: least-privilege roles.
--
-- outbox_producer: may only insert messages (directly or through outbox.enqueue).
-- outbox_relay:    may only read messages and mark them sent or failed.
-- Both are NOLOGIN groups: grant them to your login roles, e.g.
--   CREATE ROLE relay LOGIN PASSWORD '...' IN ROLE outbox_relay;
--   GRANT outbox_producer TO order_service;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_producer') THEN
        CREATE ROLE outbox_producer NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_relay') THEN
        CREATE ROLE outbox_relay NOLOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA outbox TO outbox_producer, outbox_relay;

GRANT INSERT (message_id, topic, partition_key, payload, headers)
    ON outbox.messages TO outbox_producer;
-- INSERT ... RETURNING (and outbox.enqueue, which returns the message_id)
-- needs SELECT on the returned columns; nothing else is readable.
-- 009_producer_grants.sql takes this SELECT back: enqueue returns the
-- message_id as the schema owner, and producers read no column at all.
GRANT SELECT (id, message_id) ON outbox.messages TO outbox_producer;
GRANT EXECUTE ON FUNCTION
    outbox.enqueue(text, text, bytea, jsonb),
    outbox.enqueue(text, text, text, jsonb),
    outbox.enqueue(text, text, jsonb, jsonb)
    TO outbox_producer;

-- SELECT ... FOR UPDATE needs UPDATE on some column; the relay may change only
-- the delivery columns, never what a producer wrote.
GRANT SELECT ON outbox.messages TO outbox_relay;
GRANT UPDATE (sent_at, attempts, last_error, retry_at, failed_at)
    ON outbox.messages TO outbox_relay;

-- Functions are executable by PUBLIC by default; keep enqueue to producers.
REVOKE EXECUTE ON FUNCTION
    outbox.enqueue(text, text, bytea, jsonb),
    outbox.enqueue(text, text, text, jsonb),
    outbox.enqueue(text, text, jsonb, jsonb)
    FROM PUBLIC;
