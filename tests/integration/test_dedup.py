"""The publish function's dedup records (docs/DESIGN.md P2, "Key layout").

Promises tested:
- the relay's function, called twice with one message id, adds one entry and
  returns the first entry's id the second time; its record expires (PTTL);
- a failed XADD (WRONGTYPE on the stream key) leaves no dedup record, so the
  retry after the key is fixed is published, not swallowed;
- a publish that names the record of the message sent before it to its stream
  (a third key) adds nothing while that record is missing, and is published
  once it is there; a message already recorded still answers its entry id;
- the call of several rows of one stream, as the relay sends them, answers
  each row as a call of its own would: the rows in order, a row already
  recorded with its first entry, a failed row with its error, and every row
  behind it not recorded with ORDER, adding nothing for them, up to a row
  recorded before, after which rows are published again; the record of
  the row before the first (when named) holds back the whole call; past the
  deadline only the recorded rows answer;
- the relay cuts a stream's rows into calls of at most 64 rows and 256 KiB,
  a row bigger than that alone (FCALLs counted in commandstats);
- dedup memory stays bounded: while the relay sends 20,000 rows there are never
  more records than two batches (sampled with DBSIZE) beside those a committed
  batch retired within the last publish_timeout, every record is removed
  publish_timeout after its batch's commit, and then none is left; the gauge
  of the removals waiting in the relay is above 0 right after the last commit
  and 0 once they are done;
  the memory of one
  record is measured (INFO used_memory: FCALL with the record minus a plain
  XADD of the same entry) and printed next to the README's figure; it must stay
  under twice that figure;
- a publish whose commit never happened adds no second copy:
    * a row published by "an earlier run" (our own FCALL, exactly as the relay
      builds it) and still pending is published by the relay exactly once,
      with the entry id our FCALL returned;
    * for real: a deferred trigger makes the relay's COMMIT fail once after
      Redis acknowledged the batch (an error, or its backend terminated during
      COMMIT, so the outcome is unknown to the relay); the relay publishes the
      batch again, the function absorbs every republish (FCALL ran twice per
      row), each row is in its stream once, and every record is retired after.
"""

import contextlib
import signal
import sys
import threading
import time
import unittest
import uuid

import redis as redis_py

from testkit import harness
from testkit.harness import insert, scalar, wait_until

harness.require_relay()
harness.set_deadline(240)

FUNCTION = "outbox_relay_publish_v2"
MANY = "outbox_relay_publish_many_v1"
FAR_FUTURE_MS = 9999999999999  # the validity deadline argument: never expired
# stream_retention = 0: the trim function's FCALLs would count among the
# publishes these tests count.
RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="500ms",
                   stream_retention="0")
README_BYTES_PER_RECORD = 200


def dedup_key(stream, message_id):
    return f"{{{stream}}}:dedup:{message_id}"


# The longest stream_prefix: test_removals_past_the_cap fills the relay's
# queue of removals with few rows.
LONG_PREFIX = "p" * 64


def count_dedup_records(r):
    return sum(1 for _ in r.scan_iter(match="*:dedup:*", count=1000))


def used_memory(r):
    time.sleep(0.3)  # let the server finish incremental rehashing in its cron
    return r.info("memory")["used_memory"]


def fcall_calls(r):
    """Rows the publish functions took (harness.publish_calls)."""
    return harness.publish_calls(r)


class DedupTest(harness.ServerTestCase):

    def start_relay(self, **flags):
        relay = self.relay(**{**RELAY_FLAGS, **flags})
        relay.wait_for_log(r"^\S+ INFO redis: .*ready", timeout=30)
        return relay

    def fcall(self, stream, message_id, *fields, ttl=60000):
        return self.r.fcall(FUNCTION, 2, stream, dedup_key(stream, message_id), ttl,
                            FAR_FUTURE_MS, *fields).decode()

    def test_a_call_past_its_deadline_publishes_nothing(self):
        """A publish that reaches Redis after the relay gave up on it (a partition
        that held it in the kernel) must not add an entry: by then the relay may
        have published the row again, committed, and removed the dedup record."""
        self.start_relay()
        mid = str(uuid.uuid4())
        now_s, now_us = self.r.time()
        past = now_s * 1000 + now_us // 1000 - 1
        with self.assertRaises(Exception) as refused:
            self.r.fcall(FUNCTION, 2, "late", dedup_key("late", mid), 60000, past,
                         "id", mid, "payload", "x")
        self.assertIn("EXPIRED", str(refused.exception))
        self.assertEqual(self.r.exists("late"), 0)
        self.assertEqual(self.r.exists(dedup_key("late", mid)), 0)

    # (a)
    def test_second_call_returns_first_entry_id(self):
        self.start_relay()
        mid = str(uuid.uuid4())
        first = self.fcall("dedup-a", mid, "id", mid, "payload", "x")
        second = self.fcall("dedup-a", mid, "id", mid, "payload", "x")
        third = self.fcall("dedup-a", mid, "id", mid, "payload", "other bytes, same id")
        self.assertEqual(second, first)
        self.assertEqual(third, first)
        entries = harness.stream_entries(self.r, "dedup-a")
        self.assertEqual([e[0] for e in entries], [first])
        self.assertEqual(entries[0][1], {b"id": mid.encode(), b"payload": b"x"})
        self.assertEqual(self.r.get(dedup_key("dedup-a", mid)), first.encode())
        ttl = self.r.pttl(dedup_key("dedup-a", mid))
        self.assertTrue(0 < ttl <= 60000, f"the record expires: PTTL {ttl}")
        # Another id is another message.
        other = str(uuid.uuid4())
        self.assertNotEqual(self.fcall("dedup-a", other, "id", other, "payload", "x"), first)
        self.assertEqual(self.r.xlen("dedup-a"), 2)

    # (b)
    def test_failed_xadd_leaves_no_record(self):
        self.start_relay()
        mid = str(uuid.uuid4())
        self.r.set("dedup-b", "a string, not a stream")
        with self.assertRaises(redis_py.exceptions.ResponseError) as refused:
            self.fcall("dedup-b", mid, "id", mid, "payload", "x")
        self.assertIn("WRONGTYPE", str(refused.exception))
        self.assertEqual(self.r.exists(dedup_key("dedup-b", mid)), 0,
                         "a failed XADD left a dedup record: the retry would be swallowed")
        self.r.delete("dedup-b")
        entry = self.fcall("dedup-b", mid, "id", mid, "payload", "x")
        self.assertEqual([e[0] for e in harness.stream_entries(self.r, "dedup-b")], [entry])
        self.assertEqual(self.r.get(dedup_key("dedup-b", mid)), entry.encode())

    def test_a_publish_waits_for_the_message_before_it(self):
        """Within a pipelined batch, a command that failed (a slot being
        migrated, memory full for a moment) must not be overtaken by a later
        one to the same stream that succeeded: the retry would put the earlier
        row behind it. Each publish names the record of the one before it."""
        self.start_relay()
        first, second = str(uuid.uuid4()), str(uuid.uuid4())
        stream = "dedup-order"

        def chained(mid, before):
            return self.r.fcall(FUNCTION, 3, stream, dedup_key(stream, mid),
                                dedup_key(stream, before), 60000, FAR_FUTURE_MS,
                                "id", mid, "payload", mid).decode()

        with self.assertRaises(redis_py.exceptions.ResponseError) as refused:
            chained(second, first)
        self.assertIn("ORDER", str(refused.exception))
        self.assertEqual(self.r.exists(stream), 0, "the later message was published first")
        self.assertEqual(self.r.exists(dedup_key(stream, second)), 0)
        # The retry, in claim order: the first, then the second after it.
        one = self.fcall(stream, first, "id", first, "payload", first)
        two = chained(second, first)
        self.assertEqual([e[0] for e in harness.stream_entries(self.r, stream)], [one, two])
        # A record of another type failed the message before (its GET
        # answered WRONGTYPE): it holds this one back too.
        third = str(uuid.uuid4())
        self.r.hset(dedup_key(stream, first + "-other"), "f", "v")
        with self.assertRaises(redis_py.exceptions.ResponseError) as refused:
            self.r.fcall(FUNCTION, 3, stream, dedup_key(stream, third),
                         dedup_key(stream, first + "-other"), 60000, FAR_FUTURE_MS,
                         "id", third, "payload", third)
        self.assertIn("ORDER", str(refused.exception))
        self.assertEqual(self.r.xlen(stream), 2)
        # A message already recorded answers its entry whatever came before
        # it: a retry of a batch whose first record was retired meanwhile.
        self.r.delete(dedup_key(stream, first))
        self.assertEqual(chained(second, first), two)
        self.assertEqual(self.r.xlen(stream), 2)

    def test_a_call_of_several_rows(self):
        """The relay sends each stream's rows of a batch in calls of several
        rows (docs/DESIGN.md, "The claim cycle"); each row is answered as a
        call of its own would be."""
        self.start_relay()
        stream = "dedup-many"
        mids = [str(uuid.uuid4()) for _ in range(6)]

        def call(rows, before=None, deadline=FAR_FUTURE_MS, stream=stream):
            keys = [stream] + ([dedup_key(stream, before)] if before else [])
            keys += [dedup_key(stream, m) for m in rows]
            args = [60000, deadline, len(rows)]
            for m in rows:
                args += [4, "id", m, "payload", m]
            return self.r.execute_command("FCALL", MANY, len(keys), *keys, *args)

        def ids():
            return [f[b"id"].decode() for _, f in harness.stream_entries(self.r, stream)]

        # mids[1] was published before; mids[3]'s record is of another type.
        recorded = self.fcall(stream, mids[1], "id", mids[1], "payload", mids[1])
        self.r.hset(dedup_key(stream, mids[3]), "f", "v")
        got = call(mids)
        self.assertEqual(len(got), 6, got)
        self.assertEqual(got[1].decode(), recorded)
        self.assertIn("WRONGTYPE", str(got[3]))
        for refused in got[4:]:
            self.assertIsInstance(refused, redis_py.exceptions.ResponseError)
            self.assertIn("ORDER", str(refused))
        self.assertEqual(ids(), [mids[1], mids[0], mids[2]])
        self.assertEqual([e[0] for e in harness.stream_entries(self.r, stream)],
                         [recorded, got[0].decode(), got[2].decode()])
        for m in mids[4:]:
            self.assertEqual(self.r.exists(dedup_key(stream, m)), 0)
        self.assertEqual(self.r.get(dedup_key(stream, mids[0])), got[0])
        ttl = self.r.pttl(dedup_key(stream, mids[2]))
        self.assertTrue(0 < ttl <= 60000, f"the record expires: PTTL {ttl}")

        # Behind a failed row, a recorded row answers its entry, and the row
        # after it is published: a call of its own would find the record of
        # the row before it.
        self.r.delete(dedup_key(stream, mids[3]))
        other = "dedup-many-after-recorded"
        late = [str(uuid.uuid4()) for _ in range(3)]
        recorded = self.fcall(other, late[1], "id", late[1], "payload", late[1])
        self.r.hset(dedup_key(other, late[0]), "f", "v")
        got = call(late, stream=other)
        self.assertIn("WRONGTYPE", str(got[0]))
        self.assertEqual(got[1].decode(), recorded)
        self.assertIsInstance(got[2], bytes, got)
        self.assertEqual([f[b"id"].decode() for _, f in harness.stream_entries(self.r, other)],
                         late[1:])

        # Named after a row that is not recorded: nothing is added.
        got = call(mids[3:], before=str(uuid.uuid4()))
        self.assertTrue(all("ORDER" in str(g) for g in got), got)
        self.assertEqual(len(ids()), 3)
        # Past its deadline: only the recorded rows answer.
        now_s, now_us = self.r.time()
        got = call([mids[0], mids[3]], deadline=now_s * 1000 + now_us // 1000 - 1)
        self.assertEqual(got[0], self.r.get(dedup_key(stream, mids[0])))
        self.assertIn("EXPIRED", str(got[1]))
        self.assertEqual(len(ids()), 3)
        # The retry, in order, after the last row sent: every row once.
        got = call(mids[3:], before=mids[2])
        self.assertTrue(all(isinstance(g, bytes) for g in got), got)
        self.assertEqual(ids(), [mids[1], mids[0], mids[2]] + mids[3:])

    # (c)
    def test_a_stream_s_calls_hold_64_rows_and_256_kib(self):
        """A batch cuts each stream's rows into calls of at most 64 rows and
        256 KiB of entries, a bigger row going alone (docs/DESIGN.md, "The
        claim cycle"): Redis holds its one thread for one call, and a call
        stays far below its 512 MB limit on a command."""
        kib = 1024
        sizes = [100 * kib] * 3 + [300 * kib] + [10] * 72
        # In claim order: {100, 100} KiB (a third would pass 256 KiB),
        # {100} (the 300 KiB row does not fit beside it), {300} (nor does a
        # small row), then 64 small rows and the last 8.
        expected_calls = 5
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT 'cut', convert_to(repeat('x', n), 'UTF8')"
                        " FROM unnest(%s::int[]) WITH ORDINALITY AS s(n, i) ORDER BY i",
                        (sizes,))
        self.r.config_resetstat()
        relay = self.start_relay()
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        calls = self.r.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0)
        self.assertEqual(fcall_calls(self.r), len(sizes), "each row taken once")
        self.assertEqual(calls, expected_calls,
                         f"{len(sizes)} rows in calls of at most 64 rows and 256 KiB")
        self.assertEqual([len(f[b"payload"]) for _, f in harness.stream_entries(self.r, "cut")],
                         sizes, "the rows in claim order")

    def test_committed_batches_retire_their_records(self):
        relay = self.start_relay()
        rows = 20_000
        topics = 3
        peak = [0]
        stop = threading.Event()

        def sample():
            """DBSIZE is O(1): every key but the (at most 3) streams is a record."""
            with contextlib.closing(self.redis.client()) as c:
                while not stop.is_set():
                    peak[0] = max(peak[0], c.dbsize() - topics)
                    time.sleep(0.005)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        self.addCleanup(stop.set)
        started = time.monotonic()
        for lo in range(1, rows + 1, 5000):
            with self.db.cursor() as cur:
                cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload)"
                            " SELECT 'topic' || (i %% 3), 'k' || (i %% 100),"
                            "  convert_to('row ' || i, 'UTF8')"
                            " FROM generate_series(%s, %s) AS i", (lo, lo + 4999))
        harness.wait_all_sent(self.db, timeout=120, relay=relay)
        took = time.monotonic() - started
        # The last batches' removals wait in the relay, and the gauge shows them.
        waiting = harness.metric(harness.metrics_text(relay),
                                 "outbox_relay_dedup_removals_waiting_bytes")
        try:  # the relay removes the records publish_timeout (5 s) after their COMMIT
            wait_until(lambda: harness.unretired_dedup_records(self.r, 5000) == [], timeout=10,
                       interval=0.2)
        except AssertionError:
            pass
        stop.set()
        sampler.join(5)
        unretired = len(harness.unretired_dedup_records(self.r, 5000))
        # A record is removed publish_timeout (5 s) after its batch's commit;
        # the bound leaves room for a second, as before when records expired.
        retired_bound = 2 * harness.max_sent_within(self.db, 5 + 1)
        wait_until(lambda: count_dedup_records(self.r) == 0, timeout=10, interval=0.2,
                   relay=relay, message="the retired records to expire")
        print(f"dedup records not retired after relaying {rows} rows: {unretired}; most at"
              f" once while relaying: {peak[0]} (batch_size 500, two batches in flight, and"
              f" twice the rows marked sent within any 6 s: {retired_bound}); relayed in"
              f" {took:.1f}s",
              file=sys.stderr, flush=True)
        self.assertEqual(unretired, 0, "dedup records of committed batches were not retired")
        self.assertGreater(waiting, 0, "no removal waited after the last commit")
        self.assertEqual(harness.metric(harness.metrics_text(relay),
                                        "outbox_relay_dedup_removals_waiting_bytes"), 0,
                         "removals still waiting after publish_timeout")
        # pipeline (on by default): a batch publishes while the one before it
        # commits, so the records of two batches can exist at once, beside
        # those retired within the last publish_timeout.
        self.assertLessEqual(peak[0], 2 * 500 + retired_bound,
                             "more dedup records than two batches in flight and those retired")
        fig = self.verifier().report("dedup-bounded")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, rows)

    def test_removals_past_the_cap_go_to_redis_a_slice_at_a_time(self):
        """Past RELAY_RETIRE_QUEUE_MAX (16 MiB) of waiting removals the relay
        hands the oldest to Redis as expiries at their due time
        (relay/retire.h). It hands over 1 MiB at a time: a hand-off
        is written to the Redis client's output buffer at once, and 8 MiB of
        it (half the queue) raised the relay's peak resident memory by 8-14
        MiB (docs/PERFORMANCE.md, "The peak RSS of long drains"). The records
        handed over still go by their due time, and nothing is lost."""
        cap = 16 << 20
        # The longest keys make few rows fill the queue: about 320 bytes a
        # removal, 16 MiB in some 53,000 rows; publish_timeout keeps them
        # all waiting while the backlog drains.
        relay = self.start_relay(publish_timeout="60s", stream_prefix=LONG_PREFIX)
        rows, topic = 70_000, "t" * 200
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    samples.append(harness.metric(harness.metrics_text(relay),
                                                  "outbox_relay_dedup_removals_waiting_bytes"))
                except OSError:
                    pass
                time.sleep(0.01)
        sampler = threading.Thread(target=sample, daemon=True)
        self.addCleanup(stop.set)
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT %s, convert_to('row ' || i, 'UTF8')"
                        " FROM generate_series(1, %s) AS i", (topic, rows))
        started = time.monotonic()
        sampler.start()
        # Done well within publish_timeout: no removal falls due meanwhile.
        harness.wait_all_sent(self.db, timeout=50, relay=relay)
        took = time.monotonic() - started
        time.sleep(0.2)
        stop.set()
        sampler.join(5)
        seen = [v for v in samples if v is not None]
        full = next((i for i, v in enumerate(seen) if v > cap - (2 << 20)), None)
        print(f"{rows} rows with {len(LONG_PREFIX + topic)}-byte stream names in {took:.1f}s:"
              f" waiting removals peaked at {max(seen) / 2**20:.2f} MiB, after the cap"
              f" {min(seen[full:]) / 2**20 if full is not None else 0:.2f} MiB at the least"
              f" ({len(seen)} samples)", file=sys.stderr, flush=True)
        self.assertIsNotNone(full, "the waiting removals never came near the cap")
        self.assertLessEqual(max(seen), cap, "more removals waiting than the cap")
        self.assertGreaterEqual(min(seen[full:]), cap - (2 << 20),
                                "more than 1 MiB of removals handed to Redis at once")
        # Handed over: the oldest records expire by their due time (within
        # publish_timeout); the rest still wait in the relay.
        ttls = harness.dedup_records(self.r, match=f"{{{LONG_PREFIX + topic}}}:dedup:*")
        handed = [t for t in ttls.values() if 0 < t <= 60_000]
        self.assertGreater(len(handed), 0, "no record was handed to Redis to expire")
        self.assertEqual(len(ttls), rows, "a record went missing")
        fig = self.verifier(stream_prefix=LONG_PREFIX).report("removals past the cap")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, rows)

    def test_a_removal_larger_than_a_chunk_after_the_queue_emptied(self):
        """The waiting removals are kept in 1 MiB chunks, and an emptied queue
        keeps its chunk for the next. One batch's UNLINK can be larger than a
        chunk: 10,000 rows of one stream with a long name. Pushed into the
        emptied queue, it must still be sent at its due time, and every
        removal after it too: a queue that stopped there would keep every
        later record for its whole dedup_ttl and grow the relay's memory."""
        relay = self.start_relay(publish_timeout="1s", batch_size=10_000)
        topic = "t" * 120

        def waiting():
            return harness.metric(harness.metrics_text(relay),
                                  "outbox_relay_dedup_removals_waiting_bytes")

        def put(n):
            with self.db.cursor() as cur:
                cur.execute("INSERT INTO outbox.messages (topic, payload)"
                            " SELECT %s, convert_to('row ' || i, 'UTF8')"
                            " FROM generate_series(1, %s) AS i", (topic, n))
        put(10)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        wait_until(lambda: waiting() == 0, timeout=10, interval=0.1, relay=relay,
                   message="the first batch's removal to be sent")
        put(10_000)
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        put(50)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        # Every removal is due 1 s after its commit.
        try:
            wait_until(lambda: waiting() == 0 and count_dedup_records(self.r) == 0,
                       timeout=10, interval=0.2)
        except AssertionError:
            pass
        left, records = waiting(), count_dedup_records(self.r)
        print(f"a {len(topic)}-byte stream name, batches of 10, 10,000 and 50 rows:"
              f" {left} bytes of removals waiting and {records} records left after"
              f" publish_timeout", file=sys.stderr, flush=True)
        self.assertEqual(left, 0, "removals still waiting after publish_timeout")
        self.assertEqual(records, 0, "dedup records outlived publish_timeout")
        fig = self.verifier().report("a large removal")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, 10_060)

    def test_removals_due_together_go_a_slice_at_a_time(self):
        """Removals fall due together when the relay could not send them as
        each fell due: Redis was away, or the relay was frozen. Up to the
        whole queue (16 MiB) can then be due. They go out RELAY_RETIRE_HANDOFF
        (1 MiB) at a time, each slice once the one before is answered, never
        all at once through the Redis client's output buffer (docs/DESIGN.md,
        "The publish deadline"). Here the relay is frozen past
        publish_timeout, and Redis holds write commands unanswered while its
        clients are paused for writes: only the first slice may leave."""
        relay = self.start_relay(publish_timeout="3s", stream_prefix=LONG_PREFIX)
        rows, topic = 12_000, "t" * 200  # about 315 bytes a removal: 3.6 MiB

        def waiting():
            return harness.metric(harness.metrics_text(relay),
                                  "outbox_relay_dedup_removals_waiting_bytes")
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload)"
                        " SELECT %s, convert_to('row ' || i, 'UTF8')"
                        " FROM generate_series(1, %s) AS i", (topic, rows))
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        held = waiting()
        relay.kill(signal.SIGSTOP)
        self.addCleanup(relay.kill, signal.SIGCONT)
        self.r.execute_command("CLIENT", "PAUSE", 10000, "WRITE")
        self.addCleanup(self.r.execute_command, "CLIENT", "UNPAUSE")
        time.sleep(3.5)  # every removal is due 3 s after its commit
        relay.kill(signal.SIGCONT)
        time.sleep(1.5)
        paused = waiting()
        self.r.execute_command("CLIENT", "UNPAUSE")
        wait_until(lambda: waiting() == 0 and count_dedup_records(self.r) == 0, timeout=20,
                   interval=0.2, relay=relay, message="every removal to be sent and answered")
        print(f"{held / 2**20:.2f} MiB of removals waiting when the relay froze,"
              f" {paused / 2**20:.2f} MiB still waiting once all were due and the relay ran"
              f" again with Redis's writes paused", file=sys.stderr, flush=True)
        self.assertGreater(held, 3 << 20, "fewer removals waited than the test needs")
        self.assertGreaterEqual(paused, held - (1 << 20),
                                "more than a slice of removals sent before any was answered")
        fig = self.verifier(stream_prefix=LONG_PREFIX).report("removals a slice at a time")
        fig.assert_exactly_once(self)
        self.assertEqual(fig.committed, rows)

    def test_memory_per_record(self):
        self.start_relay()
        n = 10_000
        payload = b"p" * 200
        created = "2026-11-30T11:43:48.001535Z"

        def fields(mid, i):
            return ["id", mid, "topic", "orders", "payload", payload, "created_at", created,
                    "outbox_id", str(i)]
        # Both streams exist first, so only entries and records are counted.
        self.r.xadd("orders", {"warm": "up"})
        self.r.xadd("plain", {"warm": "up"})

        m0 = used_memory(self.r)
        ids = [str(uuid.uuid4()) for _ in range(n)]
        for lo in range(0, n, 1000):
            pipe = self.r.pipeline(transaction=False)
            for i in range(lo, lo + 1000):
                pipe.fcall(FUNCTION, 2, "orders", dedup_key("orders", ids[i]), 86400000,
                           FAR_FUTURE_MS, *fields(ids[i], i))
            pipe.execute()
        m1 = used_memory(self.r)
        for lo in range(0, n, 1000):
            pipe = self.r.pipeline(transaction=False)
            for i in range(lo, lo + 1000):
                pipe.xadd("plain", dict(zip(fields(ids[i], i)[::2], fields(ids[i], i)[1::2])))
            pipe.execute()
        m2 = used_memory(self.r)
        self.assertEqual(count_dedup_records(self.r), n)
        self.assertEqual(self.r.xlen("orders"), self.r.xlen("plain"))
        sample = self.r.memory_usage(dedup_key("orders", ids[0]))
        for lo in range(0, n, 1000):
            self.r.unlink(*[dedup_key("orders", m) for m in ids[lo:lo + 1000]])
        m3 = used_memory(self.r)

        with_record = (m1 - m0) / n
        entry_only = (m2 - m1) / n
        per_record = with_record - entry_only
        freed = (m1 - m3 + (m2 - m1)) / n  # what UNLINK of the records gave back
        print(f"dedup record memory: {per_record:.0f} bytes per record"
              f" (FCALL with record {with_record:.0f} B - plain XADD {entry_only:.0f} B;"
              f" freed by UNLINK {freed:.0f} B; MEMORY USAGE of one record {sample} B;"
              f" README says about {README_BYTES_PER_RECORD} B)", file=sys.stderr, flush=True)
        self.assertGreater(per_record, 0)
        self.assertLess(per_record, 2 * README_BYTES_PER_RECORD,
                        "a dedup record costs far more than the README says")

    # (d)
    def pending_rows(self, ids):
        """The rows as the relay's claim formats them."""
        with self.db.cursor() as cur:
            cur.execute("SELECT id, message_id::text, topic, partition_key, payload,"
                        " to_char(created_at AT TIME ZONE 'UTC',"
                        "  'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
                        " FROM outbox.messages WHERE message_id = ANY(%s::uuid[]) ORDER BY id",
                        (ids,))
            return cur.fetchall()

    def test_row_published_before_a_crash_is_not_published_again(self):
        ids = [insert(self.db, "orders", b"row %d" % i, key=f"k{i}") for i in range(4)]
        ids.append(insert(self.db, "billing", b"row 4"))
        # An earlier run loaded the function, published rows 1, 4 and 5 and crashed
        # before its COMMIT. Rather than race a kill, we do what it did: a relay loads
        # the function (the rows are held back from it by retry_at), then we FCALL
        # exactly as the relay builds the command.
        with self.db.cursor() as cur:
            cur.execute("UPDATE outbox.messages SET retry_at = now() + interval '1 hour'")
        loader = self.start_relay()
        self.assertEqual(loader.terminate(), 0)
        with self.db.cursor() as cur:
            cur.execute("UPDATE outbox.messages SET retry_at = NULL")
        ours = {}
        for oid, mid, topic, key, payload, created in self.pending_rows(ids):
            if oid in (2, 3):
                continue
            fields = ["id", mid, "topic", topic]
            if key is not None:
                fields += ["key", key]
            fields += ["payload", bytes(payload), "created_at", created, "outbox_id", str(oid)]
            ours[mid] = self.fcall(topic, mid, *fields, ttl=86400000)
        self.assertEqual(harness.count_unsent(self.db), 5)
        self.r.config_resetstat()

        relay = self.start_relay()
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        found = harness.entries_by_message_id(self.r)
        for mid in ids:
            self.assertEqual(len(found.get(mid, [])), 1, f"entries of {mid}")
        for mid, entry_id in ours.items():
            self.assertEqual(found[mid][0][1], entry_id,
                             "the row published before the crash keeps its first entry")
        self.assertEqual(fcall_calls(self.r), 5, "the relay published every row once more")
        self.verifier().report("published-before-crash").assert_exactly_once(self)
        wait_until(lambda: harness.unretired_dedup_records(self.r, 5000) == [], timeout=10,
                   message="the records of the committed batch to be retired")

    def install_commit_failure(self, how):
        """A deferred trigger that fails the first COMMIT that marks a row sent."""
        action = {
            "error": "RAISE EXCEPTION 'test: this COMMIT is refused once';",
            "connection lost": "PERFORM pg_terminate_backend(pg_backend_pid());",
        }[how]
        with self.db.cursor() as cur:
            cur.execute("DROP SEQUENCE IF EXISTS public.commit_failures;"
                        " CREATE SEQUENCE public.commit_failures")
            cur.execute(f"""
                CREATE OR REPLACE FUNCTION public.fail_first_commit() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                  IF NEW.sent_at IS NOT NULL AND OLD.sent_at IS NULL
                     AND nextval('public.commit_failures') = 1 THEN
                    {action}
                  END IF;
                  RETURN NULL;
                END $$""")
            cur.execute("DROP TRIGGER IF EXISTS fail_first_commit ON outbox.messages;"
                        " CREATE CONSTRAINT TRIGGER fail_first_commit"
                        " AFTER UPDATE ON outbox.messages"
                        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
                        " EXECUTE FUNCTION public.fail_first_commit()")

        def drop():
            with self.db.cursor() as cur:
                cur.execute("DROP TRIGGER IF EXISTS fail_first_commit ON outbox.messages")
        self.addCleanup(drop)

    def test_commit_failure_after_publish_adds_no_second_copy(self):
        for how in ("error", "connection lost"):
            with self.subTest(how=how):
                harness.reset(self.db, self.r)
                self.install_commit_failure(how)
                conn = self.pg.connect(autocommit=False)
                self.addCleanup(conn.close)
                n = 50
                harness.insert_many(conn, [(("orders", "billing")[i % 2], b"row %d" % i)
                                           for i in range(n)])
                self.r.config_resetstat()
                relay = self.start_relay()
                harness.wait_all_sent(self.db, timeout=30, relay=relay)
                self.assertEqual(scalar(self.db, "SELECT last_value FROM public.commit_failures"),
                                 n + 1, "the first COMMIT was refused, the second went through")
                relay.wait_for_log(r"^\S+ WARNING relay: .*marking the batch sent failed"
                                   + (".*commit outcome unknown" if how == "connection lost"
                                      else ""), timeout=5)
                self.assertEqual(fcall_calls(self.r), 2 * n,
                                 "every row of the batch was published twice")
                self.verifier().report(f"commit-failed({how})").assert_exactly_once(self)
                wait_until(lambda: harness.unretired_dedup_records(self.r, 5000) == [],
                           timeout=10, message="the records of the committed batch to be retired")
                self.assertEqual(relay.terminate(), 0)


if __name__ == "__main__":
    unittest.main()
