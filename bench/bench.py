#!/usr/bin/python3
"""The outbox-relay benchmark: the relay against the limits of this machine, in one run.

Run it through bench/run.sh, which installs what is missing and builds the relay
and the tools optimised into build-bench first, then runs this file as the
module bench.bench with the repository root on PYTHONPATH. Every section
starts its own PostgreSQL 15 (fsync on) and Redis 7 on loopback through the
integration-test harness and stops them at the end, also on failure or Ctrl-C.

Sections (BENCH_SECTIONS, comma-separated, all by default):
  drain      BENCH_ROWS pending rows, then the relay until all are sent and in
             Redis: msgs/s, CPU per 100k, peak RSS; then the claim's cost with
             those rows sent and still in the table
  latency    first the producers alone at the ramp's target rate (no relay, the
             wake-up lock held as a busy relay holds it): whether they can offer
             it at all; then an idle relay's single-row latency, then producers
             at fixed rates: commit -> stream entry and commit -> group
             acknowledgement, and the ramps to the highest rate that holds
  producers  pgbench producers at 1/4/16 clients, wake-up trigger present or
             dropped, synchronous_commit on and off, with a relay running; the
             16 clients in BENCH_PRODUCER_ROUNDS alternating rounds (medians)
  limits     claim-and-mark alone, the publish function alone, the claim's cost
             with no sent rows
  storage    the same backlog drained with rows marked sent and kept
             (sent_retention 1h, autovacuum alone) and with the default (each
             row deleted as it is published, the relay vacuums), in
             BENCH_STORAGE_ROUNDS alternating rounds: PostgreSQL CPU per
             message and the claim on fresh rows before and right after each
             drain
  partitions a keyed backlog on one topic drained by one relay with the
             topic unpartitioned, and with 8 partitions by 1, 2 and 3 relays,
             in BENCH_PARTITION_ROUNDS alternating rounds
  replicas   the same backlog drained with a replica attached, with
             min_replicas 0 and 1 (a WAIT after every batch), in
             BENCH_REPLICA_ROUNDS alternating rounds: what the wait costs
  cluster    the same backlog drained into the benchmark's single Redis and
             into a Redis Cluster of 3 primaries (append-only like it), in
             BENCH_CLUSTER_ROUNDS alternating rounds
  alternatives
             side by side with what a user would pick instead: PgQ (Debian's
             postgresql-15-pgq3) with bench-pgq, a consumer that XADDs each
             event, on the same servers and workload: a drain of
             BENCH_ALT_ROWS, then commit -> stream latency at BENCH_ALT_RATES,
             relay and PgQ in BENCH_ALT_ROUNDS alternating rounds; then a
             drain of BENCH_ALT_CRASH_ROWS by each, killed (SIGKILL) halfway
             and started again; every message lost or published twice is
             counted
  profile    perf record -a during a drain: where the machine's time goes

Sizes come from the environment (BENCH_QUICK=1 for a two-minute smoke run);
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
    BATCH, LOAD_PRODUCERS, LOADGEN_BIN, NAIVE_BIN, PAYLOAD, PG_SETTINGS, PGQ_BIN,
    PHASES, PUBLISH_CALLS, QUICK, R, REDIS_AOF, REDIS_ARGS, RELAY_BIN, RESULTS, SOURCE,
    TOPICS, BenchPostgres, CpuMeter, cpu_shares, cpu_ticks, env_float, env_int, env_list,
    execute, fresh_round, insert_backlog, loadgen, log, machine_busy, pending, proc_cpu,
    proc_status, publish_alone, relay_batches, relay_metric, relay_phase_sums,
    reset_servers, run_delay, run_json, scalar, servers, start_relay, stop_relay,
    stream_total, wait_drained)
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
CLAIM_PENDING = env_int("BENCH_CLAIM_PENDING", 10000)
STORAGE_ROUNDS = env_int("BENCH_STORAGE_ROUNDS", 2)
CLAIM_SECONDS = env_float("BENCH_CLAIM_SECONDS", 1 if QUICK else 4)
AUTOVACUUM_WAIT = env_float("BENCH_AUTOVACUUM_WAIT", 5 if QUICK else 90)
LIMIT_ROWS = env_int("BENCH_LIMIT_ROWS", 30000 if QUICK else 300000)
CALL_ROWS = 64  # RELAY_CALL_ROWS: the most rows of one stream the relay sends in a call
PROFILE_ROWS = env_int("BENCH_PROFILE_ROWS", 20000 if QUICK else 100000)
ALT_ROWS = env_int("BENCH_ALT_ROWS", 20000 if QUICK else 200000)
ALT_RATES = env_list("BENCH_ALT_RATES", [200, 2000])
ALT_SECONDS = env_float("BENCH_ALT_SECONDS", 3 if QUICK else 15)
ALT_ROUNDS = env_int("BENCH_ALT_ROUNDS", 1 if QUICK else 2)
ALT_CRASH_ROWS = env_int("BENCH_ALT_CRASH_ROWS", 20000 if QUICK else 100000)
ALL_SECTIONS = ["drain", "latency", "producers", "limits", "storage",
                "partitions", "replicas", "cluster", "alternatives", "profile"]
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

def settle_dedup_records(rc, rd, redis_base, most=30.0):
    """Waits, with the relay still running, until the dedup records of a drain
    are gone from Redis (DBSIZE counts an expired key until Redis reclaims it,
    so this includes the expiry's work): returns (Redis CPU seconds since
    redis_base, seconds waited), or None after `most` seconds. DBSIZE is O(1):
    polling it costs Redis nothing measurable."""
    started = time.monotonic()
    while time.monotonic() - started < most:
        if rc.dbsize() <= TOPICS + 8:  # the streams, and a few keys of the relay's
            return proc_cpu(rd.proc.pid) - redis_base, time.monotonic() - started
        time.sleep(0.1)
    return None


def drain(pg, rd, conn, rc, kind, rows, batch, extra=None, relay_flags=None, settle=False):
    if kind != "relay":
        raise ValueError(f"drain: no drain of kind {kind!r}: only the relay drains")
    """Drains a backlog of `rows` with the relay (with relay_flags); returns its
    figures. With settle, the relay's drain also measures
    Redis until its dedup records are retired (settle_dedup_records)."""
    meter = CpuMeter(pg, rd)
    redis_base = proc_cpu(rd.proc.pid)
    redis_delay = run_delay(rd.proc.pid)
    settled = None
    timeout = max(120.0, rows / 1500.0)
    rc.config_resetstat()  # INFO commandstats from here: Redis's work by command
    if kind == "relay":
        started = time.monotonic()
        relay = start_relay(pg, rd, batch_size=batch, **(relay_flags or {}))
        try:
            deadline = started + timeout
            while True:
                # Redis first, every 20 ms: four XLEN cost next to nothing. The
                # pending count reads an index of up to a million entries, so it
                # runs only once every entry is in, to see the last commit.
                if stream_total(rc) >= rows and pending(conn) == 0:
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
            if settle:
                settled = settle_dedup_records(rc, rd, redis_base)
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
    # message: where its core goes besides the publishes (the scans of the
    # observer and the trim pass, the removal of the dedup records, the
    # benchmark's own polling).
    # The share of the drain Redis's main thread had work but no core: on two
    # cores it shares with PostgreSQL, the relay and the kernel.
    if redis_delay is not None and waited is not None:
        result["redis_waited_for_cpu"] = (waited - redis_delay) / took
    for name in ("fcall", "unlink", "scan", "xinfo", "xlen"):
        stat = commands.get(f"cmdstat_{name}", {})
        result[f"redis_{name}_calls"] = stat.get("calls", 0)
        result[f"redis_{name}_us_per_msg"] = stat.get("usec", 0) / rows
    if settled is not None:
        # Redis's CPU until the last dedup record was retired (removed, or
        # expired and reclaimed), some seconds after the last commit: the
        # drain's own CPU figures stop at the last commit.
        result["redis_cpu_settled"], result["settle_seconds"] = settled
        result["total_cpu_settled_per_100k"] = (cpu + pg_cpu + settled[0]) / rows * 1e5
    if kind == "relay" and batches:
        # The relay's own histogram: time from claim to commit of a batch.
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


def claim_cost(pg, conn, label, explain_file):
    """The claim statement's own time (prepared, binary, BEGIN; claim; ROLLBACK)."""
    d = run_json([NAIVE_BIN, "--claim-only", "--postgres", pg.dsn(), "--batch-size", str(BATCH),
                  "--seconds", str(CLAIM_SECONDS)])
    R.add_dict("claim", f"claim.{label}", d, dict(_ms="ms", seconds="s"))
    sql = subprocess.run([NAIVE_BIN, "--print-claim-sql"], stdout=subprocess.PIPE, text=True,
                         check=True).stdout.strip()
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(f"PREPARE bench_claim AS {sql}")
        # No partition owned ($3-$5): the benchmark's claims are of unpartitioned topics;
        # the walk of the whole pending index ($6 = 0), as the relay's first claim does.
        cur.execute(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_claim({BATCH}, '{{}}', '{{}}',"
                    f" '{{}}', 0, 0)")
        plan = "\n".join(r[0] for r in cur.fetchall())
        cur.execute("ROLLBACK")
        cur.execute("DEALLOCATE ALL")
    with open(os.path.join(RESULTS, explain_file), "w") as f:
        f.write(f"-- claim with {label}\n{plan}\n")
    m = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
    if m:
        R.add("claim", f"claim.{label}.buffers", int(m.group(1)) + int(m.group(2) or 0),
              "pages", "shared buffers touched by the claim (EXPLAIN ANALYZE, BUFFERS)")
    log(f"claim with {label}: mean {d['mean_ms']:.3f} ms, p50 {d['p50_ms']:.3f} ms,"
        f" first {d['first_ms']:.3f} ms over {d['claims']} claims")
    return d


def claims_interleaved(pg_a, pg_b, slices=8):
    """The claim timed on two servers in turn, CLAIM_SECONDS in all on each, in
    `slices` alternating slices, so that a drift of the shared machine's speed
    falls on both alike. Returns (a, b), each {mean_ms, server_cpu_ms, claims}."""
    out = [dict(claims=0, ms=0.0, cpu_ms=0.0) for _ in range(2)]
    for i in range(slices):
        for j, pg in (((0, pg_a), (1, pg_b)) if i % 2 == 0 else ((1, pg_b), (0, pg_a))):
            d = run_json([NAIVE_BIN, "--claim-only", "--postgres", pg.dsn(), "--batch-size",
                          str(BATCH), "--seconds", str(CLAIM_SECONDS / slices)])
            out[j]["claims"] += d["claims"]
            out[j]["ms"] += d["mean_ms"] * d["claims"]
            out[j]["cpu_ms"] += d["server_cpu_ms"] * d["claims"]
    return tuple(dict(claims=o["claims"], mean_ms=o["ms"] / o["claims"],
                      server_cpu_ms=o["cpu_ms"] / o["claims"]) for o in out)


def table_stats(conn):
    with conn.cursor() as cur:
        cur.execute("SELECT n_live_tup, n_dead_tup, coalesce(last_autovacuum::text, 'never'),"
                    " autovacuum_count, pg_relation_size('outbox.messages'),"
                    " pg_relation_size('outbox.messages_pending_idx')"
                    " FROM pg_stat_user_tables WHERE relid = 'outbox.messages'::regclass")
        live, dead, last, count, size, idx = cur.fetchone()
    return dict(live=live, dead=dead, last_autovacuum=last, autovacuum_count=count,
                heap_bytes=size, pending_idx_bytes=idx)


def section_drain():
    with servers() as (pg, rd, conn, rc):
        took = insert_backlog(conn, ROWS)
        R.add("drain", "insert.rows", ROWS, "rows")
        R.add("drain", "insert.seconds", took, "s", "one INSERT ... SELECT generate_series")
        R.add("drain", "insert.rate", ROWS / took, "rows/s")
        # The claim's cost before anything is sent: the baseline, on the same server.
        claim_cost(pg, conn, "sent_0_backlog", "claim-explain-sent-0-backlog.txt")
        d = drain(pg, rd, conn, rc, "relay", ROWS, BATCH, settle=True)
        record_drain("drain", "drain.relay", d, f"batch {BATCH}, dedup on")
        # The claim's cost with the drained rows still in the table (sent, not deleted).
        insert_backlog(conn, CLAIM_PENDING, prepare=False)
        drained = time.monotonic()
        after_drain = table_stats(conn)
        R.add_dict("claim", "claim.sent_1m.table", after_drain,
                   dict(bytes="bytes"), "right after the drain")
        claim_cost(pg, conn, "sent_1m", "claim-explain-sent-before-vacuum.txt")
        # What a running system gets: the table's own autovacuum settings
        # (migrations/008) at PostgreSQL's default naptime of one minute. The
        # count is the one read right after the drain: an autovacuum that ends
        # while the claim above is measured counts.
        count0 = after_drain["autovacuum_count"]
        while table_stats(conn)["autovacuum_count"] == count0 and \
                time.monotonic() - drained < AUTOVACUUM_WAIT:
            time.sleep(1)
        stats = table_stats(conn)
        R.add_dict("claim", "claim.sent_1m_autovacuumed.table", stats, dict(bytes="bytes"),
                   f"after the next autovacuum ({time.monotonic() - drained:.0f} s after the drain)")
        if stats["autovacuum_count"] != count0:
            claim_cost(pg, conn, "sent_1m_autovacuumed", "claim-explain-sent-after-autovacuum.txt")
        else:
            log(f"no autovacuum within {AUTOVACUUM_WAIT} s of the drain")
        execute(conn, "VACUUM ANALYZE outbox.messages")
        claim_cost(pg, conn, "sent_1m_vacuumed", "claim-explain-sent-after-vacuum.txt")


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
                execute(conn, "TRUNCATE outbox.messages RESTART IDENTITY")
                execute(conn, "TRUNCATE outbox.topics; SELECT outbox.sync_partition_trigger()")
                if parts > 1:
                    execute(conn, "SELECT outbox.set_partitions('bench0', %s)", (parts,))
                execute(conn, "VACUUM ANALYZE outbox.messages")
                execute(conn, "CHECKPOINT")
                rc.flushall()
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


# The storage designs of section "storage": name, relay flags, what it is.
STORAGE_MODES = [
    ("mark", dict(sent_retention="1h", vacuum_dead_rows="0"),
     "rows marked sent (UPDATE sent_at) and kept an hour; autovacuum alone"),
    ("delete", {}, "the default: each row deleted as it is published; the relay vacuums"),
]


def vacuum_settled(conn, threshold):
    """No VACUUM runs and fewer dead rows than the relay's end-of-drain mark."""
    return (scalar(conn, "SELECT count(*) FROM pg_stat_progress_vacuum") == 0
            and table_stats(conn)["dead"] < threshold)


class SessionMeter:
    """Which PostgreSQL backend is whose: samples pg_stat_activity five times a
    second, so that the CPU a CpuMeter keeps per pid can be split into the
    relay's claiming sessions, vacuums (the relay's and autovacuum's) and the
    rest, short-lived backends included."""

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
    """One drain of ROWS rows with one storage design, on fresh servers. The
    claim is measured the same way before and after: on CLAIM_PENDING rows just
    inserted (not vacuumed), first into the fresh table, then into the table
    the drain (and the relay's cleanup) left behind. A twin PostgreSQL server
    stays in the state before the drain, and the claim after it is timed in
    turns with the twin's: the ratio of the two is the claim after against the
    claim before, with the machine's drift taken out."""
    with servers() as (pg, rd, conn, rc), BenchPostgres() as twin:
        with contextlib.closing(twin.connect()) as tconn:
            insert_backlog(tconn, CLAIM_PENDING, prepare=False)
        insert_backlog(conn, CLAIM_PENDING, prepare=False)
        before = claim_cost(pg, conn, f"storage.{name}.{tag}.before",
                            f"claim-explain-storage-{name}-before.txt")
        insert_backlog(conn, ROWS - CLAIM_PENDING)
        meter = CpuMeter(pg, rd)
        sessions = SessionMeter(pg)
        started = time.monotonic()
        relay = start_relay(pg, rd, batch_size=BATCH, **flags)
        try:
            while not (stream_total(rc) >= ROWS and pending(conn) == 0):
                if not relay.alive():
                    raise RuntimeError("the relay exited\n" + relay.log_tail())
                if time.monotonic() - started > max(120.0, ROWS / 1500.0):
                    raise RuntimeError("drain not done\n" + relay.log_tail())
                time.sleep(0.02)
            took = time.monotonic() - started
            # A running relay's own work after a drain: its VACUUM (the
            # marking design leaves its dead rows to autovacuum instead).
            if name == "delete":
                deadline = time.monotonic() + 120
                while not vacuum_settled(conn, 10000) and time.monotonic() < deadline:
                    time.sleep(0.2)
            settled = time.monotonic() - started - took
            vacuums = relay_metric(relay, "outbox_relay_vacuums_total")
            pg_cpu, _ = meter.read()
            split = sessions.split(meter)
        finally:
            stop_relay(relay)
        stats = table_stats(conn)
        insert_backlog(conn, CLAIM_PENDING, prepare=False)
        after = claim_cost(pg, conn, f"storage.{name}.{tag}.after",
                           f"claim-explain-storage-{name}-after.txt")
        side, same = claims_interleaved(twin, pg)
        R.add_dict("claim", f"claim.storage.{name}.{tag}.twin_before", side,
                   dict(_ms="ms"))
        R.add_dict("claim", f"claim.storage.{name}.{tag}.twin_after", same,
                   dict(_ms="ms"))
        # The cleanup still owed: the dead rows the drain left, vacuumed now
        # (for the marking design, what autovacuum does later).
        owed = vacuum_cpu(pg)
    per = 1e6 / ROWS
    fig = {
        "rate": (ROWS / took, "msg/s", what),
        "relay_sessions_us": (split["relay"] * per, "us", "CPU of the relay's claiming sessions"
                              " (claim, mark or delete, commit) per message"),
        "vacuum_us": ((split["vacuum"] + owed) * per, "us", "CPU of every VACUUM during the"
                      " drain (the relay's, autovacuum's) and of the one still owed after it,"
                      " per message"),
        "work_us": ((split["relay"] + split["vacuum"] + owed) * per, "us",
                    "the two above: PostgreSQL's work for each message, cleanup included"),
        "pg_cpu_per_msg_us": (pg_cpu * per, "us", "every PostgreSQL process, from the drain's"
                              " start until it and the relay's VACUUM are done (WAL writer,"
                              " checkpointer, observer included)"),
        "settle_seconds": (settled, "s", "from the last commit until the relay's VACUUM is done"),
        "relay_vacuums": (vacuums or 0, "", ""),
        "dead_rows_after": (stats["dead"], "rows", ""),
        "claim_ratio": (same["mean_ms"] / side["mean_ms"], "", f"claim of {BATCH} on"
                        f" {CLAIM_PENDING:,} new rows right after the drain / the same on a twin"
                        " server in the state before it, timed in turns: client-side time"),
        "claim_cpu_ratio": (same["server_cpu_ms"] / side["server_cpu_ms"], "", "the same, the"
                            " server process's CPU per claim"),
        "claim_ratio_sequential": (after["mean_ms"] / before["mean_ms"], "", "the claim after"
                                   " the drain / the claim before it, same server, a minute"
                                   " apart (the machine's drift included)"),
    }
    for key, (value, unit, detail) in fig.items():
        R.add("storage", f"storage.{name}.{tag}.{key}", value, unit, detail)
    log(f"storage {name} ({tag}): {ROWS / took:,.0f} msg/s; PostgreSQL per message: relay"
        f" sessions {split['relay'] * per:.1f} us, vacuum {(split['vacuum'] + owed) * per:.1f} us,"
        f" all processes {pg_cpu * per:.1f} us; relay VACUUMs {vacuums}, settled"
        f" {settled:.1f}s after the drain; claim {before['mean_ms']:.2f} ->"
        f" {after['mean_ms']:.2f} ms ({after['mean_ms'] / before['mean_ms']:.2f}x); in turns"
        f" with the twin {side['mean_ms']:.2f} -> {same['mean_ms']:.2f} ms"
        f" ({same['mean_ms'] / side['mean_ms']:.2f}x), server CPU {side['server_cpu_ms']:.2f} ->"
        f" {same['server_cpu_ms']:.2f} ms ({same['server_cpu_ms'] / side['server_cpu_ms']:.2f}x)")
    return fig


REPLICA_ROWS = env_int("BENCH_REPLICA_ROWS", 20000 if QUICK else 200000)
REPLICA_ROUNDS = env_int("BENCH_REPLICA_ROUNDS", 3)


def section_replicas():
    """What min_replicas costs: one backlog drained with a replica attached
    to the benchmark's Redis, without WAIT (min_replicas 0) and with a WAIT
    for one replica after every batch (min_replicas 1), rounds alternating on
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
                    execute(conn, "TRUNCATE outbox.messages RESTART IDENTITY")
                    rc.flushall()
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
                  "claim to commit of a batch, the relay's histogram")
    ratio = statistics.median(rates[1]) / statistics.median(rates[0])
    R.add("replicas", "ratio_wait_to_none", ratio, "x",
          "drain rate with min_replicas 1 / with 0")
    log(f"replicas: a WAIT per batch drains at {ratio:.2f}x the rate without")


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
                        execute(conn, "TRUNCATE outbox.messages RESTART IDENTITY")
                        rc.flushall()
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
    """STORAGE_ROUNDS rounds of every design, the order turned round each
    round (mark, delete, delete, mark, ...) so that a drift of the shared
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
    mark, delete = rounds["mark"], rounds["delete"]
    pairs = [d["pg_cpu_per_msg_us"][0] / m["pg_cpu_per_msg_us"][0] for m, d in zip(mark, delete)]
    R.add("storage", "storage.delete_vs_mark.pg_cpu_ratio", statistics.median(pairs), "",
          "PostgreSQL CPU per message, delete / mark, per round: " +
          ", ".join(f"{p:.2f}" for p in pairs))


# --------------------------------------------------------------------------
# Latency.

SUSTAINED_P99_MS = 200

# The figures the performance targets are measured against: relay, PostgreSQL
# and Redis CPU per 100k messages in the full run of 2026-11-30 15:49 UTC
# (docs/PERFORMANCE.md, "Results of the latest full run" at relay code
# ff4c421), and the latency and rate targets themselves.
BASELINE_SYSTEM_CPU_PER_100K = 7.94
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
        f" p99 to the stream {flat['visible_ms'].get('p99')} ms")
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
            log(f"idle relay: commit -> stream p50 {res['visible_ms'].get('p50')} ms,"
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
                log(f"{rate}/s: achieved {res['achieved_rate']:,.0f}/s; commit -> stream"
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

        def run(name, clients, relay=None, drop=False, seconds=PGBENCH_SECONDS):
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
                res = pgbench(pg, script, clients, seconds)
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
        # and when none does (a session holds it, as a busy relay does,
        # migrations/007), against no trigger at all. Each run starts from
        # fresh_round's state.
        clients = max(PRODUCER_CLIENTS)
        busy = pg.connect()
        try:
            for sync in ("on", "off"):
                execute(conn, f"ALTER SYSTEM SET synchronous_commit = {sync}")
                execute(conn, "SELECT pg_reload_conf()")
                time.sleep(0.2)
                for case, drop, held in (("notify", False, False), ("busy", False, True),
                                         ("dropped", True, False)):
                    execute(busy, f"SELECT pg_advisory_lock({WAKEUP_LOCK})" if held
                            else "SELECT pg_advisory_unlock_all()")
                    run(f"producers.norelay.sync_{sync}.c{clients}.{case}", clients, drop=drop,
                        seconds=NORELAY_SECONDS)
        finally:
            busy.close()
            execute(conn, "ALTER SYSTEM RESET synchronous_commit")
            execute(conn, "SELECT pg_reload_conf()")
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------
# Limits.

def section_limits():
    with servers() as (pg, rd, conn, rc):
        insert_backlog(conn, CLAIM_PENDING)
        claim_cost(pg, conn, "sent_0", "claim-explain-sent-0.txt")

        insert_backlog(conn, LIMIT_ROWS)
        count = max(1, int(LIMIT_ROWS * 0.8) // BATCH)
        d = run_json([NAIVE_BIN, "--claim-mark", "--postgres", pg.dsn(), "--batch-size",
                      str(BATCH), "--count", str(count)])
        d = {k: v for k, v in d.items() if k not in ("publish_ms", "unlink_ms", "drop_dedup")}
        R.add_dict("limits", "limit.claim_mark", d, dict(rate="rows/s", seconds="s", _ms="ms"),
                   "BEGIN; claim; delete (the relay's default finish); COMMIT without Redis,"
                   " prepared, binary")
        log(f"claim-and-finish alone: {d['rate']:,.0f} rows/s")
        source = subprocess.run([NAIVE_BIN, "--print-function"], stdout=subprocess.PIPE,
                                text=True, check=True).stdout
        rc.execute_command("FUNCTION", "LOAD", "REPLACE", source)
        p = publish_alone(rd)
        R.add_dict("limits", "limit.publish", p, dict(rps="calls/s", msgs="msg/s"),
                   f"redis-benchmark -c 1 -P {BATCH}: FCALL of one message, dedup on")
        log(f"publish function alone, one message a call: {p.get('rps', 0):,.0f} calls/s")
        p = publish_alone(rd, CALL_ROWS)
        R.add_dict("limits", "limit.publish_calls", p, dict(rps="calls/s", msgs="msg/s"),
                   f"redis-benchmark -c 1 -P {-(-BATCH // CALL_ROWS)}: the relay's FCALL of"
                   f" {CALL_ROWS} messages of one stream, dedup on")
        log(f"publish alone, the relay's calls of {CALL_ROWS}: {p.get('msgs', 0):,.0f} msg/s")


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
            full = drain(pg, rd, conn, rc, "relay", ALT_ROWS, BATCH, settle=True)
            d = {k: full[k] for k in ("rows", "seconds", "rate", "cpu", "pg_cpu", "redis_cpu",
                                      "total_cpu_per_100k")}
            if "redis_cpu_settled" in full:  # the records' retirement is the relay's work too
                d["redis_cpu"] = full["redis_cpu_settled"]
                d["total_cpu_per_100k"] = full["total_cpu_settled_per_100k"]
        time.sleep(0.5)  # a copy still on its way would land now
        total, distinct = stream_ids(rc)
        d["entries"] = total
        d["lost"] = ALT_ROWS - distinct
        d["doubled"] = total - distinct
        return d


def alt_latency(kind, rate):
    """Commit -> stream entry at a fixed rate, through the relay or through PgQ."""
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
        for key in ("rate", "total_cpu_per_100k", "seconds", "cpu", "pg_cpu", "redis_cpu"):
            R.add("alternatives", f"alt.{kind}.drain.{key}",
                  statistics.median(r[key] for r in runs),
                  dict(rate="msg/s").get(key, "s"), f"median of {len(runs)} drains")
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
                f" commit -> stream p50 {v.get('p50')} p99 {v.get('p99')} ms,"
                f" missing {res['missing_visible']}, doubled {res['duplicate_visible']}")


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
    relay_rate = g("drain.relay.rate")
    cm = g("limit.claim_mark.rate")
    pub = g("limit.publish_calls.msgs")  # as the relay publishes: the overlap bound
    single = g("limit.publish.rps")  # one message a call
    R.row(f"drain {ROWS:,} rows, relay (batch {BATCH})", relay_rate, "msg/s")
    if cm and pub and single:
        serial = 1 / (1 / cm + 1 / single)
        R.add("limits", "limit.serial_bound", serial, "msg/s",
              "1/(1/claim_mark + 1/publish of one message a call): both sides at their limit,"
              " one after the other")
        R.add("limits", "limit.overlap_bound", min(cm, pub), "msg/s",
              "min(claim_mark, publish): both sides at their limit, overlapped")
        R.row("drain, relay", relay_rate, "msg/s", "min(claim+finish, publish) alone",
              min(cm, pub), "≥ 0.8")
    R.row("claim-and-finish alone (rows deleted, the relay's default; no Redis)", cm, "rows/s")
    R.row(f"publish alone, the relay's calls of {CALL_ROWS} messages of one stream"
          f" (redis-benchmark -P {-(-BATCH // CALL_ROWS)})", g("limit.publish_calls.msgs"),
          "msg/s", f"one message a call (-P {BATCH})", g("limit.publish.rps"))
    R.row("relay CPU per 100k messages", g("drain.relay.cpu_per_100k"), "s")
    phases = [g(f"drain.relay.phase_{p}_ms") for p in PHASES]
    if all(v is not None for v in phases):
        R.row(f"relay, mean batch of {BATCH}: {' / '.join(PHASES)}",
              " / ".join(fmt(v) for v in phases), "ms", "the relay's mean batch (claim to commit)",
              g("drain.relay.batch_total_ms"))
    R.row("relay+PostgreSQL+Redis CPU per 100k", g("drain.relay.total_cpu_per_100k"), "s")
    R.row("relay+PostgreSQL+Redis CPU per 100k, 1M drain with dedup, Redis until the"
          " records are retired",
          g("drain.relay.total_cpu_settled_per_100k") or g("drain.relay.total_cpu_per_100k"),
          "s", "the full run of 2026-11-30 (ff4c421)", BASELINE_SYSTEM_CPU_PER_100K, "≤ 0.70")
    for kind in ("relay",):
        if g(f"drain.{kind}.rate"):
            parts = [g(f"drain.{kind}.{k}_busy") for k in ("relay", "pg", "redis", "other")]
            R.row(f"{ROWS:,} drain, {kind}: cores busy (client / PostgreSQL / Redis / others' work)",
                  " / ".join(fmt(p) for p in parts), "cores")
    hwm1m = g("drain.relay.hwm_kb")
    R.row(f"relay peak RSS, {ROWS:,}-row backlog", hwm1m / 1024 if hwm1m else None, "MiB")
    for p in ("p50", "p99"):
        v = g(f"idle.visible_ms.{p}")
        R.row(f"idle relay, one row: commit → stream {p}", v, "ms", "a few ms", 5.0, "≤ 1.0")
    rates = [int(float(x)) for x in str(g("latency.rates", "") or "").split(",") if x]
    for rate in rates:
        tag = " (the ramp's highest)" if rate == g("max_rate") else ""
        R.row(f"load {rate}/s{tag}: achieved", g(f"load.{rate}.achieved_rate"), "rows/s",
              "target rate", float(rate))
        for kind, label in (("visible", "commit → stream"), ("acked", "commit → group ack")):
            vals = [g(f"load.{rate}.{kind}_ms.{p}") for p in ("p50", "p99", "p999", "max")]
            text = " / ".join(fmt(v) for v in vals)
            R.row(f"load {rate}/s: {label} p50/p99/p99.9/max", text, "ms")
    for sync in ("on", "off"):
        for c in PRODUCER_CLIENTS:
            w = g(f"producers.sync_{sync}.c{c}.with.tps")
            wo = g(f"producers.sync_{sync}.c{c}.without.tps")
            R.row(f"producers {c}, synchronous_commit {sync}, with wake-up", w, "tx/s",
                  "without wake-up (trigger dropped)", wo, "≥ 0.95" if c == 16 else "")
    c0 = g("claim.sent_0_backlog.mean_ms")
    R.row(f"claim of {BATCH}, 0 sent rows (fresh table, {CLAIM_PENDING:,} pending)",
          g("claim.sent_0.mean_ms"), "ms", f"0 sent rows, {ROWS:,} pending (before the drain)", c0)
    for label, key in ((f"{ROWS:,} rows drained, right after, relay stopped", "sent_1m"),
                       (f"{ROWS:,} rows drained, after the next autovacuum", "sent_1m_autovacuumed"),
                       (f"{ROWS:,} rows drained, after VACUUM", "sent_1m_vacuumed")):
        R.row(f"claim of {BATCH} ({label})", g(f"claim.{key}.mean_ms"), "ms",
              "0 sent rows, same server before the drain", c0, "≤ 1.10")
    R.row(f"PostgreSQL work per message, {ROWS:,}-row drain (relay sessions + every VACUUM),"
          " default: delete as published, relay vacuums", g("storage.delete.work_us"), "us",
          "rows marked sent (UPDATE), same run", g("storage.mark.work_us"), "≤ 0.70")
    R.row(f"PostgreSQL CPU per message, {ROWS:,}-row drain, every process, default",
          g("storage.delete.pg_cpu_per_msg_us"), "us", "rows marked sent (UPDATE), same run",
          g("storage.mark.pg_cpu_per_msg_us"), "≤ 0.70")
    for name, _, _ in STORAGE_MODES:
        for key, what in (("claim_ratio", "time, in turns with a twin in the state before"),
                          ("claim_cpu_ratio", "server CPU, in turns with the twin"),
                          ("claim_ratio_sequential", "time, same server, before and after")):
            R.row(f"claim of {BATCH} on {CLAIM_PENDING:,} new rows right after a {ROWS:,}-row"
                  f" drain, {name}: after / before, {what}",
                  g(f"storage.{name}.{key}"), "ratio",
                  target="≤ 1.10" if name == "delete" and key == "claim_ratio" else "",
                  ratio=g(f"storage.{name}.{key}"))
    R.row(f"drain of {PARTITION_ROWS:,} keyed rows, one relay, a topic of 8 partitions",
          g("partitions_8.rate"), "msg/s", "the same rows, topic unpartitioned",
          g("unpartitioned.rate"))
    for n in (2, 3):
        R.row(f"the same drain of 8 partitions by {n} relays",
              g(f"partitions_8_relays_{n}.rate"), "msg/s", "by one relay",
              g("partitions_8.rate"), target="≥ 1")
    R.row(f"drain of {REPLICA_ROWS:,} rows, min_replicas 1 (a WAIT for one replica per batch)",
          g("min_replicas_1.rate"), "msg/s", "min_replicas 0, the same replica attached",
          g("min_replicas_0.rate"))
    R.row(f"drain of {CLUSTER_ROWS:,} rows into a Redis Cluster of 3 primaries",
          g("cluster_cluster.rate"), "msg/s", "into one Redis", g("cluster_single.rate"))
    p99 = g("load.2000.visible_ms.p99")
    R.row("load 2000/s: commit → stream p99", p99, "ms", "the target", TARGET_P99_2000_MS,
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
    R.row(f"drain of {ALT_ROWS:,}, relay (dedup, rows deleted)", g("alt.relay.drain.rate"),
          "msg/s", "PgQ and bench-pgq (no dedup), same backlog", g("alt.pgq.drain.rate"))
    R.row("the same drains: client+PostgreSQL+Redis CPU per 100k, relay",
          g("alt.relay.drain.total_cpu_per_100k"), "s", "PgQ and bench-pgq",
          g("alt.pgq.drain.total_cpu_per_100k"))
    for kind, label in (("relay", "relay"), ("pgq", "PgQ")):
        lost, doubled = g(f"alt.{kind}.drain.lost"), g(f"alt.{kind}.drain.doubled")
        if lost is not None:
            R.row(f"the same drains, {label}: messages lost / published twice",
                  f"{lost} / {doubled}", "msgs")
    for kind, label in (("relay", "relay"), ("pgq", "PgQ")):
        lost, doubled = g(f"alt.{kind}.crash.lost"), g(f"alt.{kind}.crash.doubled")
        if lost is not None:
            R.row(f"a drain of {ALT_CRASH_ROWS:,} killed halfway and restarted, {label}:"
                  " messages lost / published twice", f"{lost} / {doubled}", "msgs")
    for rate in ALT_RATES:
        for p in ("p50", "p99"):
            R.row(f"load {rate}/s, commit → stream {p}, relay",
                  g(f"alt.relay.load.{rate}.visible_ms.{p}"), "ms", "PgQ, ticker every poll",
                  g(f"alt.pgq.load.{rate}.visible_ms.{p}"))
        for kind, label in (("relay", "relay"), ("pgq", "PgQ")):
            miss = g(f"alt.{kind}.load.{rate}.missing_visible")
            if miss is not None:
                R.row(f"load {rate}/s, {label}: achieved rate; messages lost / published twice",
                      f"{fmt(g(f'alt.{kind}.load.{rate}.achieved_rate'))};"
                      f" {miss} / {g(f'alt.{kind}.load.{rate}.duplicate_visible')}", "")
    for sync in ("on", "off"):
        c = max(PRODUCER_CLIENTS)
        base = g(f"producers.norelay.sync_{sync}.c{c}.dropped.tps")
        for case, label in (("notify", "every transaction notifies"),
                            ("busy", "trigger, relay declared busy (no notify)")):
            R.row(f"no relay: {c} producers, sc {sync}, {label}",
                  g(f"producers.norelay.sync_{sync}.c{c}.{case}.tps"), "tx/s",
                  "no trigger", base)
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
    for pkg in ("libpq5", "libhiredis0.14", "libev4"):
        info[pkg] = cmd_out(["dpkg-query", "-W", "-f=${Version}", pkg])
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
    R.add("settings", "relay.other", "defaults: listen on, poll_interval 1s, dedup_ttl 24h")
    for key in ("ROWS", "RATE_SECONDS", "PGBENCH_SECONDS", "LOAD_PRODUCERS",
                "CLAIM_PENDING", "LIMIT_ROWS", "PUBLISH_CALLS", "CALL_ROWS", "PROFILE_ROWS",
                "QUICK"):
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
                     partitions=section_partitions, replicas=section_replicas,
                     cluster=section_cluster, alternatives=section_alternatives,
                     profile=section_profile)
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
