#!/usr/bin/python3
"""What the wake-up protocol costs at low rates: transactions and CPU per published row.

An experiment behind docs/PERFORMANCE.md ("Latency"), not part of the run: a relay with
its defaults, producers at 100, 500 and 2,000 single-row commits per second for 5 s each
(bench-loadgen), and for each rate the database's transactions (pg_stat_database), the
relay's cycles (/metrics), the relay's and PostgreSQL's CPU. Needs build-bench (run
bench/run.sh once first).

    PYTHONPATH=. /usr/bin/python3 bench/extra/wakeup_churn.py
"""
import os
import time

from bench import benchlib
from testkit import harness

SECONDS = 5


def main():
    os.environ["OUTBOX_RELAY_BIN"] = benchlib.RELAY_BIN
    count = ("SELECT xact_commit + xact_rollback FROM pg_stat_database"
             " WHERE datname = current_database()")
    with benchlib.servers() as (pg, rd, conn, rc):
        relay = benchlib.start_relay(pg, rd, batch_size=benchlib.BATCH)
        try:
            harness.insert(conn, "bench0", b"warm-up")
            time.sleep(1.5)
            for rate in (100, 500, 2000):
                x0, b0 = benchlib.scalar(conn, count), benchlib.relay_batches(relay)
                c0 = benchlib.proc_cpu(relay.pid)
                meter = benchlib.CpuMeter(pg, rd)
                res = benchlib.loadgen(pg, rd, rate=rate, seconds=SECONDS, wait=3, group=f"g{rate}")
                pg_cpu, _ = meter.read()
                time.sleep(0.7)  # the counters are reported when a transaction ends
                x1, b1 = benchlib.scalar(conn, count), benchlib.relay_batches(relay)
                c1 = benchlib.proc_cpu(relay.pid)
                n = res["committed"]
                print(f"{rate}/s: {n} rows; {x1 - x0} transactions, {(x1 - x0 - n) / n:.1f} per row"
                      f" besides its insert; {b1 - b0:.0f} relay cycles ({n / (b1 - b0):.1f} rows"
                      f" each); relay CPU {c1 - c0:.2f} s ({(c1 - c0) / n * 1e3:.3f} ms a row);"
                      f" PostgreSQL CPU {pg_cpu:.1f} s ({pg_cpu / SECONDS:.2f} cores);"
                      f" commit -> stream p50 {res['visible_ms']['p50']:.2f} ms", flush=True)
        finally:
            benchlib.stop_relay(relay)


if __name__ == "__main__":
    main()
