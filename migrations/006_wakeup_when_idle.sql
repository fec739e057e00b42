-- outbox-relay schema, part 6: wake the relay only when it is idle.
--
-- A transaction that ran NOTIFY holds a cluster-wide lock through its commit,
-- WAL flush included, so a NOTIFY in every producer transaction turns group
-- commit into one-at-a-time commit under concurrency. A notification is only
-- a latency hint, so producers send one only while a relay has declared
-- itself idle. A busy relay claims again on its own until a claim comes back
-- empty; it then sets relay_idle, waits for every transaction that was
-- running at that moment (those may have read the old value and skipped the
-- notification), and claims once more before it waits for a notification.

CREATE TABLE IF NOT EXISTS outbox.relay_wakeup (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    -- true: producers notify. It starts true so that a relay without this
    -- protocol, or none at all, still gets its wake-ups.
    relay_idle boolean     NOT NULL DEFAULT true,
    changed_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO outbox.relay_wakeup DEFAULT VALUES ON CONFLICT DO NOTHING;

-- One row read per inserting statement, and a NOTIFY only while idle.
CREATE OR REPLACE FUNCTION outbox.notify_relay()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF coalesce((SELECT relay_idle FROM outbox.relay_wakeup), true) THEN
        PERFORM pg_notify('outbox_relay', '');
    END IF;
    RETURN NULL;
END
$$;

GRANT SELECT ON outbox.relay_wakeup TO outbox_producer;
GRANT SELECT, UPDATE (relay_idle, changed_at) ON outbox.relay_wakeup TO outbox_relay;

INSERT INTO outbox.schema_version (version, name)
VALUES (6, '006_wakeup_when_idle.sql')
ON CONFLICT (version) DO NOTHING;
