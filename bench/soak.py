#!/usr/bin/python3
"""The soak benchmark: does the relay run for a year? Storage must stay bounded.

    bench/run.sh --soak                   30 minutes (the full run)
    SOAK_MINUTES=4 bench/run.sh --soak    the same checks in 4 minutes

Starts its own PostgreSQL 15 (fsync on) and Redis 7 (appendonly, everysec) on
loopback, a relay with retention, and for SOAK_MINUTES a steady SOAK_RATE
(2,000) messages a second over 4 topics from bench-loadgen (8 producers,
single-row transactions). Two consumer groups read every stream: "steady"
(bench-loadgen's own, reading and acknowledging at once) and "lagger", which
stops for the middle third of the run and then catches up.

The retention settings scale with the run so that storage reaches its steady
state within the first third: sent_retention = SOAK_MINUTES x 4 s (at least
45 s, 2 min for 30; SOAK_SENT_RETENTION sets it),
stream_retention = SOAK_MINUTES x 10 s (5 min for 30),
vacuum_dead_rows = SOAK_RATE x SOAK_MINUTES x 2 (at least 5,000; 120,000 for
30 minutes at 2,000 a second, about the default).

Every SOAK_SAMPLE seconds it records the outbox's table+index size, the
time of a chunk of 500 rows of the latest batch (outbox.batch_rows, as the
relay reads it), Redis's used_memory, the stream lengths and the relay's retention
figures; bench-loadgen records, per window of commits, commit -> visible: read
by its own XREAD reader, which shares the load generator's process and cores.
(The entry id's time part is the tick's, not the time Redis added the entry,
so it gives no latency.)

Targets, checked at the end (exit 1 when one is missed):
- over the last third of the run (10 minutes of 30) the outbox's table+index
  size grows less than 5 % (the last sample against the largest of the minute
  before the last third and its first sample, so that a VACUUM truncating
  the table just before does not count its refill as growth), and Redis's
  used_memory less than 5 %;
- commit -> visible p99 never above 50 ms in a window outside the lagger's
  stop (and the minute after, while it catches up);
- no entry that the lagger had not acknowledged is trimmed: it reads every
  message exactly once, in the end;
- nothing is lost: every committed row reaches its stream and the steady group.

Writes bench/results/soak.csv (the samples), soak-windows.csv (latency),
soak-forks.csv (Redis's forks: when, and how long each blocked it),
soak-summary.md and soak.png (the five figures against time). BENCH_RESULTS
writes them elsewhere; BENCH_REDIS_ARGS passes more options to redis-server.
"""

import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

if not __package__:  # run as a file, "bench" would name bench/bench.py, not the package
    sys.exit("soak.py: run it as a module of the package bench, with the repository root\n"
             "on PYTHONPATH: PYTHONPATH=. /usr/bin/python3 -m bench.soak (bench/run.sh\n"
             "--soak builds the relay and the tools, then does so)")

from bench import benchlib  # noqa: E402
from testkit import harness  # noqa: E402

MINUTES = benchlib.env_float("SOAK_MINUTES", 30)
RATE = benchlib.env_int("SOAK_RATE", 2000)
SAMPLE = benchlib.env_float("SOAK_SAMPLE", 10 if MINUTES >= 10 else 5)
PRODUCERS = benchlib.env_int("SOAK_PRODUCERS", 8)
TOPICS = 4
SECONDS = MINUTES * 60
STOP_FROM, STOP_UNTIL = SECONDS / 3, 2 * SECONDS / 3
CATCH_UP = min(60.0, SECONDS / 10)  # after the stop: the lagger's reads compete
# At least 45 s: a few minutes' run then keeps tens of MiB of sent rows,
# large against the steps PostgreSQL extends a busy table by (up to 512
# pages at once), which would otherwise decide the 5 % check alone.
SENT_RETENTION_S = benchlib.env_int("SOAK_SENT_RETENTION", max(45, int(MINUTES * 4)))
STREAM_RETENTION_S = int(MINUTES * 10)
VACUUM_DEAD_ROWS = max(5000, int(RATE * MINUTES * 2))
P99_LIMIT_MS = 50.0
GROWTH_LIMIT = 0.05
# ... or one step of PostgreSQL's extension of a busy table (512 pages of 8
# KiB at once under concurrent inserts), whichever is more: in the test
# tier's 3-minute run the outbox is some 20 MiB, and one such step decides
# a 5 % check alone. Growth without bound adds far more: every row of the
# last third, some 20 MiB at 1,000 a second.
GROWTH_FLOOR_BYTES = 512 * 8192
# 0: the latency target is reported, not checked (the test tier's short run:
# a speed figure has no place in a test on a shared machine).
LATENCY_CHECK = os.environ.get("SOAK_LATENCY_CHECK", "1") != "0"
RESULTS = benchlib.RESULTS
STREAMS = [f"bench{i}" for i in range(TOPICS)]


def log(msg):
    benchlib.log(f"soak: {msg}")


class Lagger(threading.Thread):
    """Consumer group "lagger": reads and acknowledges everything, except while
    stopped; remembers every outbox_id it read and how often."""

    def __init__(self, rd, t0):
        super().__init__(daemon=True)
        self.rc = rd.client()
        self.t0 = t0
        self.seen = {}
        self.done = threading.Event()
        self.error = None

    def stopped(self):
        t = time.monotonic() - self.t0
        return STOP_FROM <= t < STOP_UNTIL

    def run(self):
        try:
            while not self.done.is_set():
                if self.stopped():
                    time.sleep(0.2)
                    continue
                got = self.rc.xreadgroup("lagger", "c1", {s: ">" for s in STREAMS},
                                         count=2000, block=200)
                for stream, entries in got or []:
                    ids = []
                    for entry_id, fields in entries:
                        oid = int(fields[b"outbox_id"])
                        self.seen[oid] = self.seen.get(oid, 0) + 1
                        ids.append(entry_id)
                    if ids:
                        self.rc.xack(stream, "lagger", *ids)
        except Exception as e:  # reported, and fails the run
            self.error = repr(e)


def scrape(relay):
    with urllib.request.urlopen(f"http://{relay.metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("outbox_relay_") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def timed_claim(conn, sql):
    """ms for a chunk of 500 rows of the latest batch, read as the relay reads it."""
    with conn.cursor() as cur:
        started = time.perf_counter()
        cur.execute(sql)
        cur.fetchall()
        took = (time.perf_counter() - started) * 1e3
    conn.rollback()
    return took


def sampler(pg, rd, relay, claim_sql, t0, samples, stop):
    conn = pg.connect()
    conn.autocommit = False
    rc = rd.client()
    auto = pg.connect()
    while not stop.wait(SAMPLE):
        try:
            s = {"t": round(time.monotonic() - t0, 1)}
            s["table_bytes"] = benchlib.scalar(
                auto, "SELECT sum(pg_total_relation_size(relid))::bigint"
                      " FROM pg_partition_tree('outbox.messages')")
            s["rows"] = benchlib.scalar(auto, "SELECT sum(n_live_tup)::bigint FROM pg_stat_all_tables"
                                              " WHERE relid IN (SELECT relid FROM"
                                              " pg_partition_tree('outbox.messages'))")
            s["claim_ms"] = round(timed_claim(conn, claim_sql), 3)
            s["redis_used_memory"] = rc.info("memory")["used_memory"]
            lengths = [rc.xlen(x) for x in STREAMS]
            s["stream_entries"] = sum(lengths)
            m = scrape(relay)
            for key in ("outbox_relay_outbox_dead_rows", "outbox_relay_sent_rows_deleted_total",
                        "outbox_relay_stream_entries_trimmed_total",
                        "outbox_relay_outbox_oldest_sent_age_seconds",
                        "outbox_relay_retention_errors_total"):
                s[key.replace("outbox_relay_", "")] = m.get(key)
            samples.append(s)
            log(f"t={s['t']:.0f}s table {s['table_bytes'] / 2**20:.1f} MiB ({s['rows']} rows),"
                f" claim {s['claim_ms']:.2f} ms, redis {s['redis_used_memory'] / 2**20:.1f} MiB,"
                f" streams {s['stream_entries']} entries")
        except Exception as e:
            log(f"sample failed: {e!r}")
            # A statement that failed leaves its transaction aborted: end it, or
            # every later sample fails with it.
            try:
                conn.rollback()
            except Exception as again:
                log(f"sample: rollback failed: {again!r}")
    conn.close()
    auto.close()
    rc.close()


def growth(samples, key):
    """Relative growth of key over the last third: the last sample against the
    first of the last third."""
    last = [s for s in samples if s["t"] >= 2 * SECONDS / 3]
    if len(last) < 2:
        return None, None, None
    a, b = last[0][key], last[-1][key]
    return a, b, (b - a) / a if a else None


def table_growth(samples):
    """Growth of the outbox's table+index size over the last third: the last
    sample against the largest in the minute before the last third and its
    first sample. A VACUUM may truncate the table's empty tail pages just
    before the last third begins; the table fills that space again at once,
    which is not growth. Returns (reference, last, growth, first of the last
    third)."""
    start = 2 * SECONDS / 3
    last = [s for s in samples if s["t"] >= start]
    if len(last) < 2:
        return None, None, None, None
    before = [s["table_bytes"] for s in samples if start - 60 <= s["t"] < start]
    a = max(before + [last[0]["table_bytes"]])
    b = last[-1]["table_bytes"]
    return a, b, (b - a) / a if a else None, last[0]["table_bytes"]


def plot(samples, windows):
    if shutil.which("gnuplot") is None:
        log("gnuplot not found: no plot (bench/run.sh installs gnuplot-nox)")
        return
    dat = os.path.join(RESULTS, "soak.dat")
    with open(dat, "w") as f:
        for s in samples:
            f.write(f"{s['t'] / 60:.3f} {s['table_bytes'] / 2**20:.3f} {s['claim_ms']}"
                    f" {s['redis_used_memory'] / 2**20:.3f} {s['stream_entries']}\n")
    wdat = os.path.join(RESULTS, "soak-windows.dat")
    with open(wdat, "w") as f:
        for w in windows:
            if "p99" in w:
                f.write(f"{w['t'] / 60:.3f} {w['p99']}\n")
    stop = (f"set object 1 rect from {STOP_FROM / 60},graph 0 to {STOP_UNTIL / 60},graph 1"
            " fc rgb '#eeeeee' behind\n")
    gp = os.path.join(RESULTS, "soak.gp")
    with open(gp, "w") as f:
        f.write(f"""set terminal pngcairo size 1000,1400 font ',9'
set output '{os.path.join(RESULTS, "soak.png")}'
set multiplot layout 5,1 title 'outbox-relay soak: {RATE} msg/s over {TOPICS} topics for {MINUTES:g} min (grey: group "lagger" stopped)'
set xlabel 'minutes'
set grid
{stop}set ylabel 'MiB'
plot '{dat}' u 1:2 w l lw 2 t 'outbox.messages, table + indexes'
set ylabel 'ms'
plot '{dat}' u 1:3 w lp pt 7 ps 0.4 t 'a batch chunk of 500 rows'
set ylabel 'ms'
set yrange [0:*]
plot '{wdat}' u 1:2 w lp pt 7 ps 0.4 t 'commit -> visible to a reader (XREAD), p99 per window', {P99_LIMIT_MS} w l dt 2 t 'target'
unset yrange
set ylabel 'MiB'
plot '{dat}' u 1:4 w l lw 2 t 'Redis used memory'
set ylabel 'entries'
plot '{dat}' u 1:5 w l lw 2 t 'entries in the 4 streams'
unset multiplot
""")
    proc = subprocess.run(["gnuplot", gp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        log(f"gnuplot: {proc.stdout[-1000:]}")


def fork_watcher(rd, t0, forks, stop):
    """Redis's forks (its AOF rewrites), each as (seconds from t0, the time
    it blocked Redis in ms), read from INFO stats every 0.25 s."""
    rc = rd.client()
    last = None
    while not stop.wait(0.25):
        try:
            st = rc.info("stats")
        except Exception:
            continue
        total = st.get("total_forks", 0)
        if last is not None and total > last:
            forks.append((round(time.monotonic() - t0, 2), st.get("latest_fork_usec", 0) / 1000))
        last = total
    rc.close()


def main():
    os.makedirs(RESULTS, exist_ok=True)
    for path in (benchlib.RELAY_BIN, benchlib.LOADGEN_BIN):
        if not os.access(path, os.X_OK):
            sys.exit(f"soak.py: {path} not found: run bench/run.sh --soak, which builds it")
    os.environ["OUTBOX_RELAY_BIN"] = benchlib.RELAY_BIN
    harness.set_deadline(SECONDS + 900)
    log(f"{RATE} msg/s for {MINUTES:g} min; sent_retention {SENT_RETENTION_S}s,"
        f" stream_retention {STREAM_RETENTION_S}s, vacuum_dead_rows {VACUUM_DEAD_ROWS};"
        f" group lagger stops from"
        f" {STOP_FROM:.0f}s to {STOP_UNTIL:.0f}s")
    with benchlib.servers() as (pg, rd, conn, rc):
        for s in STREAMS:
            rc.xgroup_create(s, "lagger", id="$", mkstream=True)
        relay = benchlib.start_relay(pg, rd, sent_retention=f"{SENT_RETENTION_S}s",
                                     stream_retention=f"{STREAM_RETENTION_S}s",
                                     observe_interval="1s",
                                     vacuum_dead_rows=str(VACUUM_DEAD_ROWS))
        # A chunk of the latest batch, as the relay reads it: its cost must not
        # grow with the table.
        claim_sql = ("SELECT count(*) FROM (SELECT max(tick_id) AS n FROM outbox.ticks) AS t,"
                     " LATERAL outbox.batch_bounds(t.n - 1, t.n) AS b,"
                     " LATERAL outbox.batch_rows(t.n - 1, t.n, b.lo - 1, b.hi, 500) AS r")
        samples, stop = [], threading.Event()
        t0 = time.monotonic()
        lagger = Lagger(rd, t0)
        lagger.start()
        th = threading.Thread(target=sampler, args=(pg, rd, relay, claim_sql, t0, samples, stop),
                              daemon=True)
        th.start()
        forks = []
        fw = threading.Thread(target=fork_watcher, args=(rd, t0, forks, stop), daemon=True)
        fw.start()
        try:
            res = benchlib.run_json([benchlib.LOADGEN_BIN, "--postgres", pg.dsn(), "--redis-port",
                                     str(rd.port), "--rate", str(RATE), "--seconds", str(SECONDS),
                                     "--producers", str(PRODUCERS), "--topics", str(TOPICS),
                                     "--payload", "200", "--group", "steady", "--wait", "60",
                                     "--windows", str(SAMPLE)], timeout=SECONDS + 600)
            # The lagger catches up on what is left.
            deadline = time.monotonic() + 120
            while len(lagger.seen) < res["committed"] and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            stop.set()
            lagger.done.set()
            th.join(30)
            fw.join(10)
            lagger.join(10)
            relay_log = relay.log()
            benchlib.stop_relay(relay)
    return report(res, samples, lagger, relay_log, forks)


def report(res, samples, lagger, relay_log, forks=()):
    windows = res.get("windows", [])
    with open(os.path.join(RESULTS, "soak.csv"), "w") as f:
        keys = list(samples[0].keys()) if samples else []
        f.write(",".join(keys) + "\n")
        for s in samples:
            f.write(",".join("" if s.get(k) is None else str(s[k]) for k in keys) + "\n")
    with open(os.path.join(RESULTS, "soak-windows.csv"), "w") as f:
        f.write("t,n,missing,visible_p50,visible_p99,visible_max\n")
        for w in windows:
            f.write(f"{w['t']},{w['n']},{w['missing']},{w.get('p50', '')},"
                    f"{w.get('p99', '')},{w.get('max', '')}\n")
    plot(samples, windows)

    checks = []
    a, b, g, first = table_growth(samples)
    if g is not None:
        allowed = max(GROWTH_LIMIT * a, GROWTH_FLOOR_BYTES)
        # What the last third would add with nothing deleted: its rows at
        # the bytes per row of the outbox (which holds sent_retention's rows).
        unbounded = a / (RATE * SENT_RETENTION_S) * RATE * SECONDS / 3
        table = (f"{a / 2**20:.1f} -> {b / 2**20:.1f} MiB ({g:+.1%}; limit"
                 f" {allowed / 2**20:.1f} MiB, the larger of 5 % and one 512-page extension;"
                 f" without retention about +{unbounded / 2**20:.0f} MiB)")
        if first != a:
            table += (f"; from the last third's first sample, {first / 2**20:.1f} MiB after"
                      f" a VACUUM truncated the table: {(b - first) / first:+.1%}")
    checks.append(("outbox table+index size, growth over the last third",
                   table if g is not None else "n/a",
                   g is not None and b - a < allowed))
    a, b, g = growth(samples, "redis_used_memory")
    checks.append(("Redis used_memory, growth over the last third",
                   f"{a / 2**20:.1f} -> {b / 2**20:.1f} MiB ({g:+.1%})" if g is not None else "n/a",
                   g is not None and g < GROWTH_LIMIT))
    # A window with fewer than half the rows it should hold (the last one, cut
    # by the end of the run) has no p99 to speak of.
    full = [w for w in windows if "p99" in w and w["n"] >= RATE * SAMPLE / 2]
    outside = [w for w in full if not (STOP_FROM - SAMPLE < w["t"] < STOP_UNTIL + CATCH_UP)]
    worst = max((w["p99"] for w in outside), default=None)
    where = max(outside, key=lambda w: w["p99"])["t"] if outside else None
    over = sum(1 for w in outside if w["p99"] > P99_LIMIT_MS)
    checks.append(("commit -> visible p99, worst window outside the lagger's stop",
                   (f"{worst:.1f} ms at {where:.0f}s (limit {P99_LIMIT_MS:g}; {over} of"
                    f" {len(outside)} windows above)" if worst is not None else "n/a")
                   + ("" if LATENCY_CHECK else " (reported)"),
                   not LATENCY_CHECK or (worst is not None and worst <= P99_LIMIT_MS)))
    inside = [w["p99"] for w in full if w not in outside]
    # Which slow windows held a fork of Redis (an AOF rewrite), which blocks
    # every command while the kernel copies its page tables. A window's t is
    # its start from the first commit, a second or so after t0.
    with open(os.path.join(RESULTS, "soak-forks.csv"), "w") as f:
        f.write("t,fork_ms\n")
        for t, ms in forks:
            f.write(f"{t},{ms}\n")

    def forked(w):
        return any(w["t"] - 1 <= t <= w["t"] + SAMPLE + 2 for t, _ in forks)
    slow = [w for w in outside if w["p99"] > P99_LIMIT_MS]
    fork_ms = sorted(ms for _, ms in forks)
    committed = res["committed"]
    read_once = sum(1 for c in lagger.seen.values() if c == 1)
    checks.append(("entries the lagger had not acknowledged, trimmed",
                   f"read {len(lagger.seen)} of {committed} messages, {read_once} exactly once"
                   + (f"; error {lagger.error}" if lagger.error else ""),
                   lagger.error is None and len(lagger.seen) == committed
                   and read_once == committed))
    checks.append(("nothing lost: missing from the streams / from group steady",
                   f"{res['missing_visible']} / {res['missing_acked']} of {committed}",
                   res["missing_visible"] == 0 and res["missing_acked"] == 0 and committed > 0))
    claims = [s["claim_ms"] for s in samples]
    lines = [f"# Soak: {RATE} msg/s over {TOPICS} topics for {MINUTES:g} minutes", "",
             f"sent_retention {SENT_RETENTION_S}s, stream_retention {STREAM_RETENTION_S}s;"
             f" group lagger stopped from {STOP_FROM:.0f}s to {STOP_UNTIL:.0f}s;"
             + (f" redis-server {' '.join(benchlib.REDIS_ARGS)};" if benchlib.REDIS_ARGS else "")
             + f" achieved {res['achieved_rate']:.0f} msg/s, {committed} messages.", "",
             "| check | figure | met |", "|---|---|---|"]
    for what, figure, ok in checks:
        lines.append(f"| {what} | {figure} | {'yes' if ok else '**no**'} |")
    lines += ["", f"commit -> visible (bench-loadgen's own XREAD reader, in the load"
              f" generator's process) p99 in the lagger's stop and catch-up: worst"
              f" {max(inside, default=0):.1f} ms; over the whole run p99"
              f" {res['visible_ms'].get('p99', 0):.1f} ms.",
              f"a batch chunk of 500 rows: median {statistics.median(claims):.2f} ms, first third"
              f" {statistics.median([s['claim_ms'] for s in samples if s['t'] < SECONDS / 3] or [0]):.2f} ms,"
              f" last third"
              f" {statistics.median([s['claim_ms'] for s in samples if s['t'] >= 2 * SECONDS / 3] or [0]):.2f} ms."
              if claims else "no samples",
              f"Redis forked {len(forks)} times (AOF rewrites), blocking it"
              f" {statistics.median(fork_ms) if fork_ms else 0:.1f} ms in the median, at most"
              f" {max(fork_ms, default=0):.1f} ms; of the {len(slow)} windows above"
              f" {P99_LIMIT_MS:g} ms outside the stop, {sum(1 for w in slow if forked(w))} held"
              f" a fork, and {sum(1 for w in outside if forked(w))} of the {len(outside)}"
              f" windows there held one.",
              f"retention warnings in the relay's log: "
              f"{len([x for x in relay_log.splitlines() if 'WARNING retention' in x])}."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, "soak-summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
