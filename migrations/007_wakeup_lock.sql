-- outbox-relay schema, part 7: the wake-up flag becomes an advisory lock.
--
-- 006 made producers notify only while a relay is idle, but every inserting
-- statement still ran a plpgsql trigger that read the flag table: about 15
-- to 30 % of the producers' throughput at 16 concurrent producers even when
-- nothing was notified. Here the flag is PostgreSQL's own lock table.
--
-- A busy relay holds the session-level advisory lock
--   pg_advisory_lock(122550254464888)        -- "outbox" in ASCII
-- on its LISTEN connection. The trigger's WHEN clause asks for the same lock
-- in shared mode for the producer's transaction:
--   - the relay holds it (busy): the request fails at once, the trigger
--     function is not even called, and the producer pays one lock-table probe;
--   - nobody holds it (idle, or no relay running, or the relay's connection
--     died): the producer gets the shared lock until its commit and notifies.
-- The relay takes the lock with a short lock_timeout when it turns busy
-- (producers that are notifying hold it shared until they commit; while the
-- relay waits, new producers already skip the notification). When a claim
-- comes back empty it releases the lock, takes a transaction id as a marker
-- (every producer that skipped its notification got its id before that), waits
-- until no older transaction is running, and claims once more before it sleeps.
--
-- Do not use advisory lock 122550254464888 for anything else in this database.
-- Idempotent like every file here.

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
    WHEN (pg_try_advisory_xact_lock_shared(122550254464888))
    EXECUTE FUNCTION outbox.notify_relay();

-- The flag table of 006 has no reader left.
DROP TABLE IF EXISTS outbox.relay_wakeup;

INSERT INTO outbox.schema_version (version, name)
VALUES (7, '007_wakeup_lock.sql')
ON CONFLICT (version) DO NOTHING;
