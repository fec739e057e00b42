"""Operating the relay: /metrics, /healthz, /readyz, queue age, stream backpressure
and `outbox-relay status` (issue: Operate it).

- A real scrape passes `promtool check metrics` (skipped when promtool is
  missing) and carries the documented names.
- outbox_relay_batch_phase_seconds counts each committed batch once per
  phase, the phases add up to the batch's duration, and a batch that waited
  for a stopped Redis shows it in its publish phase.
- A bad path gets 404, a bad method 405, and a client that connects and
  sends nothing does not stall the relay: rows keep flowing and /healthz
  answers while it hangs.
- Queue age rises while a group's consumers are stopped and falls when they
  catch up.
- With pause_lag_entries set, a stream whose group lags is paused (metric,
  log line), its rows wait in the outbox while another topic keeps flowing,
  and it resumes below resume_lag_entries.
- `outbox-relay status` shows the groups with queue age; --json parses; with
  a server unreachable it names it and exits 69.
- `status --json` says null where there is nothing (no row waits, no entry is
  pending), never a made-up number; and where a server did not answer.
- `outbox-relay status` shows every stream of the relay's topics, also those
  no group reads yet (the partition streams of a new partitioned topic).
- `outbox-relay failed retry` writes quarantined rows again as new rows (same
  message_id, key and payload), in id order, the later quarantined rows of a
  partitioned key with the row named, and a relay publishes each once and in
  order; `failed drop` removes a row; ids not quarantined exit 65.
"""

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request

from testkit import harness
from testkit.harness import insert

harness.require_relay()
harness.set_deadline(240)


def scrape(port, path="/metrics", method="GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


metric = harness.metric


class OperationsTest(harness.ServerTestCase):

    def start_relay(self, **flags):
        self.port = harness.free_port()
        flags.setdefault("observe_interval", "200ms")
        flags.setdefault("poll_interval", "200ms")
        relay = self.relay(metrics_listen=f"127.0.0.1:{self.port}", **flags)
        harness.wait_until(lambda: harness.port_open(self.port), timeout=15, relay=relay,
                           message="the metrics endpoint to listen")
        return relay

    def wait_metric(self, name, pred, timeout=15, relay=None, **labels):
        def check():
            _, text = scrape(self.port)
            v = metric(text, name, **labels)
            return v is not None and pred(v) and (v,)
        return harness.wait_until(check, timeout=timeout, relay=relay,
                                  message=f"{name}{labels} to satisfy the condition")[0]

    def test_scrape_is_valid_prometheus_text(self):
        relay = self.start_relay()
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        for i in range(10):
            insert(self.db, "orders", b"x")
        harness.wait_all_sent(self.db, relay=relay)
        self.wait_metric("outbox_relay_group_lag_entries", lambda v: v == 10, relay=relay,
                         stream="orders", group="email")
        status, text = scrape(self.port)
        self.assertEqual(status, 200)
        for name in ("outbox_relay_messages_published_total", "outbox_relay_batches_total",
                     "outbox_relay_batch_duration_seconds_bucket",
                     "outbox_relay_publish_errors_total", "outbox_relay_up",
                     "outbox_relay_outbox_pending_rows",
                     "outbox_relay_outbox_oldest_pending_age_seconds",
                     "outbox_relay_group_queue_age_seconds", "outbox_relay_group_dead_letters",
                     "outbox_relay_stream_paused", "outbox_relay_build_info"):
            self.assertIn(name, text)
        self.assertEqual(metric(text, "outbox_relay_messages_published_total", topic="orders"), 10)
        promtool = shutil.which("promtool")
        if promtool is None:
            self.skipTest("promtool not installed (Debian package prometheus)")
        proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=30)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

    def test_batch_phases_show_where_a_batch_waited(self):
        relay = self.start_relay()
        insert(self.db, "orders", b"first")
        harness.wait_all_sent(self.db, relay=relay)
        self.redis.pause()  # SIGSTOP: the batch publishes into a Redis that does not answer
        try:
            insert(self.db, "orders", b"published while Redis is stopped")
            time.sleep(0.5)
        finally:
            self.redis.resume()
        harness.wait_all_sent(self.db, relay=relay)
        _, text = scrape(self.port)
        phases = ("read", "publish", "record")
        batches = metric(text, "outbox_relay_batches_total")
        counts = {p: metric(text, "outbox_relay_batch_phase_seconds_count", phase=p)
                  for p in phases}
        sums = {p: metric(text, "outbox_relay_batch_phase_seconds_sum", phase=p) for p in phases}
        self.assertGreaterEqual(batches, 2)
        self.assertEqual(counts, {p: batches for p in phases}, text)
        print(f"batch phases over {batches:.0f} batches, seconds: {sums}")
        self.assertGreaterEqual(sums["publish"], 0.4, "the wait for Redis is in the publish phase")
        self.assertLess(sums["read"] + sums["record"], 0.3,
                        "the wait for Redis counted in another phase")
        # From the batch's first read to its positions recorded, as its own duration.
        self.assertAlmostEqual(sum(sums.values()),
                               metric(text, "outbox_relay_batch_duration_seconds_sum"),
                               delta=0.002 * batches)

    def test_bad_requests_and_a_silent_client(self):
        relay = self.start_relay()
        self.assertEqual(scrape(self.port, "/nope")[0], 404)
        self.assertEqual(scrape(self.port, "/metrics", "POST")[0], 405)
        self.assertEqual(scrape(self.port, "/healthz")[0], 200)
        harness.wait_until(lambda: scrape(self.port, "/readyz")[0] == 200, relay=relay)
        # A client that connects and never sends a request.
        silent = [socket.create_connection(("127.0.0.1", self.port)) for _ in range(3)]
        try:
            for i in range(20):
                insert(self.db, "orders", b"while a client hangs")
            harness.wait_all_sent(self.db, timeout=10, relay=relay)
            self.assertEqual(scrape(self.port, "/healthz")[0], 200)
        finally:
            for s in silent:
                s.close()
        self.assertTrue(relay.alive())

    def test_queue_age_rises_while_consumers_stop_and_falls_when_they_resume(self):
        relay = self.start_relay()
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        insert(self.db, "orders", b"first")
        harness.wait_all_sent(self.db, relay=relay)
        a = self.wait_metric("outbox_relay_group_queue_age_seconds", lambda v: v > 0.5,
                             relay=relay, stream="orders", group="email")
        b = self.wait_metric("outbox_relay_group_queue_age_seconds", lambda v: v > a + 1.0,
                             relay=relay, stream="orders", group="email")
        print(f"queue age with no consumer: {a:.2f}s, then {b:.2f}s")
        # The consumer comes back, reads and acknowledges.
        reply = self.r.xreadgroup("email", "c1", {"orders": ">"}, count=100)
        ids = [entry_id for _, entries in reply for entry_id, _ in entries]
        self.r.xack("orders", "email", *ids)
        c = self.wait_metric("outbox_relay_group_queue_age_seconds", lambda v: v == 0,
                             relay=relay, stream="orders", group="email")
        print(f"queue age after the consumer caught up: {c:.2f}s")

    def test_a_lagging_stream_is_paused_and_resumed(self):
        relay = self.start_relay(pause_lag_entries="50", resume_lag_entries="10")
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        for i in range(60):
            insert(self.db, "orders", b"lagging")
        harness.wait_all_sent(self.db, relay=relay)
        relay.wait_for_log(r"stream orders paused", timeout=15)
        self.wait_metric("outbox_relay_stream_paused", lambda v: v == 1, relay=relay,
                         stream="orders")
        for i in range(5):
            insert(self.db, "orders", b"held back")
        insert(self.db, "invoices", b"other streams keep flowing")
        harness.wait_until(lambda: harness.count_sent(self.db, "m.topic = 'invoices'") == 1,
                           relay=relay)
        time.sleep(1.0)
        held = harness.scalar(self.db, "SELECT count(*) FROM outbox.unsent"
                                       " WHERE topic = 'orders'")
        self.assertEqual(held, 5, "rows of a paused stream must wait in the outbox")
        # The group catches up below the low-water mark: the stream resumes.
        reply = self.r.xreadgroup("email", "c1", {"orders": ">"}, count=1000)
        ids = [entry_id for _, entries in reply for entry_id, _ in entries]
        self.r.xack("orders", "email", *ids)
        relay.wait_for_log(r"stream orders resumed", timeout=15)
        harness.wait_all_sent(self.db, timeout=15, relay=relay)

    def test_resumed_stream_is_claimed_at_once(self):
        # A 30 s poll: the held rows must not wait for it once the stream resumes.
        relay = self.start_relay(pause_lag_entries="5", resume_lag_entries="1",
                                 poll_interval="30s")
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        for i in range(6):
            insert(self.db, "orders", b"lagging")
        harness.wait_all_sent(self.db, timeout=40, relay=relay)
        relay.wait_for_log(r"stream orders paused", timeout=15)
        for i in range(5):
            insert(self.db, "orders", b"held back")
        time.sleep(0.5)
        self.assertEqual(harness.count_unsent(self.db), 5)
        reply = self.r.xreadgroup("email", "c1", {"orders": ">"}, count=1000)
        self.r.xack("orders", "email", *[i for _, entries in reply for i, _ in entries])
        mark = relay.mark()
        relay.wait_for_log(r"stream orders resumed", timeout=15, since=mark)
        resumed = time.monotonic()
        harness.wait_all_sent(self.db, timeout=40, relay=relay)
        took = time.monotonic() - resumed
        print(f"held rows published {took * 1000:.0f} ms after the stream resumed (poll 30 s)",
              file=sys.stderr, flush=True)
        self.assertLess(took, 5, "the resumed stream waited for the poll")

    def test_producer_refused_then_admitted(self):
        """End to end: a lagging group pauses its stream, rows pile up in the outbox,
        producers of that topic get OB503 from outbox.admit, and are admitted again
        once the group catches up and the outbox drains below the resume limit."""
        import psycopg2
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.topic_limits (topic, max_pending, resume_pending)"
                        " VALUES ('orders', 20, 5)")
        relay = self.start_relay(pause_lag_entries="10", resume_lag_entries="2")
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        for i in range(12):
            insert(self.db, "orders", b"fills the stream")
        relay.wait_for_log(r"stream orders paused", timeout=15)

        def admit():
            try:
                with self.db.cursor() as cur:
                    cur.execute("SELECT outbox.admit('orders')")
                return None
            except psycopg2.Error as e:
                return e

        refused_at = None
        for i in range(40):
            insert(self.db, "orders", b"waits in the outbox")
        err = harness.wait_until(admit, timeout=20, relay=relay,
                                 message="outbox.admit to refuse the topic")
        self.assertEqual(err.pgcode, "OB503", str(err))
        print(f"producer refused: {err.pgerror.strip().splitlines()[0]}")
        # The scrape shows the observation once its retention pass is done,
        # a moment after outbox.admit refuses.
        harness.wait_until(lambda: metric(scrape(self.port)[1], "outbox_relay_topic_admitting",
                                          topic="orders") == 0, timeout=10, relay=relay,
                           message="the scrape to show the topic refused")
        # The consumers come back: the stream resumes, the outbox drains, producers
        # are admitted again.
        def consume():
            reply = self.r.xreadgroup("email", "c1", {"orders": ">"}, count=1000)
            ids = [entry_id for _, entries in reply or [] for entry_id, _ in entries]
            if ids:
                self.r.xack("orders", "email", *ids)
            return admit() is None
        harness.wait_until(consume, timeout=30, interval=0.2, relay=relay,
                           message="producers to be admitted again")
        print("producer admitted again after the group caught up")

    def failed(self, *args):
        return harness.run_relay(["failed", *args], env=harness.relay_env(self.pg))

    def test_failed_retry_and_drop_write_rows_again_in_order(self):
        """failed retry writes quarantined rows again as new rows (same message_id,
        topic, key, payload), in id order, in one transaction: a later batch
        publishes them; in a partitioned topic the later quarantined rows of the
        key go with the row named. failed drop removes a row, never published."""
        harness.scalar(self.db, "SELECT outbox.set_partitions('orders', 2)")
        held = [harness.quarantine_row(self.db, "orders", b"k%d" % i, key="k",
                                       error="bad" if i == 0 else "held behind")
                for i in range(3)]
        other = harness.quarantine_row(self.db, "orders", b"other", key="j")
        plain = harness.quarantine_row(self.db, "plain", b"p")
        # As the relay that quarantined them leaves it: every stream, and the
        # relays' lead, past them.
        harness.mark_published(self.db, "orders")
        harness.mark_published(self.db, "plain")
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.stream_positions (topic, partition, tick)"
                        " SELECT '', -1, max(tick_id) FROM outbox.ticks"
                        " ON CONFLICT (topic, partition) DO UPDATE SET tick = excluded.tick")
            cur.execute("SELECT id, message_id::text FROM outbox.quarantine")
            mids = dict(cur.fetchall())
        self.assertEqual(harness.count_unsent(self.db), 0)
        done = self.failed("list")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("5 quarantined", done.stdout)
        # The first row of key k, and an id that is not quarantined.
        done = self.failed("retry", str(held[0]), "999999")
        self.assertEqual(done.returncode, 65, done.output)
        self.assertIn("re-queued 3 row(s)", done.stdout)
        self.assertIn("not quarantined", done.stderr)
        self.assertIn("999999", done.stderr)
        with self.db.cursor() as cur:
            cur.execute("SELECT message_id::text, partition_key, payload FROM outbox.unsent"
                        " ORDER BY id")
            again = [(m, k, bytes(p)) for m, k, p in cur.fetchall()]
        self.assertEqual(again, [(mids[held[i]], "k", b"k%d" % i) for i in range(3)],
                         "written again in their order, as the producer wrote them")
        self.assertEqual(harness.scalar(self.db, "SELECT array_agg(id ORDER BY id)"
                                                 " FROM outbox.quarantine"), [other, plain])
        done = self.failed("drop", str(other))
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("dropped 1 row(s)", done.stdout)
        self.assertEqual(harness.scalar(self.db, "SELECT count(*) FROM outbox.messages"
                                                 " WHERE id = %s", (other,)), 0)
        done = self.failed("drop", str(other))
        self.assertEqual(done.returncode, 65, done.output)
        self.assertIn("not quarantined", done.stderr)
        done = self.failed("retry", "--all")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("re-queued 1 row(s)", done.stdout)
        self.assertEqual(harness.scalar(self.db, "SELECT count(*) FROM outbox.quarantine"), 0)
        # A relay publishes them: each once, key k in its order.
        relay = self.start_relay()
        harness.wait_all_sent(self.db, relay=relay)
        found = harness.wait_until(
            lambda: (f := harness.entries_by_message_id(self.r)) and len(f) == 4 and f,
            relay=relay, message="the four rows written again in their streams")
        self.assertEqual(sorted(found), sorted([mids[i] for i in held] + [mids[plain]]))
        self.assertEqual([len(e) for e in found.values()], [1] * 4, "each once")
        placed = [found[mids[i]][0] for i in held]
        self.assertEqual(len({stream for stream, _, _ in placed}), 1)
        ids = [tuple(int(x) for x in entry_id.split("-")) for _, entry_id, _ in placed]
        self.assertEqual(ids, sorted(ids), "key k out of order")
        self.assertNotIn(b"other", [fields.get(b"payload") for e in found.values()
                                    for _, _, fields in e])

    def status(self, *args, env=None):
        return harness.run_relay(["status", *args], env=env or harness.relay_env(self.pg,
                                                                                  self.redis))

    def test_status_command(self):
        relay = self.start_relay()
        self.r.xgroup_create("orders", "email", id="0", mkstream=True)
        insert(self.db, "orders", b"x")
        harness.wait_all_sent(self.db, relay=relay)
        done = self.status()
        self.assertEqual(done.returncode, 0, done.output)
        self.assertRegex(done.stdout, r"orders\s+email\s+\S+\s+1\s+0\s+0")
        self.assertIn("appendonly", done.stdout)
        done = self.status("--json")
        self.assertEqual(done.returncode, 0, done.output)
        data = json.loads(done.stdout)
        self.assertTrue(data["postgres"]["up"])
        group = [g for g in data["groups"] if g["group"] == "email"][0]
        self.assertEqual(group["lag"], 1)
        self.assertGreater(group["queue_age_seconds"], 0)

    def test_status_json_null_for_none(self):
        # A stream with one undelivered entry, read by nobody yet; an empty outbox.
        self.r.xadd("orders", {"id": "1", "payload": "x"})
        self.r.xgroup_create("orders", "email", id="0")
        done = self.status("--json")
        self.assertEqual(done.returncode, 0, done.output)
        data = json.loads(done.stdout)
        self.assertIsNone(data["outbox"]["oldest_pending_age_seconds"], done.stdout)
        self.assertEqual(data["outbox"]["quarantined"], 0)
        topic = [t for t in data["topics"] if t["stream"] == "orders"][0]
        self.assertIsNone(topic["outbox_oldest_age_seconds"], done.stdout)
        self.assertEqual(topic["outbox_pending"], 0)
        group = [g for g in data["groups"] if g["group"] == "email"][0]
        self.assertIsNone(group["oldest_pending_age_seconds"], done.stdout)
        self.assertGreaterEqual(group["oldest_undelivered_age_seconds"], 0)
        self.assertEqual(group["pending"], 0)
        self.assertGreaterEqual(group["queue_age_seconds"], 0)
        # PostgreSQL does not answer: what comes from it is not known.
        env = harness.relay_env(None, self.redis, {
            "OUTBOX_RELAY_POSTGRES": f"host=127.0.0.1 port={harness.free_port()} dbname=app"
                                     " user=postgres",
            "OUTBOX_RELAY_CONNECT_TIMEOUT": "1s"})
        done = self.status("--json", env=env)
        self.assertEqual(done.returncode, 69, done.output)
        data = json.loads(done.stdout)
        self.assertFalse(data["postgres"]["up"])
        self.assertEqual(set(data["outbox"].values()), {None}, done.stdout)
        self.assertEqual(set(data["relays"].values()), {None}, done.stdout)
        topic = [t for t in data["topics"] if t["stream"] == "orders"][0]
        self.assertIsNone(topic["outbox_pending"], done.stdout)
        self.assertEqual(data["groups"][0]["pending"], 0)

    def test_status_lists_streams_without_groups(self):
        # A topic just partitioned: its streams exist, no group reads them yet.
        streams = [f"orders:{p:03d}" for p in range(4)]
        for st in streams:
            self.r.xadd(st, {"id": "1", "payload": "x"})
        self.r.xgroup_create("plain", "email", id="0", mkstream=True)
        done = self.status()
        self.assertEqual(done.returncode, 0, done.output)
        for st in streams:
            self.assertRegex(done.stdout, rf"(?m)^{st}\s+\(no groups\)\s", done.stdout)
        self.assertRegex(done.stdout, r"(?m)^plain\s+email\s")
        self.assertNotRegex(done.stdout, r"(?m)^plain\s+\(no groups\)")
        # The same streams as --json lists.
        data = json.loads(self.status("--json").stdout)
        self.assertEqual(sorted(t["stream"] for t in data["topics"]), sorted(streams + ["plain"]))

    def test_status_names_an_unreachable_server(self):
        env = harness.relay_env(self.pg, None, {
            "OUTBOX_RELAY_REDIS": f"redis://127.0.0.1:{harness.free_port()}/0",
            "OUTBOX_RELAY_CONNECT_TIMEOUT": "1s"})
        done = self.status(env=env)
        self.assertEqual(done.returncode, 69, done.output)
        self.assertIn("Redis unreachable", done.stderr)
        env = harness.relay_env(None, self.redis, {
            "OUTBOX_RELAY_POSTGRES": f"host=127.0.0.1 port={harness.free_port()} dbname=app"
                                     " user=postgres",
            "OUTBOX_RELAY_CONNECT_TIMEOUT": "1s"})
        done = self.status(env=env)
        self.assertEqual(done.returncode, 69, done.output)
        self.assertIn("PostgreSQL unreachable", done.stderr)


if __name__ == "__main__":
    unittest.main()
