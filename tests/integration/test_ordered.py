"""Ordered consumers (docs/CONSUMERS.md, "Ordered consumers"), with the real relay
and `outbox-email-consumer --ordered` processes.

Promises tested:
- three ordered consumers of one group divide the 8 partition streams of a
  topic; 500 keys carry sequence numbers 1..20, 10 % of first deliveries fail
  transiently, and consumers are SIGKILLed at random (6 times) and started
  again, at once or after 5 s: per key the effects (the emails table, in
  insertion order) are 1..20, none missing, none doubled, and nothing is
  dead-lettered; the partitions of a killed consumer are taken over (by its
  successor, or by the others while it is down) within 6 s of the kill (the
  lease is 2 s, renewed every third of it);
- a key whose first message waits out a retry, with enough later messages to
  fill what the consumer holds in hand, does not stop another key of its
  partition;
- after a dead letter a key goes on with its next message; with
  --park-after-dead-letter its later messages wait, pending, while the other
  keys go on, until an operator removes the key from the parked set;
- a consumer frozen with SIGSTOP past its lease, while a key's first message
  waits out its backoff with the key's later messages behind it, loses the
  partition: another consumer takes the entries over and handles the key in
  order; resumed, the first one gives the partition up without acknowledging
  anything, and each message has one effect.
"""

import contextlib
import json
import re
import random
import signal
import statistics
import subprocess
import sys
import time
import unittest

from testkit import consumers
from testkit import harness
from testkit.consumers import Consumer
from testkit.harness import scalar, wait_until

harness.require_relay()
consumers.require_consumer()
harness.set_deadline(600)

PARTITIONS = 8
KEYS = [f"cust-{i:03d}" for i in range(500)]
SEQS = 20


@contextlib.contextmanager
def servers():
    """PostgreSQL with the consumer schema and "orders" in 8 partitions, and
    Redis: (pg, redis, a connection, a Redis client)."""
    with harness.Postgres() as pg, harness.Redis() as redis:
        db = pg.connect()
        consumers.apply_consumer_schema(pg)
        scalar(db, "SELECT outbox.set_partitions('orders', %s)", (PARTITIONS,))
        yield pg, redis, db, redis.client()


def partition_stream(key, topic="orders"):
    h = 0x811c9dc5
    for b in key.encode():
        h = ((h ^ b) * 16777619) & 0xffffffff
    return "%s:%03d" % (topic, h % PARTITIONS)


def insert_round(db, seq, keys, headers=None, topic="orders"):
    rows = [(topic, json.dumps({"order": seq, "customer": k}).encode(), k, headers)
            for k in keys]
    harness.insert_many(db, rows)


def per_key_effects(db, group="email"):
    with db.cursor() as cur:
        cur.execute("SELECT customer, order_id FROM emails WHERE consumer = %s ORDER BY id",
                    (group,))
        out = {}
        for customer, order_id in cur.fetchall():
            out.setdefault(customer, []).append(order_id)
        return out


class OrderedTest(unittest.TestCase):

    def consumer(self, pg, redis, name, lease="2s", fail_rate=None):
        return Consumer(pg, redis, consumer=name, backoff="200ms,400ms", max_deliveries=10,
                        block="100ms", fail_rate=fail_rate,
                        args=["--ordered", str(PARTITIONS), "--lease", lease])

    def test_three_ordered_consumers_through_kills(self):
        with servers() as (pg, redis, db, r):
            with harness.Relay(pg, redis, poll_interval="100ms"):
                procs = [self.consumer(pg, redis, f"c{i}", fail_rate=0.1) for i in range(3)]
                for c in procs:
                    c.start()
                for c in procs:
                    c.wait_for_log(r"consumer \d of 3 of group email", timeout=20)
                rng = random.Random(14)
                kills = []
                dead_logs = []
                seq = 0
                started = time.monotonic()
                restart_at = None  # (time, index) of a consumer kept down a while
                while seq < SEQS or len(kills) < 6 or restart_at is not None:
                    if seq < SEQS:
                        seq += 1
                        insert_round(db, seq, KEYS)
                    time.sleep(0.5)
                    if restart_at is not None and time.monotonic() >= restart_at[0]:
                        i = restart_at[1]
                        procs[i] = self.consumer(pg, redis, f"c{i}", fail_rate=0.1)
                        procs[i].start()
                        restart_at = None
                    elif (restart_at is None and len(kills) < 6 and seq >= 3
                          and rng.random() < 0.5):
                        i = rng.randrange(3)
                        procs[i].kill(signal.SIGKILL)
                        procs[i].wait(timeout=10)
                        kills.append((time.time(), i))
                        dead_logs.append(procs[i].log())
                        procs[i].close()
                        if len(kills) % 2 == 0:
                            # Down for a while: the other two take its partitions.
                            restart_at = (time.monotonic() + 5.0, i)
                        else:
                            procs[i] = self.consumer(pg, redis, f"c{i}", fail_rate=0.1)
                            procs[i].start()
                total = len(KEYS) * SEQS
                wait_until(lambda: scalar(db, "SELECT count(DISTINCT message_id) FROM emails")
                           >= total, timeout=180, interval=0.5,
                           message=f"{total} messages handled")
                took = time.monotonic() - started
                time.sleep(1.0)
                logs = dead_logs + [c.log() for c in procs]
                effects = per_key_effects(db)
                dead = sum(r.xlen(f"{{orders:{p:03d}}}.email.dlq") for p in range(PARTITIONS))
                pending = sum(consumers.pending_count(r, f"orders:{p:03d}")
                              for p in range(PARTITIONS))
                lost_leases = sum(len(consumers.log_events(t, r"lost the lease")) for t in logs)
                for c in procs:
                    c.terminate()
                retried = sum(len(consumers.log_events(text, r"will be retried"))
                              for text in logs)

            # Takeovers: for each kill, the partitions the killed process held
            # (from its log), and the first time each was taken again, by any
            # process, after the kill.
            took_events = sorted((t, m.group(1)) for text in logs
                                 for t, m in consumers.log_events(text, r": took (\S+) "))
            takeovers = []
            for (t, _), text in zip(kills, dead_logs):
                held = set()
                for _, m in consumers.log_events(
                        text, r"(took|released|lost the lease of) (orders:\d+)"):
                    if m.group(1) == "took":
                        held.add(m.group(2))
                    else:
                        held.discard(m.group(2))
                firsts = [min((e for e, s in took_events if s == stream and e > t),
                              default=float("inf")) for stream in held]
                if firsts:
                    takeovers.append(max(firsts) - t)
            wrong = {k: got for k, got in effects.items() if got != list(range(1, SEQS + 1))}
            doubled = sum(len(got) - len(set(got)) for got in effects.values())
            print(f"ordered consumers: {total} messages of {len(KEYS)} keys in {took:.1f} s;"
                  f" {len(kills)} SIGKILLs; takeovers after a kill: "
                  + (f"min {min(takeovers):.2f} s, median {statistics.median(takeovers):.2f} s,"
                     f" max {max(takeovers):.2f} s" if takeovers else "none seen")
                  + f"; keys out of order or incomplete {len(wrong)}, doubled {doubled};"
                  f" deliveries retried {retried}, dead-lettered {dead},"
                  f" pending {pending}, leases lost {lost_leases}",
                  file=sys.stderr, flush=True)
            self.assertEqual(len(effects), len(KEYS))
            self.assertEqual(wrong, {}, "per key, effects 1..20 in order, each once")
            self.assertEqual(dead, 0)
            self.assertEqual(pending, 0)
            self.assertGreaterEqual(len(takeovers), 1)
            for t in takeovers:
                # The lease (2 s), then the next upkeep (a third of it), with slack.
                self.assertLess(t, 6.0, f"a takeover took {t:.2f} s")

    def test_a_frozen_consumer_loses_its_partition_and_acknowledges_nothing(self):
        with servers() as (pg, redis, db, r):
            key = KEYS[7]
            stream = partition_stream(key)
            with harness.Relay(pg, redis, poll_interval="100ms"):
                # One consumer first: it holds every partition.
                a = self.consumer(pg, redis, "a", lease="1s")
                with a:
                    a.wait_for_log(rf": took {stream} ", timeout=20)
                    insert_round(db, 1, [key], headers={"fail": "transient:1"})
                    for seq in range(2, 6):
                        insert_round(db, seq, [key])
                    a.wait_for_log(r"will be retried in \d+ ms .* later messages of its key wait",
                                   timeout=20)
                    a.kill(signal.SIGSTOP)
                    stopped = time.monotonic()
                    try:
                        b = self.consumer(pg, redis, "b", lease="1s")
                        with b:
                            line = b.wait_for_log(rf": took {re.escape(stream)} ", timeout=20)
                            wait_until(lambda: per_key_effects(db).get(key) == [1, 2, 3, 4, 5],
                                       timeout=20, relay=b, message="b to handle the key")
                            taken_after = time.monotonic() - stopped
                            mark = a.mark()
                            a.kill(signal.SIGCONT)
                            a.wait_for_log(rf"lost the lease of {re.escape(stream)}", since=mark,
                                           timeout=20)
                            time.sleep(1.0)
                            self.assertEqual(per_key_effects(db).get(key), [1, 2, 3, 4, 5])
                            self.assertEqual(consumers.pending_count(r, stream), 0)
                            self.assertEqual(r.xlen(f"{{{stream}}}.email.dlq"), 0)
                            print(f"frozen consumer: {stream} taken over {taken_after:.2f} s"
                                  f" after the SIGSTOP (lease 1 s): {line.group(0)}",
                                  file=sys.stderr, flush=True)
                    finally:
                        a.kill(signal.SIGCONT)
                    a.terminate()
                    stats = a.stats()
            # a handled the first delivery (a retry) and acknowledged nothing.
            self.assertIsNotNone(stats)
            self.assertEqual(stats["done"], 0, stats)
            self.assertGreaterEqual(stats["leases_lost"], 1, stats)

    def test_a_dead_letter_parks_its_key_when_asked(self):
        with servers() as (pg, redis, db, r):
            parked, other = KEYS[3], KEYS[4]
            with harness.Relay(pg, redis, poll_interval="100ms"):
                # A topic of its own for each mode.
                for name, args in (("plain", []), ("parking", ["--park-after-dead-letter"])):
                    with self.subTest(mode=name):
                        scalar(db, "SELECT outbox.set_partitions(%s, %s)", (name, PARTITIONS))
                        stream = partition_stream(parked, name)
                        c = Consumer(pg, redis, consumer=name, group=name, stream=name,
                                     block="100ms",
                                     args=["--ordered", str(PARTITIONS), "--lease", "2s", *args])
                        with c:
                            c.wait_for_log(rf": took {re.escape(stream)} ", timeout=20)
                            insert_round(db, 1, [parked], headers={"fail": "permanent"},
                                         topic=name)
                            insert_round(db, 1, [other], topic=name)
                            for seq in range(2, 4):
                                insert_round(db, seq, [parked, other], topic=name)
                            wait_until(lambda: per_key_effects(db, name).get(other) == [1, 2, 3],
                                       timeout=20, relay=c, message="the other key's messages")
                            time.sleep(1.0)
                            dlq = f"{{{stream}}}.{name}.dlq"
                            got = per_key_effects(db, name).get(parked)
                            self.assertEqual(r.xlen(dlq), 1)
                            if name == "plain":
                                self.assertEqual(got, [2, 3], "the key goes on")
                                continue
                            self.assertIsNone(got, "the parked key's later messages wait")
                            key = f"{{{stream}}}:parked:{name}"
                            self.assertEqual(r.smembers(key), {parked.encode()})
                            c.wait_for_log(rf"key {parked} parked on {re.escape(stream)}")
                            self.assertEqual(consumers.pending_count(r, stream, name), 2)
                            r.srem(key, parked)
                            wait_until(lambda: per_key_effects(db, name).get(parked) == [2, 3],
                                       timeout=20, relay=c, message="the unparked key's messages")
                            self.assertEqual(consumers.pending_count(r, stream, name), 0)
                            c.wait_for_log(rf"key {parked} unparked")

    def test_other_keys_pass_a_key_whose_messages_fill_the_hand(self):
        with servers() as (pg, redis, db, _):
            slow = KEYS[0]
            stream = partition_stream(slow)
            other = next(k for k in KEYS[1:] if partition_stream(k) == stream)
            with harness.Relay(pg, redis, poll_interval="100ms"):
                # count 16 (the default): the slow key's 40 messages fill the
                # hand behind its first, which waits 5 s for its retry.
                c = Consumer(pg, redis, consumer="a", backoff="5s", block="100ms",
                             args=["--ordered", str(PARTITIONS)])
                with c:
                    c.wait_for_log(rf": took {re.escape(stream)} ", timeout=20)
                    insert_round(db, 1, [slow], headers={"fail": "transient:1"})
                    for seq in range(2, 41):
                        insert_round(db, seq, [slow])
                    for seq in range(1, 11):
                        insert_round(db, seq, [other])
                    started = time.monotonic()
                    wait_until(lambda: per_key_effects(db).get(other) == list(range(1, 11)),
                               timeout=20, relay=c, message="the other key's messages")
                    waited = time.monotonic() - started
                    self.assertIsNone(per_key_effects(db).get(slow), "the slow key waits")
                    self.assertLess(waited, 4.0, "the other key waited for the retry")
                    wait_until(lambda: per_key_effects(db).get(slow) == list(range(1, 41)),
                               timeout=30, relay=c, message="the slow key, in order")

    def test_ordered_flags_are_checked(self):
        binary = consumers.require_consumer()
        base = [binary, "--redis", "redis://127.0.0.1:1/0", "--postgres", "dbname=x"]
        for args, code, text in (
                (["--ordered", "1"], 64, "--ordered takes the topic's number of partitions"),
                (["--ordered", "abc"], 64, "--ordered takes the topic's number of partitions"),
                (["--ordered", "8", "--lease", "10ms"], 64, "--lease takes a duration"),
                (["--park-after-dead-letter"], 78, "park_keys needs the ordered mode"),
        ):
            with self.subTest(args=args):
                done = subprocess.run(base + args, capture_output=True, text=True, timeout=30)
                self.assertEqual(done.returncode, code, done.stderr)
                self.assertIn(text, done.stderr)


if __name__ == "__main__":
    unittest.main()
