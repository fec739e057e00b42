-- outbox-relay CONSUMER schema, last part: the version of this set of files,
-- in the consumer's database (see 001_processed.sql). It is numbered on its
-- own, separately from the producer's outbox.schema_version: the two sets
-- live in different databases and change at different times. Check it from
-- the consumer at start-up, e.g.
--   SELECT max(version) FROM outbox_consumer.schema_version;  -- expect 2

CREATE TABLE IF NOT EXISTS outbox_consumer.schema_version (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

GRANT SELECT ON outbox_consumer.schema_version TO outbox_consumer;

INSERT INTO outbox_consumer.schema_version (version, name)
VALUES (2, '002_schema_version.sql')
ON CONFLICT (version) DO NOTHING;
