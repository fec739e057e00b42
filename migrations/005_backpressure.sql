-- outbox-relay schema, part 5: producer backpressure.
--
-- A queue that nobody pushes back on accepts work it cannot finish: the only
-- symptom is a queue age that keeps rising. This file lets the application
-- team set, per topic, how old (max_queue_age) or how deep (max_pending) the
-- outbox may get before producers are refused, and lets producers ask, in
-- O(1), whether they may write:
--
--   outbox.topic_limits     set by the application team (high and low water marks)
--   outbox.topic_state      written by the relay every few seconds per topic
--   outbox.observe_topic()  the relay's call: records what it saw, applies the
--                           hysteresis, returns whether the topic admits
--   outbox.admit()          the producer's call, inside its transaction, before
--                           writing: raises SQLSTATE OB503 when the topic is full
--   outbox.enqueue(..., p_admit => true)   admit, then enqueue, in one call
--
-- OB503 is RETRYABLE: nothing was written (the producer's transaction is
-- aborted by the error; roll it back), the topic admits again once the relay
-- has drained it below its resume limits. Map it to HTTP 503 with a
-- Retry-After header (a few seconds), never to a 4xx or a 500.
--
--   BEGIN;
--   SELECT outbox.admit('orders');            -- raises OB503 when over the limit
--   INSERT INTO orders ...;
--   SELECT outbox.enqueue('orders', '9001', '{"order":9001}'::jsonb);
--   COMMIT;
--
-- The decision is the relay's, made from what it last observed; admit() only
-- reads it (one primary-key lookup, never a count or a scan of the outbox).
-- If no relay observes a topic (none is running, or the topic has no stream
-- yet), its state does not change: a topic with no state admits, and a topic
-- refused when the last relay stopped stays refused until a relay observes it
-- again or an operator runs
--   UPDATE outbox.topic_state SET admitting = true WHERE topic = 'orders';
--
-- Idempotent like every file here: applying it again fails nothing and
-- changes nothing (limits and state rows are kept).

-- The oldest pending row of ONE topic in O(log n), and the span of its pending
-- ids, for the relay's per-topic observation:
--   SELECT created_at FROM outbox.messages
--   WHERE topic = $1 AND sent_at IS NULL AND failed_at IS NULL ORDER BY id LIMIT 1
CREATE INDEX IF NOT EXISTS messages_pending_topic_idx
    ON outbox.messages (topic, id)
    WHERE sent_at IS NULL AND failed_at IS NULL;

-- Limits, one row per topic, set by the application team. Each limit is a
-- pair: producers are refused when the topic goes OVER the max (high-water)
-- mark, and admitted again only when it is back BELOW the resume (low-water)
-- mark, so the admission does not flap around one threshold. Set a pair
-- completely or leave it NULL (that dimension is then not limited); a topic
-- without a row is never limited.
--
--   INSERT INTO outbox.topic_limits (topic, max_queue_age, resume_queue_age)
--   VALUES ('orders', '1 minute', '20 seconds')
--   ON CONFLICT (topic) DO UPDATE SET max_queue_age = EXCLUDED.max_queue_age,
--                                     resume_queue_age = EXCLUDED.resume_queue_age;
CREATE TABLE IF NOT EXISTS outbox.topic_limits (
    topic            text     PRIMARY KEY,
    max_queue_age    interval,
    resume_queue_age interval,
    max_pending      bigint,
    resume_pending   bigint,
    CONSTRAINT topic_limits_queue_age_pair
        CHECK ((max_queue_age IS NULL) = (resume_queue_age IS NULL)),
    CONSTRAINT topic_limits_queue_age_hysteresis
        CHECK (resume_queue_age < max_queue_age),
    CONSTRAINT topic_limits_queue_age_positive
        CHECK (resume_queue_age > interval '0'),
    CONSTRAINT topic_limits_pending_pair
        CHECK ((max_pending IS NULL) = (resume_pending IS NULL)),
    CONSTRAINT topic_limits_pending_hysteresis
        CHECK (resume_pending < max_pending),
    CONSTRAINT topic_limits_pending_positive
        CHECK (resume_pending > 0)
);

COMMENT ON TABLE outbox.topic_limits IS
    'Producer backpressure limits per topic, set by the application team; read by outbox.observe_topic. A topic without a row is not limited.';
COMMENT ON COLUMN outbox.topic_limits.max_queue_age IS
    'Refuse producers when the oldest pending row of the topic is older than this (high-water mark). NULL together with resume_queue_age: no age limit.';
COMMENT ON COLUMN outbox.topic_limits.resume_queue_age IS
    'Admit producers again only when the oldest pending row is younger than this (low-water mark); must be above zero and below max_queue_age.';
COMMENT ON COLUMN outbox.topic_limits.max_pending IS
    'Refuse producers when more rows than this wait in the outbox for the topic (high-water mark). NULL together with resume_pending: no depth limit.';
COMMENT ON COLUMN outbox.topic_limits.resume_pending IS
    'Admit producers again only when fewer rows than this wait (low-water mark); must be above zero and below max_pending.';

-- What the relay last observed per topic, and its admission verdict. Written
-- only through outbox.observe_topic; read by outbox.admit with one lookup of
-- its primary key.
CREATE TABLE IF NOT EXISTS outbox.topic_state (
    topic             text        PRIMARY KEY,
    -- Rows waiting in the outbox (the relay may report an upper-bound estimate).
    pending           bigint      NOT NULL,
    -- created_at of the oldest waiting row; NULL when none waits.
    oldest_pending_at timestamptz,
    admitting         boolean     NOT NULL DEFAULT true,
    updated_at        timestamptz NOT NULL,
    CONSTRAINT topic_state_pending_nonnegative CHECK (pending >= 0)
);

COMMENT ON TABLE outbox.topic_state IS
    'Per topic: what outbox-relay last observed and whether producers are admitted. Written by outbox.observe_topic, read by outbox.admit.';

-- outbox.observe_topic: the relay's call, every few seconds per topic, in its
-- own short transaction. Records what it saw and applies the hysteresis
-- against outbox.topic_limits:
--   admitting now:  stop admitting when queue age (now() - p_oldest_pending_at)
--                   > max_queue_age, or p_pending > max_pending;
--   refusing now:   admit again only when queue age < resume_queue_age AND
--                   p_pending < resume_pending (pairs left NULL do not count);
--   no limits row:  admit.
-- An empty topic (p_pending 0, p_oldest_pending_at NULL) has queue age zero,
-- so it always admits again. Returns the new admitting value.
CREATE OR REPLACE FUNCTION outbox.observe_topic(
    p_topic             text,
    p_pending           bigint,
    p_oldest_pending_at timestamptz)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_was        boolean;
    v_limits     outbox.topic_limits%ROWTYPE;
    v_has_limits boolean;
    v_age        interval;
    v_admitting  boolean;
BEGIN
    IF p_topic IS NULL OR p_pending IS NULL OR p_pending < 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('outbox.observe_topic(%L, %s, %L): the topic and a pending count'
                             ' of zero or more are required', p_topic,
                             coalesce(p_pending::text, 'NULL'), p_oldest_pending_at);
    END IF;

    -- Serialises relays observing the same topic at the same time.
    SELECT s.admitting INTO v_was
    FROM outbox.topic_state AS s
    WHERE s.topic = p_topic
    FOR UPDATE;
    IF NOT FOUND THEN
        v_was := true;
    END IF;

    SELECT l.* INTO v_limits
    FROM outbox.topic_limits AS l
    WHERE l.topic = p_topic;
    v_has_limits := FOUND;

    v_age := CASE WHEN p_oldest_pending_at IS NULL THEN interval '0'
                  ELSE greatest(now() - p_oldest_pending_at, interval '0') END;

    IF NOT v_has_limits THEN
        v_admitting := true;
    ELSIF v_was THEN
        v_admitting := NOT (
            coalesce(v_age > v_limits.max_queue_age, false)
            OR coalesce(p_pending > v_limits.max_pending, false));
    ELSE
        v_admitting := coalesce(v_age < v_limits.resume_queue_age, true)
                       AND coalesce(p_pending < v_limits.resume_pending, true);
    END IF;

    INSERT INTO outbox.topic_state AS s
        (topic, pending, oldest_pending_at, admitting, updated_at)
    VALUES (p_topic, p_pending, p_oldest_pending_at, v_admitting, now())
    ON CONFLICT (topic) DO UPDATE
        SET pending = EXCLUDED.pending,
            oldest_pending_at = EXCLUDED.oldest_pending_at,
            admitting = EXCLUDED.admitting,
            updated_at = EXCLUDED.updated_at;

    RETURN v_admitting;
END
$$;

COMMENT ON FUNCTION outbox.observe_topic(text, bigint, timestamptz) IS
    'outbox-relay records what it observed of a topic; applies the hysteresis of outbox.topic_limits; returns whether producers are admitted.';

-- '00:02:13' for an interval, hours not wrapped at a day ('26:00:00'), whatever
-- the session's IntervalStyle; for the messages of outbox.admit.
CREATE OR REPLACE FUNCTION outbox.interval_hms(p interval)
RETURNS text
LANGUAGE sql
IMMUTABLE
STRICT
AS $$
    SELECT CASE WHEN s < 0 THEN '-' ELSE '' END
        || lpad((abs(s) / 3600)::text, 2, '0') || ':'
        || lpad((abs(s) / 60 % 60)::text, 2, '0') || ':'
        || lpad((abs(s) % 60)::text, 2, '0')
    FROM (SELECT floor(extract(epoch FROM p))::bigint AS s) AS t
$$;

-- outbox.admit: the producer's call, inside its transaction, before writing.
-- O(1): one primary-key lookup in outbox.topic_state (the limits are read only
-- on the refusing path, for the message, also by primary key). Unknown topics
-- admit. When the relay's verdict is "not admitting" it raises
--   SQLSTATE OB503 (retryable)
--   MESSAGE  outbox topic "orders" is over its limit: queue age 00:02:13 > 00:01:00
--   DETAIL   the figures the relay observed and the resume limits
--   HINT     retry after a few seconds; map to HTTP 503 with Retry-After
-- SECURITY DEFINER so that producers need no privilege on topic_limits; the
-- search_path is pinned and every name is schema-qualified.
CREATE OR REPLACE FUNCTION outbox.admit(p_topic text)
RETURNS void
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_state  outbox.topic_state%ROWTYPE;
    v_limits outbox.topic_limits%ROWTYPE;
    v_age    interval;
    v_reason text;
BEGIN
    SELECT s.* INTO v_state
    FROM outbox.topic_state AS s
    WHERE s.topic = p_topic;
    IF NOT FOUND OR v_state.admitting THEN
        RETURN;
    END IF;

    -- Refused: say why, with the figures the relay reported.
    SELECT l.* INTO v_limits
    FROM outbox.topic_limits AS l
    WHERE l.topic = p_topic;
    v_age := CASE WHEN v_state.oldest_pending_at IS NULL THEN interval '0'
                  ELSE date_trunc('second',
                                  greatest(now() - v_state.oldest_pending_at, interval '0')) END;
    v_reason := CASE
        WHEN v_age > v_limits.max_queue_age THEN
            format('queue age %s > %s', outbox.interval_hms(v_age),
                   outbox.interval_hms(v_limits.max_queue_age))
        WHEN v_state.pending > v_limits.max_pending THEN
            format('pending %s > %s', v_state.pending, v_limits.max_pending)
        WHEN v_age >= v_limits.resume_queue_age THEN
            format('queue age %s not yet below %s', outbox.interval_hms(v_age),
                   outbox.interval_hms(v_limits.resume_queue_age))
        WHEN v_state.pending >= v_limits.resume_pending THEN
            format('pending %s not yet below %s', v_state.pending, v_limits.resume_pending)
        ELSE
            format('refused by the relay at %s', v_state.updated_at)
    END;

    RAISE EXCEPTION USING
        ERRCODE = 'OB503',
        MESSAGE = format('outbox topic "%s" is over its limit: %s', p_topic, v_reason),
        DETAIL = format('observed at %s: %s pending, oldest pending since %s;'
                        ' producers are admitted again when %s',
                        v_state.updated_at, v_state.pending,
                        coalesce(v_state.oldest_pending_at::text, '-'),
                        coalesce(nullif(concat_ws(' and ',
                            'queue age < ' || outbox.interval_hms(v_limits.resume_queue_age),
                            'pending < ' || v_limits.resume_pending), ''),
                            'a relay observes the topic again')),
        HINT = 'retry after a few seconds; map to HTTP 503 with Retry-After';
END
$$;

COMMENT ON FUNCTION outbox.admit(text) IS
    'Raises SQLSTATE OB503 (retryable: map to HTTP 503 with Retry-After) when the topic is over its limit; call it in the producing transaction before writing. O(1).';

-- outbox.enqueue with p_admit: outbox.admit(p_topic) first when p_admit is
-- true, then the enqueue of 002. A fifth parameter without a default, so the
-- four-argument calls keep resolving to the functions of 002:
--   SELECT outbox.enqueue('orders', '9001', '{"order":9001}'::jsonb, NULL, p_admit => true);
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic         text,
    p_partition_key text,
    p_payload       bytea,
    p_headers       jsonb,
    p_admit         boolean)
RETURNS uuid
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    IF p_admit THEN
        PERFORM outbox.admit(p_topic);
    END IF;
    RETURN outbox.enqueue(p_topic, p_partition_key, p_payload, p_headers);
END
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic         text,
    p_partition_key text,
    p_payload       text,
    p_headers       jsonb,
    p_admit         boolean)
RETURNS uuid
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    IF p_admit THEN
        PERFORM outbox.admit(p_topic);
    END IF;
    RETURN outbox.enqueue(p_topic, p_partition_key, p_payload, p_headers);
END
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic         text,
    p_partition_key text,
    p_payload       jsonb,
    p_headers       jsonb,
    p_admit         boolean)
RETURNS uuid
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    IF p_admit THEN
        PERFORM outbox.admit(p_topic);
    END IF;
    RETURN outbox.enqueue(p_topic, p_partition_key, p_payload, p_headers);
END
$$;

-- Grants. Functions are executable by PUBLIC by default: take that away first.
REVOKE EXECUTE ON FUNCTION
    outbox.observe_topic(text, bigint, timestamptz),
    outbox.admit(text),
    outbox.interval_hms(interval),
    outbox.enqueue(text, text, bytea, jsonb, boolean),
    outbox.enqueue(text, text, text, jsonb, boolean),
    outbox.enqueue(text, text, jsonb, jsonb, boolean)
    FROM PUBLIC;

-- The relay observes and decides.
GRANT EXECUTE ON FUNCTION outbox.observe_topic(text, bigint, timestamptz) TO outbox_relay;
GRANT SELECT, INSERT, UPDATE ON outbox.topic_state TO outbox_relay;
GRANT SELECT ON outbox.topic_limits TO outbox_relay;

-- Producers ask, and may look at the state (e.g. for their own health checks).
GRANT EXECUTE ON FUNCTION
    outbox.admit(text),
    outbox.enqueue(text, text, bytea, jsonb, boolean),
    outbox.enqueue(text, text, text, jsonb, boolean),
    outbox.enqueue(text, text, jsonb, jsonb, boolean)
    TO outbox_producer;
GRANT SELECT ON outbox.topic_state TO outbox_producer;

INSERT INTO outbox.schema_version (version, name)
VALUES (5, '005_backpressure.sql')
ON CONFLICT (version) DO NOTHING;
