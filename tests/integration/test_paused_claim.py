"""A paused topic's backlog costs the batch reads nothing (docs/DESIGN.md, "Batches
from snapshots": "The loop" and "Streams behind the lead"; docs/OPERATIONS.md,
backpressure).

The relay pauses a stream whose consumer group lags (pause_lag_entries). It
reads every batch (the rows committed between two ticks) in chunks of
batch_size rows, the prepared "batch" statement over messages_txid_idx, and
skips in memory the rows of a paused stream: they wait in the outbox, and a
paused stream stays where the lead was when it paused. Later batches hold
only what committed after the tick before, so they never read those rows
again; when the pause ends, the stream reads its batches from where it stood
to the lead again, one at a time, and publishes its rows.

Here a group on "orders" lags, so "orders" is paused; then PAUSED_ROWS
"orders" rows are committed in one transaction (one batch), followed by
transactions of two healthy topics, "invoices" and "mail", each row followed
by one more "orders" row: the first half of them back to back (read while the
backlog's batch is, or right after it), the second half one transaction at a
time, each once the one before is published (a batch each).

Promises tested:
- the healthy rows flow: every one is published once, each stream in id
  order, and batch after batch across both topics: the healthy rows grouped
  by the time part of their entry id (their tick's ms) are ranges of ids in
  commit order, and the ms never falls from one batch to the next; no
  "orders" row is published while "orders" is paused (outbox.unsent);
- every execution of the batch statement reads O(batch_size) rows and
  buffers, also while the long paused backlog waits: from the plans that
  auto_explain logs for the relay's own executions (EXPLAIN ANALYZE with
  BUFFERS, for the sessions of the relay's login role only), the rows its
  table and index scans return or filter out stay within ROWS_PER_READ and
  the buffers it touches within BUFFERS_PER_READ, for the chunks of the
  backlog's own batch, of the healthy batches after it, and of the catch-up;
  a read that walked the backlog would read all PAUSED_ROWS of it;
- the batches read after the backlog committed never return its rows: while
  "orders" is paused the executions return, in all, the backlog once plus
  the healthy rows and the "orders" rows interleaved with them, each once;
- once the group catches up (XGROUP SETID orders email $), "orders" resumes
  (the group is then dropped, so that its lag does not pause the catch-up
  again) and all its rows, the 20 published before the pause, the whole backlog and
  the interleaved rows, are in the stream once each, in id order, and
  nothing is left unsent.

Wall time is printed, never asserted.
"""

import json
import re
import statistics
import sys
import time
import unittest

import psycopg2

from testkit import harness
from testkit.harness import wait_until

harness.require_relay()
harness.set_deadline(900)

# 500 times batch_size: a read that walked the backlog would read 50 times
# ROWS_PER_READ. (It was 200,000 when a claim could walk it once; here a
# relay that walked it would do so in each of the backlog's 500 chunks, and
# again while catching up, and the run would take many minutes.)
PAUSED_ROWS = 50_000
HEALTHY = ("invoices", "mail")
HEALTHY_ROWS = 1000          # interleaved with as many more rows of the paused topic
TRANSACTIONS = 20            # the healthy rows come in this many transactions
BATCH = 100
# Generous bounds: an execution returns at most BATCH rows of the outbox
# (about 4 rows read and 10 buffers per row with the ticks, topics and
# headers lookups); one that walked the paused backlog would read about
# PAUSED_ROWS rows and PAUSED_ROWS / 25 buffers.
ROWS_PER_READ = 10 * BATCH
BUFFERS_PER_READ = 40 * BATCH
RELAY_ROLE = "relay_explained"
AUTO_EXPLAIN = {"session_preload_libraries": "auto_explain", "auto_explain.log_min_duration": "0",
                "auto_explain.log_analyze": "on", "auto_explain.log_buffers": "on",
                "auto_explain.log_timing": "off", "auto_explain.log_format": "json"}
PLAN_HEAD = re.compile(r"LOG:  duration: ([\d.]+) ms  plan:$")
# The relay's "batch" statement (relay/pgsrc.c, relay_pgsrc_batch_sql).
BATCH_TEXT = "SELECT id, message_id, topic"


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


def batch_reads(log):
    """[(duration ms, plan document)] of the relay's executions of its batch statement."""
    return [(ms, doc) for ms, doc in logged_plans(log)
            if doc["Query Text"].lstrip().startswith(BATCH_TEXT)
            and "outbox.batch_rows" in doc["Query Text"]]


def figures(reads):
    """(duration ms, rows returned, rows read, buffers touched) of each execution."""
    return [(ms, doc["Plan"].get("Actual Rows", 0), rows_read(doc["Plan"]),
             buffers(doc["Plan"])) for ms, doc in reads]


def entry_ms(entry_id):
    return int(entry_id.split("-")[0])


class PausedBacklogTest(harness.ServerTestCase):

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

    def commit_healthy(self, n):
        """Commits transaction n of the healthy rows: each healthy row followed
        by a row of the paused topic. Returns the ids of its healthy rows."""
        per = HEALTHY_ROWS // TRANSACTIONS
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT CASE WHEN g %% 2 = 1 THEN 'orders'"
                        "  ELSE (%s::text[])[1 + g / 2 %% 2] END,"
                        "  convert_to(rpad(g::text, 200, 'y'), 'UTF8')"
                        " FROM generate_series(%s, %s) AS g"
                        " RETURNING id, topic",
                        (list(HEALTHY), 2 * per * n, 2 * per * (n + 1) - 1))
            return sorted(i for i, t in cur.fetchall() if t in HEALTHY)

    def healthy_sent(self):
        return harness.count_sent(self.db, "m.topic = ANY(%s)", (list(HEALTHY),))

    def test_paused_backlog_costs_the_batch_reads_nothing(self):
        began = time.monotonic()
        relay = self.start_relay()
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'orders', convert_to('read by nobody ' || g, 'UTF8')"
                        " FROM generate_series(0, 19) AS g")
        wait_until(lambda: self.r.xlen("orders") == 20, timeout=30, relay=relay,
                   message="the first 20 orders rows in their stream")
        relay.wait_for_log(r"stream orders paused", timeout=30)

        # Executions from here on see the backlog committed.
        since = len(self.pg.log())
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'orders', convert_to(rpad(g::text, 200, 'x'), 'UTF8')"
                        " FROM generate_series(1, %s) AS g", (PAUSED_ROWS,))
            cur.execute("ANALYZE outbox.messages")
        # Healthy rows behind the backlog: half back to back, while the relay
        # reads the backlog's batch or right after it ...
        half = TRANSACTIONS // 2
        transactions = [self.commit_healthy(n) for n in range(half)]
        wait_until(lambda: self.healthy_sent() == half * HEALTHY_ROWS // TRANSACTIONS,
                   timeout=300, interval=0.2, relay=relay,
                   message="the first half of the healthy rows to be sent")
        backlog_read = time.monotonic()
        # ... and half one transaction at a time, each once the one before is
        # published: a batch each, read while the backlog waits.
        for n in range(half, TRANSACTIONS):
            transactions.append(self.commit_healthy(n))
            wait_until(lambda n=n: self.healthy_sent() == (n + 1) * HEALTHY_ROWS // TRANSACTIONS,
                       timeout=60, interval=0.05, relay=relay,
                       message=f"healthy transaction {n} to be sent")
        healthy = sorted(i for ids in transactions for i in ids)
        self.assertEqual(len(healthy), HEALTHY_ROWS)

        # The healthy rows: once each, each stream in id order.
        ms_of = {}
        with self.db.cursor() as cur:
            cur.execute("SELECT id, topic FROM outbox.messages WHERE topic = ANY(%s) ORDER BY id",
                        (list(HEALTHY),))
            rows = cur.fetchall()
        for topic in HEALTHY:
            entries = harness.stream_entries(self.r, topic)
            ids = [int(f[b"outbox_id"]) for _, f in entries]
            self.assertEqual(ids, [i for i, t in rows if t == topic],
                             f"stream {topic}: each row once, in id order")
            ms_of.update((int(f[b"outbox_id"]), entry_ms(eid)) for eid, f in entries)
        # Batch after batch across both streams: the transactions committed
        # one after another, in id order, so grouped by their tick's ms the
        # healthy rows are ranges of ids, and the ms never falls from one
        # batch to the next. Each transaction of the second half is a batch
        # of its own.
        clock = [ms_of[i] for i in healthy]
        for n, (before, after) in enumerate(zip(clock, clock[1:])):
            self.assertLessEqual(before, after,
                                 f"healthy row {healthy[n + 1]} has an entry id ms below the"
                                 f" row before it ({after} < {before}): a batch published"
                                 f" after a later one")
        batches = {}
        for i in healthy:
            batches.setdefault(ms_of[i], []).append(i)
        spans = sorted((min(ids), max(ids), len(ids)) for ids in batches.values())
        for before, after in zip(spans, spans[1:]):
            self.assertLess(before[1], after[0], f"batches overlap: (first id, last id, rows)"
                                                 f" {spans}")
        late = [{ms_of[i] for i in ids} for ids in transactions[half:]]
        for n, ms in enumerate(late):
            self.assertEqual(len(ms), 1, f"healthy transaction {half + n} spread over batches")
        self.assertEqual(len(set.union(*late)), len(late),
                         "a healthy transaction shared its batch with the one before")
        self.assertGreaterEqual(len(spans), len(late) + 1)
        # Nothing of the paused topic was published.
        self.assertEqual(self.r.xlen("orders"), 20, "rows of the paused topic published")
        self.assertEqual(harness.scalar(self.db, "SELECT count(*) FROM outbox.unsent"
                                                 " WHERE topic = 'orders'"),
                         PAUSED_ROWS + HEALTHY_ROWS, "rows of the paused topic not waiting")
        self.assertEqual(harness.count_unsent(self.db), PAUSED_ROWS + HEALTHY_ROWS)

        # What each execution of the batch statement read while "orders" was
        # paused: the backlog once, in chunks, and then each healthy batch,
        # whose rows are its healthy rows and its own interleaved "orders"
        # rows: never the backlog again.
        # The server may still be writing the last plans.
        paused_until = wait_until(
            lambda: sum(f[1] for f in figures(batch_reads(self.pg.log()[since:])))
            >= PAUSED_ROWS + 2 * HEALTHY_ROWS and len(self.pg.log()),
            timeout=10, interval=1, relay=relay, message="the plans of the batch reads")
        paused = figures(batch_reads(self.pg.log()[since:paused_until]))
        self.assertTrue(paused, "no execution of the batch statement was logged")
        returned = sum(f[1] for f in paused)
        self.assertEqual(returned, PAUSED_ROWS + 2 * HEALTHY_ROWS,
                         f"the batch reads while paused returned {returned} rows in"
                         f" {len(paused)} executions; each row once is"
                         f" {PAUSED_ROWS} + {2 * HEALTHY_ROWS}")

        # The consumers catch up, and stop reading "orders": the pause ends,
        # and the group's lag must not pause the catch-up again.
        mark = len(relay.log())
        self.r.execute_command("XGROUP", "SETID", "orders", "email", "$")
        relay.wait_for_log(r"stream orders resumed", timeout=30, since=mark)
        resumed = time.monotonic()
        self.r.xgroup_destroy("orders", "email")
        expected = 20 + PAUSED_ROWS + HEALTHY_ROWS
        wait_until(lambda: self.r.xlen("orders") >= expected, timeout=300, interval=0.5,
                   relay=relay, message="the paused topic's rows to arrive")
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        caught_up = time.monotonic()
        entries = harness.stream_entries(self.r, "orders")
        ids = [int(f[b"outbox_id"]) for _, f in entries]
        with self.db.cursor() as cur:
            cur.execute("SELECT id FROM outbox.messages WHERE topic = 'orders' ORDER BY id")
            orders = [i for i, in cur.fetchall()]
        self.assertEqual(len(orders), expected)
        self.assertEqual(len(ids), len(set(ids)), "an orders row published twice")
        self.assertEqual(ids, orders, "stream orders: each row once, in id order")

        # Every execution of the batch statement, paused or catching up, read
        # O(batch_size) rows and buffers.
        catchup = figures(batch_reads(self.pg.log()[paused_until:]))
        every = paused + catchup
        worst_rows = max(f[2] for f in every)
        worst_buffers = max(f[3] for f in every)
        full = [f for f in every if f[1] > 0]
        print(f"{len(paused)} batch reads while {PAUSED_ROWS + HEALTHY_ROWS} rows were paused"
              f" and {len(catchup)} while catching up (batch_size {BATCH}, {len(spans)} healthy"
              f" batches): rows read at most {worst_rows}, buffers at most {worst_buffers};"
              f" duration median {statistics.median(f[0] for f in full):.2f} ms, max"
              f" {max(f[0] for f in every):.2f} ms (auto_explain, analyze, timing off);"
              f" wall time: backlog read {backlog_read - began:.1f} s, catch-up"
              f" {caught_up - resumed:.1f} s, in all {time.monotonic() - began:.1f} s",
              file=sys.stderr, flush=True)
        for what, figs in (("while paused", paused), ("catching up", catchup)):
            over_rows = [f for f in figs if f[2] > ROWS_PER_READ]
            over_buffers = [f for f in figs if f[3] > BUFFERS_PER_READ]
            if over_rows:
                worst = max(over_rows, key=lambda f: f[2])
                self.fail(f"{len(over_rows)} of {len(figs)} batch reads {what} read more than"
                          f" {ROWS_PER_READ} rows: at worst {worst[2]} rows to return {worst[1]}")
            if over_buffers:
                worst = max(over_buffers, key=lambda f: f[3])
                self.fail(f"{len(over_buffers)} of {len(figs)} batch reads {what} touched more"
                          f" than {BUFFERS_PER_READ} buffers: at worst {worst[3]} to return"
                          f" {worst[1]} rows")

if __name__ == "__main__":
    unittest.main()
