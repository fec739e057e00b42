#!/usr/bin/python3
"""The outbox of issue 40 partitioned by transaction id: what it costs producers, what its
rotation costs them, and whether the batch query prunes (bench/extra/outbox_layout.sql).

An experiment behind docs/PERFORMANCE.md ("Rotation and the producers' cost"), not part of
the run. One PostgreSQL (the benchmark's settings: fsync on, shared_buffers 1GB) and the
benchmark's Redis (only for benchlib's CPU meter), in three parts:

  producers  pgbench, 16 clients, -M prepared, each transaction one INSERT of a 200-byte
             payload (bench/bench.py's producers), into
               plain      the table without the relay's additions: PK (id), UNIQUE
                          (message_id), no trigger
               full       the table with them: txid column, PARTITION BY RANGE (txid), PK
                          (txid, id), the wake-up trigger with the wake-up lock held by a
                          session (a busy relay), the partition_no trigger
               full_idle  full with the wake-up lock free: every transaction notifies (an
                          idle relay, LISTENing)
               full_mid   full plus a plain index on message_id (what looking messages up
                          by message_id would cost)
             in turns, LAYOUT_ROUNDS rounds, synchronous_commit on and off; tx/s and
             PostgreSQL CPU per 100k rows. The partitions cover the round beforehand.
  rotation   16 producers into full while a session rotates every second: partitions of
             width W (about 2 s of the producers' transactions) created K=3 ahead, and
             dropped once a fake finished-tick xmin (pg_current_snapshot()'s xmin as it
             was a second before) has passed them, in turns:
               none       no rotation (the partitions created before the round)
               create     CREATE TABLE ... PARTITION OF and DROP TABLE (ACCESS EXCLUSIVE
                          on the parent), with a DEFAULT partition present
               attach     CREATE TABLE (LIKE) + ATTACH PARTITION, and DETACH PARTITION ...
                          CONCURRENTLY + DROP TABLE (no DEFAULT partition: CONCURRENTLY
                          refuses one)
             The producers' rate, each statement's time, the producers' transaction
             latencies (pgbench's log) and how often pg_stat_activity showed a producer
             waiting on a lock (sampled every 10 ms).
  pruning    the batch query of bench/extra/snapshot_cursor.sql (batch_rows) and the same
             with its older-transactions branch bounded (batch_rows_bounded), prepared,
             with custom and generic plans, on 8, 64 and 256 partitions of 2,000 rows:
             time per chunk of 500; EXPLAIN ANALYZE into
             bench/results/outbox-layout-explain.txt.

Writes bench/results/outbox-layout.csv and prints a table in markdown. Waits while
/tmp/ci-running exists (a CI run on the same machine), polling every 30 s.

    PYTHONPATH=. /usr/bin/python3 bench/extra/outbox_layout.py [--quick]

--quick: a smoke run (1 round of 1 s, 8 and 64 partitions, no waiting for CI);
LAYOUT_PARTS=producers,rotation,stall,default,pruning chooses the parts (the rotation's
width then assumes 5,000 tx/s without the producers' part), LAYOUT_ROUNDS and
LAYOUT_SECONDS the rounds (2) and their length (10 s).
"""
import argparse
import csv
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import benchlib  # noqa: E402
from bench.benchlib import execute, log, scalar  # noqa: E402

SQL = os.path.join(benchlib.HERE, "extra", "outbox_layout.sql")
OUT = os.path.join(benchlib.RESULTS, "outbox-layout.csv")
EXPLAIN_OUT = os.path.join(benchlib.RESULTS, "outbox-layout-explain.txt")
WAKEUP_LOCK = 122550254464888
CLIENTS = 16
KINDS = ("plain", "full", "full_idle", "full_mid")
ROTATIONS = ("none", "create", "attach")
AHEAD = 3
PRUNE_WIDTH = 4000  # fake transaction ids a partition, every other one with a row
PRUNE_BASE = 100_000_000

RAW = []  # (section, name, value, unit, detail)


def add(section, name, value, unit="", detail=""):
    if isinstance(value, float):
        value = round(value, 6)
    RAW.append((section, name, value, unit, detail))
    return value


def wait_for_ci():
    while os.path.exists("/tmp/ci-running"):
        log("a CI run is going on (/tmp/ci-running): waiting 30 s")
        time.sleep(30)


def set_sync(conn, sync):
    execute(conn, f"ALTER SYSTEM SET synchronous_commit = {sync}")
    execute(conn, "SELECT pg_reload_conf()")
    time.sleep(0.2)


def pgbench(pg, script, seconds, latency_log=None):
    """16 clients flat out for `seconds`; with latency_log (a directory), every
    transaction's latency from pgbench's log, in ms."""
    argv = [os.path.join(pg.bindir, "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(pg.port),
            "-U", "postgres", "-M", "prepared", "-c", str(CLIENTS), "-j", "2",
            "-T", str(seconds), "-f", script]
    if latency_log:
        argv += ["-l", "--log-prefix", os.path.join(latency_log, "lat")]
    argv.append(pg.database)
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=seconds + 120)
    tps = n = None
    for line in proc.stdout.splitlines():
        if line.startswith("tps = ") and "without initial connection time" in line:
            tps = float(line.split()[2])
        if line.startswith("number of transactions actually processed:"):
            n = int(line.split(":")[1].split("/")[0])
        if line.startswith("number of failed transactions:"):
            add("notes", "pgbench.failed", line.split(":")[1].strip())
    if proc.returncode != 0 or tps is None:
        raise RuntimeError(f"pgbench failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    res = dict(tps=tps, transactions=n)
    if latency_log:
        lat = []
        for name in os.listdir(latency_log):
            with open(os.path.join(latency_log, name)) as f:
                lat += [int(line.split()[2]) / 1000.0 for line in f if line.strip()]
            os.unlink(os.path.join(latency_log, name))
        lat.sort()
        if lat:
            res.update(lat_p50_ms=lat[len(lat) // 2], lat_p99_ms=lat[int(len(lat) * 0.99)],
                       lat_p999_ms=lat[int(len(lat) * 0.999)], lat_max_ms=lat[-1],
                       lat_over_50ms=sum(1 for x in lat if x > 50))
    return res


def insert_script(tmp, table):
    path = os.path.join(tmp, f"insert-{table}.sql")
    payload = bytes((i * 37 + 11) & 0xFF for i in range(benchlib.PAYLOAD)).hex()
    with open(path, "w") as f:
        f.write(f"INSERT INTO layout_proto.{table} (topic, payload)"
                f" VALUES ('bench', '\\x{payload}');\n")
    return path


def drop_partitions(conn):
    """Every partition of full, the DEFAULT one too."""
    with conn.cursor() as cur:
        cur.execute("SELECT name FROM layout_proto.parts")
        for (name,) in cur.fetchall():
            cur.execute(f"DROP TABLE layout_proto.{name}")


def cover(conn, width, xids):
    """Partitions of `width` from the xid counter's to `xids` beyond it, none below."""
    drop_partitions(conn)
    ahead = xids // width + AHEAD
    return scalar(conn, "SELECT created FROM layout_proto.rotate(%s, %s)", (width, ahead))


def fresh(conn):
    execute(conn, "TRUNCATE layout_proto.plain, layout_proto.full")
    execute(conn, "CHECKPOINT")


# --------------------------------------------------------------------------
# The producers: plain against full.

def producers(pg, rd, conn, tmp, rounds, seconds):
    scripts = {k: insert_script(tmp, "plain" if k == "plain" else "full") for k in KINDS}
    busy = pg.connect()
    listener = pg.connect()
    execute(listener, "LISTEN outbox_relay")
    tps = {}
    try:
        for sync in ("on", "off"):
            set_sync(conn, sync)
            for rnd in range(rounds):
                order = KINDS[rnd % len(KINDS):] + KINDS[:rnd % len(KINDS)]
                if sync == "off":
                    order = tuple(reversed(order))
                for kind in order:
                    # A busy relay holds the wake-up lock; an idle one does not.
                    execute(busy, "SELECT pg_advisory_unlock_all()" if kind == "full_idle"
                            else f"SELECT pg_advisory_lock({WAKEUP_LOCK})")
                    if kind == "full_mid":
                        execute(conn, "CREATE INDEX full_message_id_idx"
                                      " ON layout_proto.full (message_id)")
                    cover(conn, 1_000_000, 60_000 * seconds)
                    fresh(conn)
                    meter = benchlib.CpuMeter(pg, rd)
                    try:
                        res = pgbench(pg, scripts[kind], seconds)
                    finally:
                        pg_cpu, _ = meter.read()
                        if kind == "full_mid":
                            execute(conn, "DROP INDEX layout_proto.full_message_id_idx")
                        execute(busy, "SELECT pg_advisory_unlock_all()")
                    notified = 0
                    while select.select([listener], [], [], 0.2)[0]:
                        listener.poll()
                        notified += len(listener.notifies)
                        listener.notifies.clear()
                    parts = scalar(conn, "SELECT count(DISTINCT tableoid) FROM layout_proto.full")
                    name = f"producers.sync_{sync}.{kind}.r{rnd + 1}"
                    add("producers", f"{name}.tps", res["tps"], "tx/s")
                    add("producers", f"{name}.transactions", res["transactions"])
                    add("producers", f"{name}.pg_cpu", pg_cpu, "s")
                    per = pg_cpu / max(1, res["transactions"]) * 1e5
                    add("producers", f"{name}.pg_cpu_per_100k", per, "s")
                    add("producers", f"{name}.notifications", notified)
                    add("producers", f"{name}.partitions_written", parts)
                    tps.setdefault((sync, kind), []).append((res["tps"], per))
                    log(f"{name}: {res['tps']:,.0f} tx/s, PostgreSQL {per:.2f} s per 100k,"
                        f" {notified} notifications")
    finally:
        busy.close()
        listener.close()
    return tps


# --------------------------------------------------------------------------
# Rotation under load.

class LockSampler:
    """Every 10 ms, how many producers (application_name pgbench) wait on a lock:
    on a table's lock (wait_event 'relation', what DDL makes them wait for), and on
    any (the extension of the table's files is one too)."""

    def __init__(self, pg):
        self.conn = pg.connect()
        self.samples = 0
        self.waiting = 0       # samples with a producer waiting on a table's lock
        self.waiting_any = 0   # samples with a producer waiting on any lock
        self.peak = 0          # the most producers waiting on a table's lock at once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with self.conn.cursor() as cur:
            while not self._stop.wait(0.01):
                cur.execute("SELECT count(*) FILTER (WHERE wait_event = 'relation'), count(*)"
                            " FROM pg_stat_activity"
                            " WHERE application_name = 'pgbench' AND wait_event_type = 'Lock'")
                table, any_lock = cur.fetchone()
                self.samples += 1
                self.waiting += table > 0
                self.waiting_any += any_lock > 0
                self.peak = max(self.peak, table)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.conn.close()


class Rotator:
    """Rotates full every second as the relay would: partitions created AHEAD beyond
    the xid counter's, and those below the finished tick's xmin (here the xmin the
    loop saw a second before) dropped."""

    def __init__(self, pg, how, width):
        self.conn = pg.connect()
        self.how = how
        self.width = width
        self.times = {}  # statement -> [ms]
        self.errors = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _timed(self, what, sql, args=None):
        with self.conn.cursor() as cur:
            t0 = time.perf_counter()
            cur.execute(sql, args)
            row = cur.fetchone() if cur.description else None
            self.times.setdefault(what, []).append((time.perf_counter() - t0) * 1000)
            return row

    def _run(self):
        xmin_before = None
        cur = self.conn.cursor()
        while not self._stop.wait(1.0):
            try:
                made = self._timed("create", "SELECT created FROM layout_proto.rotate(%s, %s, %s)",
                                   (self.width, AHEAD, self.how))
                if made[0] == 0:
                    self.times["create"].pop()  # nothing created: not a CREATE's time
                cur.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())")
                xmin_now = cur.fetchone()[0]
                if xmin_before is not None:
                    if self.how == "create":
                        n = self._timed("drop", "SELECT layout_proto.drop_done(%s)",
                                        (xmin_before,))
                        if n[0] == 0:
                            self.times["drop"].pop()
                    else:
                        cur.execute("SELECT layout_proto.due(%s)", (xmin_before,))
                        for (name,) in cur.fetchall():
                            self._timed("detach", f"ALTER TABLE layout_proto.full DETACH"
                                                  f" PARTITION layout_proto.{name} CONCURRENTLY")
                            self._timed("drop", f"DROP TABLE layout_proto.{name}")
                xmin_before = xmin_now
            except Exception as e:  # noqa: BLE001 (recorded, and the run reports it)
                self.errors.append(str(e).strip().splitlines()[0])

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.conn.close()


def rotation(pg, conn, tmp, rounds, seconds, rates):
    script = insert_script(tmp, "full")
    latdir = os.path.join(tmp, "lat")
    os.makedirs(latdir, exist_ok=True)
    busy = pg.connect()
    execute(busy, f"SELECT pg_advisory_lock({WAKEUP_LOCK})")
    summary = {}
    try:
        for sync in ("on", "off"):
            set_sync(conn, sync)
            # About two seconds of the producers' transactions a partition.
            width = max(1000, int(rates[sync] * 2 / 1000) * 1000)
            add("rotation", f"rotation.sync_{sync}.width", width, "xids",
                f"partition width, K={AHEAD} ahead")
            for rnd in range(rounds):
                order = ROTATIONS[rnd % 3:] + ROTATIONS[:rnd % 3]
                for how in order:
                    cover(conn, width, int(rates[sync] * 1.5) * seconds if how == "none" else 0)
                    if how == "create":
                        execute(conn, "CREATE TABLE layout_proto.full_default"
                                      " PARTITION OF layout_proto.full DEFAULT")
                    fresh(conn)
                    parts0 = scalar(conn, "SELECT count(*) FROM layout_proto.parts")
                    sampler = LockSampler(pg)
                    rotator = Rotator(pg, how, width) if how != "none" else None
                    try:
                        res = pgbench(pg, script, seconds, latency_log=latdir)
                    finally:
                        if rotator:
                            rotator.stop()
                        sampler.stop()
                    parts1 = scalar(conn, "SELECT count(*) FROM layout_proto.parts")
                    in_default = scalar(conn, "SELECT count(*) FROM ONLY layout_proto.full_default"
                                        ) if how == "create" else 0
                    name = f"rotation.sync_{sync}.{how}.r{rnd + 1}"
                    for key, value in res.items():
                        add("rotation", f"{name}.{key}", value,
                            "tx/s" if key == "tps" else "ms" if key.endswith("_ms") else "")
                    add("rotation", f"{name}.lock_wait_share",
                        sampler.waiting / max(1, sampler.samples),
                        "", f"share of {sampler.samples} samples with a producer waiting on a"
                        " table's lock (wait_event relation)")
                    add("rotation", f"{name}.any_lock_wait_share",
                        sampler.waiting_any / max(1, sampler.samples), "",
                        "the same, waiting on any lock (relation extension included)")
                    add("rotation", f"{name}.lock_wait_peak", sampler.peak, "producers")
                    add("rotation", f"{name}.partitions", f"{parts0} -> {parts1}")
                    add("rotation", f"{name}.rows_in_default", in_default)
                    times = rotator.times if rotator else {}
                    for what, ms in times.items():
                        if ms:
                            add("rotation", f"{name}.{what}.count", len(ms))
                            add("rotation", f"{name}.{what}.p50_ms", statistics.median(ms), "ms")
                            add("rotation", f"{name}.{what}.max_ms", max(ms), "ms")
                    for err in (rotator.errors if rotator else [])[:3]:
                        add("rotation", f"{name}.error", err)
                    d = summary.setdefault((sync, how), dict(tps=[], wait=[], lat_max=[],
                                                            lat_p999=[], times={}, errors=0))
                    d["tps"].append(res["tps"])
                    d["wait"].append(sampler.waiting / max(1, sampler.samples))
                    d["lat_max"].append(res.get("lat_max_ms", 0))
                    d["lat_p999"].append(res.get("lat_p999_ms", 0))
                    d["errors"] += len(rotator.errors) if rotator else 0
                    for what, ms in times.items():
                        d["times"].setdefault(what, []).extend(ms)
                    log(f"{name}: {res['tps']:,.0f} tx/s, latency p99.9 {res.get('lat_p999_ms')}"
                        f" max {res.get('lat_max_ms')} ms, a producer waiting on a table's lock in"
                        f" {sampler.waiting} of {sampler.samples} samples (peak {sampler.peak};"
                        f" on any lock in {sampler.waiting_any}),"
                        f" partitions {parts0} -> {parts1}, "
                        + ", ".join(f"{w} {len(ms)}x p50 {statistics.median(ms):.1f} max"
                                    f" {max(ms):.1f} ms" for w, ms in times.items() if ms)
                        + (f", errors {rotator.errors[:2]}" if rotator and rotator.errors else ""))
                    if how == "create":
                        execute(conn, "DROP TABLE layout_proto.full_default")
    finally:
        busy.close()
    return summary


def stall(pg, conn, tmp, seconds):
    """What removing a finished partition costs the producers while a transaction that
    inserted into full stays open for 1.5 s (a slow producer): 16 producers for
    `seconds`; at 1.0 s a session inserts a row and holds its transaction; at 1.2 s a
    finished partition is removed by
      drop          DROP TABLE, which queues for its ACCESS EXCLUSIVE lock on full
      drop_timeout  DROP TABLE with lock_timeout 100 ms, retried every 200 ms
      detach        DETACH PARTITION ... CONCURRENTLY, then DROP TABLE
    The producers' latencies (pgbench's log) and the removal's time."""
    script = insert_script(tmp, "full")
    latdir = os.path.join(tmp, "lat")
    os.makedirs(latdir, exist_ok=True)
    busy = pg.connect()
    execute(busy, f"SELECT pg_advisory_lock({WAKEUP_LOCK})")
    out = {}
    try:
        set_sync(conn, "on")
        for how in ("drop", "drop_timeout", "detach"):
            # The finished partition: transaction ids 1 and 2 are never a transaction's.
            # The others follow it (rotate() goes on from the highest bound).
            drop_partitions(conn)
            execute(conn, "CREATE TABLE layout_proto.full_old PARTITION OF layout_proto.full"
                          " FOR VALUES FROM ('1') TO ('3')")
            execute(conn, "SELECT layout_proto.rotate(1000000, %s)",
                    (60_000 * seconds // 1_000_000 + AHEAD,))
            fresh(conn)
            removal = dict(ms=None, refused=0, error="")

            def hold():
                h = pg.connect(autocommit=False)
                try:
                    time.sleep(1.0)
                    execute(h, "INSERT INTO layout_proto.full (topic, payload)"
                               " VALUES ('bench', '\\x00')")
                    time.sleep(1.5)
                    h.commit()
                finally:
                    h.close()

            def remove():
                r = pg.connect()
                try:
                    time.sleep(1.2)
                    t0 = time.perf_counter()
                    if how == "drop_timeout":
                        execute(r, "SET lock_timeout = '100ms'")
                    while True:
                        try:
                            if how == "detach":
                                execute(r, "ALTER TABLE layout_proto.full DETACH PARTITION"
                                           " layout_proto.full_old CONCURRENTLY")
                            execute(r, "DROP TABLE layout_proto.full_old")
                            break
                        except Exception as e:  # noqa: BLE001
                            if how != "drop_timeout" or "lock timeout" not in str(e):
                                removal["error"] = str(e).strip().splitlines()[0]
                                break
                            removal["refused"] += 1
                            time.sleep(0.2)
                    removal["ms"] = (time.perf_counter() - t0) * 1000
                finally:
                    r.close()

            threads = [threading.Thread(target=f, daemon=True) for f in (hold, remove)]
            for t in threads:
                t.start()
            res = pgbench(pg, script, seconds, latency_log=latdir)
            for t in threads:
                t.join(30)
            name = f"stall.{how}"
            for key, value in res.items():
                add("stall", f"{name}.{key}", value,
                    "tx/s" if key == "tps" else "ms" if key.endswith("_ms") else "")
            add("stall", f"{name}.removal_ms", removal["ms"], "ms",
                "from the first attempt to the partition's DROP, retries included")
            add("stall", f"{name}.lock_timeouts", removal["refused"])
            if removal["error"]:
                add("stall", f"{name}.error", removal["error"])
            out[how] = dict(res, removal_ms=removal["ms"], refused=removal["refused"],
                            error=removal["error"])
            log(f"{name}: {res['tps']:,.0f} tx/s, producers' latency max {res.get('lat_max_ms')}"
                f" ms, {res.get('lat_over_50ms')} over 50 ms; removal took"
                f" {removal['ms'] or 0:.0f} ms, {removal['refused']} lock timeouts"
                + (f", error: {removal['error']}" if removal["error"] else ""))
    finally:
        busy.close()
    return out


def default_partition(conn, sizes):
    """What a DEFAULT partition costs the rotation: CREATE TABLE ... PARTITION OF scans
    it for rows of the new range, under an ACCESS EXCLUSIVE lock on it and on full,
    so each creation takes longer as DEFAULT holds more; and a range that rows in
    DEFAULT belong to cannot be created at all."""
    out = {}
    drop_partitions(conn)
    execute(conn, "TRUNCATE layout_proto.full")
    execute(conn, "CREATE TABLE layout_proto.full_default PARTITION OF layout_proto.full DEFAULT")
    have = 0
    base = PRUNE_BASE
    for n in sizes:
        if n > have:
            execute(conn, "INSERT INTO layout_proto.full (topic, payload, txid)"
                          " SELECT 'bench', '\\x00', (%s + g)::text::xid8"
                          " FROM generate_series(%s, %s) AS g", (base, have, n - 1))
            execute(conn, "VACUUM ANALYZE layout_proto.full_default")
            have = n
        ms = []
        for i in range(5):
            lo = base + 10_000_000 + i * 1000 + n * 10
            t0 = time.perf_counter()
            execute(conn, f"CREATE TABLE layout_proto.full_{lo} PARTITION OF layout_proto.full"
                          f" FOR VALUES FROM ('{lo}') TO ('{lo + 1000}')")
            ms.append((time.perf_counter() - t0) * 1000)
            execute(conn, f"DROP TABLE layout_proto.full_{lo}")
        add("default", f"default.rows_{n}.create_p50_ms", statistics.median(ms), "ms",
            f"CREATE TABLE ... PARTITION OF with {n} rows in DEFAULT (none of the range),"
            " 5 times")
        out[n] = statistics.median(ms)
        log(f"CREATE ... PARTITION OF with {n:,} rows in DEFAULT: p50 {out[n]:.1f} ms")
    try:
        execute(conn, f"CREATE TABLE layout_proto.full_{base} PARTITION OF layout_proto.full"
                      f" FOR VALUES FROM ('{base}') TO ('{base + 1000}')")
        refusal = "(created)"
    except Exception as e:  # noqa: BLE001 (the refusal is the figure)
        refusal = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    add("default", "default.create_over_rows", refusal, "",
        "CREATE TABLE ... PARTITION OF a range that rows in DEFAULT belong to")
    log(f"creating a range that rows in DEFAULT belong to: {refusal}")
    drop_partitions(conn)
    return out, refusal


# --------------------------------------------------------------------------
# Pruning: the batch query with 8, 64, 256 partitions.

def fill_partitions(conn, upto):
    """Partitions [base + i*W, base + (i+1)*W) for i < upto, each with a row at every
    other transaction id (2,000 rows)."""
    have = scalar(conn, "SELECT count(*) FROM layout_proto.parts")
    with conn.cursor() as cur:
        for i in range(have, upto):
            lo = PRUNE_BASE + i * PRUNE_WIDTH
            cur.execute(f"CREATE TABLE layout_proto.full_{lo} PARTITION OF layout_proto.full"
                        f" FOR VALUES FROM ('{lo}') TO ('{lo + PRUNE_WIDTH}')")
        lo0 = PRUNE_BASE + have * PRUNE_WIDTH
        payload = bytes((i * 37 + 11) & 0xFF for i in range(benchlib.PAYLOAD)).hex()
        cur.execute("INSERT INTO layout_proto.full (topic, payload, txid)"
                    " SELECT 'bench' || (g %% 4), %s::bytea, (%s + 2 * g)::text::xid8"
                    " FROM generate_series(0, %s) AS g",
                    ("\\x" + payload, lo0, (upto - have) * PRUNE_WIDTH // 2 - 1))
    execute(conn, "VACUUM ANALYZE layout_proto.full")


def pruning(pg, conn, counts, reps):
    drop_partitions(conn)
    execute(conn, "TRUNCATE layout_proto.full")
    # A batch of 1,500 new transactions' rows inside partition 4 and two older
    # transactions, one in partition 3: three chunks of 500.
    lo = PRUNE_BASE + 4 * PRUNE_WIDTH + 100
    hi = lo + 3000
    older = "{%d,%d}" % (PRUNE_BASE + 3 * PRUNE_WIDTH + 10, PRUNE_BASE + 4 * PRUNE_WIDTH + 50)
    args = (str(lo), str(hi), older, f"{lo}:{lo}:", f"{hi}:{hi}:")
    explain = []
    summary = {}
    for count in counts:
        fill_partitions(conn, count)
        rows = scalar(conn, "SELECT count(*) FROM layout_proto.full")
        add("pruning", f"pruning.p{count}.rows", rows)
        for fn in ("batch_rows", "batch_rows_bounded"):
            for mode in ("custom", "generic"):
                c = pg.connect()
                try:
                    with c.cursor() as cur:
                        cur.execute(f"SET plan_cache_mode = force_{mode}_plan")
                        cur.execute(f"PREPARE chunk (xid8, xid8, xid8[], pg_snapshot, pg_snapshot,"
                                    f" xid8, bigint, integer) AS SELECT * FROM layout_proto.{fn}"
                                    f" ($1, $2, $3, $4, $5, $6, $7, $8)")
                        call = "EXECUTE chunk (%s, %s, %s, %s, %s, %s, %s, 500)"

                        def batch():
                            """The batch's three chunks and the empty fourth, as the relay
                            reads them: each after the last (txid, id) of the one before."""
                            after, got = ("0", 0), 0
                            while True:
                                cur.execute(call, args + after)
                                r = cur.fetchall()
                                if not r:
                                    return got
                                got += len(r)
                                after = (r[-1][0], r[-1][1])

                        got = batch()  # warm, and check
                        if got != 1502:
                            raise RuntimeError(f"{fn}: the batch read {got} rows, not 1,502")
                        chunk_ms = []
                        for _ in range(reps):
                            t0 = time.perf_counter()
                            cur.execute(call, args + ("0", 0))
                            cur.fetchall()
                            chunk_ms.append((time.perf_counter() - t0) * 1000)
                        t0 = time.perf_counter()
                        for _ in range(max(1, reps // 10)):
                            batch()
                        batch_ms = (time.perf_counter() - t0) * 1000 / max(1, reps // 10)
                        cur.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) "
                                    + call, args + ("0", 0))
                        plan = [r[0] for r in cur.fetchall()]
                finally:
                    c.close()
                removed = [int(line.split(":")[1]) for line in plan if "Subplans Removed" in line]
                scans = sum(1 for line in plan
                            if "Scan on full_" in line or "Scan using full_" in line)
                planning = next((line.split(":")[1].strip() for line in plan
                                 if line.startswith("Planning Time")), "")
                execution = next((line.split(":")[1].strip() for line in plan
                                  if line.startswith("Execution Time")), "")
                name = f"pruning.p{count}.{fn}.{mode}"
                add("pruning", f"{name}.chunk_p50_ms", statistics.median(chunk_ms), "ms",
                    f"first chunk of 500, {reps} executions, client wall time")
                add("pruning", f"{name}.chunk_mean_ms", statistics.mean(chunk_ms), "ms")
                add("pruning", f"{name}.batch_ms", batch_ms, "ms", "4 chunks: 1,502 rows")
                add("pruning", f"{name}.partition_scans", scans, "",
                    "partition scans in the plan (EXPLAIN ANALYZE)")
                add("pruning", f"{name}.subplans_removed", sum(removed))
                add("pruning", f"{name}.planning", planning)
                add("pruning", f"{name}.execution", execution)
                summary[(count, fn, mode)] = dict(chunk=statistics.median(chunk_ms),
                                                  batch=batch_ms, scans=scans,
                                                  removed=sum(removed))
                log(f"{name}: chunk p50 {statistics.median(chunk_ms):.3f} ms, batch"
                    f" {batch_ms:.2f} ms, {scans} partition scans in the plan,"
                    f" {sum(removed)} removed at run time, planning {planning}")
                if count in (counts[0], counts[-1]):
                    explain.append(f"== {count} partitions ({rows:,} rows), {fn},"
                                   f" plan_cache_mode = force_{mode}_plan, first chunk ==")
                    explain += plan + [""]
    return summary, explain


# --------------------------------------------------------------------------

def med(values):
    return statistics.median(values) if values else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    opts = ap.parse_args()
    rounds = 1 if opts.quick else benchlib.env_int("LAYOUT_ROUNDS", 2)
    seconds = 1 if opts.quick else benchlib.env_int("LAYOUT_SECONDS", 10)
    parts = (os.environ.get("LAYOUT_PARTS")
             or "producers,rotation,stall,default,pruning").split(",")
    counts = (8, 64) if opts.quick else (8, 64, 256)
    reps = 20 if opts.quick else 300
    if not opts.quick:
        wait_for_ci()
    started = time.monotonic()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    commit = subprocess.run(["git", "-C", benchlib.SOURCE, "rev-parse", "--short", "HEAD"],
                            stdout=subprocess.PIPE, text=True).stdout.strip()
    load = os.getloadavg()
    add("run", "run.started", stamp)
    add("run", "run.commit", commit)
    add("run", "run.loadavg", load[0])
    add("run", "run.quick", int(opts.quick))
    add("run", "run.ci_running", int(os.path.exists("/tmp/ci-running")))
    ci_seen = []  # a CI run that starts during this one makes its figures suspect

    def watch_ci():
        while not ci_seen:
            if os.path.exists("/tmp/ci-running"):
                ci_seen.append(time.strftime("%H:%M:%S"))
                log("warning: a CI run started during the measurement (/tmp/ci-running)")
            time.sleep(5)

    threading.Thread(target=watch_ci, daemon=True).start()
    tmp = tempfile.mkdtemp(prefix="outbox-layout-")
    with benchlib.servers() as (pg, rd, conn, rc):
        pg.psql("-f", SQL)
        add("run", "run.server_version", scalar(conn, "SHOW server_version"))
        tps, rot, prune, explain = {}, {}, {}, []
        if "producers" in parts:
            tps = producers(pg, rd, conn, tmp, rounds, seconds)
        # The partitions' width in the rotation follows the producers' rate.
        rates = {sync: med([t for t, _ in tps[(sync, "full")]]) if tps else 5000.0
                 for sync in ("on", "off")}
        if "rotation" in parts:
            rot = rotation(pg, conn, tmp, rounds, seconds, rates)
        st = stall(pg, conn, tmp, 2 if opts.quick else 5) if "stall" in parts else {}
        dflt = default_partition(conn, (0, 10_000) if opts.quick else (0, 100_000, 1_000_000)
                                 ) if "default" in parts else ({}, "")
        if "pruning" in parts:
            prune, explain = pruning(pg, conn, counts, reps)
    subprocess.run(["rm", "-rf", tmp], check=False)
    took = time.monotonic() - started
    add("run", "run.seconds", took, "s")
    add("run", "run.ci_started_during", ci_seen[0] if ci_seen else "")

    os.makedirs(benchlib.RESULTS, exist_ok=True)
    with open(OUT, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("section", "name", "value", "unit", "detail"))
        w.writerows(RAW)
    with open(EXPLAIN_OUT, "w") if explain else open(os.devnull, "w") as f:
        f.write(f"# bench/extra/outbox_layout.py, {stamp}, commit {commit}: the batch query's"
                " first chunk of 500\n# (a batch of 1,502 rows in partitions 3 and 4) with the"
                " fewest and the most partitions\n\n")
        f.write("\n".join(explain) + "\n")

    print(f"\n{stamp}, commit {commit}, {took:.0f} s, load average at the start {load[0]:.2f};"
          f" {rounds} round(s) of {seconds} s in turns, 16 pgbench clients\n")
    print("| synchronous_commit | table | tx/s (rounds) | × plain"
          " | PostgreSQL CPU per 100k rows, s |")
    print("|---|---|---|---|---|")
    for sync in ("on", "off") if tps else ():
        base = med([t for t, _ in tps[(sync, "plain")]])
        for kind in KINDS:
            v = tps[(sync, kind)]
            ratios = [t / p for (t, _), (p, _) in zip(v, tps[(sync, "plain")])]
            rate = med([t for t, _ in v])
            print(f"| {sync} | {kind} | {rate:,.0f} ("
                  + " / ".join(f"{t:,.0f}" for t, _ in v) + f") | {rate / base:.2f}"
                  f" ({' / '.join(f'{r:.2f}' for r in ratios)}) | {med([c for _, c in v]):.2f} |")
    print("\n| synchronous_commit | rotation | tx/s (rounds) | × none | a producer waiting on"
          " a table's lock, share of 10-ms samples | latency p99.9 / max, ms"
          " | CREATE / DETACH / DROP p50 and max, ms |")
    print("|---|---|---|---|---|---|---|")
    for sync in ("on", "off") if rot else ():
        base = med(rot[(sync, "none")]["tps"])
        for how in ROTATIONS:
            d = rot[(sync, how)]
            ops = " / ".join(f"{w} {med(d['times'][w]):.1f}, {max(d['times'][w]):.1f}"
                             f" ({len(d['times'][w])}x)" for w in ("create", "detach", "drop")
                             if d["times"].get(w))
            print(f"| {sync} | {how} | {med(d['tps']):,.0f} ("
                  + " / ".join(f"{t:,.0f}" for t in d["tps"]) + f") | {med(d['tps']) / base:.2f}"
                  f" | {max(d['wait']):.3f} | {max(d['lat_p999']):.1f} / {max(d['lat_max']):.1f}"
                  f" | {ops or '-'}{' errors ' + str(d['errors']) if d['errors'] else ''} |")
    print("\n| removal behind a 1.5-s open transaction | tx/s | producers' latency max, ms"
          " | transactions over 50 ms | removal took, ms | lock timeouts |")
    print("|---|---|---|---|---|---|")
    for how, d in st.items():
        print(f"| {how} | {d['tps']:,.0f} | {d.get('lat_max_ms', 0):.0f} | {d.get('lat_over_50ms')}"
              f" | {d['removal_ms'] or 0:.0f} | {d['refused']}"
              f"{' error: ' + d['error'] if d['error'] else ''} |")
    if dflt[0]:
        print("\nCREATE TABLE ... PARTITION OF, p50 of 5, with rows in DEFAULT: "
              + ", ".join(f"{n:,} rows {ms:.1f} ms" for n, ms in dflt[0].items())
              + f"; a range that rows in DEFAULT belong to: {dflt[1]}")
    print("\n| partitions | query | plan | chunk of 500, p50 ms | batch of 1,502, ms"
          " | partitions scanned (removed at run time) |")
    print("|---|---|---|---|---|---|")
    for (count, fn, mode), d in prune.items():
        print(f"| {count} | {fn} | {mode} | {d['chunk']:.3f} | {d['batch']:.2f} | {d['scans']}"
              f" ({d['removed']}) |")
    print(f"\nraw figures: {OUT}\nplans: {EXPLAIN_OUT}")


if __name__ == "__main__":
    main()
