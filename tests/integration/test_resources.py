"""Bounded memory whatever the backlog (docs/DESIGN.md P5).

Promise tested: the relay's peak resident memory (VmHWM in /proc/<pid>/status)
while draining a backlog of BIG_ROWS pending rows stays within 10 % of its peak
while draining 100,000 rows, beside the removals of dedup records that wait
publish_timeout after their commit (relay/retire.h). Those depend on
the rate, not on the backlog: the big drain is allowed 64 bytes for each row
it committed within its busiest publish_timeout, plus 3 MiB of chunks. Both
drains run with publish_timeout 2 s, so that the small one lasts longer than
that and the allowance stays small. The small backlog is also large enough to
reach the steady state of two lanes in flight (with 1,000 rows, two batches,
whether the second was claimed while the first published was up to the
scheduler, and the peak of the run without that overlap was 0.9 MiB lower).
Each figure comes from a fresh relay process
started on a full outbox (200-byte payloads, 3 topics, filled with INSERT ...
SELECT FROM generate_series) and read once every row is sent. Redis runs with
appendonly no, so the drain is not paced by the disk.

BIG_ROWS is 1,000,000 unless OUTBOX_RELAY_RSS_ROWS says otherwise (on a
2-core machine the whole file takes about two minutes with 1,000,000 rows).

Commands in flight are bounded too. The peak RSS covers the relay's own
buffers (hiredis and libpq), so this file adds one exact measurement of what
is in flight, plus one sampled from Redis:
- rows per claim transaction: the relay publishes only the rows a claim
  transaction holds, one batch at a time (with pipeline on, the next batch is
  claimed on a second connection while this one publishes, but waits for
  every reply of this one before its own publishes start), and marks them sent
  in that same transaction. The row version the mark writes carries that
  transaction's id (xmin), the same for every row of one batch and different
  between batches, whatever the clock says (two batches marked by two
  backends woken in the same microsecond share a sent_at). The largest group
  of rows sharing one xmin is therefore exactly the largest number of publish
  commands the relay had in flight, taken from the table after the fact, with
  no sampling and no timing: it must be at most batch_size (and, with a
  backlog, equal to it);
- dedup records in Redis, sampled with DBSIZE (O(1)) every few milliseconds
  during the drain: every executed publish leaves one record until its batch
  is committed and the records dropped. One batch can publish while the one
  before it commits, so they never exceed two batches' worth, 2 x batch_size.
Every row is published once: XLEN over the streams and Redis' count of FCALL
calls both equal the number of rows.
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
# stream_retention = 0: the trim function's FCALLs would count among the
# publishes counted here.
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

        per_tx = scalar(self.db, "SELECT max(n) FROM (SELECT count(*) AS n FROM outbox.messages"
                                 " GROUP BY xmin::text) AS batches")
        batches = scalar(self.db, "SELECT count(DISTINCT xmin::text) FROM outbox.messages")
        stamps = scalar(self.db, "SELECT count(DISTINCT sent_at) FROM outbox.messages")
        published = sum(self.r.xlen(t) for t in TOPICS)
        fcalls = harness.publish_calls(self.r)
        # Every batch committed (no fault here), so every dedup record left
        # must be retired: the drain at SIGTERM leaves the records whose
        # removal waits to expire within publish_timeout (2 s).
        records_left = len(harness.unretired_dedup_records(self.r, 2000))
        print(f"{rows} rows: dedup records not retired after the drain: {records_left}",
              file=sys.stderr, flush=True)
        self.assertEqual(records_left, 0, "dedup records of committed batches were not retired")
        # Retired records live on for publish_timeout after their commit, and
        # Redis reclaims expired keys in the background (its active expiry
        # lets some stay on): up to twice those committed within 3 s.
        retired_bound = 2 * harness.max_sent_within(self.db, 2 + 1)
        print(f"{rows} rows: drained in {took:.1f}s ({rows / took:.0f} rows/s), VmHWM {hwm} kB,"
              f" VmRSS {rss} kB, {batches} batches ({stamps} distinct sent_at), at most {per_tx}"
              f" rows per claim transaction, at most {peak_records[0]} dedup records at once"
              f" (twice the rows marked sent within any 3 s: {retired_bound})",
              file=sys.stderr, flush=True)
        self.assertEqual(problems, [], "the relay warned while draining")
        self.assertEqual(published, rows, "entries in the streams")
        self.assertEqual(fcalls, rows, "rows the publish function took: every row once")
        self.assertEqual(harness.count_unsent(self.db), 0)
        self.assertLessEqual(per_tx, BATCH_SIZE, "more rows in flight than batch_size")
        self.assertEqual(per_tx, min(rows, BATCH_SIZE), "a backlog is claimed in full batches")
        self.assertLessEqual(peak_records[0], 2 * BATCH_SIZE + retired_bound,
                             "more dedup records than two batches (one committing, one"
                             " publishing) and those retired within publish_timeout")
        # The removals of dedup records waiting publish_timeout (2 s) after
        # their commit: the most rows committed within any 2 s of this drain.
        return hwm, took, int(harness.max_sent_within(self.db, 2))

    def test_peak_rss_does_not_grow_with_the_backlog(self):
        self.fill(SMALL_ROWS)
        small, small_took, _ = self.drain(SMALL_ROWS)
        harness.reset(self.db, self.r)

        fill_big = self.fill(BIG_ROWS)
        print(f"filled {BIG_ROWS} rows in {fill_big:.1f}s", file=sys.stderr, flush=True)
        big, big_took, waiting = self.drain(BIG_ROWS)

        # What the removals waiting in the big drain may add beyond those of the
        # small one: 64 bytes a record (a 58-byte key in the protocol, and the
        # command's share of its header), in chunks of 1 MiB, two of them kept
        # spare (relay/retire.h). It depends on the rate, not on the
        # backlog; the rest of the relay's memory must not grow at all.
        allowance = (waiting * 64 + 3 * 1024 * 1024) // 1024
        ratio = big / small
        print(f"peak RSS: {SMALL_ROWS} rows {small} kB, {BIG_ROWS} rows {big} kB,"
              f" ratio {ratio:.3f}; at most {waiting} dedup-record removals waiting in the big"
              f" drain, allowed {allowance} kB beside 1.10 x the small drain's peak",
              file=sys.stderr, flush=True)
        self.assertLessEqual(big, 1.10 * small + allowance,
                             f"peak RSS grew with the backlog: {small} kB for {SMALL_ROWS} rows,"
                             f" {big} kB for {BIG_ROWS}")


if __name__ == "__main__":
    unittest.main()
