"""The partition-lease functions of the consumer library (docs/CONSUMERS.md,
"Ordered consumers"; their contract is in include/outbox/consumer.h).

Promises tested, by calling the functions as a consumer in any language would:
- the relay loads the consumer library when it connects, so the functions are
  there without a consumer of ours;
- a free lease is taken with a token larger than every one given before for
  that partition and group; the holder renews it with its token; anyone else
  (another consumer, or the holder with an old token) is told who holds it
  and for how long;
- once a lease has expired and another consumer took it, the first
  consumer's token is refused by read, take, ack and the leased dead letter
  (an error beginning LEASELOST) and nothing is changed: no entry delivered,
  acknowledged, claimed or dead-lettered;
- take moves the group's pending entries of other consumers to the holder (a
  delivery more each), from anywhere in the pending list, and names the ids it
  asked for, so an entry deleted from the stream shows as missing from the
  entries; reading one's own pending entries (with an id) counts no delivery;
- a renewal of a lease that ran out takes nothing;
- release gives the lease up only for its own token;
- every function answers a usage error for wrong arguments, before writing.
"""

import time
import unittest

import redis as redis_py

from testkit import harness
from testkit.harness import wait_until

STREAM = "orders:003"
GROUP = "billing"
LEASE = "{orders:003}:lease:billing"
TOKENS = "{orders:003}:lease-token:billing"
DLQ = "{orders:003}.billing.dlq"


class LeaseTest(harness.ServerTestCase):

    def setUp(self):
        super().setUp()
        relay = self.relay()
        wait_until(lambda: self.r.execute_command("FUNCTION", "LIST", "LIBRARYNAME",
                                                  "outbox_consumer"),
                   timeout=15, relay=relay, message="the relay to load the consumer library")
        self.r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)

    def fcall(self, name, keys, *args):
        return self.r.execute_command("FCALL", name, len(keys), *keys, *args)

    def lease(self, consumer, ttl, token=0):
        got = self.fcall("outbox_consumer_lease_v1", [LEASE, TOKENS], consumer, ttl, token)
        return int(got[0]), got[1].decode(), int(got[2])

    def lost(self, name, keys, *args):
        with self.assertRaises(redis_py.ResponseError) as cm:
            self.fcall(name, keys, *args)
        self.assertTrue(str(cm.exception).startswith("LEASELOST"), str(cm.exception))
        return str(cm.exception)

    def test_leases_fence_every_step(self):
        ids = [self.r.xadd(STREAM, {"id": f"m{i}", "key": "k"}).decode() for i in range(4)]

        token_a, holder, ttl = self.lease("a", 300)
        self.assertEqual((holder, ttl), ("a", 300))
        self.assertGreaterEqual(token_a, 1)
        # Held: another consumer is told who holds it; the holder renews.
        token, holder, left = self.lease("b", 5000)
        self.assertEqual((token, holder), (0, "a"))
        self.assertTrue(0 < left <= 300, left)
        self.assertEqual(self.lease("a", 300, token_a), (token_a, "a", 300))
        self.assertEqual(self.lease("a", 300, token_a + 1)[0], 0, "a wrong token renews nothing")

        got = self.fcall("outbox_consumer_read_v1", [STREAM, LEASE], GROUP, "a", token_a, 2, ">")
        self.assertEqual([e[0].decode() for e in got[0][1]], ids[:2])

        # A's lease runs out; B takes it with a larger token.
        time.sleep(0.4)
        token_b, holder, _ = self.lease("b", 5000)
        self.assertEqual(holder, "b")
        self.assertGreater(token_b, token_a)
        self.assertEqual(self.lease("a", 300, token_a)[:2], (0, "b"))

        # A, late, can do nothing more.
        pending = self.r.xpending(STREAM, GROUP)["pending"]
        message = self.lost("outbox_consumer_read_v1", [STREAM, LEASE], GROUP, "a", token_a, 10,
                            ">")
        self.assertIn(f"token {token_b} holds it", message)
        self.lost("outbox_consumer_ack_v1", [STREAM, LEASE], GROUP, token_a, ids[0])
        self.lost("outbox_consumer_take_v1", [STREAM, LEASE], GROUP, "a", token_a, 10)
        self.lost("outbox_consumer_dead_letter_leased_v1", [DLQ, STREAM, LEASE], GROUP, token_a,
                  ids[1], "dlq.reason", "permanent")
        self.assertEqual(self.r.xpending(STREAM, GROUP)["pending"], pending)
        self.assertEqual(self.r.exists(DLQ), 0)
        self.assertEqual(self.r.xinfo_groups(STREAM)[0]["last-delivered-id"].decode(), ids[1])

        # B takes over A's pending entries (one of them deleted meanwhile),
        # then reads on.
        self.r.xdel(STREAM, ids[1])
        asked, entries = self.fcall("outbox_consumer_take_v1", [STREAM, LEASE], GROUP, "b",
                                    token_b, 100)
        self.assertEqual([x.decode() for x in asked], ids[:2])
        self.assertEqual([e[0].decode() for e in entries], ids[:1], "the deleted entry is lost")
        detail = self.r.xpending_range(STREAM, GROUP, "-", "+", 10)
        self.assertEqual([(d["message_id"].decode(), d["consumer"].decode(),
                           d["times_delivered"]) for d in detail], [(ids[0], "b", 2)])
        self.assertEqual(self.fcall("outbox_consumer_take_v1", [STREAM, LEASE], GROUP, "b",
                                    token_b, 100), [[], []], "nothing of others left to take")
        got = self.fcall("outbox_consumer_read_v1", [STREAM, LEASE], GROUP, "b", token_b, 10,
                         ">")
        self.assertEqual([e[0].decode() for e in got[0][1]], ids[2:])
        self.assertEqual(self.fcall("outbox_consumer_read_v1", [STREAM, LEASE], GROUP, "b",
                                    token_b, 10, ">"), None, "nothing new")
        # Its own pending entries, from the start (id 0), as after a restart.
        got = self.fcall("outbox_consumer_read_v1", [STREAM, LEASE], GROUP, "b", token_b, 10,
                         "0")
        self.assertEqual([e[0].decode() for e in got[0][1]], [ids[0]] + ids[2:])

        self.assertEqual(self.fcall("outbox_consumer_ack_v1", [STREAM, LEASE], GROUP, token_b,
                                    ids[0], ids[2]), 2)
        dead = self.fcall("outbox_consumer_dead_letter_leased_v1", [DLQ, STREAM, LEASE], GROUP,
                          token_b, ids[3], "id", "m3", "dlq.reason", "exhausted")
        self.assertEqual([e[0] for e in self.r.xrange(DLQ)], [dead])
        self.assertEqual(self.r.xpending(STREAM, GROUP)["pending"], 0)

        # Release: only with the holder's token.
        self.assertEqual(self.fcall("outbox_consumer_release_v1", [LEASE], token_a), 0)
        self.assertEqual(self.r.exists(LEASE), 1)
        self.assertEqual(self.fcall("outbox_consumer_release_v1", [LEASE], token_b), 1)
        self.assertEqual(self.r.exists(LEASE), 0)
        self.assertGreater(self.lease("a", 1000)[0], token_b, "tokens only grow")

    def test_take_pages_and_history_reads_count_nothing(self):
        # 150 entries pending at "a", 30 at "b" first in the list.
        ids = [self.r.xadd(STREAM, {"id": f"m{i}"}).decode() for i in range(180)]
        self.r.xreadgroup(GROUP, "b", {STREAM: ">"}, count=30)
        self.r.xreadgroup(GROUP, "a", {STREAM: ">"}, count=150)
        token, _, _ = self.lease("b", 5000)
        asked, entries = self.fcall("outbox_consumer_take_v1", [STREAM, LEASE], GROUP, "b",
                                    token, 1000)
        self.assertEqual([x.decode() for x in asked], ids[30:], "all of a's, past b's own")
        self.assertEqual(len(entries), 150)
        self.assertEqual(self.r.xpending_range(STREAM, GROUP, "-", "+", 1000, "a"), [])

        def counts():
            return {d["message_id"].decode(): d["times_delivered"]
                    for d in self.r.xpending_range(STREAM, GROUP, "-", "+", 1000)}
        before = counts()
        got = self.fcall("outbox_consumer_read_v1", [STREAM, LEASE], GROUP, "b", token, 100,
                         "0")
        self.assertEqual([e[0].decode() for e in got[0][1]], ids[:100])
        got = self.fcall("outbox_consumer_read_v1", [STREAM, LEASE], GROUP, "b", token, 100,
                         ids[99])
        self.assertEqual([e[0].decode() for e in got[0][1]], ids[100:])
        self.assertEqual(counts(), before, "reading one's own pending entries counts nothing")
        # A deleted pending entry reads as (id, nil).
        self.r.xdel(STREAM, ids[5])
        got = self.fcall("outbox_consumer_read_v1", [STREAM, LEASE], GROUP, "b", token, 10,
                         ids[3])
        self.assertEqual([(e[0].decode(), e[1]) for e in got[0][1]][1], (ids[5], None))

    def test_a_lease_that_ran_out_is_not_renewed(self):
        token, _, _ = self.lease("a", 100)
        time.sleep(0.25)
        self.assertEqual(self.lease("a", 5000, token), (0, "", 0), "a renewal takes nothing")
        self.assertEqual(self.r.exists(LEASE), 0)
        again, holder, _ = self.lease("a", 5000)
        self.assertEqual(holder, "a")
        self.assertGreater(again, token)
        # A lease key of another type: told, not crashed.
        self.r.delete(LEASE)
        self.r.hset(LEASE, "x", "y")
        with self.assertRaises(redis_py.ResponseError) as cm:
            self.lease("a", 1000)
        self.assertIn("WRONGTYPE lease key", str(cm.exception))
        self.lost("outbox_consumer_ack_v1", [STREAM, LEASE], GROUP, again, "1-0")

    def test_usage_errors_change_nothing(self):
        self.r.xadd(STREAM, {"id": "m"})
        bad = [
            ("outbox_consumer_lease_v1", [LEASE, TOKENS], ("a", 1000)),
            ("outbox_consumer_lease_v1", [LEASE, TOKENS], ("", 1000, 0)),
            ("outbox_consumer_lease_v1", [LEASE, TOKENS], ("a", 0, 0)),
            ("outbox_consumer_lease_v1", [LEASE, TOKENS], ("a", "1.5", 0)),
            ("outbox_consumer_release_v1", [LEASE], ()),
            ("outbox_consumer_read_v1", [STREAM, LEASE], (GROUP, "a", 1, 10, "$")),
            ("outbox_consumer_take_v1", [STREAM], (GROUP, "a", 1, 10)),
            ("outbox_consumer_ack_v1", [STREAM, LEASE], (GROUP, 1)),
            ("outbox_consumer_dead_letter_leased_v1", [DLQ, STREAM, LEASE],
             (GROUP, 1, "1-0", "odd")),
        ]
        for name, keys, args in bad:
            with self.subTest(name=name, args=args):
                with self.assertRaises(redis_py.ResponseError) as cm:
                    self.fcall(name, keys, *args)
                text = str(cm.exception)  # redis-py drops the leading "ERR "
                self.assertTrue(text.startswith("usage: FCALL") or "must" in text, text)
        self.assertEqual(self.r.exists(LEASE, TOKENS, DLQ), 0)
        self.r.set(LEASE, "not a lease")
        with self.assertRaises(redis_py.ResponseError) as cm:
            self.lease("a", 1000)
        self.assertIn("WRONGTYPE lease key", str(cm.exception))
        self.assertEqual(self.r.get(LEASE), b"not a lease")


if __name__ == "__main__":
    unittest.main()
