#!/usr/bin/python3
"""The snapshot-and-cursor prototype (bench/extra/snapshot_cursor.*) against PgQ and the
relay: the same backlog drained by each, in turns, on fresh servers each time.

An experiment behind docs/PERFORMANCE.md ("Exactly once at PgQ's cost: the prototype"),
not part of the run. Each drain is the benchmark's side-by-side drain (bench/bench.py,
alt_drain): CURSOR_ROWS rows of 200 bytes over 4 topics committed in one transaction,
checkpointed, then drained into Redis (appendonly, everysec) with PostgreSQL's fsync on;
the drain ends when every entry is in Redis. The kinds, in turns (A B C A B C ...):

  pgq     PgQ and bench-pgq, the plain XADD consumer (at least once)
  cursor  bench-cursor: batches from ticks' snapshots, one FCALL per stream per
          chunk of 500 that appends and moves the stream's cursor key (exactly once)
  ids     bench-cursor --publish ids: the same batches, MULTI + XADD with the row's
          place as the entry id + EXEC per stream per chunk (exactly once, no key
          besides the stream, no function)
  relay   outbox-relay with its defaults (exactly once: a dedup record a message);
          Redis's CPU is counted until the records are retired, as the benchmark does

For each: the rate, and client + PostgreSQL + Redis CPU per 100k messages; the ratios
to PgQ are medians over the rounds. A thread polls DBSIZE and used_memory every 0.25 s
for every kind alike, for the peak count of keys besides the streams (the relay's
dedup records, the prototype's 4 cursors) and their bytes (MEMORY USAGE of a sample).
Writes bench/results/snapshot-cursor.csv and prints a table in markdown. Needs
build-bench with bench-pgq, bench-cursor and outbox-relay, and PgQ
(apt-get install postgresql-15-pgq3).

    CURSOR_ROWS=1000000 CURSOR_ROUNDS=2 PYTHONPATH=. /usr/bin/python3 bench/extra/snapshot_cursor.py

CURSOR_KINDS chooses the kinds (pgq,cursor,ids,relay). It waits while /tmp/ci-running
exists (a CI run on the same machine), polling every 30 s.
"""
import contextlib
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from bench import benchlib

ROWS = benchlib.env_int("CURSOR_ROWS", 1000000)
ROUNDS = benchlib.env_int("CURSOR_ROUNDS", 2)
KINDS = [k for k in (os.environ.get("CURSOR_KINDS") or "pgq,cursor,ids,relay").split(",") if k]
os.environ["BENCH_ALT_ROWS"] = str(ROWS)  # bench.bench reads its sizes when imported
from bench import bench as B  # noqa: E402  (alt_drain, the PgQ case, stream_ids)

CURSOR_BIN = os.path.join(benchlib.BUILD, "bench-cursor")
os.environ["OUTBOX_RELAY_BIN"] = benchlib.RELAY_BIN  # the harness's relay: build-bench's
SQL = os.path.join(benchlib.HERE, "extra", "snapshot_cursor.sql")
OUT = os.path.join(benchlib.RESULTS, "snapshot-cursor.csv")


# --------------------------------------------------------------------------
# Keys besides the streams, sampled during every drain.

class KeySampler:
    """Polls DBSIZE and used_memory; once more than 1,000 keys besides the streams
    exist, reads MEMORY USAGE of up to 50 of them (a SCAN step): the relay's dedup
    records. The prototype's cursors are read at the end (cursor_bytes)."""

    def __init__(self, rd, interval=0.25):
        self.client = rd.client()
        self.peak_keys = 0
        self.peak_used = 0
        self.sample_bytes = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval):
        while not self._stop.wait(interval):
            keys = self.client.dbsize() - B.TOPICS
            self.peak_keys = max(self.peak_keys, keys)
            self.peak_used = max(self.peak_used, self.client.info("memory")["used_memory"])
            if self.sample_bytes is None and keys > 1000:
                _, found = self.client.scan(0, match="*:dedup:*", count=1000)
                sizes = [self.client.memory_usage(k) or 0 for k in found[:50]]
                if sizes:
                    self.sample_bytes = statistics.mean(sizes)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.commands = self.client.info("commandstats")
        self.client.close()


SAMPLERS = []


@contextlib.contextmanager
def sampled_servers():
    """bench.bench's servers(), with a KeySampler on Redis while they run."""
    with benchlib.servers() as (pg, rd, conn, rc):
        sampler = KeySampler(rd)
        SAMPLERS.append(sampler)
        try:
            yield pg, rd, conn, rc
        finally:
            sampler.stop()


B.servers = sampled_servers  # alt_drain() starts its servers through this name


# --------------------------------------------------------------------------
# The prototype's drain, in the shape of alt_drain's PgQ case.

def cursor_backlog(conn, n):
    """The relay's backlog (benchlib.insert_backlog) in cursor_proto.messages."""
    benchlib.execute(conn, "INSERT INTO cursor_proto.messages (topic, payload)"
                           " SELECT 'bench' || (g %% %s),"
                           " substring(decode(repeat(md5(g::text), 13), 'hex') FROM 1 FOR %s)"
                           " FROM generate_series(1, %s) AS g",
                     (B.TOPICS, B.PAYLOAD, n))
    benchlib.execute(conn, "VACUUM ANALYZE cursor_proto.messages")
    benchlib.execute(conn, "CHECKPOINT")


def start_cursor(pg, rd, publish):
    proc = subprocess.Popen([CURSOR_BIN, "--postgres", pg.dsn(), "--redis-port", str(rd.port),
                             "--fetch", str(B.BATCH), "--publish", publish],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    if proc.poll() is not None:
        raise RuntimeError(f"bench-cursor exited: {proc.stderr.read()[-2000:]}")
    return proc


def stop_cursor(proc):
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"bench-cursor failed ({proc.returncode}): {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def cursor_drain(publish):
    with B.servers() as (pg, rd, conn, rc):
        pg.psql("-f", SQL)
        benchlib.execute(conn, "SELECT cursor_proto.register('bench')")
        cursor_backlog(conn, ROWS)
        meter = benchlib.CpuMeter(pg, rd)
        started = time.monotonic()
        proc = start_cursor(pg, rd, publish)
        try:
            deadline = started + max(120.0, ROWS / 1000.0)
            while benchlib.stream_total(rc) < ROWS:
                if proc.poll() is not None:
                    raise RuntimeError(f"bench-cursor exited: {proc.stderr.read()[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError("the prototype's drain did not finish")
                time.sleep(0.02)
            took = time.monotonic() - started
            cpu = benchlib.proc_cpu(proc.pid)
            pg_cpu, rd_cpu = meter.read()
        finally:
            out = stop_cursor(proc)
        d = dict(rows=ROWS, seconds=took, rate=ROWS / took, cpu=cpu, pg_cpu=pg_cpu,
                 redis_cpu=rd_cpu, total_cpu_per_100k=(cpu + pg_cpu + rd_cpu) / ROWS * 1e5,
                 batches=out["batches"], calls=out["calls"], refused=out["refused"],
                 read_s=out["read_s"], publish_wait_s=out["publish_wait_s"],
                 finish_s=out["finish_s"], tick_s=out["tick_s"])
        time.sleep(0.5)
        total, distinct = B.stream_ids(rc)
        d.update(entries=total, lost=ROWS - distinct, doubled=total - distinct,
                 cursor_bytes=sum(rc.memory_usage(f"{{bench{i}}}:cursor") or 0
                                  for i in range(B.TOPICS)))
        return d


def run(kind):
    started = time.monotonic()
    if kind in ("cursor", "ids"):
        d = cursor_drain("fcall" if kind == "cursor" else "ids")
    else:
        d = B.alt_drain(kind)
    s = SAMPLERS.pop()
    d.update(kind=kind, peak_other_keys=s.peak_keys, peak_used_memory=s.peak_used,
             key_bytes=s.sample_bytes, wall=time.monotonic() - started)
    # Redis's time in the commands that publish, µs a message (INFO commandstats):
    # PgQ's XADD, the relay's and the prototype's FCALL, the EXEC of the ids variant
    # (which includes its XADDs).
    publish = dict(pgq="xadd", cursor="fcall", ids="exec", relay="fcall")[kind]
    d["redis_publish_us"] = s.commands.get(f"cmdstat_{publish}", {}).get("usec", 0) / ROWS
    if kind == "relay" and s.sample_bytes:
        d["records_peak_bytes"] = s.peak_keys * s.sample_bytes
    return d


def wait_for_ci():
    while os.path.exists("/tmp/ci-running"):
        benchlib.log("a CI run is going on (/tmp/ci-running): waiting 30 s")
        time.sleep(30)


def main():
    for path in (CURSOR_BIN, benchlib.PGQ_BIN, benchlib.RELAY_BIN):
        if not os.path.exists(path):
            sys.exit(f"{path} not found: build build-bench first (bench/run.sh, or cmake"
                     " --build build-bench --target outbox-relay bench-pgq bench-cursor)")
    wait_for_ci()
    started = time.monotonic()
    load = os.getloadavg()
    runs = []
    for i in range(ROUNDS):
        for kind in KINDS:
            d = run(kind)
            runs.append(d)
            benchlib.log(f"round {i + 1}, {kind}: {d['rate']:,.0f} msg/s, CPU (client +"
                         f" PostgreSQL + Redis) {d['total_cpu_per_100k']:.3f} s per 100k"
                         f" (client {d['cpu']:.2f}, PostgreSQL {d['pg_cpu']:.2f}, Redis"
                         f" {d['redis_cpu']:.2f} s), lost {d['lost']}, doubled {d['doubled']},"
                         f" peak keys besides the streams {d['peak_other_keys']:,},"
                         f" {d['wall']:.0f} s in all")
    fields = sorted({k for d in runs for k in d})
    os.makedirs(benchlib.RESULTS, exist_ok=True)
    with open(OUT, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["kind"] + [k for k in fields if k != "kind"])
        w.writeheader()
        for d in runs:
            w.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()})

    def med(kind, key):
        vals = [d[key] for d in runs if d["kind"] == kind and d.get(key) is not None]
        return statistics.median(vals) if vals else None

    took = time.monotonic() - started
    print(f"\n{ROWS:,} rows, {ROUNDS} rounds in turns ({', '.join(KINDS)}), {took:.0f} s;"
          f" load average at the start {load[0]:.2f}\n")
    print("| | drain rate (msg/s) | × PgQ | CPU per 100k (s): client + PostgreSQL + Redis"
          " | × PgQ | Redis in its publish commands, µs a message | lost / doubled"
          " | keys besides the streams, peak |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in KINDS:
        rate, cpu = med(kind, "rate"), med(kind, "total_cpu_per_100k")
        prate, pcpu = med("pgq", "rate"), med("pgq", "total_cpu_per_100k")
        parts = [med(kind, k) / ROWS * 1e5 for k in ("cpu", "pg_cpu", "redis_cpu")]
        lost = sum(d["lost"] for d in runs if d["kind"] == kind)
        doubled = sum(d["doubled"] for d in runs if d["kind"] == kind)
        keys = max(d["peak_other_keys"] for d in runs if d["kind"] == kind)
        print(f"| {kind} | {rate:,.0f} (" + " / ".join(f"{d['rate']:,.0f}" for d in runs
                                                      if d["kind"] == kind)
              + f") | {rate / prate:.2f} | {cpu:.3f} = {parts[0]:.3f} + {parts[1]:.3f} +"
              f" {parts[2]:.3f} | {cpu / pcpu:.2f} | {med(kind, 'redis_publish_us'):.2f}"
              f" | {lost} / {doubled} | {keys:,} |"
              if prate and pcpu else f"| {kind} | {rate:,.0f} | | {cpu:.3f} | | | | |")
    rb, cb = med("relay", "records_peak_bytes"), med("cursor", "cursor_bytes")
    if rb is not None or cb is not None:
        print(f"\nRedis memory for exactly once: relay's dedup records at their peak about"
              f" {rb or 0:,.0f} bytes ({med('relay', 'peak_other_keys') or 0:,.0f} records of"
              f" {med('relay', 'key_bytes') or 0:.0f} bytes); the prototype's cursor keys"
              f" {cb or 0:,.0f} bytes for {B.TOPICS} streams, whatever the backlog; with entry"
              f" ids as the cursor, no key at all")
    print(f"\nraw figures: {OUT}")


if __name__ == "__main__":
    main()
