#!/usr/bin/python3
"""The outbox-relay benchmark: the relay against the limits of this machine, in one run.

Run it through bench/run.sh, which installs what is missing and builds the relay
and the tools optimised into build-bench first, then runs this file as the
module bench.bench with the repository root on PYTHONPATH. Every section
starts its own PostgreSQL 15 (fsync on) and Redis 7 on loopback through the
integration-test harness and stops them at the end, also on failure or Ctrl-C.

Sections (BENCH_SECTIONS, comma-separated, all by default):
  drain      BENCH_ROWS pending rows, then the relay (its defaults) until all are
             in Redis: msgs/s, CPU per 100k, peak RSS, where a batch's time
             goes; Redis's used memory after it against its streams' own
  latency    first the producers alone at the ramp's target rate (no relay, the
             wake-up lock held as a busy relay holds it): whether they can offer
             it at all; then an idle relay's single-row latency, then producers
             at fixed rates: commit -> visible to a reader (XREAD) and commit ->
             group acknowledgement, and the ramps to the highest rate that holds
  producers  pgbench producers at 1/4/16 clients, wake-up trigger present or
             dropped, synchronous_commit on and off, with a relay running; the
             16 clients in BENCH_PRODUCER_ROUNDS alternating rounds (medians);
             then without a relay: the outbox with every addition of the relay
             (txid and its index, the triggers) against a plain table of the
             producers' columns, in BENCH_PRODUCER_ROUNDS alternating rounds
  limits     each end of the relay alone: the batch read (outbox.tick,
             outbox.batch_bounds, outbox.batch_rows, outbox.record_batch) over
             a backlog of BENCH_BATCH-row batches, and the publish (MULTI /
             XADD with explicit ids / EXEC, a batch's calls pipelined)
  storage    the same backlog drained with the published rows kept
             (sent_retention 1h) and deleted as they go (sent_retention 0: the
             retention pass deletes them once their stream is past them), in
             BENCH_STORAGE_ROUNDS alternating rounds: PostgreSQL CPU per
             message, the table's size, and one batch's read on fresh rows
             before and after the drain (history kept or purged)
  partitions a keyed backlog on one topic drained by one relay with the
             topic unpartitioned, and with 8 partitions by 1, 2 and 3 relays,
             in BENCH_PARTITION_ROUNDS alternating rounds
  units      BENCH_UNIT_BATCHES batches of BENCH_BATCH keyed rows on the same
             8 streams, one after the other, with the relay owning 8
             partitions and then 4096: a batch's time and CPU
  replicas   the same backlog drained with a replica attached, with
             min_replicas 0 and 1 (a WAIT per chunk), in
             BENCH_REPLICA_ROUNDS alternating rounds: what the wait costs
  cluster    the same backlog drained into the benchmark's single Redis and
             into a Redis Cluster of 3 primaries (append-only like it), in
             BENCH_CLUSTER_ROUNDS alternating rounds
  alternatives
             side by side with what a user would pick instead: PgQ (Debian's
             postgresql-15-pgq3) with bench-pgq, a consumer that XADDs each
             event, on the same servers and workload: a drain of
             BENCH_ALT_ROWS, then commit -> visible latency at BENCH_ALT_RATES,
             relay and PgQ in BENCH_ALT_ROUNDS alternating rounds; then a
             drain of BENCH_ALT_CRASH_ROWS by each, killed (SIGKILL) halfway
             and started again; every message lost or published twice is
             counted
  tls        the relay into one Redis over plain TCP and over TLS (rediss://
             to redis-server's own TLS port, with a client certificate), in
             BENCH_TLS_ROUNDS alternating rounds: a drain of BENCH_TLS_ROWS and
             commit -> visible at BENCH_TLS_RATE rows/s; needs a relay built
             with TLS (hiredis 1.x, Debian 13), else it records that it did not
             run
  profile    perf record -a during a drain: where the machine's time goes

Sizes come from the environment (BENCH_QUICK=1 for a smoke run of a few minutes);
see the constants below and in benchlib.py. Writes bench/results/latest.csv
(every raw number), latest-table.md (the table), PNG plots, and prints the
table.
"""

import contextlib
import csv
import datetime
import glob
import hashlib
import json
import math
import os
import platform
import re
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

if not __package__:  # run as a file, "bench" would name this file, not the package
    sys.exit("bench.py: run it as a module of the package bench, with the repository root\n"
             "on PYTHONPATH: PYTHONPATH=. /usr/bin/python3 -m bench.bench (bench/run.sh\n"
             "builds the relay and the tools, then does so)")

# What the benchmark's programs share; main() reads LOAD_PRODUCERS and
# PUBLISH_CALLS through globals().
from bench.benchlib import (  # noqa: E402,F401
    BATCH, BATCH_READ_SQL, CALL_ROWS, LOAD_PRODUCERS, LOADGEN_BIN, PAYLOAD, PG_SETTINGS,
    PGQ_BIN, PHASES, PUBLISH_CALLS, QUICK, R, REDIS_AOF, REDIS_ARGS, RELAY_BIN, RESULTS,
    SOURCE, TOPICS, BenchPostgres, CpuMeter, aof_bytes, batch_read_alone, bench_redis,
    cpu_shares, cpu_ticks, env_float, env_int, env_list, execute, fresh_round, insert_backlog,
    loadgen, log, machine_busy, pending, proc_cpu, proc_status, publish_alone, recorded,
    relay_batches, relay_metric, relay_phase_sums, reset_outbox, run_delay, scalar, servers,
    start_relay, stop_relay, stream_total, tick, wait_drained)
from testkit import harness  # noqa: E402  (the integration tests' throwaway servers)

ROWS = env_int("BENCH_ROWS", 50000 if QUICK else 1000000)          # the drain backlog
RATES = env_list("BENCH_RATES", [500, 2000] if QUICK else [500, 2000, 5000])
RATE_SECONDS = env_float("BENCH_RATE_SECONDS", 3 if QUICK else 15)
RAMP_SECONDS = env_float("BENCH_RAMP_SECONDS", 2 if QUICK else 4)
IDLE_ROWS = env_int("BENCH_IDLE_ROWS", 30 if QUICK else 100)
PGBENCH_SECONDS = env_int("BENCH_PGBENCH_SECONDS", 2 if QUICK else 15)
NORELAY_SECONDS = env_int("BENCH_NORELAY_SECONDS", 2 if QUICK else 6)
# Rounds in turns of the most producers with and without the wake-up: three
# left the ratio of the medians 0.89-0.95 between runs of the same code.
PRODUCER_ROUNDS = env_int("BENCH_PRODUCER_ROUNDS", 1 if QUICK else 5)
PRODUCER_CLIENTS = env_list("BENCH_PRODUCER_CLIENTS", [1, 4, 16])
STORAGE_ROUNDS = env_int("BENCH_STORAGE_ROUNDS", 2)
# How long one batch's read is timed, over and over (storage section).
READ_SECONDS = env_float("BENCH_READ_SECONDS", 1 if QUICK else 4)
LIMIT_ROWS = env_int("BENCH_LIMIT_ROWS", 30000 if QUICK else 300000)
PROFILE_ROWS = env_int("BENCH_PROFILE_ROWS", 20000 if QUICK else 100000)
ALT_ROWS = env_int("BENCH_ALT_ROWS", 20000 if QUICK else 200000)
ALT_RATES = env_list("BENCH_ALT_RATES", [200, 2000])
ALT_SECONDS = env_float("BENCH_ALT_SECONDS", 3 if QUICK else 15)
ALT_ROUNDS = env_int("BENCH_ALT_ROUNDS", 1 if QUICK else 2)
ALT_CRASH_ROWS = env_int("BENCH_ALT_CRASH_ROWS", 20000 if QUICK else 100000)
ALL_SECTIONS = ["drain", "latency", "producers", "limits", "storage",
                "partitions", "units", "replicas", "cluster", "alternatives", "tls", "profile"]
SECTIONS = [s.strip() for s in (os.environ.get("BENCH_SECTIONS") or ",".join(ALL_SECTIONS))
            .split(",") if s.strip()]
if QUICK and not os.environ.get("BENCH_SECTIONS"):
    SECTIONS = [s for s in SECTIONS if s != "profile"]


# --------------------------------------------------------------------------
# The table's numbers as text.

def fmt(v):
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


# --------------------------------------------------------------------------
# Drains.

def drain(pg, rd, conn, rc, kind, rows, batch, relay_flags=None):
    """Drains a backlog of `rows` with the relay (with relay_flags); returns its
    figures, from the relay's start until every row is in Redis and none is
    left in outbox.unsent."""
    if kind != "relay":
        raise ValueError(f"drain: no drain of kind {kind!r}: only the relay drains")
    meter = CpuMeter(pg, rd)
    redis_delay = run_delay(rd.proc.pid)
    timeout = max(120.0, rows / 1500.0)
    rc.config_resetstat()  # INFO commandstats from here: Redis's work by command
    if kind == "relay":
        started = time.monotonic()
        relay = start_relay(pg, rd, batch_size=batch, **(relay_flags or {}))
        try:
            deadline = started + timeout
            while True:
                # Redis first, every 20 ms: four XLEN cost next to nothing. Then
                # whether the last batch is recorded (recorded(): a few rows);
                # the count of outbox.unsent, which reads the whole backlog,
                # runs once the clock is stopped, as PgQ's drain is timed to
                # its last entry too.
                if stream_total(rc) >= rows and recorded(conn, rc):
                    break
                if not relay.alive():
                    raise RuntimeError("the relay exited during the drain\n" + relay.log_tail())
                if time.monotonic() > deadline:
                    raise RuntimeError(f"drain not done after {timeout:.0f}s\n" + relay.log_tail())
                time.sleep(0.02)
            took = time.monotonic() - started
            cpu = proc_cpu(relay.pid)
            hwm = proc_status(relay.pid, "VmHWM")
            pg_cpu, rd_cpu = meter.read()
            other = meter.other(cpu)
            commands = rc.info("commandstats")
            waited = run_delay(rd.proc.pid)
            batches = relay_batches(relay)
            batch_sum = relay_metric(relay, "outbox_relay_batch_duration_seconds_sum")
            phase_sums = relay_phase_sums(relay)
        finally:
            stop_relay(relay)
    in_redis = stream_total(rc)
    left = pending(conn)
    if in_redis != rows or left != 0:
        raise RuntimeError(f"{kind} drain: {in_redis} entries in Redis and {left} rows pending"
                           f" for {rows} rows")
    result = dict(rows=rows, batch=batch, seconds=took, rate=rows / took, cpu=cpu,
                cpu_per_100k=cpu / rows * 1e5, hwm_kb=hwm, pg_cpu=pg_cpu, redis_cpu=rd_cpu,
                total_cpu_per_100k=(cpu + pg_cpu + rd_cpu) / rows * 1e5,
                relay_busy=cpu / took, pg_busy=pg_cpu / took, redis_busy=rd_cpu / took,
                other_busy=other / took)
    # Redis's time by command until the last row was in, in microseconds a
    # message: the publishes (XADD inside MULTI / EXEC) and what else takes
    # its core (the observer's and the trim pass's reads, the benchmark's own
    # polling with XLEN).
    # The share of the drain Redis's main thread had work but no core: on two
    # cores it shares with PostgreSQL, the relay and the kernel.
    if redis_delay is not None and waited is not None:
        result["redis_waited_for_cpu"] = (waited - redis_delay) / took
    for name in ("xadd", "multi", "exec", "xrevrange", "xinfo", "xlen", "scan"):
        stat = commands.get(f"cmdstat_{name}", {})
        result[f"redis_{name}_calls"] = stat.get("calls", 0)
        result[f"redis_{name}_us_per_msg"] = stat.get("usec", 0) / rows
    if batches:
        # The relay's own histogram: a recorded batch's time, from its tick's
        # read to its record.
        result["batches"] = batches
        result["batch_total_ms"] = batch_sum / batches * 1e3 if batch_sum is not None else None
        # Where that time went (outbox_relay_batch_phase_seconds), mean ms a batch.
        for phase, seconds in (phase_sums or {}).items():
            result[f"phase_{phase}_ms"] = seconds / batches * 1e3
    return result


def record_drain(section, name, d, detail=""):
    units = dict(seconds="s", rate="msg/s", cpu="s", cpu_per_100k="s", hwm_kb="kB", _ms="ms",
                 pg_cpu="s", redis_cpu="s", total_cpu_per_100k="s", busy="cores")
    R.add_dict(section, name, d, units, detail)
    log(f"{name}: {d['rows']} rows in {d['seconds']:.2f}s = {d['rate']:,.0f} msg/s,"
        f" CPU {d['cpu']:.2f}s ({d['cpu_per_100k']:.3f}s/100k), peak RSS {d['hwm_kb']} kB,"
        f" PostgreSQL CPU {d['pg_cpu']:.1f}s, Redis CPU {d['redis_cpu']:.1f}s;"
        f" other work on the machine {d['other_busy']:.2f} cores")


def batch_read_cost(conn, label, explain_file):
    """One batch's read as the relay reads it, on BATCH rows committed now in one
    transaction (the batch between the tick before them and the tick after):
    outbox.batch_bounds and outbox.batch_rows of the whole batch, executed over
    and over for READ_SECONDS after three reads to warm up (EXPLAIN ANALYZE
    with TIMING OFF: the server's execution time, no transfer), then once with
    BUFFERS into explain_file.
    The rows stay pending. Returns {mean_ms, p50_ms, reads, buffers}."""
    conn.autocommit = True
    prev = tick(conn)
    insert_backlog(conn, BATCH, prepare=False)
    nxt = tick(conn)
    # Statistics as autovacuum would keep them: the plan is the same whatever
    # the table held before (a table never analysed is planned from guesses).
    execute(conn, "ANALYZE outbox.messages")
    args = dict(prev=prev, next=nxt, limit=BATCH)
    times = []
    with conn.cursor() as cur:
        for _ in range(3):  # warm-up: the plan cached, the pages in shared buffers
            cur.execute(cur.mogrify(f"EXPLAIN (ANALYZE, TIMING OFF) {BATCH_READ_SQL}", args))
            cur.fetchall()
        ended = time.monotonic() + READ_SECONDS
        while time.monotonic() < ended or len(times) < 3:
            cur.execute(cur.mogrify(f"EXPLAIN (ANALYZE, TIMING OFF) {BATCH_READ_SQL}", args))
            plan = "\n".join(r[0] for r in cur.fetchall())
            m = re.search(r"Execution Time: ([\d.]+) ms", plan)
            rows = re.search(r"\(actual rows=(\d+) loops=1\)", plan)
            if not m or not rows or int(rows.group(1)) != BATCH:
                raise RuntimeError(f"the batch read of {BATCH} rows read otherwise:\n{plan}")
            times.append(float(m.group(1)))
        cur.execute(cur.mogrify(f"EXPLAIN (ANALYZE, BUFFERS) {BATCH_READ_SQL}", args))
        plan = "\n".join(r[0] for r in cur.fetchall())
    with open(os.path.join(RESULTS, explain_file), "w") as f:
        f.write(f"-- the read of a batch of {BATCH} rows, {label}\n{plan}\n")
    d = dict(mean_ms=statistics.mean(times), p50_ms=statistics.median(times), reads=len(times))
    m = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
    if m:
        d["buffers"] = int(m.group(1)) + int(m.group(2) or 0)
    R.add_dict("batch_read", f"batch_read.{label}", d, dict(_ms="ms", buffers="pages"),
               f"outbox.batch_bounds + outbox.batch_rows of one batch of {BATCH} rows,"
               " server execution time (EXPLAIN ANALYZE, TIMING OFF)")
    log(f"batch read of {BATCH}, {label}: mean {d['mean_ms']:.3f} ms, p50 {d['p50_ms']:.3f} ms"
        f" over {d['reads']} reads, {d.get('buffers')} buffers")
    return d


def table_stats(conn):
    with conn.cursor() as cur:
        # Summed over the table's partitions (migrations/019_rotation.sql).
        cur.execute("WITH t AS (SELECT relid FROM pg_partition_tree('outbox.messages'))"
                    " SELECT sum(n_live_tup)::bigint, sum(n_dead_tup)::bigint,"
                    " coalesce(max(last_autovacuum)::text, 'never'), sum(autovacuum_count)::bigint,"
                    " (SELECT sum(pg_relation_size(relid))::bigint FROM t),"
                    " (SELECT sum(pg_total_relation_size(relid))::bigint FROM t),"
                    " (SELECT sum(pg_relation_size(relid))::bigint"
                    "  FROM pg_partition_tree('outbox.messages_txid_idx'))"
                    " FROM pg_stat_user_tables WHERE relid IN (SELECT relid FROM t)")
        live, dead, last, count, size, total, idx = cur.fetchone()
    return dict(live=live, dead=dead, last_autovacuum=last, autovacuum_count=count,
                heap_bytes=size, total_bytes=total, txid_idx_bytes=idx)


def redis_memory(rc):
    """Redis's used memory, and the part of it its streams take (MEMORY USAGE of
    each, every node counted): what the relay keeps besides its streams is the
    difference."""
    used = rc.info("memory")["used_memory"]
    streams = sum(rc.memory_usage(f"bench{i}", samples=0) or 0 for i in range(TOPICS))
    return dict(used_bytes=used, streams_bytes=streams, keys=rc.dbsize())


def section_drain():
    with servers() as (pg, rd, conn, rc):
        took = insert_backlog(conn, ROWS)
        R.add("drain", "insert.rows", ROWS, "rows")
        R.add("drain", "insert.seconds", took, "s", "one INSERT ... SELECT generate_series")
        R.add("drain", "insert.rate", ROWS / took, "rows/s")
        empty = redis_memory(rc)
        d = drain(pg, rd, conn, rc, "relay", ROWS, BATCH)
        record_drain("drain", "drain.relay", d, f"batch {BATCH}, the relay's defaults")
        # Redis after the drain: nothing is kept per message besides the
        # entries, so used memory less the streams' own is what an empty
        # Redis uses.
        mem = redis_memory(rc)
        R.add_dict("drain", "drain.redis_memory", mem, dict(bytes="bytes"),
                   f"INFO memory and MEMORY USAGE of the {TOPICS} streams after the drain")
        R.add("drain", "drain.redis_memory.empty_used_bytes", empty["used_bytes"], "bytes",
              "used memory of the same Redis before the drain, no key")
        R.add("drain", "drain.redis_memory.beyond_streams_bytes",
              mem["used_bytes"] - mem["streams_bytes"], "bytes",
              "used memory after the drain less its streams' own")
        log(f"Redis after the drain: used {mem['used_bytes'] / 2**20:.1f} MiB, of which the"
            f" streams {mem['streams_bytes'] / 2**20:.1f} MiB; {mem['keys']} keys; empty it used"
            f" {empty['used_bytes'] / 2**20:.1f} MiB")


PARTITION_ROWS = env_int("BENCH_PARTITION_ROWS", 20000 if QUICK else 300000)
PARTITION_ROUNDS = env_int("BENCH_PARTITION_ROUNDS", 3)
PARTITION_KEYS = 10000


# The drains of section "partitions": label, partitions of the topic, relays.
PARTITION_RUNS = (("unpartitioned", 1, 1), ("partitions_8", 8, 1),
                  ("partitions_8_relays_2", 8, 2), ("partitions_8_relays_3", 8, 3))


def keyed_backlog(conn, n):
    """n rows with partition keys ('key-0' ... 'key-9999') on topic bench0,
    committed at once: the relays, already running, see the whole backlog
    appear together. Returns the time of the commit."""
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload)"
                    " SELECT 'bench0', 'key-' || (g %% %s),"
                    " substring(decode(repeat(md5(g::text), 13), 'hex') FROM 1 FOR %s)"
                    " FROM generate_series(1, %s) AS g", (PARTITION_KEYS, PAYLOAD, n))
        cur.execute("COMMIT")
    return time.monotonic()


def section_partitions():
    """A keyed backlog on one topic drained by one relay unpartitioned, and
    with 8 partitions (streams bench0:000 ... :007) by 1, 2 and 3 relays;
    same server, rounds alternating so that drift on the machine falls on
    all. The relays start first and divide the partitions (their metrics say
    so); then the backlog is committed in one transaction and the clock runs
    until every entry is in Redis and no row is pending."""
    streams = {1: ["bench0"], 8: [f"bench0:{p:03d}" for p in range(8)]}
    rates = {label: [] for label, _, _ in PARTITION_RUNS}
    with servers() as (pg, rd, conn, rc):
        for rnd in range(PARTITION_ROUNDS):
            for label, parts, nrelays in PARTITION_RUNS:
                reset_outbox(conn, rc)
                if parts > 1:
                    execute(conn, "SELECT outbox.set_partitions('bench0', %s)", (parts,))
                execute(conn, "VACUUM ANALYZE outbox.messages")
                execute(conn, "CHECKPOINT")
                relays = [start_relay(pg, rd, batch_size=BATCH) for _ in range(nrelays)]
                try:
                    deadline = time.monotonic() + 60
                    want = (nrelays, parts if parts > 1 else 0)
                    while True:
                        seen = [(relay_metric(x, "outbox_relay_relays"),
                                 relay_metric(x, "outbox_relay_partitions_owned")) for x in relays]
                        if all(s[0] == nrelays for s in seen) and \
                                sum(s[1] or 0 for s in seen) == want[1]:
                            break
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{nrelays} relays did not divide {parts}"
                                               f" partitions: {seen}")
                        time.sleep(0.05)
                    started = keyed_backlog(conn, PARTITION_ROWS)
                    deadline = started + max(120.0, PARTITION_ROWS / 1500.0)
                    while True:
                        pipe = rc.pipeline(transaction=False)
                        for st in streams[parts]:
                            pipe.xlen(st)
                        if sum(pipe.execute()) >= PARTITION_ROWS and pending(conn) == 0:
                            break
                        if not all(x.alive() for x in relays) or time.monotonic() > deadline:
                            raise RuntimeError("partitioned drain did not finish\n"
                                               + relays[0].log_tail())
                        time.sleep(0.02)
                    took = time.monotonic() - started
                finally:
                    for relay in relays:
                        stop_relay(relay)
                rates[label].append(PARTITION_ROWS / took)
                R.add("partitions", f"{label}.round{rnd}.rate", PARTITION_ROWS / took, "msg/s")
                log(f"partitions: {label} round {rnd}: {PARTITION_ROWS} rows in {took:.2f}s"
                    f" = {PARTITION_ROWS / took:,.0f} msg/s")
    for label, parts, nrelays in PARTITION_RUNS:
        R.add("partitions", f"{label}.rate", statistics.median(rates[label]), "msg/s",
              f"median of {PARTITION_ROUNDS} rounds, {PARTITION_ROWS} keyed rows, one topic of"
              f" {parts} partition(s), {nrelays} relay(s)")
    base = statistics.median(rates["unpartitioned"])
    one = statistics.median(rates["partitions_8"])
    R.add("partitions", "ratio_partitioned_to_unpartitioned", one / base, "x",
          "drain rate with 8 partitions / without, one relay each")
    for n in (2, 3):
        r = statistics.median(rates[f"partitions_8_relays_{n}"]) / one
        R.add("partitions", f"ratio_relays_{n}_to_1", r, "x",
              f"drain rate of 8 partitions with {n} relays / with one")
        log(f"partitions: {n} relays drain 8 partitions at {r:.2f}x one relay's rate")
    log(f"partitions: 8 partitions drain at {one / base:.2f}x the unpartitioned rate")


# Section "units": the partitions the relay owns, 8 or 4096 (outbox.set_partitions
# allows 1000 a topic and 4096 in all: bench0 to bench3 with 1000 each and
# bench4 with 96), while every batch is the same UNIT_BATCH keyed rows of
# bench0 on the same 8 streams: what owning more partitions costs a batch.
UNIT_BATCHES = env_int("BENCH_UNIT_BATCHES", 20 if QUICK else 100)
UNIT_BATCH = BATCH
UNIT_LAYOUTS = (("units_8", {"bench0": 8}),
                ("units_4096", {"bench0": 1000, "bench1": 1000, "bench2": 1000, "bench3": 1000,
                                "bench4": 96}))


def unit_keys(conn):
    """Eight keys of bench0, the first for each of its partitions 0-7 as
    outbox.set_partitions left them: every batch lands on the same 8 streams."""
    with conn.cursor() as cur:
        cur.execute("SELECT DISTINCT ON (p) p, k FROM ("
                    " SELECT g, k, outbox.row_partition('bench0', k, 0) AS p"
                    " FROM generate_series(1, 200000) AS g, LATERAL (SELECT 'key-' || g AS k) AS n)"
                    " AS s WHERE p < 8 ORDER BY p, g")
        keys = dict(cur.fetchall())
    if len(keys) < 8:
        raise RuntimeError(f"no key for partitions {sorted(set(range(8)) - set(keys))}")
    return [keys[p] for p in range(8)]


def section_units():
    """Target 9 of issue 40: UNIT_BATCHES batches of UNIT_BATCH rows each, one
    committed after the other was published, with the relay owning 8
    partitions and then 4096; the rows of every batch go to the same 8
    streams. A batch's cost is the relay's own histogram of a recorded batch
    (outbox_relay_batch_duration_seconds: from its tick's read to its
    record) and the relay's and PostgreSQL's CPU over the batches."""
    for label, layout in UNIT_LAYOUTS:
        with servers() as (pg, rd, conn, rc):
            for topic, n in layout.items():
                execute(conn, "SELECT outbox.set_partitions(%s, %s)", (topic, n))
            total = sum(layout.values())
            keys = unit_keys(conn)
            streams = [f"bench0:{p:03d}" for p in range(8)]
            relay = start_relay(pg, rd, batch_size=BATCH)
            try:
                harness.wait_until(
                    lambda: relay_metric(relay, "outbox_relay_partitions_owned") == total,
                    timeout=60, relay=relay, message=f"the relay to own {total} partitions")
                payload = bytes((i * 37 + 11) & 0xFF for i in range(PAYLOAD))

                def batch(expected):
                    with conn.cursor() as cur:
                        cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload)"
                                    " SELECT 'bench0', (%s::text[])[1 + g %% 8], %s"
                                    " FROM generate_series(0, %s - 1) AS g",
                                    (keys, payload, UNIT_BATCH))
                    conn.commit()

                    def done():
                        pipe = rc.pipeline(transaction=False)
                        for st in streams:
                            pipe.xlen(st)
                        return sum(pipe.execute()) >= expected
                    harness.wait_until(done, timeout=60, relay=relay, interval=0.002,
                                       message="the batch in its streams")

                conn.autocommit = False
                for i in range(3):  # warm-up: plans, connections
                    batch((i + 1) * UNIT_BATCH)
                n0 = relay_batches(relay)
                sum0 = relay_metric(relay, "outbox_relay_batch_duration_seconds_sum")
                cpu0 = proc_cpu(relay.pid)
                meter = CpuMeter(pg, rd)
                for i in range(UNIT_BATCHES):
                    batch((i + 4) * UNIT_BATCH)
                pg_cpu, rd_cpu = meter.read()
                cpu = proc_cpu(relay.pid) - cpu0
                n = relay_batches(relay) - n0
                took = relay_metric(relay, "outbox_relay_batch_duration_seconds_sum") - sum0
                conn.autocommit = True
            finally:
                stop_relay(relay)
            R.add("units", f"{label}.batch_ms", took / max(n, 1) * 1e3, "ms",
                  f"mean of {n:.0f} recorded batches of {UNIT_BATCH} rows on 8 streams,"
                  f" {total} partitions owned")
            R.add("units", f"{label}.cpu_per_batch_ms",
                  (cpu + pg_cpu + rd_cpu) / max(n, 1) * 1e3, "ms",
                  "relay + PostgreSQL (the producer's INSERT included) + Redis CPU per batch")
            R.add("units", f"{label}.relay_cpu_per_batch_ms", cpu / max(n, 1) * 1e3, "ms",
                  "the relay's CPU per batch")
            log(f"units: {total} partitions owned: {took / max(n, 1) * 1e3:.2f} ms a batch"
                f" ({n:.0f} batches), CPU {(cpu + pg_cpu + rd_cpu) / max(n, 1) * 1e3:.2f} ms,"
                f" the relay's {cpu / max(n, 1) * 1e3:.2f} ms")


# The storage designs of section "storage": name, relay flags, what it is.
STORAGE_MODES = [
    ("kept", dict(sent_retention="1h"),
     "published rows kept an hour (sent_retention 1h): none deleted during the drain"),
    ("purged", dict(sent_retention="0"),
     "sent_retention 0: the retention pass deletes published rows after each observation,"
     " the relay vacuums"),
]


def vacuum_settled(conn, threshold):
    """No VACUUM runs and fewer dead rows than the relay's end-of-drain mark."""
    return (scalar(conn, "SELECT count(*) FROM pg_stat_progress_vacuum") == 0
            and table_stats(conn)["dead"] < threshold)


class SessionMeter:
    """Which PostgreSQL backend is whose: samples pg_stat_activity five times a
    second, so that the CPU a CpuMeter keeps per pid can be split into the
    relay's sessions (batch reads and records, observation, retention),
    vacuums (the relay's and autovacuum's) and the rest, short-lived backends
    included."""

    def __init__(self, pg):
        self.conn = pg.connect()
        self.kind = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.2):
            with self.conn.cursor() as cur:
                cur.execute("SELECT pid, application_name, backend_type, query"
                            " FROM pg_stat_activity")
                for pid, app, btype, query in cur.fetchall():
                    if btype == "autovacuum worker" or app == "outbox-relay vacuum" or \
                            (query or "").startswith("VACUUM"):
                        self.kind[pid] = "vacuum"
                    elif app == "outbox-relay" and self.kind.get(pid) != "vacuum":
                        self.kind[pid] = "relay"

    def split(self, meter):
        """{kind: CPU seconds} over meter's interval (meter must have been read)."""
        self._stop.set()
        self._thread.join()
        self.conn.close()
        out = {"relay": 0.0, "vacuum": 0.0, "other": 0.0}
        for pid, v in meter.last.items():
            out[self.kind.get(pid, "other")] += v - meter.base.get(pid, 0.0)
        return out


def vacuum_cpu(pg):
    """CPU seconds of one VACUUM of the outbox, run now on a backend of its own."""
    conn = pg.connect()
    conn.autocommit = True
    try:
        pid = scalar(conn, "SELECT pg_backend_pid()")
        before = proc_cpu(pid)
        execute(conn, "VACUUM (INDEX_CLEANUP ON) outbox.messages")
        return proc_cpu(pid) - before
    finally:
        conn.close()


def storage_round(name, flags, what, tag):
    """One drain of ROWS rows with one retention setting, on fresh servers: the
    read of one batch of BATCH fresh rows before it (on an empty table) and
    after it (the drain's published rows kept, or deleted and vacuumed), the
    PostgreSQL CPU of the drain and of the retention's work after it, and the
    table's size."""
    with servers() as (pg, rd, conn, rc):
        before = batch_read_cost(conn, f"storage.{name}.{tag}.before",
                                 f"batch-read-explain-storage-{name}-before.txt")
        insert_backlog(conn, ROWS - BATCH)
        meter = CpuMeter(pg, rd)
        sessions = SessionMeter(pg)
        started = time.monotonic()
        relay = start_relay(pg, rd, batch_size=BATCH, **flags)
        try:
            while not (stream_total(rc) >= ROWS and recorded(conn, rc)):
                if not relay.alive():
                    raise RuntimeError("the relay exited\n" + relay.log_tail())
                if time.monotonic() - started > max(120.0, ROWS / 1500.0):
                    raise RuntimeError("drain not done\n" + relay.log_tail())
                time.sleep(0.02)
            took = time.monotonic() - started
            # A running relay's own work after a drain: with sent_retention 0
            # the retention pass deletes every published row, then the relay
            # vacuums the table.
            if name == "purged":
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and \
                        scalar(conn, "SELECT count(*) FROM outbox.messages") > 0:
                    time.sleep(0.2)
                # Its VACUUM comes at an observation after the purge (every
                # 5 s by default): waited for a few observations at most; a
                # VACUUM that did not come is the one still owed below.
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not (
                        (relay_metric(relay, "outbox_relay_vacuums_total") or 0) >= 1
                        and vacuum_settled(conn, 10000)):
                    time.sleep(0.2)
            settled = time.monotonic() - started - took
            vacuums = relay_metric(relay, "outbox_relay_vacuums_total")
            deleted = relay_metric(relay, "outbox_relay_sent_rows_deleted_total")
            pg_cpu, _ = meter.read()
            split = sessions.split(meter)
        finally:
            stop_relay(relay)
        left = scalar(conn, "SELECT count(*) FROM outbox.messages")
        execute(conn, "ANALYZE outbox.messages")
        stats = table_stats(conn)
        after = batch_read_cost(conn, f"storage.{name}.{tag}.after",
                                f"batch-read-explain-storage-{name}-after.txt")
        # The cleanup still owed: the dead rows left now (none kept: autovacuum's later work).
        owed = vacuum_cpu(pg)
    per = 1e6 / ROWS
    fig = {
        "rate": (ROWS / took, "msg/s", what),
        "relay_sessions_us": (split["relay"] * per, "us", "CPU of the relay's PostgreSQL"
                              " sessions (batch reads and records, observation, retention)"
                              " per message"),
        "vacuum_us": ((split["vacuum"] + owed) * per, "us", "CPU of every VACUUM during the"
                      " drain (the relay's, autovacuum's) and of the one still owed after it,"
                      " per message"),
        "work_us": ((split["relay"] + split["vacuum"] + owed) * per, "us",
                    "the two above: PostgreSQL's work for each message, cleanup included"),
        "pg_cpu_per_msg_us": (pg_cpu * per, "us", "every PostgreSQL process, from the drain's"
                              " start until it and the retention's work are done (WAL writer,"
                              " checkpointer included)"),
        "settle_seconds": (settled, "s", "from the last row in Redis until the retention pass"
                           " and the relay's VACUUM are done"),
        "rows_deleted": (deleted or 0, "rows", "by the retention pass (the relay's metric)"),
        "relay_vacuums": (vacuums or 0, "", ""),
        "rows_left": (left, "rows", "in outbox.messages after the drain (and its retention)"),
        "table_bytes": (stats["total_bytes"], "bytes", "outbox.messages with its indexes and"
                        " TOAST after the drain (and its retention)"),
        "dead_rows_after": (stats["dead"], "rows", ""),
        "read_before_ms": (before["p50_ms"], "ms", f"one batch of {BATCH} fresh rows read,"
                           " empty table before the drain: median server time"),
        "read_after_ms": (after["p50_ms"], "ms", f"one batch of {BATCH} fresh rows read,"
                          " right after the drain: median server time"),
        "read_ratio": (after["p50_ms"] / before["p50_ms"], "", "the two above: after / before"),
    }
    for key, (value, unit, detail) in fig.items():
        R.add("storage", f"storage.{name}.{tag}.{key}", value, unit, detail)
    log(f"storage {name} ({tag}): {ROWS / took:,.0f} msg/s; PostgreSQL per message: relay"
        f" sessions {split['relay'] * per:.1f} us, vacuum {(split['vacuum'] + owed) * per:.1f} us,"
        f" all processes {pg_cpu * per:.1f} us; {deleted} rows deleted, relay VACUUMs"
        f" {vacuums}, settled {settled:.1f}s after the drain; {left} rows left,"
        f" {stats['total_bytes'] / 2**20:.1f} MiB; batch read (median) {before['p50_ms']:.2f} ->"
        f" {after['p50_ms']:.2f} ms ({after['p50_ms'] / before['p50_ms']:.2f}x)")
    return fig


REPLICA_ROWS = env_int("BENCH_REPLICA_ROWS", 20000 if QUICK else 200000)
REPLICA_ROUNDS = env_int("BENCH_REPLICA_ROUNDS", 3)


def section_replicas():
    """What min_replicas costs: one backlog drained with a replica attached
    to the benchmark's Redis, without WAIT (min_replicas 0) and with a WAIT
    for one replica after every chunk (min_replicas 1), rounds alternating on
    the same servers. The replica runs as the primary does (append-only)."""
    rates = {0: [], 1: []}
    batch_ms = {0: [], 1: []}
    with servers() as (pg, rd, conn, rc):
        argv = ["--replicaof", "127.0.0.1", str(rd.port)]
        replica = (harness.Redis(appendonly=False, extra_args=argv) if REDIS_AOF == "no" else
                   harness.Redis(appendonly=True, appendfsync=REDIS_AOF, extra_args=argv))
        with replica:
            rr = replica.client()
            deadline = time.monotonic() + 60
            while rr.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError("the benchmark's replica did not sync")
                time.sleep(0.1)
            for rnd in range(REPLICA_ROUNDS):
                for m in (0, 1):
                    reset_outbox(conn, rc)
                    insert_backlog(conn, REPLICA_ROWS)
                    d = drain(pg, rd, conn, rc, "relay", REPLICA_ROWS, BATCH,
                              relay_flags=dict(min_replicas=m, replica_timeout="1s"))
                    record_drain("replicas", f"replicas.min_replicas_{m}.round{rnd}", d,
                                 f"batch {BATCH}, one replica attached")
                    rates[m].append(d["rate"])
                    if d.get("batch_total_ms") is not None:
                        batch_ms[m].append(d["batch_total_ms"])
            lag = rr.info("replication").get("master_repl_offset")
            rr.close()
            log(f"replicas: replica at offset {lag}")
    for m in (0, 1):
        R.add("replicas", f"min_replicas_{m}.rate", statistics.median(rates[m]), "msg/s",
              f"median of {REPLICA_ROUNDS} rounds, {REPLICA_ROWS} rows, one replica attached")
        if batch_ms[m]:
            R.add("replicas", f"min_replicas_{m}.batch_ms", statistics.median(batch_ms[m]), "ms",
                  "a recorded batch, from its read to its record: the relay's histogram")
    ratio = statistics.median(rates[1]) / statistics.median(rates[0])
    R.add("replicas", "ratio_wait_to_none", ratio, "x",
          "drain rate with min_replicas 1 / with 0")
    log(f"replicas: a WAIT per chunk drains at {ratio:.2f}x the rate without")


CLUSTER_ROWS = env_int("BENCH_CLUSTER_ROWS", 20000 if QUICK else 200000)
CLUSTER_ROUNDS = env_int("BENCH_CLUSTER_ROUNDS", 3)


def section_cluster():
    """The same backlog drained by one relay into the single Redis of the
    other sections and into a Redis Cluster of 3 primaries (no replicas,
    append-only as bench_redis), rounds alternating on one PostgreSQL. The
    clock runs from the relay's start until every entry is in Redis and no
    row is pending; the 4 bench streams fall on 3 primaries."""
    rates = {"single": [], "cluster": []}
    with servers() as (pg, rd, conn, rc):
        with harness.RedisCluster(primaries=3, replicas=0) as cluster:
            reader = None
            try:
                for rnd in range(CLUSTER_ROUNDS):
                    for kind in ("single", "cluster"):
                        reset_outbox(conn, rc)
                        for node in cluster.primaries().values():
                            with contextlib.closing(node.client()) as c:
                                c.flushall()
                        insert_backlog(conn, CLUSTER_ROWS)
                        if kind == "cluster":
                            reader = cluster.reader()
                            counts = lambda: sum(  # noqa: E731
                                reader.owner_xlen(f"bench{i}") for i in range(TOPICS))
                            target, flags = None, dict(env={"OUTBOX_RELAY_REDIS": cluster.url()})
                        else:
                            counts = lambda: stream_total(rc)  # noqa: E731
                            target, flags = rd, {}
                        started = time.monotonic()
                        relay = start_relay(pg, target, batch_size=BATCH, **flags)
                        try:
                            deadline = started + max(120.0, CLUSTER_ROWS / 1500.0)
                            while not (counts() >= CLUSTER_ROWS and pending(conn) == 0):
                                if not relay.alive() or time.monotonic() > deadline:
                                    raise RuntimeError(f"{kind} drain did not finish\n"
                                                       + relay.log_tail())
                                time.sleep(0.02)
                            took = time.monotonic() - started
                        finally:
                            stop_relay(relay)
                        if reader is not None:
                            reader.close()
                            reader = None
                        rates[kind].append(CLUSTER_ROWS / took)
                        R.add("cluster", f"cluster.{kind}.round{rnd}.rate", CLUSTER_ROWS / took,
                              "msg/s")
                        log(f"cluster: {kind} round {rnd}: {CLUSTER_ROWS} rows in {took:.2f}s"
                            f" = {CLUSTER_ROWS / took:,.0f} msg/s")
            finally:
                if reader is not None:
                    reader.close()
    for kind in rates:
        R.add("cluster", f"cluster_{kind}.rate", statistics.median(rates[kind]), "msg/s",
              f"median of {CLUSTER_ROUNDS} rounds, {CLUSTER_ROWS} rows over {TOPICS} topics")
    ratio = statistics.median(rates["cluster"]) / statistics.median(rates["single"])
    R.add("cluster", "ratio_cluster_to_single", ratio, "x", "drain rate into 3 primaries / one")
    log(f"cluster: 3 primaries drain at {ratio:.2f}x one Redis's rate")


def section_storage():
    """STORAGE_ROUNDS rounds of every retention setting, the order turned round
    each round (kept, purged, purged, kept, ...) so that a drift of the shared
    machine falls on both; each figure is the median over the rounds."""
    rounds = {name: [] for name, _, _ in STORAGE_MODES}
    for r in range(STORAGE_ROUNDS):
        modes = STORAGE_MODES if r % 2 == 0 else list(reversed(STORAGE_MODES))
        for name, flags, what in modes:
            rounds[name].append(storage_round(name, flags, what, f"r{r + 1}"))
    for name, figs in rounds.items():
        for key, (_, unit, detail) in figs[0].items():
            values = [f[key][0] for f in figs]
            R.add("storage", f"storage.{name}.{key}", statistics.median(values), unit,
                  f"{detail}; median of {len(values)} rounds" if detail else
                  f"median of {len(values)} rounds")
    kept, purged = rounds["kept"], rounds["purged"]
    pairs = [p["pg_cpu_per_msg_us"][0] / k["pg_cpu_per_msg_us"][0] for k, p in zip(kept, purged)]
    R.add("storage", "storage.purged_vs_kept.pg_cpu_ratio", statistics.median(pairs), "",
          "PostgreSQL CPU per message, purged / kept, per round: " +
          ", ".join(f"{p:.2f}" for p in pairs))


# --------------------------------------------------------------------------
# Latency.

SUSTAINED_P99_MS = 200

# The latency and rate targets the relay's own runs are held against (issue
# 40's are ratios to PgQ and to the plain table, measured in the same run).
TARGET_P99_2000_MS = 20.0
TARGET_MAX_RATE = 6000

# The wake-up lock a busy relay holds (migrations/007): a session holding it
# spares producers their NOTIFY, as a busy relay does.
WAKEUP_LOCK = 122550254464888


def sustained(res, rate):
    """The producers keep the rate and the relay keeps up with them: p99 stays low."""
    v = res["visible_ms"]
    return (res["achieved_rate"] >= 0.95 * rate and res["missing_visible"] == 0
            and v.get("p99", 1e9) < SUSTAINED_P99_MS)


def producers_alone(pg, rd, conn, tag, async_commit):
    """The producers at the target rate with no relay running and the wake-up
    lock held, as a busy relay holds it: whether the load generator alone can
    offer the rate the ramp's target asks the relay to hold, and what it costs
    the machine. Its rows are removed before the relay starts."""
    busy = pg.connect()
    try:
        execute(busy, f"SELECT pg_advisory_lock({WAKEUP_LOCK})")
        cpu0, t0 = machine_busy(), time.monotonic()
        res = loadgen(pg, rd, rate=TARGET_MAX_RATE, seconds=RAMP_SECONDS, wait=0,
                      group="alone", async_commit=async_commit)
        cores = (machine_busy() - cpu0) / (time.monotonic() - t0)
    finally:
        busy.close()
    execute(conn, "TRUNCATE outbox.messages")
    sc = "off" if async_commit else "on"
    R.add("latency", f"{tag}.alone.achieved_rate", res["achieved_rate"], "rows/s",
          f"producers alone at {TARGET_MAX_RATE}/s, no relay, wake-up lock held,"
          f" synchronous_commit {sc}")
    R.add("latency", f"{tag}.alone.cores", cores, "cores",
          "the machine's busy CPU over the load generator's run, start and connections"
          " included")
    log(f"{tag}: producers alone (synchronous_commit {sc}, no relay) at {TARGET_MAX_RATE}/s"
        f" achieve {res['achieved_rate']:,.0f}/s")


def ramp(pg, rd, conn, relay, tag, name, async_commit):
    """Producers flat out, then fixed rates below that (0.9, 0.8, ... 0.2 of it,
    and the target rate when it is below it) until one holds: the highest rate
    that holds, or None."""
    wait_drained(conn, 60, relay)
    flat = loadgen(pg, rd, rate=0, seconds=RAMP_SECONDS, wait=10, group="ramp",
                   async_commit=async_commit)
    R.add_dict("latency", f"{tag}.unthrottled", flat, dict(_ms="ms", rate="rows/s", seconds="s"))
    capacity = flat["achieved_rate"]
    sc = "off" if async_commit else "on"
    log(f"{tag}: producers (synchronous_commit {sc}) flat out commit {capacity:,.0f} rows/s,"
        f" p99 commit -> visible {flat['visible_ms'].get('p99')} ms")
    max_rate = None
    # Steps below the producers' flat-out rate, and the target's own rate
    # whenever they can offer it: on a host where they offer little more than
    # the target, the steps alone would pass it by.
    rates = {int(capacity * f / 100) * 100 for f in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)}
    if TARGET_MAX_RATE <= capacity:
        rates.add(TARGET_MAX_RATE)
    for rate in sorted(rates, reverse=True):
        if rate <= 0:
            break
        wait_drained(conn, 60, relay)
        res = loadgen(pg, rd, rate=rate, seconds=RAMP_SECONDS, wait=10, group="ramp",
                      async_commit=async_commit)
        ok = sustained(res, rate)
        R.add("latency", f"{tag}.{rate}.achieved_rate", res["achieved_rate"], "rows/s")
        R.add("latency", f"{tag}.{rate}.visible_p99", res["visible_ms"].get("p99"), "ms")
        R.add("latency", f"{tag}.{rate}.sustained", int(ok))
        log(f"{tag}: {rate}/s -> {res['achieved_rate']:,.0f}/s,"
            f" p99 {res['visible_ms'].get('p99')} ms: {'holds' if ok else 'does not hold'}")
        if ok:
            max_rate = rate
            break
    R.add("latency", name, max_rate or 0, "rows/s",
          f"highest fixed rate that held in the ramp (achieved >= 95%,"
          f" p99 < {SUSTAINED_P99_MS} ms), producers with synchronous_commit {sc}")
    return max_rate


def section_latency():
    with servers() as (pg, rd, conn, rc):
        for tag, async_commit in (("ramp", False), ("ramp_async", True)):
            producers_alone(pg, rd, conn, tag, async_commit)
        relay = start_relay(pg, rd, batch_size=BATCH)
        try:
            # Warm up: one row through, then let the relay settle into idle.
            harness.insert(conn, "bench0", b"warm-up")
            harness.wait_until(lambda: stream_total(rc) >= 1, timeout=30, relay=relay,
                               message="the first row to be published")
            time.sleep(1.5)
            res = loadgen(pg, rd, rate=20, count=IDLE_ROWS, producers=1, wait=5, group="idle")
            R.add_dict("latency", "idle", res, dict(_ms="ms", rate="rows/s", seconds="s"),
                       f"{IDLE_ROWS} single-row commits 50 ms apart, relay idle")
            log(f"idle relay: commit -> visible p50 {res['visible_ms'].get('p50')} ms,"
                f" p99 {res['visible_ms'].get('p99')} ms")

            max_rate = ramp(pg, rd, conn, relay, "ramp", "max_rate", False)
            rates = sorted(set(RATES + ([max_rate] if max_rate else [])))
            for rate in rates:
                wait_drained(conn, 120, relay)
                relay_cpu0 = proc_cpu(relay.pid)
                meter = CpuMeter(pg, rd)
                ticks = cpu_ticks()
                res = loadgen(pg, rd, rate=rate, seconds=RATE_SECONDS, wait=10,
                              group=f"g{rate}")
                shares = cpu_shares(ticks, cpu_ticks())
                relay_cpu = proc_cpu(relay.pid) - relay_cpu0
                pg_cpu, rd_cpu = meter.read()
                name = f"load.{rate}"
                R.add_dict("latency", name, res, dict(_ms="ms", rate="rows/s", seconds="s"),
                           "max" if rate == max_rate else "")
                R.add("latency", f"{name}.relay_cpu", relay_cpu, "s")
                R.add("latency", f"{name}.relay_cpu_per_100k",
                      relay_cpu / max(res["committed"], 1) * 1e5, "s")
                R.add("latency", f"{name}.pg_cpu", pg_cpu, "s")
                R.add("latency", f"{name}.redis_cpu", rd_cpu, "s")
                # A virtual machine's host may run other guests on its cores: the
                # time it takes ("steal") is time this run's processes waited.
                R.add("latency", f"{name}.steal", shares["steal"] * 100, "%",
                      "CPU time the host took from this machine during the run")
                R.add("latency", f"{name}.idle", (shares["idle"] + shares["iowait"]) * 100, "%")
                v, a = res["visible_ms"], res["acked_ms"]
                log(f"{rate}/s: achieved {res['achieved_rate']:,.0f}/s; commit -> visible"
                    f" p50 {v.get('p50')} p99 {v.get('p99')} p99.9 {v.get('p999')} max"
                    f" {v.get('max')} ms; -> ack p50 {a.get('p50')} p99 {a.get('p99')} ms;"
                    f" missing {res['missing_visible']}/{res['missing_acked']};"
                    f" stolen by the host {shares['steal'] * 100:.0f} %")
            R.add("latency", "latency.rates", ",".join(str(r) for r in rates))
            # The ramp again with the producers committing asynchronously:
            # their WAL flushes no longer cap the rate they offer. Last, as it
            # leaves the most dead rows behind.
            ramp(pg, rd, conn, relay, "ramp_async", "max_rate_async", True)
        finally:
            stop_relay(relay)


# --------------------------------------------------------------------------
# Producers.

def pgbench(pg, script, clients, seconds):
    argv = [os.path.join(pg.bindir, "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(pg.port),
            "-U", "postgres", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2)),
            "-T", str(seconds), "-f", script, pg.database]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=seconds + 120)
    m = re.search(r"tps = ([\d.]+) \(without initial connection time\)", proc.stdout)
    if proc.returncode != 0 or not m:
        raise RuntimeError(f"pgbench failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    lat = re.search(r"latency average = ([\d.]+) ms", proc.stdout)
    n = re.search(r"number of transactions actually processed: (\d+)", proc.stdout)
    return dict(tps=float(m.group(1)), latency_ms=float(lat.group(1)) if lat else None,
                transactions=int(n.group(1)) if n else None)


class NotifyCounter:
    """Counts the wake-up notifications a LISTEN session receives while it runs:
    how often producers paid for one."""

    def __init__(self, pg):
        self.conn = pg.connect()
        self.conn.autocommit = True
        execute(self.conn, "LISTEN outbox_relay")
        self.count = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            if select.select([self.conn], [], [], 0.2)[0]:
                self.conn.poll()
                self.count += len(self.conn.notifies)
                self.conn.notifies.clear()

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.conn.close()
        return self.count


def wake_triggers(conn):
    with conn.cursor() as cur:
        cur.execute("SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger"
                    " WHERE tgrelid = 'outbox.messages'::regclass AND NOT tgisinternal")
        return cur.fetchall()


# The producers' table without anything the relay adds (no txid, no partition
# number, no trigger, no index but the keys): bench/extra/outbox_layout.sql's
# layout_proto.plain.
PLAIN_TABLE = """
CREATE SCHEMA IF NOT EXISTS bench_plain;
CREATE TABLE IF NOT EXISTS bench_plain.messages (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    uuid        NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    topic         text        NOT NULL,
    partition_key text,
    payload       bytea       NOT NULL,
    headers       jsonb,
    created_at    timestamptz NOT NULL DEFAULT now()
)"""


def section_producers():
    with servers() as (pg, rd, conn, rc):
        triggers = wake_triggers(conn)
        tdef = dict(triggers).get("messages_notify")
        if tdef is None:
            raise RuntimeError(f"no trigger messages_notify on outbox.messages: {triggers}")
        R.add("producers", "trigger.definition", tdef)
        src = scalar(conn, "SELECT prosrc FROM pg_proc WHERE oid = 'outbox.notify_relay'::regproc")
        R.add("producers", "trigger.function", " ".join(src.split()))
        tmp = tempfile.mkdtemp(prefix="outbox-bench-")
        script = os.path.join(tmp, "insert.sql")
        payload = bytes((i * 37 + 11) & 0xFF for i in range(PAYLOAD)).hex()
        with open(script, "w") as f:
            f.write(f"INSERT INTO outbox.messages (topic, payload) VALUES ('bench', '\\x{payload}');\n")
        # The plain table: the producers' columns and keys, nothing the relay adds.
        execute(conn, PLAIN_TABLE)
        plain_script = os.path.join(tmp, "insert-plain.sql")
        with open(plain_script, "w") as f:
            f.write(f"INSERT INTO bench_plain.messages (topic, payload) VALUES ('bench',"
                    f" '\\x{payload}');\n")
        with conn.cursor() as cur:
            cur.execute("SELECT indexdef FROM pg_indexes WHERE schemaname = 'outbox'"
                        " AND tablename = 'messages' ORDER BY indexname")
            R.add("producers", "outbox.indexes", "; ".join(r[0] for r in cur.fetchall()))
        R.add("producers", "outbox.triggers", "; ".join(t for t, _ in wake_triggers(conn)))

        def run(name, clients, relay=None, drop=False, seconds=PGBENCH_SECONDS, plain=False):
            if plain:
                execute(conn, "TRUNCATE bench_plain.messages")
            if drop:
                execute(conn, "DROP TRIGGER messages_notify ON outbox.messages")
            if relay is not None:
                harness.wait_until(lambda: pending(conn) == 0, timeout=120, relay=relay,
                                   message="the rows of the round before to be published")
            fresh_round(conn, rc, "bench")
            execute(conn, "CHECKPOINT")
            cpu0 = proc_cpu(relay.pid) if relay else 0
            batches0 = relay_batches(relay) if relay else None
            meter = CpuMeter(pg, rd)
            counter = NotifyCounter(pg)
            children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            try:
                res = pgbench(pg, plain_script if plain else script, clients, seconds)
            finally:
                notifications = counter.close()
                if drop:
                    execute(conn, tdef)
            children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            pgbench_cpu = (children1.ru_utime - children0.ru_utime
                           + children1.ru_stime - children0.ru_stime)
            relay_cpu = proc_cpu(relay.pid) - cpu0 if relay else 0
            pg_cpu, _ = meter.read()
            res["pg_cpu"] = pg_cpu
            res["pgbench_cpu"] = pgbench_cpu
            res["other_cores"] = meter.other(pgbench_cpu + relay_cpu) / seconds
            res["notifications"] = notifications
            if relay is not None:
                res["relay_cpu"] = relay_cpu
                batches1 = relay_batches(relay)
                if batches0 is not None and batches1 is not None:
                    res["relay_batches"] = batches1 - batches0
                    if res.get("transactions"):
                        res["rows_per_batch"] = res["transactions"] / max(1, batches1 - batches0)
            R.add_dict("producers", name, res, dict(tps="tx/s", _ms="ms", _cpu="s", _cores="cores"))
            log(f"{name}: {res['tps']:,.0f} tx/s, {notifications} notifications"
                + (f", relay CPU {res['relay_cpu']:.1f}s in {res.get('relay_batches')} batches"
                   if relay is not None else ""))
            return res

        relay = start_relay(pg, rd, batch_size=BATCH)
        try:
            harness.insert(conn, "bench", b"warm-up")
            harness.wait_until(lambda: pending(conn) == 0, timeout=30, relay=relay,
                               message="the first row to be published")
            for sync in ("on", "off"):
                execute(conn, f"ALTER SYSTEM SET synchronous_commit = {sync}")
                execute(conn, "SELECT pg_reload_conf()")
                time.sleep(0.2)
                for i, clients in enumerate(PRODUCER_CLIENTS):
                    if clients != max(PRODUCER_CLIENTS) or PRODUCER_ROUNDS < 2:
                        order = ("with", "without") if i % 2 == 0 else ("without", "with")
                        for wake in order:
                            run(f"producers.sync_{sync}.c{clients}.{wake}", clients, relay,
                                drop=wake == "without")
                        continue
                    # The target's case: rounds in turns, the figures their
                    # medians; one round each varied 0.86-1.09 between runs.
                    name = f"producers.sync_{sync}.c{clients}"
                    tps = {"with": [], "without": []}
                    for rnd in range(PRODUCER_ROUNDS):
                        order = ("with", "without") if (i + rnd) % 2 == 0 else ("without", "with")
                        for wake in order:
                            res = run(f"{name}.{wake}.r{rnd + 1}", clients, relay,
                                      drop=wake == "without")
                            tps[wake].append(res["tps"])
                    for wake, values in tps.items():
                        R.add("producers", f"{name}.{wake}.tps", statistics.median(values),
                              "tx/s", f"median of {len(values)} rounds in turns")
                    ratios = [w / wo for w, wo in zip(tps["with"], tps["without"]) if wo]
                    R.add("producers", f"{name}.ratio_by_round",
                          " / ".join(f"{x:.2f}" for x in ratios))
                    log(f"{name}: with / without wake-up by round"
                        f" {', '.join(f'{x:.2f}' for x in ratios)}")
        finally:
            stop_relay(relay)
        # Without a relay: what the trigger alone costs the producers, when every
        # transaction notifies (no relay holds the wake-up lock: an idle relay)
        # against no trigger at all; then the outbox as the relay's migrations
        # leave it, the wake-up lock held by a session as a busy relay holds it
        # (migrations/007: no notification), against the plain table, in
        # PRODUCER_ROUNDS rounds in turns (the issue's target: at least 0.95).
        # Each run starts from fresh_round's state.
        clients = max(PRODUCER_CLIENTS)
        busy = pg.connect()
        try:
            for sync in ("on", "off"):
                execute(conn, f"ALTER SYSTEM SET synchronous_commit = {sync}")
                execute(conn, "SELECT pg_reload_conf()")
                time.sleep(0.2)
                execute(busy, "SELECT pg_advisory_unlock_all()")
                name = f"producers.norelay.sync_{sync}.c{clients}"
                for case, drop in (("notify", False), ("dropped", True)):
                    run(f"{name}.{case}", clients, drop=drop, seconds=NORELAY_SECONDS)
                execute(busy, f"SELECT pg_advisory_lock({WAKEUP_LOCK})")
                tps = {"busy": [], "plain": []}
                for rnd in range(PRODUCER_ROUNDS):
                    for case in (("busy", "plain") if rnd % 2 == 0 else ("plain", "busy")):
                        res = run(f"{name}.{case}.r{rnd + 1}", clients, plain=case == "plain",
                                  seconds=NORELAY_SECONDS)
                        tps[case].append(res["tps"])
                execute(busy, "SELECT pg_advisory_unlock_all()")
                for case, values in tps.items():
                    R.add("producers", f"{name}.{case}.tps", statistics.median(values), "tx/s",
                          f"median of {len(values)} rounds in turns")
                ratios = [b / p for b, p in zip(tps["busy"], tps["plain"]) if p]
                R.add("producers", f"{name}.additions_ratio_by_round",
                      " / ".join(f"{x:.2f}" for x in ratios))
                log(f"{name}: the relay's outbox / the plain table by round"
                    f" {', '.join(f'{x:.2f}' for x in ratios)}")
        finally:
            busy.close()
            execute(conn, "ALTER SYSTEM RESET synchronous_commit")
            execute(conn, "SELECT pg_reload_conf()")
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------
# Limits.

def section_limits():
    """Each end of the relay alone, at its ceiling: the batch read (PostgreSQL's
    side: tick, bounds, rows, record) over a backlog of BATCH-row batches, and
    the publish (Redis's side: a batch's MULTI / XADD / EXEC calls pipelined)."""
    with servers() as (pg, rd, conn, rc):
        d = batch_read_alone(conn, LIMIT_ROWS)
        R.add_dict("limits", "limit.batch_read", d, dict(rate="rows/s", seconds="s", _ms="ms"),
                   f"per batch of {BATCH}: outbox.tick(), batch_bounds + batch_rows (every"
                   " column, COPY binary to the client), record_batch; one connection, no Redis")
        log(f"batch read alone: {d['rate']:,.0f} rows/s (a batch of {BATCH}: tick"
            f" {d['tick_ms']:.2f} ms, read {d['read_ms']:.2f} ms, record {d['record_ms']:.2f} ms)")
        p = publish_alone(rd, PUBLISH_CALLS)
        R.add_dict("limits", "limit.publish", p, dict(msgs="msg/s", calls_per_s="calls/s",
                                                      seconds="s", _ms="ms"),
                   f"batches of {BATCH} over {TOPICS} streams: MULTI, up to {CALL_ROWS} XADD"
                   " with explicit ids, EXEC per call; a batch's calls pipelined on one"
                   " connection")
        log(f"publish alone: {p['msgs']:,.0f} msg/s ({p['calls_per_s']:,.0f} calls/s,"
            f" {p['batch_ms']:.2f} ms a batch)")


# --------------------------------------------------------------------------
# Side by side: PgQ, what a user would pick instead.

PGQ_QUEUE = "bench"


def pgq_setup(conn):
    """PgQ in the benchmark's database: one queue whose ticker ticks as soon as
    one event is new (ticker_max_count 1), and one consumer."""
    execute(conn, "CREATE EXTENSION IF NOT EXISTS pgq")
    execute(conn, "SELECT pgq.create_queue(%s)", (PGQ_QUEUE,))
    execute(conn, "SELECT pgq.set_queue_config(%s, 'ticker_max_count', '1')", (PGQ_QUEUE,))
    execute(conn, "SELECT pgq.register_consumer(%s, 'bench')", (PGQ_QUEUE,))


def pgq_backlog(conn, n):
    """n events of the drain's shape: 200 characters over 4 topics."""
    execute(conn, "SELECT count(pgq.insert_event(%s, 'bench' || (g %% %s),"
                  " substring(repeat(md5(g::text), 7) FROM 1 FOR %s)))"
                  " FROM generate_series(1, %s) AS g", (PGQ_QUEUE, TOPICS, PAYLOAD, n))
    execute(conn, "CHECKPOINT")


def start_pgq(pg, rd):
    proc = subprocess.Popen([PGQ_BIN, "--postgres", pg.dsn(), "--redis-port", str(rd.port),
                             "--queue", PGQ_QUEUE, "--fetch", str(BATCH)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # connected, and polling
    if proc.poll() is not None:
        raise RuntimeError(f"bench-pgq exited: {proc.stderr.read()[-2000:]}")
    return proc


def stop_pgq(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bench-pgq failed ({proc.returncode}): {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def stream_ids(rc):
    """(entries, distinct outbox_id values) over the benchmark's streams."""
    total, ids = 0, set()
    for i in range(TOPICS):
        last = "-"
        while True:
            chunk = rc.xrange(f"bench{i}", min=last, max="+", count=10000)
            if last != "-":
                chunk = chunk[1:]
            if not chunk:
                break
            for entry_id, fields in chunk:
                total += 1
                ids.add(fields.get(b"outbox_id") or fields.get("outbox_id"))
            last = chunk[-1][0]
    return total, len(ids)


def alt_drain(kind):
    """A drain of ALT_ROWS by the relay (its defaults) or by PgQ and bench-pgq."""
    with servers() as (pg, rd, conn, rc):
        aof0 = aof_bytes(rc)
        if kind == "pgq":
            pgq_setup(conn)
            pgq_backlog(conn, ALT_ROWS)
            meter = CpuMeter(pg, rd)
            started = time.monotonic()
            proc = start_pgq(pg, rd)
            try:
                deadline = started + max(120.0, ALT_ROWS / 1000.0)
                while stream_total(rc) < ALT_ROWS:
                    if proc.poll() is not None:
                        raise RuntimeError(f"bench-pgq exited: {proc.stderr.read()[-2000:]}")
                    if time.monotonic() > deadline:
                        raise RuntimeError("the PgQ drain did not finish")
                    time.sleep(0.02)
                took = time.monotonic() - started
                cpu = proc_cpu(proc.pid)
                pg_cpu, rd_cpu = meter.read()
            finally:
                out = stop_pgq(proc)
            d = dict(rows=ALT_ROWS, seconds=took, rate=ALT_ROWS / took, cpu=cpu, pg_cpu=pg_cpu,
                     redis_cpu=rd_cpu, total_cpu_per_100k=(cpu + pg_cpu + rd_cpu) / ALT_ROWS * 1e5,
                     batches=out["batches"])
        else:
            insert_backlog(conn, ALT_ROWS)
            full = drain(pg, rd, conn, rc, "relay", ALT_ROWS, BATCH)
            d = {k: full[k] for k in ("rows", "seconds", "rate", "cpu", "pg_cpu", "redis_cpu",
                                      "total_cpu_per_100k")}
        time.sleep(0.5)  # a copy still on its way would land now
        total, distinct = stream_ids(rc)
        d["entries"] = total
        d["lost"] = ALT_ROWS - distinct
        d["doubled"] = total - distinct
        d["aof_bytes_per_msg"] = (aof_bytes(rc) - aof0) / ALT_ROWS
        return d


def alt_latency(kind, rate):
    """Commit -> visible to a reader (bench-loadgen's XREAD thread) at a fixed rate,
    through the relay or through PgQ."""
    with servers() as (pg, rd, conn, rc):
        if kind == "pgq":
            pgq_setup(conn)
            proc = start_pgq(pg, rd)
            try:
                res = loadgen(pg, rd, rate=rate, seconds=ALT_SECONDS, wait=10, group="alt",
                              pgq=PGQ_QUEUE)
            finally:
                stop_pgq(proc)
        else:
            relay = start_relay(pg, rd, batch_size=BATCH)
            try:
                harness.insert(conn, "bench0", b"warm-up")
                harness.wait_until(lambda: stream_total(rc) >= 1, timeout=30, relay=relay,
                                   message="the first row to be published")
                res = loadgen(pg, rd, rate=rate, seconds=ALT_SECONDS, wait=10, group="alt")
            finally:
                stop_relay(relay)
        return res


def alt_crash(kind):
    """A drain of ALT_CRASH_ROWS killed (SIGKILL) once half of it is in Redis,
    then started again: what each tool loses or publishes twice."""
    n = ALT_CRASH_ROWS
    with servers() as (pg, rd, conn, rc):
        if kind == "pgq":
            pgq_setup(conn)
            pgq_backlog(conn, n)
            start = lambda: start_pgq(pg, rd)  # noqa: E731
        else:
            insert_backlog(conn, n)
            start = lambda: start_relay(pg, rd, batch_size=BATCH)  # noqa: E731
        proc = start()
        harness.wait_until(lambda: stream_total(rc) >= n // 2, timeout=120, interval=0.002,
                           message=f"half of the backlog to reach Redis through {kind}")
        if kind == "pgq":
            proc.kill()
            proc.wait()
        else:
            proc.kill()
            proc.close()
        killed_at = stream_total(rc)
        proc = start()
        try:
            # Done when every message is in and nothing has come for 2 s.
            last, quiet = -1, time.monotonic()
            deadline = time.monotonic() + 300
            while True:
                now_total = stream_total(rc)
                if now_total != last:
                    last, quiet = now_total, time.monotonic()
                if now_total >= n and time.monotonic() - quiet > 2.0 and (
                        kind == "pgq" or pending(conn) == 0):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {kind} drain after the kill did not finish")
                time.sleep(0.1)
        finally:
            if kind == "pgq":
                stop_pgq(proc)
            else:
                stop_relay(proc)
        total, distinct = stream_ids(rc)
        return dict(rows=n, killed_at=killed_at, entries=total, lost=n - distinct,
                    doubled=total - distinct)


def section_alternatives():
    drains = {"relay": [], "pgq": []}
    for i in range(ALT_ROUNDS):
        for kind in (("relay", "pgq") if i % 2 == 0 else ("pgq", "relay")):
            d = alt_drain(kind)
            drains[kind].append(d)
            log(f"alternatives: drain of {ALT_ROWS:,} by {kind}: {d['rate']:,.0f} msg/s,"
                f" CPU (client+PostgreSQL+Redis) {d['total_cpu_per_100k']:.2f} s per 100k,"
                f" lost {d['lost']}, doubled {d['doubled']}")
    for kind, runs in drains.items():
        for key in ("rate", "total_cpu_per_100k", "seconds", "cpu", "pg_cpu", "redis_cpu",
                    "aof_bytes_per_msg"):
            R.add("alternatives", f"alt.{kind}.drain.{key}",
                  statistics.median(r[key] for r in runs),
                  dict(rate="msg/s", aof_bytes_per_msg="bytes").get(key, "s"),
                  f"median of {len(runs)} drains")
        for key in ("lost", "doubled"):
            R.add("alternatives", f"alt.{kind}.drain.{key}", sum(r[key] for r in runs), "msgs",
                  f"over {len(runs)} drains of {ALT_ROWS:,}")
    for kind in ("relay", "pgq"):
        d = alt_crash(kind)
        R.add_dict("alternatives", f"alt.{kind}.crash", d, dict(rows="msgs", killed_at="msgs",
                                                                 entries="msgs", lost="msgs",
                                                                 doubled="msgs"),
                   f"a drain of {ALT_CRASH_ROWS:,} killed halfway and started again")
        log(f"alternatives: {kind} killed with {d['killed_at']:,} of {d['rows']:,} in Redis:"
            f" lost {d['lost']}, published twice {d['doubled']}")
    for rate in ALT_RATES:
        for kind in ("relay", "pgq"):
            res = alt_latency(kind, rate)
            name = f"alt.{kind}.load.{rate}"
            R.add_dict("alternatives", name, res, dict(_ms="ms", rate="rows/s", seconds="s"))
            v = res["visible_ms"]
            log(f"alternatives: {rate}/s through {kind}: achieved {res['achieved_rate']:,.0f}/s,"
                f" commit -> visible p50 {v.get('p50')} p99 {v.get('p99')} ms,"
                f" missing {res['missing_visible']}, doubled {res['duplicate_visible']}")


# --------------------------------------------------------------------------
# TLS to Redis.

TLS_ROWS = env_int("BENCH_TLS_ROWS", 20000 if QUICK else 200000)
TLS_ROUNDS = env_int("BENCH_TLS_ROUNDS", 2)
TLS_RATE = env_int("BENCH_TLS_RATE", 2000)


def section_tls():
    """What TLS to Redis costs: the same Redis reached on its plain port and
    on its TLS port (mutual TLS, the CA and the name checked), rounds
    alternating on one PostgreSQL."""
    if "with TLS to Redis" not in cmd_out([RELAY_BIN, "--version"]):
        log("tls: not run: this relay is built without TLS to Redis (hiredis 0.14)")
        R.add("tls", "tls.not_run", 1, "", "outbox-relay --version: built without TLS to Redis")
        return
    tmp = tempfile.mkdtemp(prefix="outbox-bench-tls-")
    try:
        ca = harness.make_ca(tmp, "bench-ca")
        server = harness.make_cert(tmp, ca, "redis")
        client = harness.make_cert(tmp, ca, "relay", hosts=("outbox-relay",), usage="clientAuth")
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        tls_port = harness.free_port()
        tls_args = ["--tls-port", str(tls_port), "--tls-cert-file", server[0],
                    "--tls-key-file", server[1], "--tls-ca-cert-file", ca[0],
                    "--tls-auth-clients", "yes"]
        with BenchPostgres() as pg, bench_redis(tls_args) as rd:
            conn, rc = pg.connect(), rd.client()
            try:
                url = (rd.url().replace("redis://", "rediss://", 1)
                       .replace(f"127.0.0.1:{rd.port}/", f"localhost:{tls_port}/")
                       + f"?ca_file={ca[0]}&cert_file={client[0]}&key_file={client[1]}")
                runs = {"plain": [], "tls": []}
                for rnd in range(TLS_ROUNDS):
                    for kind in (("plain", "tls") if rnd % 2 == 0 else ("tls", "plain")):
                        flags = {"env": {"OUTBOX_RELAY_REDIS": url}} if kind == "tls" else {}
                        reset_outbox(conn, rc)
                        insert_backlog(conn, TLS_ROWS)
                        d = drain(pg, rd, conn, rc, "relay", TLS_ROWS, BATCH, relay_flags=flags)
                        reset_outbox(conn, rc)
                        relay = start_relay(pg, rd, batch_size=BATCH, **flags)
                        try:
                            harness.insert(conn, "bench0", b"warm-up")
                            harness.wait_until(lambda: stream_total(rc) >= 1, timeout=30,
                                               relay=relay, message="the first row published")
                            res = loadgen(pg, rd, rate=TLS_RATE, seconds=ALT_SECONDS, wait=10,
                                          group="tls")
                        finally:
                            stop_relay(relay)
                        d["p99_ms"] = res["visible_ms"].get("p99")
                        d["p50_ms"] = res["visible_ms"].get("p50")
                        runs[kind].append(d)
                        log(f"tls: {kind} round {rnd}: drain {d['rate']:,.0f} msg/s, relay CPU"
                            f" {d['cpu_per_100k']:.3f} s per 100k, Redis CPU {d['redis_cpu']:.2f}"
                            f" s; at {TLS_RATE}/s commit -> visible p50 {d['p50_ms']} p99"
                            f" {d['p99_ms']} ms")
            finally:
                conn.close()
                rc.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for kind, ds in runs.items():
        for key, unit in (("rate", "msg/s"), ("cpu_per_100k", "s"), ("redis_cpu", "s"),
                          ("total_cpu_per_100k", "s"), ("p50_ms", "ms"), ("p99_ms", "ms")):
            R.add("tls", f"tls.{kind}.{key}", statistics.median(d[key] for d in ds), unit,
                  f"median of {len(ds)} rounds; drain of {TLS_ROWS:,}, latency at {TLS_RATE}/s")
    for key, what in (("rate", "drain rate"), ("cpu_per_100k", "relay CPU per message"),
                      ("total_cpu_per_100k", "relay + PostgreSQL + Redis CPU per message"),
                      ("p99_ms", "commit -> visible p99")):
        ratio = (statistics.median(d[key] for d in runs["tls"])
                 / statistics.median(d[key] for d in runs["plain"]))
        R.add("tls", f"ratio_tls_to_plain.{key}", ratio, "x", f"{what}, TLS / plain")
        log(f"tls: {what}: TLS / plain = {ratio:.2f}x")


# --------------------------------------------------------------------------
# Profile.

def section_profile():
    perf = shutil.which("perf")
    if perf is None:
        R.add("profile", "skipped", "perf not installed")
        return
    with servers() as (pg, rd, conn, rc):
        insert_backlog(conn, PROFILE_ROWS)
        data = os.path.join(tempfile.mkdtemp(prefix="outbox-perf-"), "perf.data")
        rec = subprocess.Popen([perf, "record", "-a", "-F", "997", "-o", data, "--", "sleep",
                                "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            d = drain(pg, rd, conn, rc, "relay", PROFILE_ROWS, BATCH)
            record_drain("profile", "profile.drain", d, "under perf record -a (slower)")
        finally:
            rec.send_signal(signal.SIGINT)
            rec.wait(timeout=60)
        out = []

        def report(title, *args):
            proc = subprocess.run([perf, "report", "-i", data, "--stdio", "--no-children",
                                   *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln and not ln.startswith("#")]
            out.append(f"== {title}\n" + "\n".join(lines[:40]) + "\n")
            return lines

        lines = report("CPU samples by process (both cores; swapper = idle)", "--sort", "comm")
        for ln in lines:
            m = re.match(r"\s*([\d.]+)%\s+(\S+)", ln)
            if m:
                R.add("profile", f"profile.share.{m.group(2)}", float(m.group(1)), "%")
        report("by process and library", "--sort", "comm,dso")
        report("outbox-relay: symbols", "--comm", "outbox-relay", "--sort", "dso,sym")
        report("postgres: symbols", "--comm", "postgres", "--sort", "dso,sym")
        report("redis-server: symbols", "--comm", "redis-server", "--sort", "dso,sym")
        with open(os.path.join(RESULTS, "profile-drain.txt"), "w") as f:
            f.write(f"perf record -a -F 997 during a drain of {PROFILE_ROWS} rows"
                    f" (batch {BATCH}); perf report --no-children\n\n" + "\n".join(out))
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)


# --------------------------------------------------------------------------
# The table.

def build_table():
    g = R.get

    # Issue 40's targets, each a ratio measured in this run.
    R.row(f"drain of {ALT_ROWS:,}, relay (its defaults)", g("alt.relay.drain.rate"), "msg/s",
          "PgQ and bench-pgq, same backlog", g("alt.pgq.drain.rate"), "≥ 1.0")
    R.row("the same drains: relay+PostgreSQL+Redis CPU per 100k",
          g("alt.relay.drain.total_cpu_per_100k"), "s", "PgQ: bench-pgq+PostgreSQL+Redis",
          g("alt.pgq.drain.total_cpu_per_100k"), "≤ 1.5")
    R.row(f"Redis used memory after the {ROWS:,} drain less its streams' own (nothing kept per"
          " message)", g("drain.redis_memory.beyond_streams_bytes"), "bytes",
          "the same Redis empty, before the drain", g("drain.redis_memory.empty_used_bytes"),
          "≤ 1.10")
    lost, doubled = g("alt.relay.crash.lost"), g("alt.relay.crash.doubled")
    if lost is not None:
        R.row(f"a drain of {ALT_CRASH_ROWS:,} killed (SIGKILL) halfway and restarted, relay:"
              " messages lost / published twice (ratio: their sum)", f"{lost} / {doubled}", "msgs",
              target="≤ 0", ratio=float(lost + doubled))
    R.row("load 2000/s: commit → visible (XREAD) p99, relay",
          g("alt.relay.load.2000.visible_ms.p99"), "ms", "PgQ, same load", g("alt.pgq.load.2000.visible_ms.p99"), "≤ 0.5")
    R.row(f"a batch of {UNIT_BATCH} rows on 8 streams, the relay owning 4096 partitions"
          " (its histogram: tick's read to record)", g("units_4096.batch_ms"), "ms",
          "owning 8", g("units_8.batch_ms"), "≤ 2.0")
    R.row("the same batches: relay + PostgreSQL + Redis CPU per batch (the INSERT included)",
          g("units_4096.cpu_per_batch_ms"), "ms", "owning 8", g("units_8.cpu_per_batch_ms"))
    R.row("the same batches: the relay's CPU per batch", g("units_4096.relay_cpu_per_batch_ms"),
          "ms", "owning 8", g("units_8.relay_cpu_per_batch_ms"))
    for sync in ("on", "off"):
        c = max(PRODUCER_CLIENTS)
        R.row(f"no relay: {c} producers, synchronous_commit {sync}, into the relay's outbox"
              " (every addition; wake-up lock held as by a busy relay)",
              g(f"producers.norelay.sync_{sync}.c{c}.busy.tps"), "tx/s",
              "the plain table (producers' columns and keys only)",
              g(f"producers.norelay.sync_{sync}.c{c}.plain.tps"), "≥ 0.95")

    # The relay against each of its ends alone.
    relay_rate = g("drain.relay.rate")
    read, pub = g("limit.batch_read.rate"), g("limit.publish.msgs")
    R.row(f"drain {ROWS:,} rows, relay (batch {BATCH})", relay_rate, "msg/s")
    if read and pub:
        R.add("limits", "limit.serial_bound", 1 / (1 / read + 1 / pub), "msg/s",
              "1/(1/batch read + 1/publish): both ends at their limit, one after the other")
        R.add("limits", "limit.overlap_bound", min(read, pub), "msg/s",
              "min(batch read, publish): both ends at their limit, overlapped")
        # No target: the drain's backlog is one transaction, one batch read in
        # chunks with one tick and one record, where the limit's batches of
        # BATCH rows each take their own.
        R.row("drain, relay (its backlog: one batch, read in chunks)", relay_rate, "msg/s",
              f"min(batch read, publish) alone (batches of {BATCH}, each with its tick and"
              " record)", min(read, pub))
    R.row(f"batch read alone (tick, bounds, rows, record; batches of {BATCH}, no Redis)", read,
          "rows/s")
    R.row(f"publish alone (MULTI / XADD with ids / EXEC, calls of {CALL_ROWS}, a batch's calls"
          " pipelined)", pub, "msg/s")
    R.row("relay CPU per 100k messages", g("drain.relay.cpu_per_100k"), "s")
    phases = [g(f"drain.relay.phase_{p}_ms") for p in PHASES]
    if all(v is not None for v in phases):
        batches = int(g("drain.relay.batches") or 0)
        R.row(f"relay, mean of its {batches} recorded batches (one a tick; the backlog is one"
              f" transaction): {' / '.join(PHASES)}",
              " / ".join(fmt(v) for v in phases), "ms", "the relay's mean batch (read to record)",
              g("drain.relay.batch_total_ms"))
    R.row("relay+PostgreSQL+Redis CPU per 100k", g("drain.relay.total_cpu_per_100k"), "s")
    parts = [g(f"drain.relay.{k}_busy") for k in ("relay", "pg", "redis", "other")]
    if g("drain.relay.rate"):
        R.row(f"{ROWS:,} drain, relay: cores busy (client / PostgreSQL / Redis / others' work)",
              " / ".join(fmt(p) for p in parts), "cores")
    hwm1m = g("drain.relay.hwm_kb")
    R.row(f"relay peak RSS, {ROWS:,}-row backlog", hwm1m / 1024 if hwm1m else None, "MiB")

    # Latency of the relay alone.
    for p in ("p50", "p99"):
        v = g(f"idle.visible_ms.{p}")
        R.row(f"idle relay, one row: commit → visible {p}", v, "ms", "a few ms", 5.0, "≤ 1.0")
    rates = [int(float(x)) for x in str(g("latency.rates", "") or "").split(",") if x]
    for rate in rates:
        tag = " (the ramp's highest)" if rate == g("max_rate") else ""
        R.row(f"load {rate}/s{tag}: achieved", g(f"load.{rate}.achieved_rate"), "rows/s",
              "target rate", float(rate))
        for kind, label in (("visible", "commit → visible"), ("acked", "commit → group ack")):
            vals = [g(f"load.{rate}.{kind}_ms.{p}") for p in ("p50", "p99", "p999", "max")]
            text = " / ".join(fmt(v) for v in vals)
            R.row(f"load {rate}/s: {label} p50/p99/p99.9/max", text, "ms")
    p99 = g("load.2000.visible_ms.p99")
    R.row("load 2000/s: commit → visible p99", p99, "ms", "the target", TARGET_P99_2000_MS,
          "≤ 1.0")
    R.row("load 2000/s: CPU time the host took from this machine (steal), idle",
          f"{fmt(g('load.2000.steal'))} / {fmt(g('load.2000.idle'))}", "%")
    R.row("highest rate that holds (achieved ≥ 95 %, p99 < 200 ms), producers with"
          " synchronous_commit on", g("max_rate"), "rows/s", "the target", TARGET_MAX_RATE,
          "≥ 1.0")
    R.row("producers with synchronous_commit on, flat out (the most they can offer)",
          g("ramp.unthrottled.achieved_rate"), "rows/s")
    R.row(f"producers alone (no relay, wake-up lock held) at a fixed {TARGET_MAX_RATE:,}/s,"
          " synchronous_commit on: achieved", g("ramp.alone.achieved_rate"), "rows/s",
          "the target rate", TARGET_MAX_RATE)
    R.row("highest rate that holds, producers with synchronous_commit off",
          g("max_rate_async"), "rows/s", "the target", TARGET_MAX_RATE, "≥ 1.0")
    R.row("producers with synchronous_commit off, flat out",
          g("ramp_async.unthrottled.achieved_rate"), "rows/s")
    R.row(f"producers alone (no relay, wake-up lock held) at a fixed {TARGET_MAX_RATE:,}/s,"
          " synchronous_commit off: achieved", g("ramp_async.alone.achieved_rate"), "rows/s",
          "the target rate", TARGET_MAX_RATE)

    # Producers.
    for sync in ("on", "off"):
        for c in PRODUCER_CLIENTS:
            w = g(f"producers.sync_{sync}.c{c}.with.tps")
            wo = g(f"producers.sync_{sync}.c{c}.without.tps")
            R.row(f"producers {c}, synchronous_commit {sync}, relay running, with wake-up", w,
                  "tx/s", "without wake-up (trigger dropped)", wo)
    for sync in ("on", "off"):
        c = max(PRODUCER_CLIENTS)
        R.row(f"no relay: {c} producers, sc {sync}, every transaction notifies (idle relay)",
              g(f"producers.norelay.sync_{sync}.c{c}.notify.tps"), "tx/s", "no trigger",
              g(f"producers.norelay.sync_{sync}.c{c}.dropped.tps"))

    # Storage: published rows kept against purged.
    R.row(f"PostgreSQL CPU per message, {ROWS:,}-row drain and its retention, every process,"
          " sent_retention 0 (purged)", g("storage.purged.pg_cpu_per_msg_us"), "us",
          "published rows kept (sent_retention 1h)", g("storage.kept.pg_cpu_per_msg_us"))
    R.row("PostgreSQL work per message (relay sessions + every VACUUM), purged",
          g("storage.purged.work_us"), "us", "kept", g("storage.kept.work_us"))
    R.row(f"outbox.messages with indexes after a {ROWS:,}-row drain, purged",
          g("storage.purged.table_bytes") / 2**20 if g("storage.purged.table_bytes") else None,
          "MiB", "kept",
          g("storage.kept.table_bytes") / 2**20 if g("storage.kept.table_bytes") else None)
    for name, label in (("kept", f"{ROWS:,} published rows kept"),
                        ("purged", f"{ROWS:,} published rows deleted by the retention pass"
                                   " (and the relay's VACUUM if it came)")):
        R.row(f"read of one batch of {BATCH} fresh rows, {label}",
              g(f"storage.{name}.read_after_ms"), "ms", "the same on the empty table before",
              g(f"storage.{name}.read_before_ms"))

    # Scaling out.
    R.row(f"drain of {PARTITION_ROWS:,} keyed rows, one relay, a topic of 8 partitions",
          g("partitions_8.rate"), "msg/s", "the same rows, topic unpartitioned",
          g("unpartitioned.rate"))
    for n in (2, 3):
        R.row(f"the same drain of 8 partitions by {n} relays",
              g(f"partitions_8_relays_{n}.rate"), "msg/s", "by one relay",
              g("partitions_8.rate"), target="≥ 1")
    R.row(f"drain of {REPLICA_ROWS:,} rows, min_replicas 1 (a WAIT for one replica per chunk)",
          g("min_replicas_1.rate"), "msg/s", "min_replicas 0, the same replica attached",
          g("min_replicas_0.rate"))
    R.row(f"drain of {CLUSTER_ROWS:,} rows into a Redis Cluster of 3 primaries",
          g("cluster_cluster.rate"), "msg/s", "into one Redis", g("cluster_single.rate"))

    # The rest of the side by side with PgQ.
    for kind, label in (("relay", "relay"), ("pgq", "PgQ")):
        lost, doubled = g(f"alt.{kind}.drain.lost"), g(f"alt.{kind}.drain.doubled")
        if lost is not None:
            R.row(f"the drains of {ALT_ROWS:,}, {label}: messages lost / published twice",
                  f"{lost} / {doubled}", "msgs")
    lost, doubled = g("alt.pgq.crash.lost"), g("alt.pgq.crash.doubled")
    if lost is not None:
        R.row(f"a drain of {ALT_CRASH_ROWS:,} killed halfway and restarted, PgQ:"
              " messages lost / published twice", f"{lost} / {doubled}", "msgs")
    for rate in ALT_RATES:
        for p in ("p50", "p99"):
            if rate == 2000 and p == "p99":
                continue  # the target's row, above
            R.row(f"load {rate}/s, commit → visible {p}, relay",
                  g(f"alt.relay.load.{rate}.visible_ms.{p}"), "ms", "PgQ, same load",
                  g(f"alt.pgq.load.{rate}.visible_ms.{p}"))
        for kind, label in (("relay", "relay"), ("pgq", "PgQ")):
            miss = g(f"alt.{kind}.load.{rate}.missing_visible")
            if miss is not None:
                R.row(f"load {rate}/s, {label}: achieved rate; messages lost / published twice",
                      f"{fmt(g(f'alt.{kind}.load.{rate}.achieved_rate'))};"
                      f" {miss} / {g(f'alt.{kind}.load.{rate}.duplicate_visible')}", "")
    share = {k.split(".")[-1]: v for k, v in R.values.items() if k.startswith("profile.share.")}
    if share:
        text = ", ".join(f"{k} {v:.0f}%" for k, v in sorted(share.items(), key=lambda kv: -kv[1])[:5])
        R.row("profile of a drain: CPU samples by process", text, "")


def verdict(row):
    t, ratio = row["target"], row["ratio"]
    if not t or ratio is None:
        return ""
    m = re.match(r"([≥≤])\s*([\d.]+)", t)
    if not m:
        return ""
    ok = ratio >= float(m.group(2)) if m.group(1) == "≥" else ratio <= float(m.group(2))
    return "met" if ok else "NOT met"


def print_table():
    head = ("figure", "value", "unit", "compared to", "limit", "ratio", "target")
    rows = []
    for r in R.table:
        ratio = f"{r['ratio']:.2f}" if isinstance(r["ratio"], float) else ""
        target = f"{r['target']} {verdict(r)}".strip()
        rows.append((r["figure"], fmt(r["value"]), r["unit"], r["limit"], fmt(r["limit_value"])
                     if r["limit_value"] is not None else "", ratio, target))
    widths = [max(len(h), *(len(x[i]) for x in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    for x in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(x, widths)))
    text = "\n".join(lines)
    print(text, flush=True)
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in rows:
        md.append("| " + " | ".join(c.replace("|", "\\|") for c in x) + " |")
    with open(os.path.join(RESULTS, "latest-table.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(RESULTS, "latest-table.txt"), "w") as f:
        f.write(text + "\n")


def write_csv():
    path = os.path.join(RESULTS, "latest.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["section", "name", "value", "unit", "detail"])
        for row in R.raw:
            w.writerow(row)
    return path


# --------------------------------------------------------------------------
# Plots.

def plot():
    if shutil.which("gnuplot") is None:
        log("gnuplot not found: no plots (bench/run.sh installs gnuplot-nox)")
        return
    g = R.get
    rates = [int(float(x)) for x in str(g("latency.rates", "") or "").split(",") if x]
    made = []
    if rates:
        dat = os.path.join(RESULTS, "latency.dat")
        points = sorted((g(f"load.{rate}.achieved_rate") or rate, rate) for rate in rates)
        with open(dat, "w") as f:
            f.write("# achieved_rate vis_p50 vis_p99 vis_p999 vis_max ack_p50 ack_p99 ack_p999"
                    " ack_max target_rate\n")
            for achieved, rate in points:
                vals = [g(f"load.{rate}.{k}_ms.{p}") for k in ("visible", "acked")
                        for p in ("p50", "p99", "p999", "max")]
                f.write(f"{achieved} " + " ".join(str(max(v, 0.01)) if v is not None else "NaN"
                                                  for v in vals) + f" {rate}\n")
        gp = f"""
set terminal pngcairo size 1100,480 font ",10"
set output '{RESULTS}/latency.png'
set multiplot layout 1,2 title "outbox-relay: latency against producer rate (single-row commits, {LOAD_PRODUCERS} producers, batch {BATCH})"
set logscale y
set logscale x
set xlabel "producer rate achieved (rows/s; targets {", ".join(str(r) for r in rates)})"
set ylabel "milliseconds"
set grid
set key top left
set title "commit → entry visible in the stream (XREAD)"
plot '{dat}' u 1:2 w lp t 'p50', '' u 1:3 w lp t 'p99', '' u 1:4 w lp t 'p99.9', '' u 1:5 w lp t 'max'
set title "commit → acknowledged by a consumer group (XREADGROUP + XACK)"
plot '{dat}' u 1:6 w lp t 'p50', '' u 1:7 w lp t 'p99', '' u 1:8 w lp t 'p99.9', '' u 1:9 w lp t 'max'
unset multiplot
"""
        made.append(("latency", gp))
    if g(f"producers.sync_on.c{PRODUCER_CLIENTS[0]}.with.tps"):
        dat = os.path.join(RESULTS, "producers.dat")
        with open(dat, "w") as f:
            f.write("# case with without\n")
            for sync in ("on", "off"):
                for c in PRODUCER_CLIENTS:
                    f.write(f"\"{c} sc={sync}\" {g(f'producers.sync_{sync}.c{c}.with.tps') or 'NaN'}"
                            f" {g(f'producers.sync_{sync}.c{c}.without.tps') or 'NaN'}\n")
        gp = f"""
set terminal pngcairo size 800,480 font ",10"
set output '{RESULTS}/producers.png'
set title "producer transactions per second (pgbench, one-row INSERT), relay running"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set ylabel "transactions per second"
set xlabel "concurrent producers, synchronous_commit" noenhanced
set yrange [0:*]
set grid ytics
set key top left
plot '{dat}' u 2:xtic(1) t 'with wake-up trigger', '' u 3 t 'trigger dropped'
"""
        made.append(("producers", gp))
    for name, gp in made:
        path = os.path.join(RESULTS, f"{name}.gp")
        with open(path, "w") as f:
            f.write(gp)
        proc = subprocess.run(["gnuplot", path], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            log(f"gnuplot {name}: {proc.stdout[-1000:]}")
        else:
            log(f"wrote {RESULTS}/{name}.png")


# --------------------------------------------------------------------------
# The machine.

def cmd_out(argv):
    try:
        return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine():
    info = {}
    info["nproc"] = os.cpu_count()
    with open("/proc/cpuinfo") as f:
        m = re.search(r"model name\s*:\s*(.*)", f.read())
        info["cpu"] = m.group(1).strip() if m else platform.processor()
    with open("/proc/meminfo") as f:
        m = re.search(r"MemTotal:\s*(\d+)", f.read())
        info["memory_gib"] = round(int(m.group(1)) / 1048576, 1) if m else None
    info["kernel"] = platform.release()
    info["os"] = cmd_out(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"])
    info["postgres"] = cmd_out([os.path.join(harness.pg_bindir(), "postgres"), "--version"])
    info["redis"] = cmd_out(["redis-server", "--version"])
    for pkg in ("libpq5", "libev4"):
        info[pkg] = cmd_out(["dpkg-query", "-W", "-f=${Version}", pkg])
    # libhiredis0.14 on Debian 12, libhiredis1.1.0 on Debian 13.
    info["hiredis"] = cmd_out(["pkg-config", "--modversion", "hiredis"])
    info["cc"] = cmd_out(["cc", "--version"]).splitlines()[0] if cmd_out(["cc", "--version"]) else ""
    info["git"] = cmd_out(["git", "-C", SOURCE, "rev-parse", "--short", "HEAD"])
    info["git_dirty"] = "yes" if cmd_out(["git", "-C", SOURCE, "status", "--porcelain",
                                          "--", "common", "core", "relay", "functions",
                                          "include", "migrations"]) else "no"
    digest = hashlib.sha256()
    for pattern in ("common/*.[ch]", "core/*.[ch]", "relay/*.[ch]", "functions/*.lua",
                    "migrations/*.sql", "bench/*.c"):
        for path in sorted(glob.glob(os.path.join(SOURCE, pattern))):
            with open(path, "rb") as f:
                digest.update(path.encode() + b"\0" + f.read())
    info["source_sha256"] = digest.hexdigest()[:16]
    with open("/proc/loadavg") as f:
        info["loadavg_start"] = f.read().split()[0]
    return info


def replot():
    """Rebuilds the table and the plots from results/latest.csv, measuring nothing."""
    global ROWS, PRODUCER_CLIENTS, LOAD_PRODUCERS
    with open(os.path.join(RESULTS, "latest.csv")) as f:
        for section, name, value, unit, detail in list(csv.reader(f))[1:]:
            try:
                value = float(value) if re.fullmatch(r"-?[\d.]+(e-?\d+)?", value) else value
            except ValueError:
                pass
            R.raw.append((section, name, value, unit, detail))
            R.values[name] = value
    ROWS = int(R.get("bench.rows", ROWS))
    LOAD_PRODUCERS = int(R.get("bench.load_producers", LOAD_PRODUCERS))
    value = R.get("bench.producer_clients")
    if value is not None:
        PRODUCER_CLIENTS = [int(float(x)) for x in str(value).split(",")]
    R.values["max_rate"] = int(R.get("max_rate") or 0)
    build_table()
    print_table()
    plot()


def main():
    if sys.argv[1:] == ["--replot"]:
        replot()
        return
    os.makedirs(RESULTS, exist_ok=True)
    for path in (RELAY_BIN, LOADGEN_BIN, PGQ_BIN):
        if not os.access(path, os.X_OK):
            sys.exit(f"bench.py: {path} not found: run bench/run.sh, which builds it")
    os.environ["OUTBOX_RELAY_BIN"] = RELAY_BIN
    harness.set_deadline(3600)
    started = time.monotonic()
    info = machine()
    R.add_dict("machine", "machine", info, dict(memory_gib="GiB"))
    for key, value in PG_SETTINGS.items():
        R.add("settings", f"postgres.{key}", value)
    R.add("settings", "redis.appendonly", "no" if REDIS_AOF == "no" else "yes")
    R.add("settings", "redis.appendfsync", REDIS_AOF if REDIS_AOF != "no" else "-")
    R.add("settings", "redis.args", " ".join(REDIS_ARGS) or "-")
    R.add("settings", "relay.batch_size", BATCH)
    R.add("settings", "relay.other", "defaults: listen on, poll_interval 1s, sent_retention 15m")
    for key in ("ROWS", "RATE_SECONDS", "PGBENCH_SECONDS", "LOAD_PRODUCERS", "READ_SECONDS",
                "LIMIT_ROWS", "PUBLISH_CALLS", "CALL_ROWS", "PROFILE_ROWS", "QUICK"):
        R.add("settings", f"bench.{key.lower()}", globals()[key])
    R.add("settings", "bench.sections", ",".join(SECTIONS))
    R.add("settings", "bench.producer_clients", ",".join(str(c) for c in PRODUCER_CLIENTS))
    log(f"machine: {info['nproc']} x {info['cpu']}, {info['memory_gib']} GiB; {info['postgres']};"
        f" {info['redis'].split(' sha=')[0]}; load average {info['loadavg_start']}")
    if float(info["loadavg_start"]) > 0.7:
        log("warning: the machine is busy with other work (load average above 0.7):"
            " the numbers will be noisy")
    log(f"settings: PostgreSQL {', '.join(f'{k}={v}' for k, v in PG_SETTINGS.items())};"
        f" Redis appendonly={'no' if REDIS_AOF == 'no' else 'yes'} appendfsync={REDIS_AOF}"
        f"{' ' + ' '.join(REDIS_ARGS) if REDIS_ARGS else ''}; relay batch_size={BATCH}")

    functions = dict(drain=section_drain,
                     latency=section_latency, producers=section_producers,
                     limits=section_limits, storage=section_storage,
                     partitions=section_partitions, units=section_units,
                     replicas=section_replicas,
                     cluster=section_cluster, alternatives=section_alternatives,
                     tls=section_tls, profile=section_profile)
    for name in SECTIONS:
        if name not in functions:
            sys.exit(f"bench.py: unknown section {name!r}; sections: {', '.join(ALL_SECTIONS)}")
    for name in SECTIONS:
        t = time.monotonic()
        log(f"== {name}")
        try:
            functions[name]()
        except Exception:  # one broken section must not lose the others' numbers
            R.failed.append(name)
            log(f"section {name} FAILED:\n{traceback.format_exc()}")
        R.add("timing", f"section.{name}.seconds", time.monotonic() - t, "s")
        log(f"== {name}: {time.monotonic() - t:.0f}s")

    total = time.monotonic() - started
    R.add("timing", "bench.seconds", total, "s", "bench.py alone, without installing and building")
    with open("/proc/loadavg") as f:
        R.add("machine", "machine.loadavg_end", f.read().split()[0])
    R.add("machine", "finished_at", datetime.datetime.now(datetime.timezone.utc)
          .strftime("%Y-%m-%dT%H:%M:%SZ"))
    build_table()
    csv_path = write_csv()
    print()
    print_table()
    plot()
    print(f"\nraw numbers: {csv_path}; table: {RESULTS}/latest-table.md;"
          f" bench.py took {total:.0f}s", flush=True)
    if R.failed:
        print(f"FAILED sections: {', '.join(R.failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
