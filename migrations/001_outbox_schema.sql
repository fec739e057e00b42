-- outbox-relay schema, part 1: the outbox table that producers write to.
--
-- Apply every file of this directory in name order, for example with
--   for f in migrations/*.sql; do psql -v ON_ERROR_STOP=1 -f "$f"; done
-- Each file is idempotent: applying it a second time fails nothing and changes nothing.

CREATE SCHEMA IF NOT EXISTS outbox;

COMMENT ON SCHEMA outbox IS 'Transactional outbox: rows committed here are published to Redis Streams by outbox-relay.';

CREATE TABLE IF NOT EXISTS outbox.messages (
    -- Claim order. Identity values are taken at insert time, so id order is not
    -- commit order: the relay claims by state, never by "id > last seen".
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The idempotency key that consumers see as the entry's "id" field.
    message_id    uuid        NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    -- Where it goes: stream "<stream_prefix><topic>". [A-Za-z0-9._-]{1,200}.
    topic         text        NOT NULL,
    partition_key text,
    payload       bytea       NOT NULL,
    -- A flat JSON object of string values; each becomes a field "h.<name>".
    headers       jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    sent_at       timestamptz,
    -- Per-row failures (payload too large, bad topic, WRONGTYPE on the stream key).
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    retry_at      timestamptz,
    -- Set when the relay gave up on the row (at once for a permanent failure,
    -- when attempts reached max_attempts for a transient one): the row is
    -- quarantined and skipped until an operator re-queues it (outbox-relay failed retry).
    failed_at     timestamptz
);

-- The claim reads only pending rows, in id order: this partial index keeps it
-- O(batch) however many sent rows the table still holds.
CREATE INDEX IF NOT EXISTS messages_pending_idx
    ON outbox.messages (id)
    WHERE sent_at IS NULL AND failed_at IS NULL;

-- Quarantined rows, for "outbox-relay failed list".
CREATE INDEX IF NOT EXISTS messages_failed_idx
    ON outbox.messages (id)
    WHERE failed_at IS NOT NULL AND sent_at IS NULL;
