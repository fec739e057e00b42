"""Crash safety: SIGKILL at random moments loses nothing and doubles nothing.

Promises tested (docs/DESIGN.md P1 and P2):
- 100,000 rows committed by 4 concurrent producers (transactions of 1..20
  rows, 3 topics, payloads of 0..300 random bytes) while the relay is killed
  with SIGKILL and restarted at least 5 times at random moments: at the end
  every row is sent and in its stream (lost=0, sent_but_absent=0, unsent=0);
- the publish dedup function keeps a batch that was published but not
  committed before the kill from appearing twice (duplicates=0).
Redis runs with appendonly yes + appendfsync always, so it keeps all it
acknowledged. OUTBOX_RELAY_TEST_SEED=<n> replays one random schedule.
"""

import os
import random
import sys
import time
import unittest

from testkit import harness
from testkit.harness import count_unsent, wait_until

harness.require_relay()
harness.set_deadline(600)

ROWS = 100_000
PRODUCERS = 4
TOPICS = ("orders", "billing.invoices", "mail-out")
MIN_KILLS = 5
# Producers are paced so that the kills fall while rows are being committed.
PRODUCE_SECONDS = 20
RELAY_FLAGS = dict(batch_size=500, poll_interval="200ms", reconnect_min="50ms",
                   reconnect_max="500ms")


class KillTest(harness.ServerTestCase):
    redis_options = dict(appendonly=True, appendfsync="always")

    def test_sigkill_at_random_moments(self):
        seed = int(os.environ.get("OUTBOX_RELAY_TEST_SEED") or random.randrange(1 << 30))
        print(f"seed={seed}", file=sys.stderr, flush=True)
        rnd = random.Random(seed)
        producers = [
            harness.Producer(self.pg, rows=ROWS // PRODUCERS, topics=TOPICS, tx_rows=(1, 20),
                             payload_bytes=(0, 300), rate=ROWS / PRODUCERS / PRODUCE_SECONDS,
                             seed=seed + i, name=f"producer-{i}")
            for i in range(PRODUCERS)]
        for p in producers:
            p.start()
            self.addCleanup(p.stop)

        kills = 0
        relay = self.enterContext(harness.Relay(self.pg, self.redis, **RELAY_FLAGS))
        while any(p.is_alive() for p in producers) or kills < MIN_KILLS:
            time.sleep(rnd.uniform(0.2, 2.5))  # a random moment in the relay's life
            self.assertTrue(relay.alive(), "the relay exited by itself\n" + relay.log_tail())
            relay.kill()
            kills += 1
            relay = self.enterContext(harness.Relay(self.pg, self.redis, **RELAY_FLAGS))

        for p in producers:
            p.stop()
        self.assertEqual(sum(p.committed for p in producers), ROWS)
        # One more row, so the last relay is surely up before it gets its SIGTERM.
        harness.insert(self.db, TOPICS[0], b"last")
        wait_until(lambda: count_unsent(self.db) == 0, timeout=120, interval=0.5, relay=relay,
                   message="every row to be sent after the last restart")
        self.assertEqual(relay.terminate(), 0, "clean exit after the run\n" + relay.log_tail())

        fig = self.verifier().report(f"kills={kills}")
        self.assertEqual(fig.committed, ROWS + 1)
        self.assertEqual((fig.lost, fig.sent_but_absent, fig.unsent, fig.stray), (0, 0, 0, 0),
                         f"{fig.line()}; lost e.g. {fig.lost_ids[:5]}")
        self.assertEqual(fig.duplicates, 0,
                         f"{fig.line()}; duplicated e.g. {fig.duplicate_ids[:5]}")
        self.assertGreaterEqual(kills, MIN_KILLS)


if __name__ == "__main__":
    unittest.main()
