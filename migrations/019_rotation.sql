-- outbox-relay schema, part 19: old rows go a table partition at a time.
--
-- outbox.messages becomes a table partitioned by the writing transaction's id
-- (PARTITION BY RANGE (txid)), in partitions of about a third of
-- sent_retention (10 s to 5 minutes) of transaction ids (2^10 to 2^24,
-- outbox.rotate_width). A
-- partition [lo, hi) holds only rows of transactions that had all ended by
-- the time the transaction counter passed hi; once every stream's recorded
-- position stands at a tick whose snapshot's xmin is at least hi, and the
-- oldest tick taken sent_retention ago does too, each of its rows is in its
-- stream (or quarantined, where the quarantine keeps a copy of it), and the
-- relay's retention pass drops the partition: no row is deleted one at a
-- time (docs/DESIGN.md, "Retention"). These partitions of the table have
-- nothing to do with a topic's partitions (outbox.set_partitions).
--
--   outbox.message_partitions   the table's partitions and their bounds
--   outbox.rotate_width(s)      how many transaction ids a new one covers
--   outbox.rotate(...)          creates the partitions ahead of the
--                               transaction counter, drops those done with
--   outbox.purge_sent(...)      now deletes rows only in partitions that are
--                               due but kept for a stream behind them (a
--                               paused topic's)
--
-- What changes for producers: nothing they write. A unique index of a
-- partitioned table must hold its partition key, so the primary key is
-- (id, txid) (id stays unique: one identity sequence draws it) and
-- message_id is no longer checked for uniqueness by the database: a producer
-- that writes the same message_id twice gets two messages, which the
-- consumers' processed table (keyed by message_id) absorbs. The partial
-- indexes messages_failed_idx and messages_held_idx, of the relays before
-- schema 16, go: no statement reads them.
--
-- The conversion copies the rows into the new table in this transaction,
-- which holds outbox.messages exclusively until it commits: producers wait
-- for it (1,000,000 rows of 200 bytes: 5.5 s on two shared cores). Stop the
-- relays first, as for every schema change; start relays of this version
-- after it.
--
-- One transaction (BEGIN ... COMMIT below), idempotent like every file here.

BEGIN;

-- The partitions of outbox.messages, from the catalog: lo and hi are NULL
-- for the DEFAULT partition, which takes the rows of transaction ids no
-- partition covers (the relay was down while the counter passed the
-- partitions made ahead), so that no producer's insert ever fails for want
-- of a partition.
CREATE OR REPLACE FUNCTION outbox.message_partitions()
RETURNS TABLE (part regclass, lo xid8, hi xid8)
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT b.part,
           (regexp_match(b.bound, $r$FROM \('(\d+)'\)$r$))[1]::xid8,
           (regexp_match(b.bound, $r$TO \('(\d+)'\)$r$))[1]::xid8
      FROM (SELECT c.oid::regclass AS part, pg_get_expr(c.relpartbound, c.oid) AS bound
              FROM pg_inherits AS i
              JOIN pg_class AS c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'outbox.messages'::regclass) AS b
     -- A partition dropped since this statement's snapshot has no bound left
     -- to show (pg_get_expr reads the current catalog): it is gone.
     WHERE b.bound IS NOT NULL
$$;

COMMENT ON FUNCTION outbox.message_partitions() IS
    'The partitions of outbox.messages and their transaction-id bounds [lo, hi) (NULL for the DEFAULT partition).';

-- The width of the partitions to create: the transaction ids the counter
-- passes in p_seconds, at the rate since the last tick taken a minute ago or
-- more (the oldest tick when none is that old; 2^20 when there is none), as
-- a power of two between 2^10 and 2^24. A partition then holds about
-- p_seconds of transactions, whatever the load; outbox.rotate asks for a
-- third of sent_retention, between 10 s and 5 minutes, so that rows stay
-- about sent_retention and a third. Below a few transactions a second in the
-- whole cluster, a partition of 2^10 lasts longer.
CREATE OR REPLACE FUNCTION outbox.rotate_width(p_seconds integer)
RETURNS bigint
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_snap pg_snapshot;
    v_at   timestamptz;
    v_ids  numeric;
BEGIN
    SELECT k.snap, k.taken_at INTO v_snap, v_at FROM outbox.ticks AS k
     WHERE k.taken_at <= statement_timestamp() - interval '1 minute'
     ORDER BY k.taken_at DESC LIMIT 1;
    IF NOT FOUND THEN
        SELECT k.snap, k.taken_at INTO v_snap, v_at FROM outbox.ticks AS k
         ORDER BY k.taken_at LIMIT 1;
    END IF;
    IF v_snap IS NULL THEN
        RETURN 1048576;
    END IF;
    v_ids := (pg_snapshot_xmax(pg_current_snapshot())::text::numeric
              - pg_snapshot_xmax(v_snap)::text::numeric)
             / greatest(extract(epoch FROM statement_timestamp() - v_at), 1) * p_seconds;
    RETURN least(16777216, greatest(1024, power(2, round(log(2, greatest(1, v_ids))))))::bigint;
END
$$;

-- Creates partitions of p_width transaction ids from the highest bound there
-- is (from the counter's, when there is none) until the one p_ahead beyond
-- the counter's exists, each ending at a multiple of p_width; when the
-- DEFAULT partition holds rows at or above that bound, from above them and
-- the counter instead (a range cannot take rows DEFAULT holds). While the
-- counter is a partition's width or more below the top, by CREATE TABLE
-- (LIKE) and ATTACH PARTITION, which takes a lock on outbox.messages that
-- inserts do not wait for. Otherwise inserts may be routing rows of the new
-- range into DEFAULT, and one routed before an ATTACH commits would fail
-- DEFAULT's new constraint after it: then by CREATE TABLE ... PARTITION OF,
-- whose lock on outbox.messages inserts wait for (at most the 100 ms lock
-- timeout of outbox.rotate). The counter is read
-- from a snapshot, so that it takes no transaction id when there is nothing
-- to create. Returns how many it created.
CREATE OR REPLACE FUNCTION outbox.rotate_create(p_width bigint, p_ahead integer)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_cur bigint := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
    v_top bigint;
    v_lo  bigint;
    v_def bigint;
    v_hi  bigint;
    v_quiet boolean;
    v_n   integer := 0;
BEGIN
    IF p_width IS NULL OR p_width < 1 OR p_width > 1073741824 THEN
        RAISE EXCEPTION 'outbox.rotate_create: width must be between 1 and 2^30 transaction ids'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_ahead IS NULL OR p_ahead < 1 OR p_ahead > 64 THEN
        RAISE EXCEPTION 'outbox.rotate_create: ahead must be between 1 and 64'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_top := (v_cur / p_width + p_ahead + 1) * p_width;
    SELECT max(p.hi)::text::bigint INTO v_lo FROM outbox.message_partitions() AS p;
    -- Inserts route no row into DEFAULT above the counter while it is a
    -- partition's width below the top: ranges there can be attached.
    v_quiet := v_lo IS NOT NULL AND v_cur + p_width <= v_lo;
    v_lo := coalesce(v_lo, v_cur / p_width * p_width);
    SELECT max(d.txid)::text::bigint INTO v_def FROM outbox.messages_default AS d;
    IF v_def IS NOT NULL AND v_def >= v_lo THEN
        -- From the counter on (above DEFAULT's rows), up to the next bound of
        -- the width, so that the rows to come leave DEFAULT at once.
        v_lo := greatest(v_def + 1, v_cur);
    END IF;
    WHILE v_lo < v_top LOOP
        v_hi := (v_lo / p_width + 1) * p_width;
        BEGIN
            IF v_quiet THEN
                EXECUTE format('CREATE TABLE outbox.%I (LIKE outbox.messages INCLUDING DEFAULTS)',
                               'messages_' || v_lo);
                EXECUTE format('ALTER TABLE outbox.messages ATTACH PARTITION outbox.%I'
                               ' FOR VALUES FROM (%L) TO (%L)', 'messages_' || v_lo, v_lo, v_hi);
            ELSE
                EXECUTE format('CREATE TABLE outbox.%I PARTITION OF outbox.messages'
                               ' FOR VALUES FROM (%L) TO (%L)', 'messages_' || v_lo, v_lo, v_hi);
            END IF;
        EXCEPTION WHEN check_violation THEN
            -- A transaction that began meanwhile wrote a row of this range
            -- into DEFAULT: the next pass starts above it.
            EXIT;
        END;
        v_n := v_n + 1;
        v_lo := v_hi;
    END LOOP;
    RETURN v_n;
END
$$;

-- The retention pass (relay/retention.c): creates the partitions ahead
-- (outbox.rotate_create, of p_width or outbox.rotate_width()), then drops,
-- oldest first, every partition [lo, hi)
-- with hi at or below the horizon: the lowest xmin of the snapshots of the
-- ticks every stream's recorded position stands at (the lead's row among
-- them: a stream without a position has no row at or below the lead), and
-- of the last tick taken p_older_than ago. Below that horizon each
-- transaction had ended at that tick: its rows are in their streams (or
-- quarantined, with a copy in outbox.quarantine) and were so p_older_than
-- ago. The DEFAULT partition is emptied (TRUNCATE) once its highest row is
-- below the horizon. Each DROP and TRUNCATE waits at most 100 ms for its
-- lock (a producer's transaction holds one on outbox.messages), so that
-- producers never queue behind it for longer; one that cannot have it is
-- counted busy and left for the next pass. The ticks below every stream's
-- position and before the last one taken p_older_than ago go too (nothing
-- reads their batches again). Returns how many partitions it created and
-- dropped, how many were busy, how many were due 10 s ago already but are
-- kept for a stream behind them (a paused topic's: while there is one, the
-- relay has the published rows of due partitions go one at a time,
-- outbox.purge_sent; streams that only follow the lead lag up to 2 s behind
-- it, which the 10 s leave out), and the created_at of
-- the oldest published row kept, for the oldest-sent-age metric. One call
-- at a time across relays (advisory lock 122550254464889, beside 007's
-- wake-up lock): a call that finds it taken does nothing and reports busy.
CREATE OR REPLACE FUNCTION outbox.rotate(p_older_than interval,
    p_width bigint DEFAULT NULL, p_ahead integer DEFAULT 4)
RETURNS TABLE (created integer, dropped integer, busy integer, kept integer,
               oldest_kept timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_ret  xid8;
    v_late xid8;
    v_pos  xid8;
    v_part record;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox.rotate: older_than must be an interval of 0 or more'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    created := 0;
    dropped := 0;
    busy := 0;
    kept := 0;
    -- One relay at a time: the others' passes find it taken and do nothing.
    IF NOT pg_try_advisory_xact_lock(122550254464889) THEN
        busy := 1;
        RETURN NEXT;
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '100ms', true);
    BEGIN
        created := outbox.rotate_create(coalesce(p_width, outbox.rotate_width(
            least(300, greatest(10, extract(epoch FROM p_older_than) / 3))::integer)), p_ahead);
    EXCEPTION WHEN lock_not_available THEN
        busy := busy + 1;
    END;
    SELECT pg_snapshot_xmin(k.snap) INTO v_ret FROM outbox.ticks AS k
     WHERE k.taken_at <= statement_timestamp() - p_older_than
     ORDER BY k.taken_at DESC LIMIT 1;
    SELECT pg_snapshot_xmin(k.snap) INTO v_late FROM outbox.ticks AS k
     WHERE k.taken_at <= statement_timestamp() - p_older_than - interval '10 seconds'
     ORDER BY k.taken_at DESC LIMIT 1;
    SELECT min(pg_snapshot_xmin(k.snap)) INTO v_pos
      FROM outbox.stream_positions AS p JOIN outbox.ticks AS k ON k.tick_id = p.tick;
    BEGIN
        DELETE FROM outbox.ticks AS k
         WHERE k.tick_id IN (
               SELECT k2.tick_id FROM outbox.ticks AS k2
                WHERE k2.tick_id < (SELECT min(p.tick) FROM outbox.stream_positions AS p)
                  AND k2.tick_id < (SELECT max(k3.tick_id) FROM outbox.ticks AS k3
                                     WHERE k3.taken_at <= statement_timestamp() - p_older_than)
                ORDER BY k2.tick_id LIMIT 10000);
    EXCEPTION WHEN lock_not_available THEN
        NULL;
    END;
    SELECT m.created_at INTO oldest_kept FROM outbox.messages AS m
     WHERE v_pos IS NOT NULL AND m.txid < v_pos
     ORDER BY m.txid, m.id LIMIT 1;
    -- Last: a DROP holds outbox.messages until this transaction ends.
    IF v_ret IS NOT NULL AND v_pos IS NOT NULL THEN
        FOR v_part IN
            SELECT p.part, p.hi FROM outbox.message_partitions() AS p
             WHERE p.hi <= v_ret ORDER BY p.hi
        LOOP
            IF v_part.hi > v_pos THEN
                IF v_part.hi <= v_late THEN
                    kept := kept + 1;
                END IF;
                CONTINUE;
            END IF;
            BEGIN
                EXECUTE format('DROP TABLE %s', v_part.part);
                dropped := dropped + 1;
            EXCEPTION WHEN lock_not_available THEN
                busy := busy + 1;
                EXIT;
            END;
        END LOOP;
        -- Looked at without a lock first, then again under the lock TRUNCATE
        -- takes anyway: a row that came in between is seen.
        IF (SELECT max(d.txid) FROM outbox.messages_default AS d) < least(v_ret, v_pos) THEN
            BEGIN
                LOCK TABLE outbox.messages_default IN ACCESS EXCLUSIVE MODE;
                IF (SELECT max(d.txid) FROM outbox.messages_default AS d)
                   < least(v_ret, v_pos) THEN
                    TRUNCATE outbox.messages_default;
                END IF;
            EXCEPTION WHEN lock_not_available THEN
                busy := busy + 1;
            END;
        END IF;
    END IF;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.rotate(interval, bigint, integer) IS
    'Creates the partitions of outbox.messages ahead of the transaction counter and drops those every stream is past since older_than.';

DO $$
DECLARE
    v_width bigint;
    v_base bigint;
    v_last bigint;
    v_acl  record;
BEGIN
    IF (SELECT c.relkind FROM pg_class AS c WHERE c.oid = 'outbox.messages'::regclass) = 'p' THEN
        RETURN;
    END IF;
    LOCK TABLE outbox.messages IN ACCESS EXCLUSIVE MODE;
    ALTER TABLE outbox.messages RENAME TO messages_before_019;
    ALTER TABLE outbox.messages_before_019 RENAME CONSTRAINT messages_pkey TO messages_before_019_pkey;
    DROP INDEX IF EXISTS outbox.messages_txid_idx, outbox.messages_pending_topic_idx,
                         outbox.messages_failed_idx, outbox.messages_held_idx;
    ALTER SEQUENCE IF EXISTS outbox.messages_id_seq RENAME TO messages_before_019_id_seq;

    CREATE TABLE outbox.messages (
        -- The row's place in its transaction's rows and in a batch: batches
        -- go out in id order. Unique: one identity sequence draws it.
        id            bigint      GENERATED ALWAYS AS IDENTITY,
        -- The idempotency key that consumers see as the entry's "id" field.
        message_id    uuid        NOT NULL DEFAULT gen_random_uuid(),
        -- Where it goes: stream "<stream_prefix><topic>". [A-Za-z0-9._-]{1,200}.
        topic         text        NOT NULL,
        partition_key text,
        payload       bytea       NOT NULL,
        -- A flat JSON object of string values; each becomes a field "h.<name>".
        headers       jsonb,
        created_at    timestamptz NOT NULL DEFAULT now(),
        -- Kept for the relays before schema 16; nothing writes them since.
        sent_at       timestamptz,
        attempts      integer     NOT NULL DEFAULT 0,
        last_error    text,
        retry_at      timestamptz,
        failed_at     timestamptz,
        partition_no  integer,
        txid          xid8        NOT NULL DEFAULT pg_current_xact_id(),
        PRIMARY KEY (id, txid)
    ) PARTITION BY RANGE (txid);

    CREATE INDEX messages_txid_idx ON outbox.messages (txid, id);
    CREATE INDEX messages_pending_topic_idx ON outbox.messages (topic, id)
        WHERE sent_at IS NULL AND failed_at IS NULL;
    CREATE TABLE outbox.messages_default PARTITION OF outbox.messages DEFAULT;

    -- One partition for the transactions before the counter's partition
    -- (rows that relays before 016 sent or quarantined carry txid 3), then
    -- the counter's and four beyond it.
    v_width := outbox.rotate_width(300);
    v_base := pg_snapshot_xmax(pg_current_snapshot())::text::bigint / v_width * v_width;
    IF v_base > 0 THEN
        EXECUTE format('CREATE TABLE outbox.messages_0 PARTITION OF outbox.messages'
                       ' FOR VALUES FROM (%L) TO (%L)', 0, v_base);
    END IF;
    PERFORM outbox.rotate_create(v_width, 4);

    INSERT INTO outbox.messages (id, message_id, topic, partition_key, payload, headers,
                                 created_at, sent_at, attempts, last_error, retry_at,
                                 failed_at, partition_no, txid)
    OVERRIDING SYSTEM VALUE
    SELECT id, message_id, topic, partition_key, payload, headers, created_at, sent_at,
           attempts, last_error, retry_at, failed_at, partition_no, txid
      FROM outbox.messages_before_019
     ORDER BY id;
    SELECT CASE WHEN s.is_called THEN s.last_value + 1 ELSE s.last_value END INTO v_last
      FROM outbox.messages_before_019_id_seq AS s;
    EXECUTE format('ALTER TABLE outbox.messages ALTER COLUMN id RESTART WITH %s', v_last);

    -- The grants, as they were: the table's and its columns'.
    FOR v_acl IN
        SELECT a.privilege_type, a.grantee
          FROM pg_class AS c, aclexplode(c.relacl) AS a
         WHERE c.oid = 'outbox.messages_before_019'::regclass
           AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON outbox.messages TO %s', v_acl.privilege_type,
                       CASE WHEN v_acl.grantee = 0 THEN 'PUBLIC'
                            ELSE quote_ident(v_acl.grantee::regrole::text) END);
    END LOOP;
    FOR v_acl IN
        SELECT t.attname, a.privilege_type, a.grantee
          FROM pg_attribute AS t, aclexplode(t.attacl) AS a
         WHERE t.attrelid = 'outbox.messages_before_019'::regclass AND t.attacl IS NOT NULL
           AND NOT t.attisdropped
    LOOP
        EXECUTE format('GRANT %s (%I) ON outbox.messages TO %s', v_acl.privilege_type,
                       v_acl.attname,
                       CASE WHEN v_acl.grantee = 0 THEN 'PUBLIC'
                            ELSE quote_ident(v_acl.grantee::regrole::text) END);
    END LOOP;

    -- What named the table before: the view and the chunk function follow
    -- the renamed one until they are written again.
    DROP VIEW outbox.unsent;
    DROP FUNCTION outbox.batch_rows(bigint, bigint, bigint, bigint, integer);
    DROP TABLE outbox.messages_before_019;
END
$$;

-- The files before this one, applied again, create these on the new table.
DROP INDEX IF EXISTS outbox.messages_failed_idx, outbox.messages_held_idx;

COMMENT ON TABLE outbox.messages IS
    'Transactional outbox: rows committed here are published to Redis Streams by outbox-relay.';
COMMENT ON COLUMN outbox.messages.partition_no IS
    'The topic partition a row of a partitioned topic belongs to (outbox.set_partitions); NULL otherwise.';
COMMENT ON COLUMN outbox.messages.txid IS
    'The id of the transaction that wrote the row: which batch it is in, and which table partition holds it.';

-- As in 017, but only in the table partitions that are due and kept for a
-- stream behind them (outbox.rotate): a row that is not in one goes with its
-- partition. The relay calls it while outbox.rotate reports such partitions.
CREATE OR REPLACE FUNCTION outbox.purge_sent(
    p_older_than interval,
    p_after_id   bigint,
    p_max_rows   integer)
RETURNS TABLE (deleted integer, next_after_id bigint, caught_up boolean,
               oldest_kept timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_cutoff  timestamptz;
    v_snap    pg_snapshot;
    v_ids     bigint[] := '{}';
    v_last    bigint := coalesce(p_after_id, 0);
    v_scanned integer := 0;
    v_row     record;
    v_bound   xid8;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox.purge_sent: older_than must be an interval of 0 or more'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_max_rows IS NULL OR p_max_rows < 1 OR p_max_rows > 100000 THEN
        RAISE EXCEPTION 'outbox.purge_sent: max_rows must be between 1 and 100000'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM FROM outbox.messages LIMIT 0; -- the lock order (top of the file)
    v_cutoff := statement_timestamp() - p_older_than;
    SELECT k.snap INTO v_snap FROM outbox.ticks AS k
     WHERE k.taken_at <= v_cutoff ORDER BY k.taken_at DESC LIMIT 1;
    -- Only rows of table partitions that are due (outbox.rotate drops those
    -- no stream is behind in): a row above that is dropped with its partition.
    SELECT max(p.hi) INTO v_bound FROM outbox.message_partitions() AS p
     WHERE v_snap IS NOT NULL AND p.hi <= pg_snapshot_xmin(v_snap);
    caught_up := true;
    FOR v_row IN
        SELECT m.id, m.created_at,
               s.snap IS NOT NULL AND pg_visible_in_snapshot(m.txid, s.snap)
               AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id) AS published,
               v_snap IS NOT NULL AND pg_visible_in_snapshot(m.txid, v_snap) AS old
          FROM outbox.messages AS m
          LEFT JOIN LATERAL (
              SELECT k.snap FROM outbox.stream_positions AS p
                JOIN outbox.ticks AS k ON k.tick_id = p.tick
               WHERE p.topic = m.topic AND p.partition = coalesce(m.partition_no, -1)) AS s ON true
         WHERE m.id > v_last AND m.txid < v_bound
         ORDER BY m.id
    LOOP
        IF v_row.created_at >= v_cutoff THEN
            IF v_row.published AND oldest_kept IS NULL THEN
                oldest_kept := v_row.created_at;
            END IF;
            EXIT;
        END IF;
        IF v_row.published AND v_row.old THEN
            v_ids := v_ids || v_row.id;
        ELSIF v_row.published AND oldest_kept IS NULL THEN
            oldest_kept := v_row.created_at;
        END IF;
        v_last := v_row.id;
        v_scanned := v_scanned + 1;
        IF cardinality(v_ids) >= p_max_rows OR v_scanned >= 10 * p_max_rows THEN
            caught_up := false;
            EXIT;
        END IF;
    END LOOP;
    -- Positions only move forward: what was published still is. The
    -- quarantine is checked again, for a row quarantined meanwhile.
    DELETE FROM outbox.messages AS m
     WHERE m.id = ANY (v_ids) AND m.txid < v_bound
       AND NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    -- (The ticks go in outbox.rotate.)
    next_after_id := v_last;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.purge_sent(interval, bigint, integer) IS
    'Deletes up to max_rows rows their stream passed before the last tick taken older_than ago, in due table partitions, from after_id upward; never an unsent or quarantined row. The relay calls it for sent_retention.';

-- Written again for the partitioned table (as in 016).
CREATE OR REPLACE FUNCTION outbox.batch_rows(p_prev bigint, p_next bigint,
    p_after_id bigint, p_upto_id bigint, p_limit integer)
RETURNS SETOF outbox.messages
LANGUAGE sql
STABLE
AS $$
    SELECT m.* FROM outbox.messages AS m
     WHERE m.id > p_after_id AND m.id <= p_upto_id
       AND pg_catalog.pg_visible_in_snapshot(m.txid, (SELECT t.snap FROM outbox.ticks AS t
                                                       WHERE t.tick_id = p_next))
       AND NOT pg_catalog.pg_visible_in_snapshot(m.txid, (SELECT t.snap FROM outbox.ticks AS t
                                                           WHERE t.tick_id = p_prev))
     ORDER BY m.id
     LIMIT p_limit
$$;

COMMENT ON FUNCTION outbox.batch_rows(bigint, bigint, bigint, bigint, integer) IS
    'A chunk of the batch between two ticks: its rows with an id in (after, upto], in id order, at most a limit.';

CREATE OR REPLACE VIEW outbox.unsent AS
SELECT m.*
  FROM outbox.messages AS m
 WHERE NOT EXISTS (SELECT FROM outbox.quarantine AS q WHERE q.id = m.id)
   AND NOT EXISTS (SELECT FROM outbox.stream_positions AS p
                     JOIN outbox.ticks AS t ON t.tick_id = p.tick
                    WHERE p.topic = m.topic AND p.partition = coalesce(m.partition_no, -1)
                      AND pg_visible_in_snapshot(m.txid, t.snap));

COMMENT ON VIEW outbox.unsent IS
    'Rows not yet published to their stream and not quarantined.';
GRANT SELECT ON outbox.unsent TO outbox_relay;

DROP TRIGGER IF EXISTS messages_notify ON outbox.messages;
CREATE TRIGGER messages_notify
    AFTER INSERT ON outbox.messages
    FOR EACH STATEMENT
    WHEN (pg_try_advisory_xact_lock_shared(122550254464888))
    EXECUTE FUNCTION outbox.notify_relay();
SELECT outbox.sync_partition_trigger();

REVOKE EXECUTE ON FUNCTION outbox.batch_rows(bigint, bigint, bigint, bigint, integer),
    outbox.rotate(interval, bigint, integer), outbox.rotate_create(bigint, integer),
    outbox.rotate_width(integer), outbox.message_partitions() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.batch_rows(bigint, bigint, bigint, bigint, integer),
    outbox.rotate(interval, bigint, integer), outbox.message_partitions() TO outbox_relay;

INSERT INTO outbox.schema_version (version, name)
VALUES (19, '019_rotation.sql')
ON CONFLICT (version) DO NOTHING;

COMMIT;
