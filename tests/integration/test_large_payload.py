"""Rows over max_payload_bytes cost the relay no memory (docs/DESIGN.md P4, P5).

Promises tested, with the default max_payload_bytes (1 MiB) and batch_size:
- five rows of 100 MiB each, committed in one transaction between good rows
  (one of them exactly 1 MiB), never reach the relay: its peak resident memory
  (VmHWM in /proc/<pid>/status) stays under RSS_BOUND while it claims them, so
  the claim does not transfer a payload over the limit;
- every good row is published once, in id order, in the batch that held
  the big ones (one tick: one entry id time);
- each big row is quarantined by that batch, no batch failing and being read
  again, with an error in outbox.quarantine that names its size and the limit
  and says what to do, and the relay log names the row and the quarantine.

The big payloads are made by PostgreSQL (repeat), so this test never holds
one in memory; PostgreSQL compresses them when it stores them.

Under AddressSanitizer the relay runs with the allocator's quarantine off (as
in test_resources.py), so that the peak measures the relay rather than freed
memory the sanitizer holds back. Its shadow memory and allocator still add to
the resident set (about 24 MiB against 13 MiB for a RelWithDebInfo build, with
ASan and UBSan in a Debug build): both stay far below the bound, and fetching
the big rows takes either build past 600 MiB, so the bound is the same.
"""

import os
import re
import sys
import unittest

from testkit import harness
from testkit.harness import wait_until

harness.require_relay()
harness.set_deadline(300)

MIB = 1024 * 1024
MAX_PAYLOAD = MIB            # the default max_payload_bytes
BIG = 100 * MIB
BIG_ROWS = 5
GOOD_BETWEEN = 10            # good rows before each big row, and after the last
RSS_BOUND_KB = 64 * 1024
RELAY_FLAGS = dict(poll_interval="200ms")


def proc_status_kb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def sanitized():
    """Whether the relay binary is built with AddressSanitizer."""
    with open(harness.relay_binary(), "rb") as f:
        return b"__asan_init" in f.read()


def relay_env():
    """Freed memory waits in ASan's quarantine (up to 256 MB) before reuse, so the
    peak RSS would measure the sanitizer; turn that off as test_resources does."""
    if not sanitized():
        return None
    options = os.environ.get("ASAN_OPTIONS", "")
    return {"ASAN_OPTIONS": (options + ":" if options else "") + "quarantine_size_mb=0"}


class LargePayloadTest(harness.ServerTestCase):

    def insert_rows(self):
        """One transaction: GOOD_BETWEEN good rows, a big row, ..., GOOD_BETWEEN good rows.
        Returns ([good ids in id order], [big ids])."""
        conn = self.pg.connect(autocommit=False)
        self.addCleanup(conn.close)
        good, big = [], []
        with conn.cursor() as cur:
            def good_rows(n, size=None):
                for _ in range(n):
                    payload = (b"good %d" % len(good)) if size is None else b"g" * size
                    cur.execute("INSERT INTO outbox.messages (topic, payload) VALUES ('orders', %s)"
                                " RETURNING id", (payload,))
                    good.append(cur.fetchone()[0])
            for i in range(BIG_ROWS):
                good_rows(GOOD_BETWEEN - 1)
                good_rows(1, size=MAX_PAYLOAD if i == 0 else None)  # the limit itself goes
                cur.execute("INSERT INTO outbox.messages (topic, payload)"
                            " VALUES ('orders', convert_to(repeat('x', %s), 'UTF8')) RETURNING id",
                            (BIG,))
                big.append(cur.fetchone()[0])
            good_rows(GOOD_BETWEEN)
        conn.commit()
        return good, big

    def rows(self, ids):
        """{id: (sent, quarantine error or None)}."""
        with self.db.cursor() as cur:
            cur.execute("SELECT m.id, q.id IS NULL AND NOT EXISTS (SELECT FROM outbox.unsent AS u"
                        " WHERE u.id = m.id), q.error FROM outbox.messages AS m"
                        " LEFT JOIN outbox.quarantine AS q ON q.id = m.id"
                        " WHERE m.id = ANY(%s)", (list(ids),))
            return {r[0]: r[1:] for r in cur.fetchall()}

    def test_big_rows_are_never_fetched_and_quarantined_at_once(self):
        good, big = self.insert_rows()
        with self.db.cursor() as cur:
            cur.execute("SELECT sum(octet_length(payload)), sum(pg_column_size(payload))"
                        " FROM outbox.messages WHERE id = ANY(%s)", (big,))
            raw, stored = cur.fetchone()
        print(f"{BIG_ROWS} rows of {BIG} bytes committed among {len(good)} good rows"
              f" ({raw} bytes of payload, {stored} bytes stored)", flush=True)

        relay = self.relay(env=relay_env(), **RELAY_FLAGS)

        def claimed():
            got = self.rows(good + big)
            return all(got[i][0] for i in good) and all(got[i][1] for i in big)
        wait_until(claimed, timeout=120, interval=0.2, relay=relay,
                   message="the good rows sent and every big row quarantined")
        hwm = proc_status_kb(relay.pid, "VmHWM")
        rss = proc_status_kb(relay.pid, "VmRSS")
        print(f"relay after claiming {BIG_ROWS} rows of {BIG // MIB} MiB: VmHWM {hwm} kB,"
              f" VmRSS {rss} kB (bound {RSS_BOUND_KB} kB"
              f"{', AddressSanitizer' if sanitized() else ''})", file=sys.stderr, flush=True)
        self.assertLess(hwm, RSS_BOUND_KB, "the relay's peak RSS: were the big payloads fetched?\n"
                        + relay.log_tail())

        # The good rows: each once, in id order, all in the batch that met the big ones.
        entries = harness.stream_entries(self.r, "orders")
        self.assertEqual([int(f[b"outbox_id"]) for _, f in entries], good,
                         "the good rows in the stream, in id order, each once")
        sizes = {len(f[b"payload"]) for _, f in entries}
        self.assertIn(MAX_PAYLOAD, sizes, "a payload of exactly max_payload_bytes is published")
        got = self.rows(good + big)
        self.assertEqual(len({eid.split("-")[0] for eid, _ in entries}), 1,
                         "the good rows took more than one batch")

        # The big rows: quarantined by that batch, none failing and read
        # again, saying why and what to do.
        text = harness.metrics_text(relay)
        failed = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^outbox_relay_publish_errors_total\{kind="([^"]+)"\} (\S+)$', text, re.MULTILINE)
            if m.group(1) != "row"}
        self.assertTrue(failed, "the failed-batch counters are on /metrics")
        self.assertEqual(sum(failed.values()), 0, f"a batch failed and was read again: {failed}")
        self.assertEqual(harness.metric(text, "outbox_relay_rows_quarantined_total"), BIG_ROWS)
        log = relay.log()
        for oid in big:
            sent, error = got[oid]
            self.assertFalse(sent, f"big row {oid} counted as sent")
            self.assertIsNotNone(error, f"big row {oid} not quarantined")
            for phrase in (f"payload of {BIG} bytes", f"max_payload_bytes ({MAX_PAYLOAD})",
                           "raise max_payload_bytes", "re-queue"):
                self.assertIn(phrase, error or "", f"quarantine error of big row {oid}")
            self.assertTrue(re.search(rf"^\S+ ERROR \w+: row id={oid} .*quarantined.*"
                                      rf"payload of {BIG} bytes", log, re.MULTILINE),
                            f"no ERROR line names big row {oid} and its quarantine\n"
                            + relay.log_tail())
        print(f"big row {big[0]}: {got[big[0]][1]}", flush=True)
        self.assertEqual(harness.count_unsent(self.db), 0)
        self.assertTrue(relay.alive(), relay.log_tail())


if __name__ == "__main__":
    unittest.main()
