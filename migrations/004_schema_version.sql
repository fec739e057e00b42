-- outbox-relay schema, last part: the version the relay checks at start-up.
-- A relay that needs a newer schema names the migration file to apply.

CREATE TABLE IF NOT EXISTS outbox.schema_version (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

GRANT SELECT ON outbox.schema_version TO outbox_relay, outbox_producer;

INSERT INTO outbox.schema_version (version, name)
VALUES (4, '004_schema_version.sql')
ON CONFLICT (version) DO NOTHING;
