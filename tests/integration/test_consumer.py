"""Consumers: one effect per message, retries with backoff, dead letters, take-over, replay.

Promises tested (docs/DESIGN.md P6, P7; docs/CONSUMERS.md), with the example consumer outbox-email-consumer
(examples/email_consumer.c: it inserts into emails in the same transaction as
outbox_consumer.begin_message; a header "fail" injects failures) against the
consumer schema of migrations/consumer/*.sql:
- consumers killed with SIGKILL at random moments, and restarted, leave one
  effect per message: none missing, none twice, nothing pending, no dead letter;
- a transient failure is delivered again after each step of the backoff, and
  dead-lettered (reason exhausted) at max_deliveries;
- a permanent failure (the handler says so, or its SQL hits a data exception
  because the payload is not JSON) is dead-lettered after one delivery with
  the original fields verbatim and the dlq.* fields set;
- "outbox-relay dlq replay" reaches only the group that failed;
- the pending entries of a consumer that died are taken over by another;
- a pending entry deleted from the stream is dead-lettered as lost, also when
  the relay trimmed it past a stuck group (stream_trim_max_hold);
- a dead letter that Redis refuses (the dead-letter key holds a string, the
  dead-letter function was deleted) acknowledges nothing: the entry stays
  pending, the log says what to do, and a later pass records it;
- a Redis user that may not load functions is told the ACL permissions it needs;
- an entry without the contract's fields is dead-lettered as malformed and the
  consumer goes on with the next message;
- SIGTERM: exit 0 within a few seconds, the message in hand finished.

Each test says whether its entries come through the relay (outbox rows
committed to PostgreSQL, relayed by the real daemon) or are written with XADD
in the contract's shape (where timing or shape must be exact).
"""

import os
import random
import re
import signal
import sys
import threading
import time
import unittest

from testkit import harness
from testkit.harness import insert, insert_many, scalar, wait_until
from testkit import consumers
from testkit.consumers import (Consumer, ConsumerTestCase, dlq_entries, effect_count, effects,
                               log_events, pending_count, relay_tool, table_locked,
                               xadd_message)

harness.require_relay()
consumers.require_consumer()
harness.set_deadline(420)

POLL = "200ms"
FAST = dict(backoff="200ms,400ms,800ms", block="100ms")
DLQ_FIELDS = (b"dlq.stream", b"dlq.group", b"dlq.consumer", b"dlq.entry_id", b"dlq.deliveries",
              b"dlq.reason", b"dlq.error", b"dlq.failed_at")


def order_payload(n, customer=None):
    return ('{"order": %d, "customer": "%s"}' % (n, customer or f"customer-{n % 50}")).encode()


def original_fields(fields):
    return {k: v for k, v in fields.items() if not k.startswith(b"dlq.")}


def lock_waiters(conn):
    """Sessions of the example consumer waiting on a lock (its handler is in hand)."""
    return scalar(conn, "SELECT count(*) FROM pg_stat_activity"
                        " WHERE application_name = 'outbox-email-consumer'"
                        " AND wait_event_type = 'Lock'")


class ConsumerTest(ConsumerTestCase):

    def consumer(self, **kwargs):
        """Starts outbox-email-consumer on this class's servers for the rest of the test."""
        return self.enterContext(Consumer(self.pg, self.redis, **kwargs))

    def assert_dlq_fields(self, fields, reason, deliveries, consumer, entry_id, stream="orders",
                          group="email"):
        self.assertEqual(fields[b"dlq.reason"], reason.encode(), fields)
        self.assertEqual(fields[b"dlq.deliveries"], str(deliveries).encode(), fields)
        self.assertEqual(fields[b"dlq.stream"], stream.encode())
        self.assertEqual(fields[b"dlq.group"], group.encode())
        self.assertEqual(fields[b"dlq.consumer"], consumer.encode())
        self.assertEqual(fields[b"dlq.entry_id"], entry_id.encode())
        self.assertTrue(fields[b"dlq.error"], "dlq.error is set")
        self.assertIsNotNone(harness.parse_rfc3339_utc(fields[b"dlq.failed_at"].decode()),
                             f"dlq.failed_at {fields[b'dlq.failed_at']!r} is RFC 3339 UTC")

    # ------------------------------------------------------------------
    def test_kill_consumers_at_random_one_effect_per_message(self):
        """Through the relay: 10,000 rows; 3 consumers of group email, SIGKILLed at random
        moments and restarted (same name or a new one). Effects: each message exactly once."""
        total = 10000
        seed = int(os.environ.get("CONSUMER_TEST_SEED", time.time_ns() % 100000))
        rng = random.Random(seed)
        relay = self.relay(poll_interval=POLL, batch_size=500)
        flags = dict(FAST, max_deliveries=10)
        serial = [0]

        def start(name=None):
            serial[0] += 1
            return self.consumer(consumer=name or f"k{serial[0]}", **flags)

        live = [start() for _ in range(3)]
        # The consumers create the group as they start: a victim's pending
        # entries can be listed only once it exists.
        wait_until(lambda: any(g["name"] == b"email" for g in self.r.xinfo_groups("orders"))
                   if self.r.exists("orders") else False, timeout=30, relay=relay,
                   message="the consumers to create group email")
        produced = [0]
        failure = []
        stop = threading.Event()

        def produce():
            try:
                with self.pg.connect(autocommit=False) as conn:
                    n = 0
                    while n < total and not stop.is_set():
                        chunk = min(200, total - n)
                        insert_many(conn, [("orders", order_payload(n + i)) for i in range(chunk)])
                        n += chunk
                        produced[0] = n
                        time.sleep(0.05)
            except BaseException as e:
                failure.append(e)
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        # Whatever happens below, no row is written after this test ends.
        self.addCleanup(producer.join, 30)
        self.addCleanup(stop.set)

        kills = same_name = 0
        stranded = set()
        started = time.monotonic()
        while time.monotonic() - started < 150:
            time.sleep(rng.uniform(0.1, 0.5))
            done = effects(self.db)[1]
            if done >= total:
                break
            slot = rng.randrange(len(live))
            victim = live[slot]
            victim.kill(signal.SIGKILL)
            kills += 1
            # What it left pending: the others must take these over.
            stranded.update(p["message_id"] for p in self.r.xpending_range(
                "orders", "email", "-", "+", 1000, consumername=victim.name))
            if rng.random() < 0.5:
                same_name += 1
                live[slot] = start(victim.name)
            else:
                live[slot] = start()
        producer.join(30)
        self.assertFalse(failure, failure)
        self.assertEqual(produced[0], total)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        wait_until(lambda: effects(self.db)[1] >= total and pending_count(self.r) == 0,
                   timeout=60, interval=0.2,
                   message=f"{total} effects and nothing pending (have {effects(self.db)})")
        for c in live:
            self.assertEqual(c.terminate(), 0, c.log_tail())
        rows, distinct = effects(self.db)
        missing = scalar(self.db, "SELECT count(*) FROM outbox.messages m WHERE NOT EXISTS"
                                  " (SELECT 1 FROM emails e WHERE e.message_id = m.message_id)")
        processed = scalar(self.db, "SELECT count(*) FROM outbox_consumer.processed"
                                    " WHERE consumer = 'email'")
        dead = self.r.xlen("{orders}.email.dlq")
        taken_over = sum((c.stats() or {}).get("reclaimed", 0) for c in live)
        print(f"messages={total} kills={kills} (restarted {same_name} under the same name,"
              f" {kills - same_name} under a new one) effects={rows}"
              f" duplicates={rows - distinct} missing={missing}"
              f" left_pending_by_the_killed={len(stranded)}"
              f" pending={pending_count(self.r)} dead_letters={dead}"
              f" taken_over_by_last_3={taken_over} seed={seed}"
              f" seconds={time.monotonic() - started:.1f}", file=sys.stderr, flush=True)
        self.assertGreaterEqual(kills, 5, "the consumers were killed a few times at least")
        self.assertGreater(len(stranded), 0, "the kills left entries for the others to take over")
        self.assertEqual((rows, distinct, missing, processed), (total, total, 0, total))
        self.assertEqual(pending_count(self.r), 0)
        self.assertEqual(dead, 0, dlq_entries(self.r)[:3])

    # ------------------------------------------------------------------
    def test_backoff_schedule_is_honoured_then_exhausted(self):
        """XADD (exact timing, no relay needed): fail=transient, --max-deliveries 4,
        --backoff 300ms,600ms,1200ms. Delivery times come from the consumer's log lines."""
        schedule = [300, 600, 1200]
        block = 100
        # A delivery is due when its idle time reaches the step, and it happens at the next
        # reclaim pass: every 250 ms (the library's reclaim_interval), but only between
        # reads, and a read blocks for --block, which Redis (hz 10) may end up to 100 ms
        # late: 250 + 2 * block. 200 ms more for scheduling on a busy 2-core machine.
        tolerance = 250 + 2 * block + 200
        # Redis measures idle time in whole ms and the log stamps are truncated to ms.
        # And a log line follows its delivery by the handler's time (a transaction in
        # PostgreSQL), which differs between deliveries by a few ms on a busy machine,
        # while the step counts from the delivery: one gap was 597 ms for a 600 ms step.
        # A consumer that ignored the step would redeliver at the next reclaim pass, up to
        # 250 ms early, and one that used the wrong step misses it by 300 ms or more.
        resolution = 2 + 25
        c = self.consumer(consumer="b1", max_deliveries=4, block=f"{block}ms",
                          backoff=",".join(f"{s}ms" for s in schedule))
        c.wait_for_log(r"reading orders", timeout=10)
        entry_id, mid = xadd_message(self.r, payload=order_payload(1),
                                     headers={"fail": "transient"})
        c.wait_for_log(r"exhausted after 4 deliveries", timeout=15)
        retries = log_events(c.log(), r"will be retried in (\d+) ms \(delivery (\d+) of 4\)")
        final = log_events(c.log(), r"-> \{orders\}\.email\.dlq \(exhausted after (\d+) deliveries\)")
        self.assertEqual([int(m.group(2)) for _, m in retries], [1, 2, 3], c.log_tail())
        self.assertEqual([int(m.group(1)) for _, m in retries], schedule)
        self.assertEqual(len(final), 1)
        times = [t for t, _ in retries] + [final[0][0]]
        gaps = [round((b - a) * 1000) for a, b in zip(times, times[1:])]
        print("backoff: " + ", ".join(f"delivery {i + 2} after {g} ms (step {s} ms, allowed"
                                      f" {s - resolution}..{s + tolerance} ms)"
                                      for i, (g, s) in enumerate(zip(gaps, schedule))),
              file=sys.stderr, flush=True)
        for gap, step in zip(gaps, schedule):
            self.assertGreaterEqual(gap, step - resolution, f"gaps {gaps} vs {schedule}")
            self.assertLessEqual(gap, step + tolerance, f"gaps {gaps} vs {schedule}")
        dead = dlq_entries(self.r)
        self.assertEqual(len(dead), 1)
        self.assert_dlq_fields(dead[0][1], "exhausted", 4, "b1", entry_id)
        self.assertEqual(dead[0][1][b"id"], mid.encode())
        self.assertEqual(pending_count(self.r), 0)
        self.assertEqual(effect_count(self.db, mid), 0)
        self.assertEqual(c.terminate(), 0)
        self.assertEqual({k: c.stats()[k] for k in ("delivered", "retried", "dead_lettered")},
                         {"delivered": 4, "retried": 3, "dead_lettered": 1})

    # ------------------------------------------------------------------
    def test_permanent_failure_is_dead_lettered_at_once_with_fields_intact(self):
        """Through the relay: a row with header fail=permanent and a binary payload."""
        payload = b"\x00\xff binary \x00 order \xfe\xff"
        with self.db.cursor() as cur:
            cur.execute("SELECT outbox.enqueue('orders', 'k-7', %s::bytea,"
                        " '{\"fail\": \"permanent\", \"content-type\": \"application/x-test\"}')",
                        (payload,))
        good = insert(self.db, "orders", order_payload(2))
        relay = self.relay(poll_interval=POLL)
        c = self.consumer(consumer="p1", **FAST)
        wait_until(lambda: self.r.exists("{orders}.email.dlq") and effect_count(self.db, good),
                   timeout=20, relay=relay, message="a dead letter and the good message's effect")
        [(entry_id, original)] = [(e, f) for e, f in harness.stream_entries(self.r, "orders")
                                  if f.get(b"h.fail") == b"permanent"]
        dead = dlq_entries(self.r)
        self.assertEqual(len(dead), 1)
        fields = dead[0][1]
        self.assert_dlq_fields(fields, "permanent", 1, "p1", entry_id)
        self.assertEqual(fields[b"dlq.error"], b"the message asked for a permanent failure")
        self.assertEqual(original_fields(fields), original)
        self.assertEqual(fields[b"payload"], payload)
        self.assertEqual(set(fields) - set(original), set(DLQ_FIELDS))
        self.assertEqual(pending_count(self.r), 0)
        self.assertEqual(effects(self.db), (1, 1))
        self.assertEqual(c.terminate(), 0)
        st = c.stats()
        self.assertEqual((st["delivered"], st["done"], st["dead_lettered"], st["retried"]),
                         (2, 1, 1, 0))

    # ------------------------------------------------------------------
    def test_payload_that_is_not_json_fails_permanently(self):
        """Through the relay: a payload that is not JSON (the handler's SQL raises a data
        exception, class 22), then a good one."""
        bad = insert(self.db, "orders", b"order #3: not { json")
        good = insert(self.db, "orders", order_payload(4))
        relay = self.relay(poll_interval=POLL)
        c = self.consumer(consumer="j1", **FAST)
        wait_until(lambda: self.r.exists("{orders}.email.dlq") and effect_count(self.db, good),
                   timeout=20, relay=relay, message="a dead letter and the good message's effect")
        dead = dlq_entries(self.r)
        self.assertEqual(len(dead), 1)
        fields = dead[0][1]
        self.assertEqual(fields[b"id"], bad.encode())
        self.assertEqual(fields[b"payload"], b"order #3: not { json")
        entry_id = next(e for e, f in harness.stream_entries(self.r, "orders")
                        if f[b"id"] == bad.encode())
        self.assert_dlq_fields(fields, "permanent", 1, "j1", entry_id)
        self.assertIn(b"invalid input syntax for type json", fields[b"dlq.error"])
        self.assertEqual(effect_count(self.db, bad), 0)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox_consumer.processed"
                                         " WHERE message_id = %s", (bad,)), 0,
                         "the failed transaction left no processed row")
        self.assertEqual(pending_count(self.r), 0)
        self.assertEqual(c.terminate(), 0)

    # ------------------------------------------------------------------
    def test_replay_reaches_only_the_group_that_failed(self):
        """Through the relay: group email dead-letters a message (permanent: its database
        rejects the e-mail, a data exception from a trigger); group invoice on the same
        stream handles it. The cause is removed and `outbox-relay dlq replay orders email
        --all` runs: email handles it once, invoice never sees it again."""
        with self.db.cursor() as cur:
            cur.execute("""
                CREATE OR REPLACE FUNCTION reject_broken_mailbox() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    IF NEW.consumer = 'email' AND NEW.customer = 'broken-mailbox' THEN
                        RAISE EXCEPTION 'mailbox % rejects mail', NEW.customer
                            USING ERRCODE = 'invalid_parameter_value';
                    END IF;
                    RETURN NEW;
                END $$;
                DROP TRIGGER IF EXISTS emails_reject ON emails;
                CREATE TRIGGER emails_reject BEFORE INSERT ON emails
                    FOR EACH ROW EXECUTE FUNCTION reject_broken_mailbox();""")
        self.addCleanup(lambda: self.db.cursor().execute(
            "DROP TRIGGER IF EXISTS emails_reject ON emails"))
        mid = insert(self.db, "orders", order_payload(5, customer="broken-mailbox"))
        other = insert(self.db, "orders", order_payload(6))
        relay = self.relay(poll_interval=POLL)
        email = self.consumer(consumer="e1", **FAST)
        invoice = self.consumer(consumer="i1", group="invoice", **FAST)
        wait_until(lambda: self.r.exists("{orders}.email.dlq")
                   and effects(self.db, "invoice") == (2, 2)
                   and effect_count(self.db, other) == 1,
                   timeout=20, relay=relay, message="email's dead letter and invoice's effects")
        dead = dlq_entries(self.r)
        self.assertEqual(len(dead), 1)
        self.assertEqual(dead[0][1][b"id"], mid.encode())
        self.assertEqual(dead[0][1][b"dlq.reason"], b"permanent")
        self.assertIn(b"rejects mail", dead[0][1][b"dlq.error"])
        self.assertEqual(effect_count(self.db, mid, "email"), 0)

        listed = relay_tool(["dlq", "list", "orders", "email"], redis=self.redis)
        self.assertEqual(listed.returncode, 0, listed.output)
        self.assertIn(dead[0][0], listed.stdout)

        with self.db.cursor() as cur:  # the cause is fixed
            cur.execute("DROP TRIGGER emails_reject ON emails")
        groups_before = self.r.xinfo_groups("orders")
        replayed = relay_tool(["dlq", "replay", "orders", "email", "--all"], redis=self.redis)
        print(f"dlq replay: rc={replayed.returncode} {replayed.output.strip()}",
              file=sys.stderr, flush=True)
        self.assertEqual(replayed.returncode, 0, replayed.output)
        wait_until(lambda: effect_count(self.db, mid, "email") == 1, timeout=15,
                   message="the replayed message's effect in group email")
        time.sleep(1.0)  # room for a wrong second delivery to group invoice
        self.assertEqual(effect_count(self.db, mid, "email"), 1)
        self.assertEqual(effects(self.db, "email"), (2, 2))
        self.assertEqual(effects(self.db, "invoice"), (2, 2), "invoice saw nothing twice")
        self.assertEqual(self.r.xlen("orders"), 2, "the replay did not touch the stream")
        self.assertEqual(self.r.xlen("{orders}.email.dlq"), 0, "the replay moved the letter")
        self.assertEqual(self.r.xlen("{orders}.invoice.replay"), 0)
        self.assertEqual(pending_count(self.r, "{orders}.email.replay", "email"), 0)
        self.assertEqual(pending_count(self.r, "orders", "invoice"), 0)
        self.assertEqual(self.r.xinfo_groups("orders"), groups_before)
        self.assertEqual(email.terminate(), 0)
        self.assertEqual(invoice.terminate(), 0)
        self.assertEqual(invoice.stats()["delivered"], 2, invoice.log_tail())
        self.assertEqual(email.stats()["delivered"], 3, email.log_tail())

    # ------------------------------------------------------------------
    def test_pending_entries_of_a_killed_consumer_are_taken_over(self):
        """Through the relay: consumer a1 is SIGKILLed while its handler is held on a table
        lock with entries pending; a2 takes them over and every effect completes once."""
        total = 40
        relay = self.relay(poll_interval=POLL)
        ids = insert_many(self.db, [("orders", order_payload(n)) for n in range(total)])
        harness.wait_all_sent(self.db, timeout=20, relay=relay)
        with table_locked(self.pg, "emails"):
            a1 = self.consumer(consumer="a1", **FAST)
            wait_until(lambda: lock_waiters(self.db) == 1, timeout=15, relay=relay,
                       message="a1's handler waiting on the emails lock")
            held = [p for p in self.r.xpending_range("orders", "email", "-", "+", 1000)
                    if p["consumer"] == b"a1"]
            self.assertGreater(len(held), 1, "a1 holds entries pending")
            a1.kill(signal.SIGKILL)
        a2 = self.consumer(consumer="a2", **FAST)
        wait_until(lambda: effects(self.db)[1] == total and pending_count(self.r) == 0,
                   timeout=20, message=f"{total} effects, nothing pending")
        self.assertEqual(effects(self.db), (total, total))
        self.assertEqual(effect_count(self.db, ids[0]), 1)
        owners = {c["name"]: c["pending"] for c in self.r.xinfo_consumers("orders", "email")}
        self.assertEqual(owners.get(b"a1"), 0, owners)
        self.assertEqual(a2.terminate(), 0)
        st = a2.stats()
        print(f"take-over: a1 held {len(held)} entries when killed; a2 took over"
              f" {st['reclaimed']}, handled {st['done']}", file=sys.stderr, flush=True)
        self.assertGreaterEqual(st["reclaimed"], len(held))
        self.assertEqual(st["dead_lettered"], 0)

    # ------------------------------------------------------------------
    def test_names_before_0_2_are_renamed_at_start(self):
        """A dead-letter and a replay stream under the names before 0.2 become
        {orders}.email.dlq and {orders}.email.replay when the consumer starts."""
        self.r.xadd("orders.email.dlq", {"n": "old"})
        self.r.xadd("orders.email.replay", {"n": "old"})
        self.r.xgroup_create("orders", "email", id="$", mkstream=True)
        c = self.consumer(consumer="m1", **FAST)
        c.wait_for_log(r"renamed orders\.email\.dlq to \{orders\}\.email\.dlq", timeout=10)
        c.wait_for_log(r"renamed orders\.email\.replay to \{orders\}\.email\.replay", timeout=10)
        self.assertFalse(self.r.exists("orders.email.dlq", "orders.email.replay"))
        self.assertEqual(self.r.xrange("{orders}.email.dlq")[0][1], {b"n": b"old"})
        self.assertEqual(c.terminate(), 0)

    def test_pending_entry_deleted_from_the_stream_is_dead_lettered_as_lost(self):
        """XADD (the entry must be deleted by hand anyway): delivered to l1, which fails it
        transiently and is killed; the entry is XDELed; l2 records it as lost."""
        entry_id, mid = xadd_message(self.r, payload=order_payload(7),
                                     headers={"fail": "transient"})
        l1 = self.consumer(consumer="l1", backoff="30s", block="100ms")
        l1.wait_for_log(r"will be retried in 30000 ms \(delivery 1 of 5\)", timeout=10)
        l1.kill(signal.SIGKILL)
        [p] = self.r.xpending_range("orders", "email", "-", "+", 10)
        self.assertEqual((p["message_id"].decode(), p["consumer"]), (entry_id, b"l1"))
        self.assertEqual(self.r.xdel("orders", entry_id), 1)
        l2 = self.consumer(consumer="l2", **FAST)
        wait_until(lambda: self.r.exists("{orders}.email.dlq"), timeout=10,
                   message="the lost entry in the dead-letter stream")
        [(_, fields)] = dlq_entries(self.r)
        self.assert_dlq_fields(fields, "lost", 1, "l2", entry_id)
        self.assertEqual(set(fields), set(DLQ_FIELDS), "nothing of the entry was left to copy")
        self.assertEqual(pending_count(self.r), 0)
        self.assertEqual(l2.terminate(), 0)
        self.assertEqual(l2.stats()["lost"], 1)

    # ------------------------------------------------------------------
    def test_entries_trimmed_past_a_stuck_group_are_dead_lettered_as_lost(self):
        """Through the relay: t1 fails three messages transiently (backoff 30 s) and is
        killed, so they stay pending; the relay, told to trim past a group that holds
        trimming back longer than 2 s, trims them; t2 records each as lost and handles the
        messages published after them."""
        # One entry per node: trimming with MINID ~ is then exact.
        self.r.config_set("stream-node-max-entries", 1)
        self.addCleanup(self.r.config_set, "stream-node-max-entries", 100)
        relay = self.relay(poll_interval=POLL, observe_interval="200ms", stream_retention="1s",
                           dedup_ttl="1s", publish_timeout="1s",
                           stream_trim_max_hold="2s")
        t1 = self.consumer(consumer="t1", backoff="30s", block="100ms")
        bad = [insert(self.db, "orders", order_payload(n), headers={"fail": "transient"})
               for n in range(3)]
        wait_until(lambda: len(re.findall(r"will be retried in 30000 ms", t1.log())) == 3,
                   timeout=20, relay=relay, message="three transient failures")
        t1.kill(signal.SIGKILL)
        lost_ids = [p["message_id"] for p in self.r.xpending_range("orders", "email", "-", "+", 10)]
        self.assertEqual(len(lost_ids), 3)
        good = insert_many(self.db, [("orders", order_payload(n)) for n in range(10, 20)])
        wait_until(lambda: self.r.xlen("orders") >= 10 and
                   not set(lost_ids) & {e[0] for e in self.r.xrange("orders")},
                   timeout=40, relay=relay, message="the pending entries to be trimmed")
        t2 = self.consumer(consumer="t2", **FAST)
        wait_until(lambda: len(dlq_entries(self.r)) == 3 and all(effect_count(self.db, i) == 1
                                                                for i in good),
                   timeout=20, message="three lost entries and ten effects")
        for _, fields in dlq_entries(self.r):
            self.assertEqual(fields[b"dlq.reason"], b"lost", fields)
        self.assertEqual(sorted(f[b"dlq.entry_id"] for _, f in dlq_entries(self.r)),
                         sorted(lost_ids))
        self.assertEqual(pending_count(self.r), 0)
        self.assertEqual(t2.terminate(), 0)
        self.assertEqual(t2.stats()["lost"], 3)
        self.assertEqual(sum(effect_count(self.db, i) for i in bad), 0)

    # ------------------------------------------------------------------
    def test_dead_letter_refused_by_redis_leaves_the_entry_pending(self):
        """XADD: the dead-letter key was SET as a string, so Redis refuses the dead letter
        (WRONGTYPE). A fail=permanent message must stay pending, not acknowledged, with the
        failure logged and what to do about it; once the key is deleted, a later pass
        dead-letters and acknowledges it."""
        self.r.set("{orders}.email.dlq", "not a stream")
        entry_id, mid = xadd_message(self.r, payload=order_payload(13),
                                     headers={"fail": "permanent"})
        c = self.consumer(consumer="w1", max_deliveries=50, **FAST)
        failed = r"dead-lettering orders " + re.escape(entry_id) + r" failed"
        c.wait_for_log(failed, timeout=10)
        pending = self.r.xpending_range("orders", "email", "-", "+", 10)
        self.assertEqual([p["message_id"].decode() for p in pending], [entry_id],
                         "the entry is still pending: nothing was acknowledged\n" + c.log_tail())
        self.assertEqual(self.r.get("{orders}.email.dlq"), b"not a stream")
        line = log_events(c.log(), failed + r".*")[0][1].group(0)
        print(f"refused dead letter: {line}", file=sys.stderr, flush=True)
        self.assertRegex(line, r"WRONGTYPE")
        self.assertRegex(line, r"\{orders\}\.email\.dlq")
        self.assertRegex(line, r"delete or rename it")
        self.assertRegex(line, r"stays pending")

        # Later passes try again and keep it pending while the key is wrong.
        c.wait_for_log(r"(?s)" + failed + r".*" + failed, timeout=10)
        self.assertEqual(pending_count(self.r), 1)
        self.assertEqual(self.r.type("{orders}.email.dlq"), b"string")

        self.r.delete("{orders}.email.dlq")
        wait_until(lambda: self.r.exists("{orders}.email.dlq") and pending_count(self.r) == 0,
                   timeout=10, message="the dead letter recorded and the entry acknowledged")
        [(_, fields)] = dlq_entries(self.r)
        self.assertGreaterEqual(int(fields[b"dlq.deliveries"]), 2)
        self.assert_dlq_fields(fields, "permanent", int(fields[b"dlq.deliveries"]), "w1",
                               entry_id)
        self.assertEqual(fields[b"id"], mid.encode())
        [(_, original)] = harness.stream_entries(self.r, "orders")
        self.assertEqual(original_fields(fields), original)
        self.assertEqual(c.terminate(), 0)
        st = c.stats()
        self.assertEqual((st["dead_lettered"], st["done"]), (1, 0), st)

    # ------------------------------------------------------------------
    def test_redis_user_that_may_not_load_functions_is_told_the_acl_it_needs(self):
        """XADD: the consumer's Redis user may not run FUNCTION (ACL -function). The
        consumer says which permissions it needs and keeps retrying; once FUNCTION LOAD
        is granted it connects and handles the message."""
        self.r.execute_command("ACL", "SETUSER", "limited", "reset", "on", ">secret", "~*",
                               "&*", "+@all", "-function")
        self.addCleanup(self.r.execute_command, "ACL", "DELUSER", "limited")
        _, mid = xadd_message(self.r, payload=order_payload(14))
        c = self.consumer(consumer="n1", redis_url=f"redis://limited:secret@127.0.0.1:"
                                                   f"{self.redis.port}/0", **FAST)
        line = c.wait_for_log(r"FUNCTION LOAD of library outbox_consumer .*failed: NOPERM.*",
                              timeout=10).group(0)
        print(f"no FUNCTION LOAD: {line}", file=sys.stderr, flush=True)
        self.assertIn("needs the ACL permissions +function|load and +fcall", line)
        self.assertEqual(effect_count(self.db, mid), 0)
        self.r.execute_command("ACL", "SETUSER", "limited", "+function|load")
        wait_until(lambda: effect_count(self.db, mid) == 1 and pending_count(self.r) == 0,
                   timeout=20, message="the message handled once FUNCTION LOAD was granted")
        self.assertEqual(c.terminate(), 0)

    # ------------------------------------------------------------------
    def test_dead_letter_function_deleted_while_running_is_loaded_again(self):
        """XADD: FUNCTION DELETE outbox_consumer while the consumer runs, then a
        fail=permanent message: the refused dead letter leaves it pending, the consumer
        reconnects (loading the function) and a later pass dead-letters it."""
        c = self.consumer(consumer="f1", max_deliveries=50, **FAST)
        c.wait_for_log(r"reading orders", timeout=10)
        self.r.execute_command("FUNCTION", "DELETE", "outbox_consumer")
        entry_id, _ = xadd_message(self.r, payload=order_payload(15),
                                   headers={"fail": "permanent"})
        c.wait_for_log(r"dead-lettering orders " + re.escape(entry_id)
                       + r" failed: ERR Function not found.*reconnecting", timeout=10)
        wait_until(lambda: self.r.exists("{orders}.email.dlq") and pending_count(self.r) == 0,
                   timeout=15, message="the dead letter recorded once the function was back")
        [(_, fields)] = dlq_entries(self.r)
        self.assertEqual(fields[b"dlq.entry_id"], entry_id.encode())
        self.assertEqual(c.terminate(), 0)

    # ------------------------------------------------------------------
    def test_malformed_entry_is_dead_lettered_and_the_next_one_handled(self):
        """XADD: `XADD orders * foo bar` (no contract fields), then a good contract entry."""
        bad_id = self.r.xadd("orders", {"foo": "bar"}).decode()
        good_entry, good = xadd_message(self.r, payload=order_payload(8))
        c = self.consumer(consumer="m1", **FAST)
        wait_until(lambda: effect_count(self.db, good) == 1 and self.r.exists("{orders}.email.dlq"),
                   timeout=10, message="the good message handled and a dead letter")
        [(_, fields)] = dlq_entries(self.r)
        self.assert_dlq_fields(fields, "malformed", 1, "m1", bad_id)
        self.assertEqual(fields[b"foo"], b"bar", "the original fields are kept")
        self.assertRegex(fields[b"dlq.error"].decode(), r'^malformed: .*no "id" field')
        self.assertEqual(pending_count(self.r), 0)
        self.assertEqual(effects(self.db), (1, 1))
        self.assertEqual(c.terminate(), 0)
        st = c.stats()
        self.assertEqual((st["malformed"], st["dead_lettered"], st["done"]), (1, 1, 1))
        self.assertRegex(c.log(), r"WARNING consumer: orders " + re.escape(bad_id)
                         + r" -> \{orders\}\.email\.dlq \(malformed")

    # ------------------------------------------------------------------
    def test_sigterm_finishes_the_message_in_hand_and_exits_0(self):
        """XADD: three messages; the handler of the first is held on a table lock when
        SIGTERM arrives; the lock goes 0.5 s later. Then an idle consumer gets SIGTERM."""
        mids = [xadd_message(self.r, payload=order_payload(n))[1] for n in (10, 11, 12)]
        with table_locked(self.pg, "emails"):
            c = self.consumer(consumer="t1", **FAST)
            wait_until(lambda: lock_waiters(self.db) == 1, timeout=10,
                       message="t1's handler waiting on the emails lock")
            sent = time.monotonic()
            c.kill(signal.SIGTERM)
            time.sleep(0.5)
        code = c.wait(timeout=10)
        took = time.monotonic() - sent
        self.assertEqual(code, 0, c.log_tail())
        self.assertLess(took, 5.0)
        self.assertEqual(effect_count(self.db, mids[0]), 1, "the message in hand was finished")
        st = c.stats()
        self.assertEqual((st["delivered"], st["done"]), (1, 1), st)
        # The two read but not started stay pending, for the group to take over.
        self.assertEqual(pending_count(self.r), 2)
        idle = self.consumer(consumer="t2", **FAST)
        wait_until(lambda: effects(self.db) == (3, 3) and pending_count(self.r) == 0,
                   timeout=10, message="t2 took the rest over")
        sent = time.monotonic()
        self.assertEqual(idle.terminate(timeout=10), 0)
        idle_took = time.monotonic() - sent
        print(f"SIGTERM: busy consumer exited 0 after {took:.2f} s (0.5 s of it held on the"
              f" lock), idle one after {idle_took:.2f} s", file=sys.stderr, flush=True)
        self.assertLess(idle_took, 3.0)


if __name__ == "__main__":
    unittest.main()
