"""Bounded memory whatever the backlog (docs/DESIGN.md P5, "Batches from snapshots").

Promise tested: the relay's peak resident memory (VmHWM in /proc/<pid>/status)
while draining a backlog of BIG_ROWS pending rows stays within 10 % of its peak
while draining 100,000 rows, plus 3 MiB of chunks. A batch is as large as what
committed before its tick (here the whole backlog), but it is read in chunks
of batch_size rows, the next chunk read while one publishes: memory holds at
most two chunks, whatever the batch. Each figure comes from a fresh relay
process started on a full outbox (200-byte payloads, 3 topics, filled with
INSERT ... SELECT FROM generate_series) and read once every row is sent.
Redis runs with appendonly no, so the drain is not paced by the disk.

BIG_ROWS is 1,000,000 unless OUTBOX_RELAY_RSS_ROWS says otherwise.

What is in flight is bounded too, and counted exactly by Redis:
- every row is appended once: XLEN over the streams, and Redis' count of
  XADD calls, both equal the number of rows (no fault here: no batch is read
  again);
- a stream's rows go in MULTI/EXEC calls of at most 64 rows (RELAY_CALL_ROWS)
  that never span two chunks, so the EXEC calls are at least rows / 64, and
  at least (stream count) calls per chunk of batch_size rows;
- Redis holds nothing but the streams: no record per message, sampled with
  DBSIZE (O(1)) every few milliseconds during the drain.
"""

import contextlib
import os
import sys
import threading
import time
import unittest

from testkit import harness
from testkit.harness import scalar

harness.require_relay()
harness.set_deadline(840)

SMALL_ROWS = 100_000
BIG_ROWS = int(os.environ.get("OUTBOX_RELAY_RSS_ROWS") or 1_000_000)
BATCH_SIZE = 500
TOPICS = ("orders", "billing", "mail")
PAYLOAD_BYTES = 200
FILL_CHUNK = 250_000
CALL_ROWS = 64  # relay/batch.h RELAY_CALL_ROWS
# stream_retention = 0: no trimming during the drain.
RELAY_FLAGS = dict(poll_interval="200ms", batch_size=BATCH_SIZE, stream_retention="0",
                   publish_timeout="2s")


def proc_status_kb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


class ResourcesTest(harness.ServerTestCase):
    redis_options = dict(appendonly=False)

    def fill(self, rows):
        started = time.monotonic()
        for lo in range(1, rows + 1, FILL_CHUNK):
            hi = min(rows, lo + FILL_CHUNK - 1)
            with self.db.cursor() as cur:
                cur.execute(
                    "INSERT INTO outbox.messages (topic, partition_key, payload)"
                    " SELECT (%s::text[])[1 + i %% 3], 'k' || (i %% 1000),"
                    "  convert_to(rpad(i::text || ':', %s, 'x'), 'UTF8')"
                    " FROM generate_series(%s, %s) AS i", (list(TOPICS), PAYLOAD_BYTES, lo, hi))
        with self.db.cursor() as cur:
            cur.execute("ANALYZE outbox.messages")
        return time.monotonic() - started

    @staticmethod
    def relay_env():
        """Under AddressSanitizer, freed memory waits in a quarantine of up to
        256 MB before reuse, so peak RSS would measure the sanitizer, not the
        relay. The sanitizer pass still runs this test for memory safety, with
        the quarantine off so the RSS figures keep their meaning."""
        with open(harness.relay_binary(), "rb") as f:
            instrumented = b"__asan_init" in f.read()
        if not instrumented:
            return None
        options = os.environ.get("ASAN_OPTIONS", "")
        return {"ASAN_OPTIONS": (options + ":" if options else "") + "quarantine_size_mb=0"}

    def drain(self, rows):
        """A fresh relay drains `rows` pending rows; returns its figures."""
        self.r.config_resetstat()
        peak_records = [0]
        stop = threading.Event()

        def sample():
            with contextlib.closing(self.redis.client()) as c:
                while not stop.is_set():
                    peak_records[0] = max(peak_records[0], c.dbsize() - len(TOPICS))
                    time.sleep(0.002)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        self.addCleanup(stop.set)

        started = time.monotonic()
        with harness.Relay(self.pg, self.redis, env=self.relay_env(), **RELAY_FLAGS) as relay:
            harness.wait_until(lambda: harness.count_unsent(self.db) == 0,
                               timeout=max(60, rows / 2000), interval=0.5, relay=relay,
                               message=f"{rows} rows to be sent")
            took = time.monotonic() - started
            hwm = proc_status_kb(relay.pid, "VmHWM")
            rss = proc_status_kb(relay.pid, "VmRSS")
            self.assertEqual(relay.terminate(), 0, relay.log_tail())
            problems = harness.problem_lines(relay.log(), "relay")
        stop.set()
        sampler.join(5)

        published = sum(self.r.xlen(t) for t in TOPICS)
        stats = self.r.info("commandstats")
        xadds = stats.get("cmdstat_xadd", {}).get("calls", 0)
        execs = stats.get("cmdstat_exec", {}).get("calls", 0)
        chunks = -(-rows // BATCH_SIZE)
        print(f"{rows} rows: drained in {took:.1f}s ({rows / took:.0f} rows/s), VmHWM {hwm} kB,"
              f" VmRSS {rss} kB, {xadds} XADDs in {execs} EXECs (at least {chunks} chunks),"
              f" at most {peak_records[0]} keys beside the streams",
              file=sys.stderr, flush=True)
        self.assertEqual(problems, [], "the relay warned while draining")
        self.assertEqual(published, rows, "entries in the streams")
        self.assertEqual(xadds, rows, "rows Redis was asked to append: every row once")
        self.assertEqual(harness.count_unsent(self.db), 0)
        self.assertGreaterEqual(execs, -(-rows // CALL_ROWS), "a call of more than 64 rows")
        self.assertGreaterEqual(execs, chunks * len(TOPICS),
                                "fewer calls than chunks of batch_size rows would make")
        self.assertEqual(peak_records[0], 0, "Redis held keys beside the streams")
        return hwm, took

    def test_peak_rss_does_not_grow_with_the_backlog(self):
        self.fill(SMALL_ROWS)
        small, small_took = self.drain(SMALL_ROWS)
        harness.reset(self.db, self.r)

        fill_big = self.fill(BIG_ROWS)
        print(f"filled {BIG_ROWS} rows in {fill_big:.1f}s", file=sys.stderr, flush=True)
        big, big_took = self.drain(BIG_ROWS)

        # 3 MiB for the chunks' buffers (libpq's result, hiredis' output),
        # which the allocator may place differently from one run to the next;
        # the rest of the relay's memory must not grow at all.
        allowance = 3 * 1024
        ratio = big / small
        print(f"peak RSS: {SMALL_ROWS} rows {small} kB, {BIG_ROWS} rows {big} kB,"
              f" ratio {ratio:.3f}; allowed {allowance} kB beside 1.10 x the small drain's peak",
              file=sys.stderr, flush=True)
        self.assertLessEqual(big, 1.10 * small + allowance,
                             f"peak RSS grew with the backlog: {small} kB for {SMALL_ROWS} rows,"
                             f" {big} kB for {BIG_ROWS}")


if __name__ == "__main__":
    unittest.main()
