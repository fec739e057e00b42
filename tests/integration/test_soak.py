"""A few minutes of the soak benchmark (bench/soak.py), with its checks.

Promises tested (docs/OPERATIONS.md, "Retention"; docs/PERFORMANCE.md, "Soak"):
- under steady load with retention running, Redis's used_memory grows less
  than 5 % over the last third of the run, and the outbox's table+index size
  less than 5 % or one step by which PostgreSQL extends a busy table (512
  pages, 4 MiB), whichever is more (without retention the last third of this
  run would add some 20 MiB); the table's size is measured from the largest
  of the minute before the last third and its first sample, so that a VACUUM
  that truncated the table just before does not count its refill as growth;
- a consumer group that stops for the middle third and then catches up reads
  every message exactly once: trimming never removed an entry it had not
  acknowledged;
- nothing is lost: every committed row reaches its stream and the other group.

The latency target of the benchmark (commit -> visible p99 under 50 ms) is a
speed figure: here it is reported, not asserted (SOAK_LATENCY_CHECK=0). The
run takes SOAK_MINUTES (3) at SOAK_RATE (1,000) messages a second, with sent
rows kept 45 s (bench/soak.py's floor): the outbox holds some 45,000 rows,
about 20 MiB.
"""

import os
import subprocess
import sys
import tempfile
import unittest

from testkit import harness

harness.require_relay()
harness.set_deadline(900)


class SoakTest(harness.TestCase):

    def test_soak(self):
        build = os.path.dirname(harness.require_relay())
        for tool in ("bench-loadgen",):
            if not os.access(os.path.join(build, tool), os.X_OK):
                self.fail(f"{tool} is not built next to {harness.require_relay()}")
        with tempfile.TemporaryDirectory(prefix="outbox-soak-") as results:
            env = dict(os.environ, BENCH_BUILD_DIR=build, BENCH_RESULTS=results,
                       SOAK_MINUTES=os.environ.get("SOAK_MINUTES", "3"),
                       SOAK_RATE=os.environ.get("SOAK_RATE", "1000"),
                       SOAK_LATENCY_CHECK="0")
            # bench.soak, found through the PYTHONPATH the test has.
            proc = subprocess.run([sys.executable, "-m", "bench.soak"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=840)
            print(proc.stdout[-2500:], file=sys.stderr, flush=True)
            self.assertEqual(proc.returncode, 0, "a soak check was not met")
            with open(os.path.join(results, "soak-summary.md")) as f:
                summary = f.read()
            self.assertNotIn("| **no** |", summary)


if __name__ == "__main__":
    unittest.main()
