-- outbox-relay CONSUMER schema, part 1: the processed table that makes a
-- consumer's effects happen once per message.
--
-- These files are for the CONSUMER's own database (the one its handler writes
-- its effects to), which is usually not the producer's: apply them there, not
-- the files of ../ (those are the producer's outbox). Apply every file of this
-- directory in name order, for example with
--   for f in migrations/consumer/*.sql; do psql -v ON_ERROR_STOP=1 -d billing -f "$f"; done
-- or with your own migration tool. Each file is idempotent: applying it a
-- second time fails nothing and changes nothing.
--
-- Why: Redis Streams deliver at least once. A consumer that crashes after its
-- effect committed but before XACK, a retry after a timeout, a message taken
-- over from a consumer that died, or a dead letter replayed by an operator
-- all deliver the same message (same "id" field) again. Recording the id in
-- the same transaction as the effect turns those into no-ops:
--
--   BEGIN;
--   SELECT outbox_consumer.begin_message('billing', 'aa1f671e-88ba-467e-8694-61c72692f14a');
--     -- true:  new message: apply the effect here, in this transaction
--     --        (INSERT INTO invoices ...), then COMMIT, then XACK.
--     -- false: already processed: COMMIT (there is nothing to do) and XACK.
--   COMMIT;
--
-- Rules:
-- * The begin_message call and the effect must be in ONE transaction. If the
--   transaction rolls back (a crash, an error in the effect), the processed
--   row goes with it and the next delivery applies the effect.
-- * Acknowledge (XACK) only after COMMIT. A crash between the two only
--   causes a redelivery, which begin_message answers with false.
-- * Two deliveries of one message that run at the same time (a take-over of a
--   slow consumer) cannot both apply the effect: the second begin_message
--   waits on the primary key until the first transaction ends, then returns
--   false (it committed) or true (it rolled back).
-- * The consumer name is the consumer GROUP's name (e.g. "email", "billing"),
--   not the name of one process: every process of the group shares it, so a
--   message taken over by another process is still recognised.
-- * Effects outside this database (an e-mail, an HTTP call) are not covered:
--   make those idempotent themselves, e.g. send the message id as an
--   idempotency key.
--
-- Retention: outbox_consumer.purge_processed deletes old rows (run it daily).
-- A row must outlive every possible redelivery of its message:
-- * retries: the sum of the consumer's backoffs, by default 1 s + 10 s +
--   100 s + 1000 s, about 19 minutes (plus the time handlers take);
-- * dead letters: a message can sit in the dead-letter stream
--   "<stream>.<group>.dlq" until an operator replays it, and a replay keeps the
--   message id, so keep processed rows at least as long as dead letters are
--   kept;
-- * the relay: after a crash whose commit outcome it could not know, the relay
--   republishes a batch; its dedup records hide that for dedup_ttl (24 h by
--   default), and a Redis that lost data can bring a duplicate back later.
-- 30 days is the recommended default; never less than 1 day (enforced).

CREATE SCHEMA IF NOT EXISTS outbox_consumer;

COMMENT ON SCHEMA outbox_consumer IS 'outbox-relay consumer side: messages already processed, for idempotent handlers.';

CREATE TABLE IF NOT EXISTS outbox_consumer.processed (
    -- The consumer group's name: one message is processed once per group.
    consumer   text        NOT NULL,
    -- The stream entry's "id" field (outbox.messages.message_id).
    message_id uuid        NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

COMMENT ON TABLE outbox_consumer.processed IS 'One row per (consumer group, message id) whose effect committed; written by outbox_consumer.begin_message in the effect''s transaction.';

-- purge_processed deletes by age: this keeps it from scanning the whole table.
CREATE INDEX IF NOT EXISTS processed_handled_at_idx
    ON outbox_consumer.processed (handled_at);

-- Called inside the consumer's transaction, before the effect. Records the
-- message and returns true when it is new; returns false when this consumer
-- already processed it (nothing to do: commit and acknowledge).
CREATE OR REPLACE FUNCTION outbox_consumer.begin_message(p_consumer text, p_message_id uuid)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    IF p_consumer IS NULL OR p_consumer = '' THEN
        RAISE EXCEPTION 'outbox_consumer.begin_message: consumer must be a non-empty name'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the consumer group''s name, the same for every process of the group.';
    END IF;
    IF p_message_id IS NULL THEN
        RAISE EXCEPTION 'outbox_consumer.begin_message: message id must not be NULL'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the stream entry''s "id" field.';
    END IF;
    INSERT INTO outbox_consumer.processed (consumer, message_id)
    VALUES (p_consumer, p_message_id)
    ON CONFLICT (consumer, message_id) DO NOTHING;
    -- FOUND: a row was inserted, so this message is new for this consumer.
    RETURN FOUND;
END
$$;

COMMENT ON FUNCTION outbox_consumer.begin_message(text, uuid) IS 'Call in the effect''s transaction: true = new message, apply the effect; false = already processed, commit and acknowledge.';

-- Retention: deletes the rows handled more than p_older_than ago and returns
-- how many. Refuses less than 1 day: redeliveries can come that late (see the
-- retention rule at the top of this file).
CREATE OR REPLACE FUNCTION outbox_consumer.purge_processed(p_older_than interval)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    deleted bigint;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '1 day' THEN
        RAISE EXCEPTION 'outbox_consumer.purge_processed: retention % is shorter than 1 day',
                coalesce(p_older_than::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Keep processed rows longer than any redelivery can come: the retry '
                         'backoffs (about 19 minutes by default) and as long as dead letters '
                         'are kept before a replay. 30 days is the recommended default.';
    END IF;
    DELETE FROM outbox_consumer.processed WHERE handled_at < now() - p_older_than;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

COMMENT ON FUNCTION outbox_consumer.purge_processed(interval) IS 'Deletes processed rows older than the interval (at least 1 day; 30 days recommended) and returns how many.';

-- outbox_consumer: a NOLOGIN group with what a consumer needs, nothing else.
-- Grant it to the consumer's login role, e.g.
--   CREATE ROLE billing_consumer LOGIN PASSWORD '...' IN ROLE outbox_consumer;
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_consumer') THEN
        CREATE ROLE outbox_consumer NOLOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA outbox_consumer TO outbox_consumer;
-- The functions run with the caller's rights: begin_message needs INSERT,
-- purge_processed DELETE (and SELECT for its WHERE clause).
GRANT SELECT, INSERT, DELETE ON outbox_consumer.processed TO outbox_consumer;

-- Functions are executable by PUBLIC by default; keep them to the role.
REVOKE EXECUTE ON FUNCTION
    outbox_consumer.begin_message(text, uuid),
    outbox_consumer.purge_processed(interval)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    outbox_consumer.begin_message(text, uuid),
    outbox_consumer.purge_processed(interval)
    TO outbox_consumer;
