-- outbox-relay schema, part 9: producers write messages and read none.
--
-- 003 granted outbox_producer SELECT on id and message_id, so that INSERT ...
-- RETURNING message_id and outbox.enqueue could hand back the message_id. It
-- also let every producer read the ids and message ids of every topic's rows.
-- From here on:
--
--   * outbox.enqueue (the bytea one, which the text, jsonb and p_admit ones
--     call) runs as the owner of schema outbox: SECURITY DEFINER, with its
--     search_path pinned and every name schema-qualified. It returns the
--     message_id without its caller reading the table.
--   * outbox_producer has INSERT on the columns a producer writes, EXECUTE on
--     outbox.enqueue and outbox.admit, and SELECT on outbox.topic_state (005)
--     and outbox.schema_version (004); on outbox.messages nothing else.
--
-- A plain INSERT works as before; INSERT ... RETURNING is refused ("permission
-- denied for table messages"). A producer that needs the message_id calls
-- outbox.enqueue, or chooses it and inserts it:
--   INSERT INTO outbox.messages (message_id, topic, payload)
--   VALUES ('aa1f671e-88ba-467e-8694-61c72692f14a', 'orders', '{"order":9001}');
--
-- Idempotent like every file here; apply it after 003, which grants the SELECT
-- this file takes back.

CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic         text,
    p_partition_key text,
    p_payload       bytea,
    p_headers       jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO outbox.messages (topic, partition_key, payload, headers)
    VALUES (p_topic, p_partition_key, p_payload, p_headers)
    RETURNING message_id
$$;

-- A SECURITY DEFINER function runs with its owner's rights: let that be the
-- owner of the schema (whoever applies these files normally is), not whichever
-- role happened to apply this one.
DO $$
DECLARE
    v_schema_owner regrole;
    v_owner        regrole;
BEGIN
    SELECT n.nspowner::regrole, p.proowner::regrole INTO v_schema_owner, v_owner
    FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
    WHERE p.oid = 'outbox.enqueue(text, text, bytea, jsonb)'::regprocedure;
    IF v_owner <> v_schema_owner THEN
        EXECUTE format('ALTER FUNCTION outbox.enqueue(text, text, bytea, jsonb) OWNER TO %s',
                       v_schema_owner);
    END IF;
END
$$;

COMMENT ON FUNCTION outbox.enqueue(text, text, bytea, jsonb) IS
    'Enqueues a message in the caller''s transaction and returns its message_id; runs as the schema owner, so producers need no SELECT on outbox.messages.';

-- Everything a producer may do on the table, stated once: insert these columns.
REVOKE ALL ON outbox.messages FROM outbox_producer;
GRANT INSERT (message_id, topic, partition_key, payload, headers)
    ON outbox.messages TO outbox_producer;

-- Functions are executable by PUBLIC by default; 003 and 005 took that away.
-- The producers' functions, stated once as well.
GRANT EXECUTE ON FUNCTION
    outbox.enqueue(text, text, bytea, jsonb),
    outbox.enqueue(text, text, text, jsonb),
    outbox.enqueue(text, text, jsonb, jsonb),
    outbox.enqueue(text, text, bytea, jsonb, boolean),
    outbox.enqueue(text, text, text, jsonb, boolean),
    outbox.enqueue(text, text, jsonb, jsonb, boolean),
    outbox.admit(text)
    TO outbox_producer;

INSERT INTO outbox.schema_version (version, name)
VALUES (9, '009_producer_grants.sql')
ON CONFLICT (version) DO NOTHING;
