-- outbox-relay schema, part 8: vacuum the outbox like the queue it is.
--
-- Marking a row sent writes a new row version that leaves the pending index
-- (messages_pending_idx), and the old version's entry stays in that index until
-- VACUUM removes it. The claim reads the pending index from its lowest id, so
-- it steps over every such entry: a million sent rows not yet vacuumed can
-- double or triple the cost of a claim. PostgreSQL's defaults vacuum a table
-- once a fifth of it is dead, which for an outbox of ten million rows means
-- two million dead entries in front of the claim.
--
-- For outbox.messages only:
--   autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 10000:
--     vacuum after 10,000 + 1 % of the table's rows were marked sent;
--   vacuum_index_cleanup = on: always clean the indexes, even when few heap
--     pages changed (PostgreSQL skips index cleanup under 2 % by default, which
--     is exactly the pending index's case: dead entries in a small index).
-- Each vacuum reads every index of the table, so keep the table small: delete
-- sent rows you no longer need, for example daily:
--   DELETE FROM outbox.messages WHERE sent_at < now() - interval '7 days';
--
-- Idempotent like every file here: the settings are set, not added. From
-- schema 19 on, outbox.messages is a partitioned table, which takes no such
-- settings and whose rows are not updated: applied again, this file leaves it
-- as it is.

DO $$
BEGIN
    IF (SELECT c.relkind FROM pg_class AS c WHERE c.oid = 'outbox.messages'::regclass) = 'r' THEN
        ALTER TABLE outbox.messages SET (
            autovacuum_vacuum_scale_factor = 0.01,
            autovacuum_vacuum_threshold = 10000,
            vacuum_index_cleanup = on
        );
    END IF;
END
$$;

INSERT INTO outbox.schema_version (version, name)
VALUES (8, '008_queue_vacuum.sql')
ON CONFLICT (version) DO NOTHING;
