"""Producer backpressure in SQL (migrations/005_backpressure.sql), without the relay.

Promises tested:
- outbox.observe_topic applies hysteresis against outbox.topic_limits: over
  max_queue_age or max_pending it stops admitting, between the resume and the
  max limits it keeps refusing, below both resume limits it admits again; an
  empty topic always admits again; a topic without limits always admits;
- outbox.admit raises SQLSTATE OB503 with the message
  'outbox topic "orders" is over its limit: queue age 00:02:13 > 00:01:00'
  (or pending) and the hint 'retry after a few seconds; map to HTTP 503 with
  Retry-After' while the topic is refused, and admits unknown topics;
- a limit with resume >= max, or half a pair, is rejected by a named CHECK;
- outbox.enqueue(..., p_admit => true) refuses and admits like admit, for
  bytea, text and jsonb payloads; the four-argument enqueue is unchanged;
- admit costs O(1): its plans are one primary-key lookup of topic_state (and
  of topic_limits on the refusing path), never a scan, never outbox.messages;
- roles: producers may call admit and the new enqueue, read topic_state, and
  nothing else of this file; the relay may call observe_topic; nobody else
  may execute any of the new functions;
- applying every migration again changes nothing and keeps limits and state.
"""

import difflib
import os
import re
import unittest

import psycopg2
import psycopg2.errors

from testkit import harness
from testkit.harness import scalar

harness.set_deadline(300)

OB503 = "OB503"
HINT = "retry after a few seconds; map to HTTP 503 with Retry-After"


class BackpressureSqlTest(harness.PostgresTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with cls.db.cursor() as cur:
            cur.execute("CREATE ROLE producer_login LOGIN IN ROLE outbox_producer;"
                        "CREATE ROLE relay_login LOGIN IN ROLE outbox_relay;"
                        "CREATE ROLE nobody_login LOGIN")
        cls.producer = cls.pg.connect(user="producer_login")
        cls.addClassCleanup(cls.producer.close)
        cls.relay = cls.pg.connect(user="relay_login")
        cls.addClassCleanup(cls.relay.close)

    def setUp(self):
        super().setUp()  # outbox.messages emptied
        with self.db.cursor() as cur:
            cur.execute("TRUNCATE outbox.topic_limits, outbox.topic_state")

    # -- helpers
    def limits(self, topic, max_age=None, resume_age=None, max_pending=None,
               resume_pending=None):
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.topic_limits VALUES (%s, %s::interval, %s::interval,"
                        " %s, %s)", (topic, max_age, resume_age, max_pending, resume_pending))

    def observe(self, topic, pending, age_seconds):
        """What the relay does: returns the new admitting value."""
        with self.relay.cursor() as cur:
            if age_seconds is None:
                cur.execute("SELECT outbox.observe_topic(%s, %s, NULL)", (topic, pending))
            else:
                cur.execute("SELECT outbox.observe_topic(%s, %s,"
                            " now() - make_interval(secs => %s))",
                            (topic, pending, age_seconds))
            return cur.fetchone()[0]

    def admit(self, topic, conn=None):
        with (conn or self.producer).cursor() as cur:
            cur.execute("SELECT outbox.admit(%s)", (topic,))

    def assert_refused(self, topic, message=None, conn=None):
        """admit raises OB503 with the hint; returns the message (checked if given)."""
        with self.assertRaises(psycopg2.Error) as ctx:
            self.admit(topic, conn)
        e = ctx.exception
        self.assertEqual(e.pgcode, OB503, e.pgerror)
        self.assertEqual(e.diag.message_hint, HINT)
        self.assertTrue(e.diag.message_primary.startswith(
            f'outbox topic "{topic}" is over its limit: '), e.diag.message_primary)
        if message is not None:
            if isinstance(message, str):
                self.assertEqual(e.diag.message_primary, message)
            else:
                self.assertRegex(e.diag.message_primary, message)
        return e.diag.message_primary

    def assert_admitted(self, topic, conn=None):
        try:
            self.admit(topic, conn)
        except psycopg2.Error as e:
            self.fail(f"admit({topic!r}) refused: {e.pgcode} {e.pgerror}")

    def state(self, topic):
        with self.db.cursor() as cur:
            cur.execute("SELECT pending, oldest_pending_at IS NOT NULL, admitting,"
                        " updated_at IS NOT NULL FROM outbox.topic_state WHERE topic = %s",
                        (topic,))
            return cur.fetchone()

    # -- hysteresis
    def test_exact_message_over_the_queue_age_limit(self):
        self.limits("orders", "1 minute", "20 seconds")
        # One transaction, so now() is the same for the relay's call and the
        # producer's: the age in the message is exactly 2 min 13 s.
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        with conn.cursor() as cur:
            cur.execute("SELECT outbox.observe_topic('orders', 5, now() - interval '133 s')")
            self.assertIs(cur.fetchone()[0], False)
            with self.assertRaises(psycopg2.Error) as ctx:
                cur.execute("SELECT outbox.admit('orders')")
        conn.rollback()
        e = ctx.exception
        self.assertEqual(e.pgcode, "OB503")
        self.assertEqual(e.diag.message_primary,
                         'outbox topic "orders" is over its limit: queue age 00:02:13 > 00:01:00')
        self.assertEqual(e.diag.message_hint,
                         "retry after a few seconds; map to HTTP 503 with Retry-After")
        self.assertIn("5 pending", e.diag.message_detail)
        self.assertIn("queue age < 00:00:20", e.diag.message_detail)

    def test_queue_age_hysteresis(self):
        self.limits("orders", "1 minute", "20 seconds")
        self.assertIs(self.observe("orders", 3, 30), True, "below the max: admitting")
        self.assert_admitted("orders")
        self.assertIs(self.observe("orders", 3, 133), False, "over the max: refusing")
        self.assert_refused("orders", re.compile(r"queue age 00:02:1[3-5] > 00:01:00$"))
        self.assertEqual(self.state("orders"), (3, True, False, True))
        self.assertIs(self.observe("orders", 3, 40), False,
                      "between resume and max: still refusing")
        self.assert_refused("orders", re.compile(r"queue age 00:00:4[0-2] not yet below 00:00:20$"))
        self.assertIs(self.observe("orders", 3, 19), True, "below resume: admitting again")
        self.assert_admitted("orders")
        self.assertIs(self.observe("orders", 3, 40), True,
                      "between resume and max while admitting: still admitting")
        self.assert_admitted("orders")
        self.assertIs(self.observe("orders", 3, 61), False)
        self.assertIs(self.observe("orders", 0, None), True, "an empty topic admits again")
        self.assertEqual(self.state("orders"), (0, False, True, True))
        self.assert_admitted("orders")

    def test_pending_hysteresis(self):
        self.limits("orders", max_pending=1000, resume_pending=100)
        self.assertIs(self.observe("orders", 1000, 1), True, "at the max is not over it")
        self.assertIs(self.observe("orders", 1001, 1), False)
        self.assert_refused("orders", 'outbox topic "orders" is over its limit: pending 1001 > 1000')
        self.assertIs(self.observe("orders", 500, 1), False, "between resume and max")
        self.assert_refused("orders", 'outbox topic "orders" is over its limit:'
                                      ' pending 500 not yet below 100')
        self.assertIs(self.observe("orders", 100, 1), False, "at resume is not below it")
        self.assertIs(self.observe("orders", 99, 1), True)
        self.assert_admitted("orders")
        self.assertIs(self.observe("orders", 999, 1), True, "admitting until over the max")

    def test_both_limits_refuse_alone_and_resume_together(self):
        self.limits("orders", "1 minute", "20 seconds", 1000, 100)
        self.assertIs(self.observe("orders", 5000, 1), False, "pending alone refuses")
        self.assertIs(self.observe("orders", 5, 40), False, "age still above its resume limit")
        self.assertIs(self.observe("orders", 500, 1), False, "pending still above its resume")
        self.assertIs(self.observe("orders", 5, 1), True, "both below: admitting")
        self.assertIs(self.observe("orders", 5, 3600), False, "age alone refuses")
        self.assert_refused("orders", re.compile(r"queue age 01:00:0[0-2] > 00:01:00$"))

    def test_limits_changed_or_removed(self):
        self.limits("orders", max_pending=10, resume_pending=5)
        self.assertIs(self.observe("orders", 50, 1), False)
        with self.db.cursor() as cur:
            cur.execute("DELETE FROM outbox.topic_limits WHERE topic = 'orders'")
        # The verdict stands until the relay observes the topic again.
        self.assert_refused("orders", re.compile(r"refused by the relay at "))
        self.assertIs(self.observe("orders", 50, 1), True, "no limits: admitting")
        self.assert_admitted("orders")

    def test_unknown_and_unlimited_topics_admit(self):
        self.assert_admitted("never-seen")
        self.assertIs(self.observe("free", 10**12, 86400 * 30), True, "no limits row")
        self.assert_admitted("free")
        self.limits("limited", max_pending=10, resume_pending=5)
        self.assertIs(self.observe("limited", 11, 1), False)
        self.assert_admitted("free")
        self.assert_admitted("never-seen")

    def test_limits_are_checked(self):
        bad = [
            (("t", "1 minute", "1 minute"), "topic_limits_queue_age_hysteresis"),
            (("t", "1 minute", "2 minutes"), "topic_limits_queue_age_hysteresis"),
            (("t", None, None, 100, 100), "topic_limits_pending_hysteresis"),
            (("t", None, None, 100, 1000), "topic_limits_pending_hysteresis"),
            (("t", "1 minute", None), "topic_limits_queue_age_pair"),
            (("t", None, "1 minute"), "topic_limits_queue_age_pair"),
            (("t", None, None, 100, None), "topic_limits_pending_pair"),
            (("t", None, None, None, 5), "topic_limits_pending_pair"),
            (("t", "1 minute", "0 s"), "topic_limits_queue_age_positive"),
            (("t", None, None, 100, 0), "topic_limits_pending_positive"),
        ]
        for args, constraint in bad:
            with self.subTest(args=args), self.assertRaises(
                    psycopg2.errors.CheckViolation) as ctx:
                self.limits(*args)
            self.assertEqual(ctx.exception.diag.constraint_name, constraint)
            self.assertIn(constraint, ctx.exception.diag.message_primary)
        self.limits("ok", "1 minute", "59 seconds", 2, 1)
        with self.assertRaises(psycopg2.errors.CheckViolation) as ctx, self.db.cursor() as cur:
            cur.execute("UPDATE outbox.topic_limits SET resume_pending = 3 WHERE topic = 'ok'")
        self.assertEqual(ctx.exception.diag.constraint_name, "topic_limits_pending_hysteresis")

    def test_observe_rejects_bad_arguments(self):
        for args in ((None, 1), ("t", None), ("t", -1)):
            with self.subTest(args=args), self.assertRaises(
                    psycopg2.errors.InvalidParameterValue):
                with self.relay.cursor() as cur:
                    cur.execute("SELECT outbox.observe_topic(%s, %s, NULL)", args)

    # -- enqueue with p_admit
    def test_enqueue_with_admit(self):
        self.limits("orders", max_pending=10, resume_pending=5)
        self.assertIs(self.observe("orders", 11, 1), False)
        calls = (("SELECT outbox.enqueue('orders', 'k', %s::bytea, NULL, p_admit => true)",
                  psycopg2.Binary(b"\x00\xff")),
                 ("SELECT outbox.enqueue('orders', 'k', %s, NULL, p_admit => true)", "text"),
                 ("SELECT outbox.enqueue('orders', 'k', %s::jsonb, '{\"h\": \"v\"}',"
                  " p_admit => true)", '{"a": 1}'),
                 ("SELECT outbox.enqueue(p_topic => 'orders', p_partition_key => NULL,"
                  " p_payload => %s, p_headers => NULL, p_admit => true)", "named"))
        for sql, arg in calls:
            with self.subTest(sql=sql, admitted=False):
                with self.assertRaises(psycopg2.Error) as ctx, self.producer.cursor() as cur:
                    cur.execute(sql, (arg,))
                self.assertEqual(ctx.exception.pgcode, OB503)
                self.assertEqual(ctx.exception.diag.message_hint, HINT)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages"), 0,
                         "a refused enqueue writes nothing")
        with self.producer.cursor() as cur:
            cur.execute("SELECT outbox.enqueue('orders', 'k', 'x'::text, NULL, p_admit => false)")
            cur.execute("SELECT outbox.enqueue('orders', 'k', 'y'::text)")
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages"), 2,
                         "p_admit => false and the four-argument enqueue do not ask")

        self.assertIs(self.observe("orders", 4, 1), True)
        for sql, arg in calls:
            with self.subTest(sql=sql, admitted=True), self.producer.cursor() as cur:
                cur.execute(sql, (arg,))
                self.assertEqual(len(str(cur.fetchone()[0])), 36)
        with self.db.cursor() as cur:
            cur.execute("SELECT payload, headers FROM outbox.messages ORDER BY id OFFSET 2")
            rows = [(bytes(p), h) for p, h in cur.fetchall()]
        self.assertEqual(rows, [(b"\x00\xff", None), (b"text", None),
                                (b'{"a": 1}', {"h": "v"}), (b"named", None)])

    def test_refusal_inside_a_transaction_aborts_it(self):
        self.limits("orders", max_pending=10, resume_pending=5)
        self.observe("orders", 11, 1)
        conn = self.pg.connect(autocommit=False, user="producer_login")
        self.addCleanup(conn.close)
        with conn.cursor() as cur:
            cur.execute("SELECT outbox.enqueue('orders', NULL, 'before'::text)")
            with self.assertRaises(psycopg2.Error) as ctx:
                cur.execute("SELECT outbox.admit('orders')")
        self.assertEqual(ctx.exception.pgcode, OB503)
        conn.rollback()
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages"), 0)

    # -- cost
    def nested_plans(self, sql):
        """The plans of every statement sql runs, nested ones too (auto_explain)."""
        conn = self.pg.connect()
        self.addCleanup(conn.close)
        with conn.cursor() as cur:
            cur.execute("LOAD 'auto_explain'")
            cur.execute("SET auto_explain.log_min_duration = 0;"
                        "SET auto_explain.log_nested_statements = on;"
                        "SET auto_explain.log_level = notice;"
                        "SET client_min_messages = notice")
            del conn.notices[:]
            try:
                cur.execute(sql)
            except psycopg2.Error as e:
                if e.pgcode != OB503:
                    raise
        plans = [n for n in conn.notices if "Query Text:" in n]
        self.assertTrue(plans, f"auto_explain logged no plan: {conn.notices}")
        return plans

    def test_admit_is_one_index_lookup(self):
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.topic_state (topic, pending, admitting, updated_at)"
                        " SELECT 't-' || i, i, i % 2 = 0, now()"
                        " FROM generate_series(1, 20000) AS i")
            cur.execute("INSERT INTO outbox.topic_limits (topic, max_pending, resume_pending)"
                        " SELECT 't-' || i, 100, 10 FROM generate_series(1, 20000) AS i")
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 't-' || (i % 200), 'x' FROM generate_series(1, 20000) AS i")
            cur.execute("ANALYZE outbox.topic_state; ANALYZE outbox.topic_limits;"
                        " ANALYZE outbox.messages")

            # The statement admit runs, as EXPLAIN sees it.
            cur.execute("EXPLAIN SELECT s.* FROM outbox.topic_state AS s WHERE s.topic = 't-2'")
            plan = "\n".join(r[0] for r in cur.fetchall())
            self.assertRegex(plan, r"Index Scan using topic_state_pkey on topic_state")
            self.assertNotIn("Seq Scan", plan)

        # What admit really executes, admitting (t-2) and refusing (t-1).
        for topic, tables in (("t-2", {"topic_state"}), ("t-1", {"topic_state", "topic_limits"}),
                              ("unknown", {"topic_state"})):
            with self.subTest(topic=topic):
                plans = self.nested_plans(f"SELECT outbox.admit('{topic}')")
                text = "\n".join(plans)
                self.assertNotIn("messages", text, text)
                self.assertNotIn("Seq Scan", text, text)
                self.assertNotRegex(text, r"Aggregate|Sort|Bitmap", text)
                scanned = set(re.findall(r"Index (?:Only )?Scan using (\w+) on (\w+)", text))
                self.assertEqual({t for _, t in scanned}, tables, text)
                self.assertEqual({i for i, _ in scanned}, {t + "_pkey" for t in tables}, text)
                lookups = re.findall(r"Index (?:Only )?Scan using topic_state_pkey", text)
                self.assertEqual(len(lookups), 1, f"one lookup of topic_state:\n{text}")

    # -- roles
    def test_producer_role(self):
        self.limits("orders", max_pending=10, resume_pending=5)
        self.assert_admitted("orders", self.producer)
        with self.producer.cursor() as cur:
            cur.execute("SELECT outbox.enqueue('orders', NULL, 'x'::text, NULL, true)")
        self.observe("orders", 11, 1)
        self.assert_refused("orders", conn=self.producer)
        self.assertEqual(scalar(self.producer, "SELECT admitting FROM outbox.topic_state"
                                               " WHERE topic = 'orders'"), False)
        for sql in ("SELECT outbox.observe_topic('orders', 0, NULL)",
                    "UPDATE outbox.topic_state SET admitting = true",
                    "INSERT INTO outbox.topic_state VALUES ('x', 0, NULL, true, now())",
                    "DELETE FROM outbox.topic_state",
                    "SELECT * FROM outbox.topic_limits",
                    "INSERT INTO outbox.topic_limits (topic) VALUES ('x')",
                    "UPDATE outbox.topic_limits SET max_pending = 1000000"):
            with self.subTest(sql=sql), self.assertRaises(
                    psycopg2.errors.InsufficientPrivilege):
                with self.producer.cursor() as cur:
                    cur.execute(sql)

    def test_relay_role(self):
        self.limits("orders", max_pending=10, resume_pending=5)
        self.assertIs(self.observe("orders", 11, 1), False)
        self.assertEqual(scalar(self.relay, "SELECT max_pending FROM outbox.topic_limits"
                                            " WHERE topic = 'orders'"), 10)
        self.assertEqual(scalar(self.relay, "SELECT admitting FROM outbox.topic_state"
                                            " WHERE topic = 'orders'"), False)
        for sql in ("SELECT outbox.admit('orders')",
                    "SELECT outbox.enqueue('orders', NULL, 'x'::text, NULL, false)",
                    "UPDATE outbox.topic_limits SET max_pending = 1000000",
                    "DELETE FROM outbox.topic_state"):
            with self.subTest(sql=sql), self.assertRaises(
                    psycopg2.errors.InsufficientPrivilege):
                with self.relay.cursor() as cur:
                    cur.execute(sql)

    def test_nobody_else_may_execute(self):
        conn = self.pg.connect(user="nobody_login")
        self.addCleanup(conn.close)
        for sql in ("SELECT outbox.admit('orders')",
                    "SELECT outbox.observe_topic('orders', 0, NULL)",
                    "SELECT outbox.interval_hms('1 s')",
                    "SELECT outbox.enqueue('orders', NULL, 'x'::text, NULL, false)",
                    "SELECT outbox.enqueue('orders', NULL, 'x'::bytea, NULL, false)",
                    "SELECT outbox.enqueue('orders', NULL, '{}'::jsonb, NULL, false)"):
            with self.subTest(sql=sql), self.assertRaises(
                    psycopg2.errors.InsufficientPrivilege):
                with conn.cursor() as cur:
                    cur.execute(sql)
        with self.db.cursor() as cur:
            cur.execute("SELECT p.oid::regprocedure::text FROM pg_proc p"
                        " JOIN pg_namespace n ON n.oid = p.pronamespace"
                        " WHERE n.nspname = 'outbox' AND p.proname IN"
                        " ('admit', 'observe_topic', 'interval_hms', 'enqueue')"
                        " AND has_function_privilege('public', p.oid, 'EXECUTE')")
            self.assertEqual(cur.fetchall(), [], "PUBLIC may execute none of them")

    # -- the migration itself
    def schema_dump(self):
        text = harness.run_command([os.path.join(self.pg.bindir, "pg_dump"), "-h", "127.0.0.1",
                                    "-p", str(self.pg.port), "-U", "postgres", "-d", "app",
                                    "--schema-only"], "pg_dump")
        return [line for line in text.splitlines()
                if not line.startswith(("\\restrict", "\\unrestrict"))]

    def test_version_and_second_application(self):
        self.assertEqual(scalar(self.db, "SELECT name FROM outbox.schema_version"
                                         " WHERE version = 5"), "005_backpressure.sql")
        self.assertGreaterEqual(scalar(self.db, "SELECT max(version) FROM outbox.schema_version"), 5)
        self.limits("orders", "1 minute", "20 seconds", 1000, 100)
        self.observe("orders", 5000, 1)

        def snapshot():
            with self.db.cursor() as cur:
                cur.execute("SELECT row_to_json(l)::text FROM outbox.topic_limits l")
                limits = cur.fetchall()
                cur.execute("SELECT row_to_json(s)::text FROM outbox.topic_state s")
                state = cur.fetchall()
                cur.execute("SELECT array_agg(version || ':' || name || ':' || applied_at"
                            " ORDER BY version) FROM outbox.schema_version")
                versions = cur.fetchone()
            return self.schema_dump(), limits, state, versions

        before = snapshot()
        self.pg.apply_migrations()  # every file again; raises if one fails
        after = snapshot()
        diff = "\n".join(difflib.unified_diff(before[0], after[0], "first", "second",
                                               lineterm=""))
        self.assertEqual(diff, "", "a second application changed the schema dump")
        self.assertEqual(before[1:], after[1:])
        self.assert_refused("orders")


if __name__ == "__main__":
    unittest.main()
