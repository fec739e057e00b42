#!/usr/bin/python3
"""What the order check costs Redis: the publish function with two keys against three.

An experiment behind docs/PERFORMANCE.md ("A publish that waits for the row before
it"), not part of the run: a fresh Redis (no persistence), the relay's function
(bench-naive --print-function), then rounds of 100,000 publishes in pipelines of
100 over four streams, each call as the relay builds it for a stream's first row
in a batch (two keys) or for a later one (three: the third is the record of the
call four before it, which exists). Rounds alternate A B B A. Prints Redis's CPU
per call (INFO cpu) for each round and the medians. Needs build-bench (run
bench/run.sh once first).

    PYTHONPATH=. /usr/bin/python3 bench/extra/chain_cost.py
"""
import contextlib
import statistics
import subprocess
import time
import uuid

from bench import benchlib
from testkit import harness

CALLS, PIPELINE, STREAMS, ROUNDS = 100_000, 100, 4, 3
FUNCTION = "outbox_relay_publish_v2"
PAYLOAD = b"p" * 200


def cpu_s(c):
    info = c.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def one_round(c, chained):
    c.flushall()
    mids = [str(uuid.uuid4()) for _ in range(CALLS)]
    before = cpu_s(c)
    for start in range(0, CALLS, PIPELINE):
        p = c.pipeline(transaction=False)
        for i in range(start, start + PIPELINE):
            stream = f"bench{i % STREAMS}"
            keys = [stream, f"{{{stream}}}:dedup:{mids[i]}"]
            if chained and i - STREAMS >= start:
                keys.append(f"{{{stream}}}:dedup:{mids[i - STREAMS]}")
            p.fcall(FUNCTION, len(keys), *keys, 60000, 9999999999999, "id", mids[i],
                    "topic", stream, "payload", PAYLOAD,
                    "created_at", "2026-12-03T16:00:00.000000Z", "outbox_id", str(i))
        p.execute(raise_on_error=True)
    added = sum(c.xlen(f"bench{s}") for s in range(STREAMS))
    if added != CALLS:
        raise RuntimeError(f"{added} of {CALLS} calls added an entry")
    return (cpu_s(c) - before) / CALLS * 1e6


def main():
    source = subprocess.run([benchlib.NAIVE_BIN, "--print-function"], stdout=subprocess.PIPE,
                            text=True, check=True).stdout
    times = {False: [], True: []}
    with harness.Redis(appendonly=False) as rd, contextlib.closing(rd.client()) as c:
        c.function_load(source, replace=True)
        for chained in [False, True, True, False] * ROUNDS:
            us = one_round(c, chained)
            times[chained].append(us)
            print(f"{'three keys' if chained else 'two keys  '}: {us:.2f} us of Redis CPU a call",
                  flush=True)
            time.sleep(0.2)
    two, three = statistics.median(times[False]), statistics.median(times[True])
    print(f"median: two keys {two:.2f} us, three keys {three:.2f} us, ratio {three / two:.3f}")


if __name__ == "__main__":
    main()
