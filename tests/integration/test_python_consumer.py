"""The consumer in Python, examples/python/outbox_consumer.py, with the real relay.

Promises tested (docs/CONSUMERS.md, for a consumer in another language: redis-py and
psycopg2 calling the documented Redis functions as the consumer's own Redis user), with
two consumer processes at once and rows committed to PostgreSQL and relayed by the real
daemon; the effect is the example's row in emails, written in the transaction of
outbox_consumer.begin_message, and a header "fail" injects failures:
- unordered: one consumer SIGKILLed half-way and started again under its name; every
  message has its effect once (none missing, none twice), also those that failed
  transiently twice first; a message that always fails is dead-lettered as exhausted at
  max_deliveries, one that fails for good (the effect says so, or its payload is not
  JSON) at its first delivery, each with its original fields and the dlq.* fields;
  nothing is left pending;
- ordered (--ordered, a topic of 4 partitions): the two share the partitions through the
  lease functions; one is SIGKILLed half-way and started again; per key the effects are
  in commit order, each once, while messages of some keys fail transiently first (their
  later messages wait behind them); a message that fails for good is dead-lettered in its
  partition's dead-letter stream and its key goes on.
"""

import json
import os
import re
import signal
import sys
import time
import unittest

from testkit import consumers, harness
from testkit.consumers import ConsumerTestCase, dlq_entries, pending_count
from testkit.harness import insert_many, scalar, wait_until

harness.require_relay()
harness.set_deadline(180)

SCRIPT = os.path.join(harness.SOURCE_DIR, "examples", "python", "outbox_consumer.py")
PARTITIONS = 4


def payload(order, customer):
    return json.dumps({"order": order, "customer": customer}).encode()


class PythonConsumer(harness.Daemon):
    """examples/python/outbox_consumer.py as a process (see harness.Daemon)."""

    def __init__(self, test, name, *args):
        argv = [sys.executable, SCRIPT, "--redis", test.redis.url("outbox-consumer"),
                "--postgres", test.pg.dsn(), "--consumer", name, "--backoff", "100ms,200ms",
                "--block", "100ms", *args]
        super().__init__(argv, harness.relay_env(), f"consumer {name}")


class PythonConsumerTest(ConsumerTestCase):

    def consumer(self, name, *args):
        c = PythonConsumer(self, name, *args)
        self.addCleanup(c.close)
        self.addCleanup(c.stop)
        return c.start()

    def effects(self):
        """{message id: number of effects}."""
        with self.db.cursor() as cur:
            cur.execute("SELECT message_id::text, count(*) FROM emails GROUP BY 1")
            return dict(cur.fetchall())

    def test_unordered_each_effect_once_retries_and_dead_letters(self):
        self.relay(poll_interval="100ms")
        good, dead = set(), {}  # dead: {message id: (reason, fewest deliveries)}

        def produce(first, n):
            rows, kinds = [], []
            for i in range(first, first + n):
                headers, body, kind = None, payload(i, f"c-{i % 17}"), "good"
                if i % 20 == 3:
                    headers = {"fail": "transient:2"}  # done at its third delivery
                elif i % 50 == 7:
                    headers, kind = {"fail": "transient"}, ("exhausted", 5)
                elif i % 50 == 11:
                    headers, kind = {"fail": "permanent"}, ("permanent", 1)
                elif i % 50 == 13:
                    body, kind = b"not json", ("permanent", 1)  # a data exception: class 22
                rows.append(("orders", body, str(i), headers))
                kinds.append(kind)
            for message_id, kind in zip(insert_many(self.db, rows), kinds):
                if kind == "good":
                    good.add(message_id)
                else:
                    dead[message_id] = kind

        a = self.consumer("py-a", "--max-deliveries", "5")
        b = self.consumer("py-b", "--max-deliveries", "5")
        for c in (a, b):
            c.wait_for_log(r"reading orders and \{orders\}\.email\.replay", timeout=20)

        def pending_of(name):
            return sum(c["pending"] for c in self.r.xinfo_consumers("orders", "email")
                       if c["name"].decode() == name)
        killed = restarted = None
        for rnd in range(20):  # 20 rows every 0.1 s
            produce(20 * rnd, 20)
            time.sleep(0.1)
            if killed is None and rnd >= 4 and pending_of("py-a") > 0:
                a.kill(signal.SIGKILL)  # what it held stays pending: py-b takes it over
                killed = rnd
            elif killed is not None and restarted is None and rnd >= killed + 5:
                restarted = a.mark()
                a.start()
        self.assertIsNotNone(restarted, "py-a never held an entry to be killed with")
        a.wait_for_log(r"reading orders", since=restarted, timeout=20)

        def finished():
            return (len(self.effects()) == len(good)
                    and self.r.xlen(consumers.dlq_name()) >= len(dead)
                    and pending_count(self.r) == 0)
        wait_until(finished, timeout=40, relay=b, message="every message handled")
        effects = self.effects()
        self.assertEqual(set(effects), good)
        self.assertEqual({m: n for m, n in effects.items() if n != 1}, {}, "effects twice")
        letters = {f[b"id"].decode(): (eid, f) for eid, f in dlq_entries(self.r)}
        self.assertEqual(set(letters), set(dead))
        sent = {f[b"id"].decode(): (eid, f) for eid, f in harness.stream_entries(self.r, "orders")}
        for message_id, (reason, deliveries) in dead.items():
            _, f = letters[message_id]
            entry_id, original = sent[message_id]
            self.assertEqual({k: v for k, v in f.items() if not k.startswith(b"dlq.")}, original)
            self.assertEqual(f[b"dlq.reason"].decode(), reason, message_id)
            self.assertGreaterEqual(int(f[b"dlq.deliveries"]), deliveries)
            self.assertEqual(f[b"dlq.stream"], b"orders")
            self.assertEqual(f[b"dlq.group"], b"email")
            self.assertEqual(f[b"dlq.entry_id"].decode(), entry_id)
            self.assertIn(f[b"dlq.consumer"], (b"py-a", b"py-b"))
        self.assertEqual(a.terminate(), 0)
        self.assertEqual(b.terminate(), 0)
        self.assertRegex(b.log(), r"(?m)^consumer py-b: delivered=\d+ done=\d+")

    def test_ordered_each_key_in_order_through_a_kill(self):
        scalar(self.db, "SELECT outbox.set_partitions('shipments', %s)", (PARTITIONS,))
        self.relay(poll_interval="100ms")
        keys, seqs = [f"k{i:02d}" for i in range(40)], 10
        flaky = {("k03", 2), ("k11", 1), ("k20", 5), ("k33", 7)}
        doomed = ("k05", 4)

        def produce(seq):
            rows = []
            for k in keys:
                headers = {"fail": "transient:2"} if (k, seq) in flaky else None
                headers = {"fail": "permanent"} if (k, seq) == doomed else headers
                rows.append(("shipments", payload(seq, k), k, headers))
            insert_many(self.db, rows)

        args = ("--stream", "shipments", "--ordered", str(PARTITIONS), "--lease", "1500ms",
                "--max-deliveries", "10")
        a = self.consumer("py-a", *args)
        b = self.consumer("py-b", *args)
        for c in (a, b):
            c.wait_for_log(r"consumer \d of 2 of group email", timeout=20)
        for seq in range(1, seqs + 1):
            produce(seq)
            time.sleep(0.1)
            if seq == 4:
                wait_until(lambda: len(self.effects()) >= 80, timeout=30, relay=a,
                           message="80 effects before the kill")
                killed = b.mark()
                a.kill(signal.SIGKILL)
                # Its leases run out; py-b, alone in the group now, takes them over.
                wait_until(lambda: len(re.findall(r"py-b: took ", b.log()[killed:])) == 2,
                           timeout=20, relay=b, message="py-b to take the partitions of py-a over")
            if seq == 7:  # py-a again: the partitions are shared again, and it goes on
                restarted = a.mark()
                a.start()
                a.wait_for_log(r"py-a: took shipments", since=restarted, timeout=20)
        expected = {k: [s for s in range(1, seqs + 1) if (k, s) != doomed] for k in keys}
        streams = [f"shipments:{p:03d}" for p in range(PARTITIONS)]

        def finished():
            return (sum(map(len, expected.values())) == len(self.effects())
                    and all(pending_count(self.r, s) == 0 for s in streams)
                    and sum(self.r.xlen(consumers.dlq_name(s)) for s in streams) >= 1)
        wait_until(finished, timeout=40, relay=b, message="every message handled")
        with self.db.cursor() as cur:
            cur.execute("SELECT customer, order_id FROM emails ORDER BY id")
            got = {}
            for customer, order in cur.fetchall():
                got.setdefault(customer, []).append(order)
        self.assertEqual(got, expected)
        letters = [(s, f) for s in streams for _, f in dlq_entries(self.r, s)]
        self.assertEqual(len(letters), 1, letters)
        stream, f = letters[0]
        self.assertEqual((f[b"key"].decode(), json.loads(f[b"payload"])["order"]), doomed)
        self.assertEqual((f[b"dlq.reason"], f[b"dlq.stream"].decode()), (b"permanent", stream))
        self.assertEqual(a.terminate(), 0)
        self.assertEqual(b.terminate(), 0)
        self.assertRegex(a.log(), r"py-a: took shipments:\d{3}")


if __name__ == "__main__":
    unittest.main()
