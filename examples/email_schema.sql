-- The example email consumer's own table, in the consumer's database. Apply it
-- after migrations/consumer/*.sql. It deliberately has no unique constraint on
-- message_id: exactly-once comes from outbox_consumer.processed, and the tests
-- count duplicates here to prove it.
CREATE TABLE IF NOT EXISTS emails (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id uuid        NOT NULL,
    order_id   bigint,
    customer   text,
    consumer   text        NOT NULL,
    sent_at    timestamptz NOT NULL DEFAULT now()
);
