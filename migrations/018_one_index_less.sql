-- outbox-relay schema, part 18: one index less for every producer's row.
--
-- messages_pending_idx (001) indexed the ids of the rows not yet sent, for the
-- claim of the per-message relay. Since schema 16 no row is marked sent or
-- failed (a row is published once its stream's recorded position has passed
-- it), so the index holds every row's id: a second primary key that each
-- insert writes and no statement reads (the batch reads walk
-- messages_txid_idx, retention and the tools the primary key, the per-topic
-- figures messages_pending_topic_idx). Dropping it saves each producer one
-- index entry a row (docs/PERFORMANCE.md, "The batch relay against PgQ").
--
-- DROP INDEX holds outbox.messages exclusively for a moment: producers wait
-- for this transaction, as for the ALTER TABLE of 016.
--
-- One transaction (BEGIN ... COMMIT below), idempotent like every file here.

BEGIN;

DROP INDEX IF EXISTS outbox.messages_pending_idx;

INSERT INTO outbox.schema_version (version, name)
VALUES (18, '018_one_index_less.sql')
ON CONFLICT (version) DO NOTHING;

COMMIT;
