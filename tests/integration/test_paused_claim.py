"""A paused topic's backlog costs the claim nothing (docs/DESIGN.md P5; docs/OPERATIONS.md, backpressure).

The relay pauses a stream whose consumer group lags (pause_lag_entries) and
its claim skips that topic, whose rows wait in the outbox. Here a group on
"orders" lags, so "orders" is paused; then PAUSED_ROWS pending "orders" rows
are committed in front of (with lower ids than) the rows of two healthy
topics, "invoices" and "mail", which come interleaved with more "orders" rows.

Promises tested:
- the healthy rows flow: every one is published once, each stream in id
  order, and batch after batch across both topics (the time in their entry
  ids never falls from one batch to the next); each claim takes the lowest
  healthy rows left (the batches are ranges of ids that do not overlap); no
  "orders" row is published;
- every claim the relay runs while "orders" is paused reads O(batch_size)
  rows, however long the paused backlog: from the plans that auto_explain logs
  for the relay's own claim executions (EXPLAIN ANALYZE with BUFFERS, for the
  sessions of the relay's login role only), the rows its table and index scans
  return or filter out stay within ROWS_PER_CLAIM, and the buffers it touches
  within BUFFERS_PER_CLAIM, also for the claims that find nothing to do once
  the healthy rows are sent. A claim that walks the paused backlog reads all
  PAUSED_ROWS of it.

Wall time is printed, never asserted.
"""

import json
import re
import statistics
import sys
import unittest

import psycopg2

from testkit import harness
from testkit.harness import wait_until

harness.require_relay()
harness.set_deadline(600)

PAUSED_ROWS = 200_000
HEALTHY = ("invoices", "mail")
HEALTHY_ROWS = 1000          # interleaved with as many more rows of the paused topic
BATCH = 100
# Generous bounds: a claim locks at most BATCH rows and steps over at most the
# other lane's batch (about 4 rows read and 10 buffers per row); a claim that
# walks the paused backlog reads all of it, about 200,000 rows and 8,000 buffers.
ROWS_PER_CLAIM = 10 * BATCH
BUFFERS_PER_CLAIM = 40 * BATCH
RELAY_ROLE = "relay_explained"
AUTO_EXPLAIN = {"session_preload_libraries": "auto_explain", "auto_explain.log_min_duration": "0",
                "auto_explain.log_analyze": "on", "auto_explain.log_buffers": "on",
                "auto_explain.log_timing": "off", "auto_explain.log_format": "json"}
PLAN_HEAD = re.compile(r"LOG:  duration: ([\d.]+) ms  plan:$")


def logged_plans(log):
    """[(duration ms, plan document)] for every plan auto_explain wrote into log."""
    plans = []
    lines = log.splitlines()
    i = 0
    while i < len(lines):
        m = PLAN_HEAD.search(lines[i])
        i += 1
        if not m:
            continue
        body = []
        while i < len(lines) and lines[i].startswith("\t"):
            body.append(lines[i][1:])
            i += 1
        try:
            plans.append((float(m.group(1)), json.loads("\n".join(body))))
        except json.JSONDecodeError:
            # The server may still be writing the last plan: callers poll, and
            # the next read has it whole. Anywhere else it is a broken plan.
            if i < len(lines):
                raise
    return plans


def nodes(plan):
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def rows_read(plan):
    """Rows the table and index scans of a plan returned or filtered out, over all loops."""
    total = 0.0
    for node in nodes(plan):
        if "Relation Name" in node:
            per_loop = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                        + node.get("Rows Removed by Index Recheck", 0))
            total += per_loop * node.get("Actual Loops", 1)
    return int(total)


def buffers(plan):
    return plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)


class PausedClaimTest(harness.ServerTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with cls.db.cursor() as cur:
            try:
                cur.execute("LOAD 'auto_explain'")
            except psycopg2.Error as e:
                raise unittest.SkipTest(f"auto_explain cannot be loaded: {e}") from None
            cur.execute(f"CREATE ROLE {RELAY_ROLE} LOGIN IN ROLE outbox_relay")
            for name, value in AUTO_EXPLAIN.items():
                cur.execute(f"ALTER ROLE {RELAY_ROLE} SET {name} = '{value}'")

    def start_relay(self):
        dsn = self.pg.dsn(user=RELAY_ROLE)
        return self.relay(env={"OUTBOX_RELAY_POSTGRES": dsn}, batch_size=BATCH,
                          poll_interval="200ms", observe_interval="200ms",
                          pause_lag_entries="10", resume_lag_entries="2")

    def test_paused_backlog_costs_the_claim_nothing(self):
        relay = self.start_relay()
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        for i in range(20):
            harness.insert(self.db, "orders", b"read by nobody %d" % i)
        relay.wait_for_log(r"stream orders paused", timeout=30)

        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'orders', convert_to(rpad(g::text, 200, 'x'), 'UTF8')"
                        " FROM generate_series(1, %s) AS g", (PAUSED_ROWS,))
            cur.execute("ANALYZE outbox.messages")
            # Claims from here on see the whole backlog committed.
            since = len(self.pg.log())
            # Healthy rows behind the backlog, each followed by a row of the paused topic.
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT CASE WHEN g %% 2 = 1 THEN 'orders'"
                        "  ELSE (%s::text[])[1 + g / 2 %% 2] END,"
                        "  convert_to(rpad(g::text, 200, 'y'), 'UTF8')"
                        " FROM generate_series(0, %s) AS g", (list(HEALTHY), 2 * HEALTHY_ROWS - 1))
            cur.execute("SELECT id, topic FROM outbox.messages WHERE topic = ANY(%s) ORDER BY id",
                        (list(HEALTHY),))
            healthy = cur.fetchall()
        self.assertEqual(len(healthy), HEALTHY_ROWS)

        def healthy_sent():
            return harness.scalar(self.db, "SELECT count(*) FROM outbox.messages"
                                           " WHERE topic = ANY(%s) AND sent_at IS NOT NULL",
                                  (list(HEALTHY),)) == HEALTHY_ROWS
        wait_until(healthy_sent, timeout=300, interval=0.2, relay=relay,
                   message="the healthy topics' rows to be sent")
        # A few more claims while nothing healthy is left: they must be cheap too.
        mark = len(self.pg.log())
        wait_until(lambda: len([p for p in logged_plans(self.pg.log()[mark:])
                                if "FOR UPDATE SKIP LOCKED" in p[1]["Query Text"]]) >= 3,
                   timeout=30, relay=relay, message="claims after the healthy rows")

        # The healthy rows: once each, each stream in id order, and batch after
        # batch across the two streams too: batches publish in claim order, so
        # the Redis clock in the entry ids never goes back from one batch to the
        # next. Within a batch each stream's rows go in calls of their own, so
        # across streams a batch's rows need not be in id order.
        published = {}
        for topic in HEALTHY:
            entries = harness.stream_entries(self.r, topic)
            ids = [int(f[b"outbox_id"]) for _, f in entries]
            self.assertEqual(ids, [i for i, t in healthy if t == topic],
                             f"stream {topic}: each row once, in id order")
            published.update((int(f[b"outbox_id"]), int(eid.split("-")[0]))
                             for eid, f in entries)
        # Each claim took the lowest healthy rows left: the batches (rows that share
        # a sent_at) are ranges of ids that do not overlap.
        with self.db.cursor() as cur:
            cur.execute("SELECT min(id), max(id), count(*) FROM outbox.messages"
                        " WHERE topic = ANY(%s) GROUP BY sent_at ORDER BY min(id)",
                        (list(HEALTHY),))
            batches = cur.fetchall()
        for before, after in zip(batches, batches[1:]):
            self.assertLess(before[1], after[0], f"a claim skipped a healthy row: batches"
                                                 f" (first id, last id, rows) {batches}")
        clock = [[published[i] for i, _ in healthy if lo <= i <= hi] for lo, hi, _ in batches]
        for n, (before, after) in enumerate(zip(clock, clock[1:])):
            self.assertLessEqual(max(before), min(after),
                                 f"batch {n + 1} was published before batch {n} ended")
        self.assertGreaterEqual(len(batches), HEALTHY_ROWS // BATCH)
        self.assertEqual(harness.scalar(self.db, "SELECT count(*) FROM outbox.messages"
                                                 " WHERE topic = 'orders' AND sent_at IS NULL"),
                         PAUSED_ROWS + HEALTHY_ROWS, "rows of the paused topic published")
        self.assertEqual(self.r.xlen("orders"), 20)

        # What each claim read while "orders" was paused.
        claims = [(ms, doc) for ms, doc in logged_plans(self.pg.log()[since:])
                  if "FOR UPDATE SKIP LOCKED" in doc["Query Text"]]
        figures = [(ms, doc["Plan"].get("Actual Rows", 0), rows_read(doc["Plan"]),
                    buffers(doc["Plan"])) for ms, doc in claims]
        full = [f for f in figures if f[1] > 0]
        self.assertTrue(full, "no claim that returned rows was logged")
        worst_rows = max(f[2] for f in figures)
        worst_buffers = max(f[3] for f in figures)
        print(f"{len(figures)} claims with {PAUSED_ROWS + HEALTHY_ROWS} rows paused"
              f" ({len(full)} returned rows, batch_size {BATCH}): rows read at most {worst_rows},"
              f" buffers at most {worst_buffers}; duration median"
              f" {statistics.median(f[0] for f in full):.2f} ms, max"
              f" {max(f[0] for f in figures):.2f} ms (auto_explain, analyze, timing off)",
              file=sys.stderr, flush=True)
        for ms, returned, read, touched in figures:
            self.assertLessEqual(read, ROWS_PER_CLAIM,
                                 f"a claim returning {returned} rows read {read} rows")
            self.assertLessEqual(touched, BUFFERS_PER_CLAIM,
                                 f"a claim returning {returned} rows touched {touched} buffers")


if __name__ == "__main__":
    unittest.main()
