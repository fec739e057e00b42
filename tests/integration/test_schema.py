"""The schema (migrations/) and the harness itself, without the relay.

Promises tested:
- every migration applies in name order, and applying them all a second time
  succeeds and changes nothing (schema, grants, version rows, data);
- producers (a role granted outbox_producer) can INSERT rows and call
  outbox.enqueue with text, jsonb and bytea payloads, which returns the
  message_id, and nothing else: they read no column of outbox.messages, not
  even the ids of other topics' rows (migrations/009);
- the relay (a role granted outbox_relay) can take a tick, read its batch
  (outbox.batch_rows) and record it (outbox.record_batch), after which the
  rows are no longer in outbox.unsent; two ticks split the rows between two
  batches, each row in exactly one; it cannot INSERT, DELETE or change what
  a producer wrote;
- a committed insert notifies channel outbox_relay once per transaction; a
  rolled-back one does not; no insert notifies while a session (a busy relay)
  holds the wake-up advisory lock of migrations/007, and a producer that is
  notifying holds that lock shared until its commit;
- the harness starts and stops PostgreSQL and Redis, restarts them, removes
  their directories also when the test is killed with SIGTERM, and its
  Verifier counts lost, duplicated and stray entries correctly (duplicates
  also across streams, and entries that differ from their row, when asked).
"""

import contextlib
import difflib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import unittest
import uuid

import psycopg2
import psycopg2.errors

from testkit import consumers
from testkit import harness
from testkit.harness import insert, scalar, wait_until

harness.set_deadline(300)


def dir_gone(path):
    return not os.path.exists(path)


def mark_sent(conn, topics):
    """What the relay records once a batch is in its streams: a tick over
    every row committed so far, and each topic's stream past it. Returns the tick."""
    tick = scalar(conn, "SELECT outbox.tick()")
    scalar(conn, "SELECT outbox.record_batch(%s, true, %s::text[], %s::integer[], %s::text[],"
                 " '{}', '{}', '{}', '{}', '{}'::bigint[], '{}'::text[])",
           (tick, list(topics), [-1] * len(topics), ["0-0"] * len(topics)))
    return tick


def produce(conn, topic, payload, commit=True):
    """What a producer can do: a plain INSERT (no RETURNING, which would need
    SELECT), with a message_id of its own. Returns that message_id."""
    message_id = str(uuid.uuid4())
    with conn.cursor() as cur:
        cur.execute("INSERT INTO outbox.messages (message_id, topic, payload)"
                    " VALUES (%s, %s, %s)", (message_id, topic, psycopg2.Binary(payload)))
    if commit and not conn.autocommit:
        conn.commit()
    return message_id


class HarnessServersTest(harness.TestCase):
    """The throwaway servers behave as the other tests assume."""

    def test_postgres_lifecycle(self):
        with harness.Postgres() as pg:
            directory, port = pg.dir, pg.port
            self.assertTrue(harness.port_open(port))
            conn = pg.connect()
            insert(conn, "t", b"before")
            conn.close()
            for mode in ("immediate", "fast"):
                pg.restart(mode)
                with contextlib.closing(pg.connect()) as conn:
                    self.assertEqual(scalar(conn, "SELECT count(*) FROM outbox.messages"), 1,
                                     f"committed row kept across a {mode} restart")
            pg.stop()
            self.assertFalse(harness.port_open(port))
            pg.start()
            self.assertTrue(harness.port_open(port))
        self.assertTrue(dir_gone(directory), "postgres temp dir removed")
        self.assertFalse(harness.port_open(port), "postgres stopped")

    def test_redis_lifecycle(self):
        with harness.Redis(appendonly=True, appendfsync="always") as r:
            directory, port = r.dir, r.port
            self.assertEqual(r.url(None), f"redis://127.0.0.1:{port}/0")
            self.assertEqual(r.url(), f"redis://outbox-relay:{r.passwords['outbox-relay']}"
                             f"@127.0.0.1:{port}/0")
            c = r.client()
            c.xadd("s", {"a": "1"})
            r.kill()
            self.assertFalse(harness.port_open(port))
            r.start()
            self.assertEqual(c.xlen("s"), 1, "AOF kept the entry across SIGKILL")
            r.stop()
            r.start()
            self.assertEqual(c.xlen("s"), 1)
            r.pause()
            with contextlib.closing(r.client(socket_timeout=0.3)) as paused:
                with self.assertRaises(Exception):
                    paused.ping()
            r.resume()
            self.assertTrue(c.ping())
            self.assertEqual(c.config_get("save")["save"], "")
            c.close()
        self.assertTrue(dir_gone(directory), "redis temp dir removed")
        self.assertFalse(harness.port_open(port), "redis stopped")

    def test_redis_without_aof_and_with_password(self):
        with harness.Redis(password="pw-123") as r:
            self.assertEqual(r.url(None), f"redis://:pw-123@127.0.0.1:{r.port}/0")
            self.assertEqual(r.url("outbox-consumer"),
                             f"redis://outbox-consumer:pw-123@127.0.0.1:{r.port}/0")
            c = r.client()
            self.assertEqual(c.config_get("appendonly")["appendonly"], "no")
            c.close()

    def test_servers_removed_when_the_test_gets_sigterm(self):
        script = textwrap.dedent("""
            import json, time
            from testkit import harness
            with harness.Postgres(migrations=False) as pg, harness.Redis() as r:
                print(json.dumps([pg.dir, pg.port, r.dir, r.port]), flush=True)
                time.sleep(120)
        """)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        try:
            ready, _, _ = select.select([child.stdout], [], [], 60)
            self.assertTrue(ready, "child started its servers")
            pg_dir, pg_port, redis_dir, redis_port = json.loads(child.stdout.readline())
            self.assertTrue(harness.port_open(pg_port) and harness.port_open(redis_port))
            child.send_signal(signal.SIGTERM)
            code = child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        self.assertEqual(code, 128 + signal.SIGTERM, child.stderr.read().decode())
        self.assertTrue(dir_gone(pg_dir) and dir_gone(redis_dir), "temp dirs removed")
        self.assertFalse(harness.port_open(pg_port) or harness.port_open(redis_port),
                         "servers stopped")


class SchemaTest(harness.PostgresTestCase):
    """migrations/*.sql against a real PostgreSQL 15."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with cls.db.cursor() as cur:
            cur.execute("CREATE ROLE producer_login LOGIN IN ROLE outbox_producer;"
                        "CREATE ROLE relay_login LOGIN IN ROLE outbox_relay")

    def as_role(self, user, autocommit=True):
        conn = self.pg.connect(user=user, autocommit=autocommit)
        self.addCleanup(conn.close)
        return conn

    def schema_dump(self):
        text = harness.run_command([os.path.join(self.pg.bindir, "pg_dump"), "-h", "127.0.0.1",
                                    "-p", str(self.pg.port), "-U", "postgres", "-d", "app",
                                    "--schema-only"], "pg_dump")
        # pg_dump 15.14+ brackets its output with \restrict <random key>.
        return [line for line in text.splitlines()
                if not line.startswith(("\\restrict", "\\unrestrict"))]

    def roles(self):
        with self.db.cursor() as cur:
            cur.execute("SELECT r.rolname, r.rolcanlogin, coalesce(array_agg(g.rolname ORDER BY"
                        " g.rolname) FILTER (WHERE g.rolname IS NOT NULL), '{}')"
                        " FROM pg_roles r LEFT JOIN pg_auth_members m ON m.member = r.oid"
                        " LEFT JOIN pg_roles g ON g.oid = m.roleid"
                        " WHERE r.rolname NOT LIKE 'pg\\_%' GROUP BY 1, 2 ORDER BY 1")
            return cur.fetchall()

    def test_migrations_apply_twice_and_change_nothing(self):
        message_id = insert(self.db, "orders", b"kept")
        before = (self.schema_dump(), self.roles(),
                  scalar(self.db, "SELECT array_agg(version || ':' || name || ':' || applied_at"
                                  " ORDER BY version) FROM outbox.schema_version"))
        self.pg.apply_migrations()  # raises if any file fails (ON_ERROR_STOP=1)
        after = (self.schema_dump(), self.roles(),
                 scalar(self.db, "SELECT array_agg(version || ':' || name || ':' || applied_at"
                                 " ORDER BY version) FROM outbox.schema_version"))
        self.maxDiff = None
        diff = "\n".join(difflib.unified_diff(before[0], after[0], "first", "second",
                                               lineterm=""))
        self.assertEqual(diff, "", "a second application changed the schema dump")
        self.assertEqual(before[1:], after[1:])
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages"), 1)
        self.assertEqual(scalar(self.db, "SELECT message_id::text FROM outbox.messages"),
                         message_id)

    def test_schema_shape(self):
        self.assertEqual(scalar(self.db, "SELECT max(version) FROM outbox.schema_version"), 22)
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 7"), "007_wakeup_lock.sql")
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 9"), "009_producer_grants.sql")
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 11"), "011_partitions.sql")
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 12"), "012_partition_owners.sql")
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 13"), "013_pinned_plans.sql")
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 14"), "014_cached_finish.sql")
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 15"), "015_partition_total.sql")
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 16"), "016_batches.sql")
        # Batches (016): each row's transaction, the ticks, where each stream
        # stands, the quarantine and what is not yet sent.
        for rel in ("outbox.ticks", "outbox.stream_positions", "outbox.quarantine",
                    "outbox.unsent", "outbox.messages_txid_idx"):
            self.assertIsNotNone(scalar(self.db, "SELECT to_regclass(%s)", (rel,)), rel)
        # A tick with its batch's bounds in one call (020).
        self.assertIsNotNone(scalar(self.db, "SELECT to_regprocedure(%s)",
                                    ("outbox.tick_bounds(bigint, bigint)",)))
        # The tools of 017: the quarantine written again or dropped, the backlog.
        for fn in ("outbox.quarantine_retry(boolean, bigint[])",
                   "outbox.quarantine_drop(bigint[])", "outbox.quarantine_rows(bigint[], text[])"):
            self.assertIsNotNone(scalar(self.db, "SELECT to_regprocedure(%s)", (fn,)), fn)
        self.assertIsNone(scalar(self.db, "SELECT to_regclass('outbox.relay_wakeup')"),
                          "the flag table of 006 is gone")
        # 019: partitioned by the writing transaction's id, with a DEFAULT
        # partition and partitions made ahead of the transaction counter.
        self.assertEqual(scalar(self.db, "SELECT pg_get_partkeydef('outbox.messages'::regclass)"),
                         "RANGE (txid)")
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.message_partitions()"
                                         " WHERE lo IS NULL"), 1)
        self.assertGreaterEqual(
            scalar(self.db, "SELECT count(*) FROM outbox.message_partitions()"
                            " WHERE hi > pg_snapshot_xmax(pg_current_snapshot())"), 4)
        with self.db.cursor() as cur:
            cur.execute("SELECT column_name, data_type, is_nullable FROM information_schema.columns"
                        " WHERE table_schema = 'outbox' AND table_name = 'messages'")
            columns = {name: (kind, nullable) for name, kind, nullable in cur.fetchall()}
        for name in ("id", "message_id", "topic", "partition_key", "payload", "headers",
                     "created_at", "sent_at", "attempts", "last_error", "retry_at", "failed_at",
                     "txid"):
            self.assertIn(name, columns)
        self.assertEqual(columns["txid"], ("xid8", "NO"))
        self.assertEqual(columns["payload"][0], "bytea")
        self.assertEqual(columns["message_id"], ("uuid", "NO"))
        self.assertEqual(columns["sent_at"][1], "YES")
        # 018: no second index of every row's id beside the primary key; 022:
        # no (topic, id) index. The producers write the keys and the txid index.
        with self.db.cursor() as cur:
            cur.execute("SELECT indexname FROM pg_indexes WHERE schemaname = 'outbox'"
                        " AND tablename = 'messages' ORDER BY indexname")
            self.assertEqual([r[0] for r in cur.fetchall()],
                             ["messages_pkey", "messages_txid_idx"])
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM pg_trigger WHERE tgname ="
                                         " 'messages_notify' AND NOT tgisinternal"), 1)

    def test_enqueue_stores_text_jsonb_and_bytea_payloads(self):
        with self.db.cursor() as cur:
            cur.execute("SELECT outbox.enqueue('orders', 'k1', %s)", ("héllo ☃",))
            text_id = cur.fetchone()[0]
            cur.execute("SELECT outbox.enqueue('orders', NULL, %s::jsonb, %s::jsonb)",
                        ('{"b": [true, null], "a": 1}', '{"trace": "abc"}'))
            json_id = cur.fetchone()[0]
            cur.execute("SELECT outbox.enqueue('orders', NULL, %s)",
                        (psycopg2.Binary(b"\x00\xff\xfe\r\n"),))
            bytea_id = cur.fetchone()[0]
            cur.execute("SELECT message_id, partition_key, payload, headers"
                        " FROM outbox.messages")
            rows = {r[0]: r[1:] for r in cur.fetchall()}
        self.assertEqual(rows[text_id][0], "k1")
        self.assertEqual(bytes(rows[text_id][1]), "héllo ☃".encode())
        self.assertEqual(bytes(rows[json_id][1]), b'{"a": 1, "b": [true, null]}')
        self.assertEqual(rows[json_id][2], {"trace": "abc"})
        self.assertEqual(bytes(rows[bytea_id][1]), b"\x00\xff\xfe\r\n")

    def test_producer_role_can_insert_and_enqueue(self):
        conn = self.as_role("producer_login")
        with conn.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload, headers)"
                        " VALUES ('orders', 'k', 'x', '{\"a\": \"b\"}')")
            for sql, arg in (("SELECT outbox.enqueue('orders', NULL, %s)", "text payload"),
                             ("SELECT outbox.enqueue('orders', NULL, %s::jsonb)", '{"a": 1}'),
                             ("SELECT outbox.enqueue('orders', NULL, %s)",
                              psycopg2.Binary(b"\x00\x01"))):
                try:
                    cur.execute(sql, (arg,))
                except psycopg2.Error as e:
                    self.fail(f"producer_login (IN ROLE outbox_producer) cannot run {sql}: "
                              f"{e.pgerror.strip()}")
                self.assertEqual(len(cur.fetchone()[0]), 36)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages"), 4)

    def test_producer_role_reads_no_row(self):
        """migrations/009: a producer learns nothing of the outbox's rows, its own or
        another topic's; outbox.enqueue (SECURITY DEFINER, run as the schema owner)
        still returns the message_id, and a plain INSERT may carry its own."""
        insert(self.db, "payments", b"another topic's row")
        conn = self.as_role("producer_login")
        for sql in ("SELECT id FROM outbox.messages",
                    "SELECT message_id FROM outbox.messages",
                    "SELECT id, message_id, payload FROM outbox.messages",
                    "SELECT count(*) FROM outbox.messages",
                    "INSERT INTO outbox.messages (topic, payload) VALUES ('orders', 'x')"
                    " RETURNING message_id",
                    "INSERT INTO outbox.messages (topic, payload) VALUES ('orders', 'x')"
                    " RETURNING id"):
            with self.subTest(sql=sql), self.assertRaises(
                    psycopg2.errors.InsufficientPrivilege):
                with conn.cursor() as cur:
                    cur.execute(sql)
        own = produce(conn, "orders", b"a message_id of its own")
        with conn.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload) VALUES ('orders', 'plain')")
            # A search_path of the producer's cannot redirect what enqueue runs.
            cur.execute("CREATE TEMP TABLE messages (topic text, payload bytea)")
            cur.execute("SET search_path = pg_temp, public")
            cur.execute("SELECT outbox.enqueue('orders', 'k', %s::jsonb)", ('{"a": 1}',))
            enqueued = cur.fetchone()[0]
            cur.execute("SELECT outbox.enqueue('orders', NULL, 'admitted'::text, NULL, true)")
            admitted = cur.fetchone()[0]
        with self.db.cursor() as cur:
            cur.execute("SELECT message_id::text, payload FROM outbox.messages"
                        " WHERE topic = 'orders' ORDER BY id")
            rows = [(m, bytes(p)) for m, p in cur.fetchall()]
        self.assertEqual([p for _, p in rows],
                         [b"a message_id of its own", b"plain", b'{"a": 1}', b"admitted"])
        self.assertEqual([m for m, _ in rows if m in (own, str(enqueued), str(admitted))],
                         [own, str(enqueued), str(admitted)])
        with self.db.cursor() as cur:
            cur.execute("SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig,"
                        " p.proowner = n.nspowner FROM pg_proc p"
                        " JOIN pg_namespace n ON n.oid = p.pronamespace"
                        " WHERE n.nspname = 'outbox' AND p.proname = 'enqueue'"
                        " AND p.pronargs = 4 AND p.proargtypes[2] = 'bytea'::regtype")
            name, definer, config, owned = cur.fetchone()
        self.assertTrue(definer, name)
        self.assertEqual(config, ["search_path=pg_catalog, pg_temp"], name)
        self.assertTrue(owned, f"{name} belongs to the owner of schema outbox")

    def test_relay_and_consumer_roles_still_work(self):
        """The producers' narrower grants leave the relay's and the consumer's roles as
        they were: the relay reads and records a batch; a consumer records a message."""
        produce(self.as_role("producer_login"), "orders", b"for the relay")
        relay = self.as_role("relay_login")
        prev = scalar(relay, "SELECT max(tick_id) FROM outbox.ticks")
        tick = mark_sent(relay, ["orders"])
        with relay.cursor() as cur:
            cur.execute("SELECT id, message_id, payload FROM outbox.batch_rows(%s, %s,"
                        " (SELECT lo - 1 FROM outbox.batch_bounds(%s, %s)),"
                        " (SELECT hi FROM outbox.batch_bounds(%s, %s)), 10)",
                        (prev, tick) * 3)
            claimed = cur.fetchall()
        self.assertEqual(len(claimed), 1)
        self.assertEqual(scalar(relay, "SELECT count(*) FROM outbox.unsent"), 0)
        self.pg.apply_migrations(consumers.consumer_migration_files())
        with self.db.cursor() as cur:
            cur.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname ="
                        " 'consumer_login') THEN CREATE ROLE consumer_login LOGIN"
                        " IN ROLE outbox_consumer; END IF; END $$")
        consumer = self.as_role("consumer_login")
        message_id = str(claimed[0][1])
        self.assertIs(scalar(consumer, "SELECT outbox_consumer.begin_message('email', %s)",
                             (message_id,)), True)
        self.assertIs(scalar(consumer, "SELECT outbox_consumer.begin_message('email', %s)",
                             (message_id,)), False)

    def test_producer_role_can_do_nothing_else(self):
        insert(self.db, "orders", b"x")
        conn = self.as_role("producer_login")
        for sql in ("SELECT payload FROM outbox.messages",
                    "UPDATE outbox.messages SET sent_at = now()",
                    "DELETE FROM outbox.messages",
                    "TRUNCATE outbox.messages",
                    "INSERT INTO outbox.messages (topic, payload, sent_at)"
                    " VALUES ('t', 'x', now())"):
            with self.subTest(sql=sql), self.assertRaises(
                    psycopg2.errors.InsufficientPrivilege):
                with conn.cursor() as cur:
                    cur.execute(sql)

    def test_relay_role_reads_and_records_batches(self):
        for i in range(2):
            insert(self.db, "orders", b"%d" % i)
        relay = self.as_role("relay_login")
        first = scalar(relay, "SELECT max(tick_id) FROM outbox.ticks")
        second = scalar(relay, "SELECT outbox.tick()")
        self.assertEqual(scalar(relay, "SELECT outbox.tick()"), second,
                         "a tick with nothing committed since the last one")
        for i in range(2, 4):
            insert(self.db, "orders", b"%d" % i)
        third = scalar(relay, "SELECT outbox.tick()")
        self.assertEqual((second, third), (first + 1, first + 2))

        def batch(prev, nxt, limit=10):
            with relay.cursor() as cur:
                cur.execute("SELECT id FROM outbox.batch_rows(%s, %s,"
                            " (SELECT lo - 1 FROM outbox.batch_bounds(%s, %s)),"
                            " (SELECT hi FROM outbox.batch_bounds(%s, %s)), %s)",
                            (prev, nxt) * 3 + (limit,))
                return [r[0] for r in cur.fetchall()]
        self.assertEqual(batch(first, second), [1, 2])
        self.assertEqual(batch(second, third), [3, 4], "each row in exactly one batch")
        self.assertEqual(batch(first, second, limit=1), [1])
        self.assertEqual(scalar(relay, "SELECT count(*) FROM outbox.unsent"), 4)
        self.assertEqual(scalar(relay, "SELECT outbox.record_batch(%s, true, '{orders}', '{-1}',"
                                       " '{1-1}', '{}', '{}', '{}', '{}', '{}', '{}')", (second,)), 0)
        with relay.cursor() as cur:
            cur.execute("SELECT id FROM outbox.unsent ORDER BY id")
            self.assertEqual([r[0] for r in cur.fetchall()], [3, 4])
        # A row that cannot be published is quarantined with why.
        self.assertEqual(scalar(relay, "SELECT outbox.record_batch(%s, true, '{orders}', '{-1}',"
                                       " '{2-1}', '{}', '{}', '{}', '{}', '{4}', '{too big}')", (third,)), 1)
        self.assertEqual(scalar(relay, "SELECT count(*) FROM outbox.unsent"), 0)
        self.assertEqual(scalar(self.db, "SELECT error FROM outbox.quarantine WHERE id = 4"),
                         "too big")
        self.assertEqual(scalar(self.db, "SELECT tick FROM outbox.stream_positions"
                                         " WHERE topic = 'orders'"), third)
        self.assertEqual(scalar(relay, "SELECT max(version) FROM outbox.schema_version"), 22)

    def test_relay_role_can_do_nothing_else(self):
        insert(self.db, "orders", b"x")
        conn = self.as_role("relay_login")
        for sql in ("INSERT INTO outbox.messages (topic, payload) VALUES ('t', 'x')",
                    "DELETE FROM outbox.messages",
                    "TRUNCATE outbox.messages",
                    "UPDATE outbox.messages SET payload = 'y'",
                    "UPDATE outbox.messages SET topic = 'y'",
                    "SELECT outbox.enqueue('t', NULL, 'x'::text)"):
            with self.subTest(sql=sql), self.assertRaises(
                    psycopg2.errors.InsufficientPrivilege):
                with conn.cursor() as cur:
                    cur.execute(sql)

    def listener(self):
        conn = self.pg.connect()
        self.addCleanup(conn.close)
        conn.cursor().execute("LISTEN outbox_relay")

        def notifications(wait):
            deadline = time.monotonic() + wait
            got = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return got
                select.select([conn], [], [], left)
                conn.poll()
                got += [n.channel for n in conn.notifies]
                conn.notifies.clear()
        return notifications

    def test_commit_notifies_once_rollback_does_not(self):
        notifications = self.listener()
        producer = self.pg.connect(autocommit=False)
        self.addCleanup(producer.close)
        harness.insert_many(producer, [("a", b"1"), ("a", b"2")], commit=False)
        insert(producer, "a", b"3", commit=False)
        self.assertEqual(notifications(0.3), [], "no notification before the commit")
        producer.commit()
        self.assertEqual(notifications(0.5), ["outbox_relay"], "one notification per transaction")
        insert(producer, "a", b"4", commit=False)
        producer.rollback()
        self.assertEqual(notifications(0.5), [], "a rolled-back insert notifies nobody")

    def test_no_notification_while_a_relay_holds_the_wakeup_lock(self):
        """migrations/007: a busy relay holds advisory lock 122550254464888; the
        producers' trigger then does not notify, and does again once it is gone
        (released, or its session ended)."""
        notifications = self.listener()
        producer = self.as_role("producer_login")
        relay = self.as_role("relay_login")
        relay.cursor().execute("SELECT pg_advisory_lock(122550254464888)")
        produce(producer, "a", b"while busy")
        self.assertEqual(notifications(0.5), [], "no notification while the lock is held")
        relay.cursor().execute("SELECT pg_advisory_unlock_all()")
        produce(producer, "a", b"when idle")
        self.assertEqual(notifications(0.5), ["outbox_relay"])
        relay.cursor().execute("SELECT pg_advisory_lock(122550254464888)")
        produce(producer, "a", b"busy again")
        self.assertEqual(notifications(0.5), [])
        relay.close()  # a relay that dies releases the lock with its session
        wait_until(lambda: scalar(self.db, "SELECT count(*) FROM pg_locks"
                                           " WHERE locktype = 'advisory'") == 0, timeout=5)
        produce(producer, "a", b"relay gone")
        self.assertEqual(notifications(0.5), ["outbox_relay"])

    def test_a_notifying_producer_holds_the_lock_shared_until_commit(self):
        """The relay's lock request waits for producers that are notifying; while it
        waits, new producers skip their notification."""
        notifications = self.listener()
        slow = self.as_role("producer_login", autocommit=False)
        produce(slow, "a", b"notifying, not committed", commit=False)
        relay = self.as_role("relay_login")
        self.assertFalse(scalar(relay, "SELECT pg_try_advisory_lock(122550254464888)"))
        waiter = threading.Thread(target=lambda: relay.cursor().execute(
            "SELECT pg_advisory_lock(122550254464888)"))
        waiter.start()
        wait_until(lambda: scalar(self.db, "SELECT count(*) FROM pg_locks WHERE locktype ="
                                           " 'advisory' AND NOT granted") == 1, timeout=5)
        other = self.as_role("producer_login")
        produce(other, "a", b"while the relay waits")
        self.assertEqual(notifications(0.3), [], "a waiting relay already stops notifications")
        slow.commit()
        waiter.join(5)
        self.assertFalse(waiter.is_alive(), "the lock was granted once the producer committed")
        self.assertEqual(notifications(0.5), ["outbox_relay"], "the committed producer notified")

class VerifierTest(harness.ServerTestCase):
    """The helpers that every delivery test trusts can see what goes wrong."""

    def test_stream_entries_reads_past_one_chunk(self):
        pipe = self.r.pipeline(transaction=False)
        for i in range(20_001):
            pipe.xadd("big", {"n": str(i)})
        pipe.execute()
        entries = harness.stream_entries(self.r, "big")
        self.assertEqual(len(entries), 20_001)
        self.assertEqual([int(f[b"n"]) for _, f in entries], list(range(20_001)))
        self.assertEqual(len({eid for eid, _ in entries}), 20_001)

    def test_verifier_counts_each_kind_of_fault(self):
        ok, absent, twice = (insert(self.db, "t", b"x") for _ in range(3))
        mark_sent(self.db, ["t"])
        unsent, elsewhere = (insert(self.db, "t", b"x") for _ in range(2))
        self.r.xadd("t", {"id": ok})
        self.r.xadd("t", {"id": twice})
        self.r.xadd("t", {"id": twice})
        self.r.xadd("other", {"id": elsewhere})
        self.r.xadd("t", {"id": "00000000-0000-0000-0000-000000000000"})
        self.r.set("not-a-stream", ok)
        fig = harness.Verifier(self.db, self.r).figures()
        self.assertEqual(fig.line(), "rows committed=5 published=2 lost=3 duplicates=1"
                                     " sent_but_absent=1 unsent=2 stray=2")
        self.assertEqual(sorted(fig.lost_ids), sorted([absent, unsent, elsewhere]))
        self.assertEqual(fig.duplicate_ids, [twice])
        with self.assertRaises(AssertionError):
            fig.assert_exactly_once(self)

    def test_verifier_passes_a_clean_delivery_and_honours_the_prefix(self):
        ids = [insert(self.db, "orders", b"x") for _ in range(3)]
        mark_sent(self.db, ["orders"])
        for mid in ids:
            self.r.xadd("pre.orders", {"id": mid})
        harness.Verifier(self.db, self.r, stream_prefix="pre.").figures().assert_exactly_once(self)
        self.assertEqual(harness.Verifier(self.db, self.r).figures().lost, 3)

    def test_verifier_options_across_streams_and_payloads(self):
        both, changed = insert(self.db, "t", b"same"), insert(self.db, "t", b"written")
        mark_sent(self.db, ["t"])
        with self.db.cursor() as cur:
            cur.execute("SELECT message_id::text, id FROM outbox.messages")
            outbox_id = {mid: str(i) for mid, i in cur.fetchall()}
        self.r.xadd("t", {"id": both, "topic": "t", "payload": b"same",
                          "outbox_id": outbox_id[both]})
        self.r.xadd("other", {"id": both})
        self.r.xadd("t", {"id": changed, "topic": "t", "payload": b"not as written",
                          "outbox_id": outbox_id[changed]})
        plain = harness.Verifier(self.db, self.r).figures()
        self.assertEqual((plain.duplicates, plain.stray, plain.corrupt), (0, 1, 0))
        strict = harness.Verifier(self.db, self.r, across_streams=True,
                                  compare_payloads=True).figures()
        self.assertEqual((strict.duplicates, strict.stray, strict.corrupt), (1, 1, 1))
        self.assertEqual(strict.duplicate_ids, [both])
        self.assertTrue(strict.line().endswith(" stray=1 corrupt=1"), strict.line())

    def test_wait_until_and_time_parsing(self):
        self.assertEqual(wait_until(lambda: 7, timeout=1), 7)
        with self.assertRaises(AssertionError):
            wait_until(lambda: False, timeout=0.2, message="never")
        when, digits = harness.parse_rfc3339_utc("2026-11-30T11:35:14.123Z")
        self.assertEqual((when.year, when.microsecond, digits), (2026, 123000, 3))
        self.assertIsNone(harness.parse_rfc3339_utc("2026-11-30 11:35:14+00:00"))


if __name__ == "__main__":
    unittest.main()
