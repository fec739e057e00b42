"""What the benchmark's programs share: bench.py, soak.py and bench/extra/*.

Their settings (the BENCH_* variables they have in common and the tools'
paths), the raw numbers of a run, the CPU time and memory of processes from
/proc, the servers (the harness's, PostgreSQL with fsync on), the relay
started and stopped for a measurement, and the tools: the load generator,
the publish function alone and the claim statement.
"""

import contextlib
import csv
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

from testkit import harness  # the integration tests' throwaway servers

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(HERE)


def env_int(name, default):
    return int(os.environ.get(name) or default)


def env_float(name, default):
    return float(os.environ.get(name) or default)


def env_list(name, default):
    value = os.environ.get(name)
    return [int(x) for x in value.split(",") if x.strip()] if value else list(default)


# The settings every program of the benchmark uses; bench.py has the sizes of
# its sections.
QUICK = os.environ.get("BENCH_QUICK") == "1"
BUILD = os.path.abspath(os.environ.get("BENCH_BUILD_DIR") or os.path.join(SOURCE, "build-bench"))
RESULTS = os.path.abspath(os.environ.get("BENCH_RESULTS") or os.path.join(HERE, "results"))
RELAY_BIN = os.path.join(BUILD, "outbox-relay")
NAIVE_BIN = os.path.join(BUILD, "bench-naive")
LOADGEN_BIN = os.path.join(BUILD, "bench-loadgen")
PGQ_BIN = os.path.join(BUILD, "bench-pgq")
BATCH = env_int("BENCH_BATCH", 500)  # the relay's default
LOAD_PRODUCERS = env_int("BENCH_LOAD_PRODUCERS", 16)
PUBLISH_CALLS = env_int("BENCH_PUBLISH_CALLS", 30000 if QUICK else 300000)
TOPICS = 4
PAYLOAD = 200
REDIS_AOF = os.environ.get("BENCH_REDIS_AOF") or "everysec"  # no | everysec | always
# More redis-server options, e.g. "--auto-aof-rewrite-percentage 400": to
# measure what a setting of Redis changes, with everything else the same.
REDIS_ARGS = (os.environ.get("BENCH_REDIS_ARGS") or "").split()

# PostgreSQL settings on top of the harness's (which turns fsync off for tests).
PG_SETTINGS = {
    "fsync": "on",
    "full_page_writes": "on",
    "synchronous_commit": "on",
    "shared_buffers": "1GB",
    "max_wal_size": "4GB",
    "max_connections": "100",
}

CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg):
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Results: every raw number of a run.

class Results:
    def __init__(self):
        self.raw = []       # (section, name, value, unit, detail)
        self.table = []     # dicts: figure, value, unit, limit, limit_value, ratio, target
        self.values = {}    # name -> value, for the figures derived later
        self.failed = []

    def add(self, section, name, value, unit="", detail=""):
        if isinstance(value, float):
            value = round(value, 6)
        self.raw.append((section, name, value, unit, detail))
        self.values[name] = value
        return value

    def add_dict(self, section, prefix, d, units=None, detail=""):
        for key, value in d.items():
            if isinstance(value, dict):
                self.add_dict(section, f"{prefix}.{key}", value, units, detail)
            elif isinstance(value, (int, float, str)):
                unit, full = "", f"{prefix}.{key}"
                for suffix, u in (units or {}).items():
                    if key.endswith(suffix) or f"{suffix}." in full:
                        unit = u
                self.add(section, full, value, unit, detail)

    def get(self, name, default=None):
        return self.values.get(name, default)

    def row(self, figure, value, unit, limit=None, limit_value=None, target=None, ratio=None):
        if ratio is None and value is not None and limit_value not in (None, 0):
            try:
                ratio = value / limit_value
            except TypeError:
                ratio = None
        self.table.append(dict(figure=figure, value=value, unit=unit, limit=limit or "",
                               limit_value=limit_value, ratio=ratio, target=target or ""))


R = Results()


# --------------------------------------------------------------------------
# Processes: CPU time and peak memory from /proc.

def proc_stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def proc_cpu(pid):
    """utime + stime of a live process (all its threads), in seconds."""
    st = proc_stat(pid)
    return (int(st[11]) + int(st[12])) / CLK_TCK


def run_delay(pid):
    """Seconds the main thread of a process has waited on a run queue for a
    core (/proc/<pid>/schedstat, second field, in ns), or None."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def proc_status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def tree_cpus(root):
    """{pid: CPU seconds} of a process and its live children (the postmaster and its backends)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = proc_stat(entry)
            if int(entry) == root or int(st[1]) == root:
                found[int(entry)] = (int(st[11]) + int(st[12])) / CLK_TCK
        except (OSError, IndexError, ValueError):
            continue
    return found


def cpu_ticks():
    """The machine's CPU time so far, by kind (/proc/stat, every core, in ticks; guest
    time is counted in user and nice already)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), v))


def machine_busy():
    """CPU seconds the whole machine has been busy (every core; idle and iowait excluded)."""
    t = cpu_ticks()
    return (sum(t.values()) - t["idle"] - t["iowait"]) / CLK_TCK


def cpu_shares(before, after):
    """The share of each kind of CPU time between two cpu_ticks() readings."""
    delta = {k: after[k] - before[k] for k in before}
    total = sum(delta.values()) or 1
    return {k: v / total for k, v in delta.items()}


def self_cpu():
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """CPU seconds of PostgreSQL (postmaster and children) and redis-server over an interval,
    and of everything else on the machine (other people's work: the noise).

    Backends exit with their client (pgbench, the load generator), taking their CPU
    time with them, so a thread samples every backend four times a second and keeps
    the last value it saw of each. The first read ends the interval."""

    def __init__(self, pg, rd, interval=0.25):
        self.pg_pid = pg._postmaster_pid()
        self.rd_pid = rd.proc.pid
        self.base = tree_cpus(self.pg_pid)
        self.last = dict(self.base)
        self.rd0 = proc_cpu(self.rd_pid)
        self.busy0 = machine_busy()
        self.self0 = self_cpu()
        self.final = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval):
        while not self._stop.wait(interval):
            self.last.update(tree_cpus(self.pg_pid))

    def _finish(self):
        if self.final is None:
            self._stop.set()
            self._thread.join()
            self.last.update(tree_cpus(self.pg_pid))
            pg_cpu = sum(v - self.base.get(pid, 0.0) for pid, v in self.last.items())
            self.final = (pg_cpu, proc_cpu(self.rd_pid) - self.rd0,
                          machine_busy() - self.busy0, self_cpu() - self.self0)
        return self.final

    def read(self):
        pg_cpu, rd_cpu, _, _ = self._finish()
        return pg_cpu, rd_cpu

    def other(self, ours):
        """CPU seconds used by processes other than PostgreSQL, Redis, this script and `ours`."""
        pg_cpu, rd_cpu, busy, me = self._finish()
        return max(0.0, busy - pg_cpu - rd_cpu - me - ours)


# --------------------------------------------------------------------------
# Servers.

class BenchPostgres(harness.Postgres):
    """The harness's throwaway cluster with fsync on and room for a million-row backlog."""

    _configured = False

    def start(self):
        if not self._configured:
            with open(os.path.join(self.datadir, "postgresql.conf"), "a") as conf:
                conf.write("\n# outbox-relay benchmark (later lines win)\n")
                for key, value in PG_SETTINGS.items():
                    conf.write(f"{key} = {value}\n")
            self._configured = True
        super().start()


def bench_redis():
    if REDIS_AOF == "no":
        return harness.Redis(appendonly=False, extra_args=REDIS_ARGS)
    return harness.Redis(appendonly=True, appendfsync=REDIS_AOF, extra_args=REDIS_ARGS)


@contextlib.contextmanager
def servers():
    with BenchPostgres() as pg, bench_redis() as rd:
        conn = pg.connect()
        rc = rd.client()
        try:
            yield pg, rd, conn, rc
        finally:
            conn.close()
            rc.close()


def execute(conn, sql, args=None):
    with conn.cursor() as cur:
        cur.execute(sql, args)


def scalar(conn, sql, args=None):
    with conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchone()[0]


def insert_backlog(conn, n, prepare=True):
    """n pending rows, 200-byte payloads over 4 topics, in one INSERT ... SELECT."""
    started = time.monotonic()
    execute(conn, "INSERT INTO outbox.messages (topic, payload)"
                  " SELECT 'bench' || (g %% %s),"
                  " substring(decode(repeat(md5(g::text), 13), 'hex') FROM 1 FOR %s)"
                  " FROM generate_series(1, %s) AS g", (TOPICS, PAYLOAD, n))
    took = time.monotonic() - started
    if prepare:
        # A backlog that built up over time has been vacuumed and analysed, and
        # its pages are checkpointed: the drain starts from that state.
        execute(conn, "VACUUM ANALYZE outbox.messages")
        execute(conn, "CHECKPOINT")
    return took


def reset_servers(conn, rc):
    execute(conn, "TRUNCATE outbox.messages RESTART IDENTITY")
    rc.flushall()  # the function library stays (FUNCTION FLUSH would remove it)
    execute(conn, "CHECKPOINT")


def stream_total(rc):
    pipe = rc.pipeline(transaction=False)
    for i in range(TOPICS):
        pipe.xlen(f"bench{i}")
    return sum(pipe.execute())


def pending(conn):
    return scalar(conn, "SELECT count(*) FROM outbox.messages"
                        " WHERE sent_at IS NULL AND failed_at IS NULL")


def wait_drained(conn, timeout, relay=None):
    deadline = time.monotonic() + timeout
    while pending(conn) > 0:
        if relay is not None and not relay.alive():
            raise RuntimeError("the relay exited\n" + relay.log_tail())
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def fresh_round(conn, rc, stream, timeout=60):
    """The state a producers' round starts from, the same for every round: no
    rows in the outbox (the relay has published them all and holds none), no
    stream, and Redis's append-only file just rewritten. Otherwise each round
    inherits the dead rows and the growing stream of the rounds before it, and
    a rewrite of a file grown by them can take a core in any one round."""
    def not_rewriting():
        p = rc.info("persistence")
        return not (p.get("aof_rewrite_in_progress") or p.get("aof_rewrite_scheduled"))

    execute(conn, "TRUNCATE outbox.messages")
    rc.delete(stream)
    if not rc.info("persistence").get("aof_enabled"):
        return  # BENCH_REDIS_AOF=no: no file to rewrite
    message = "Redis to end its append-only file's rewrite"
    harness.wait_until(not_rewriting, timeout, message=message)
    rc.bgrewriteaof()
    harness.wait_until(not_rewriting, timeout, message=message)


def start_relay(pg, rd, **flags):
    # The relay's own defaults, not the test suite's (harness.Relay.test_defaults).
    harness.Relay.test_defaults = {}
    flags.setdefault("metrics_listen", f"127.0.0.1:{harness.free_port()}")
    relay = harness.Relay(pg, rd, stop_timeout=10, **flags)
    relay.metrics = flags["metrics_listen"]
    harness.register(relay)
    relay.start()
    return relay


def relay_metric(relay, name):
    """One unlabelled sample from the relay's /metrics, or None."""
    try:
        with urllib.request.urlopen(f"http://{relay.metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


PHASES = ("claim", "wait", "publish", "finish")


def relay_phase_sums(relay):
    """Seconds the relay's committed batches spent in each phase
    (outbox_relay_batch_phase_seconds_sum), or None."""
    try:
        with urllib.request.urlopen(f"http://{relay.metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    sums = {}
    for phase in PHASES:
        m = re.search(rf'^outbox_relay_batch_phase_seconds_sum{{phase="{phase}"}} ([0-9.e+-]+)$',
                      text, re.MULTILINE)
        if not m:
            return None
        sums[phase] = float(m.group(1))
    return sums


def relay_batches(relay):
    return relay_metric(relay, "outbox_relay_batches_total")


def stop_relay(relay):
    try:
        code = relay.stop()
        if code not in (0, None):
            R.add("notes", "relay.exit_code", code, "",
                  "the relay did not exit 0 on SIGTERM (killed after 10 s when -9)")
            log(f"warning: the relay exited with {code} on SIGTERM\n{relay.log_tail(10)}")
    finally:
        relay.close()


def run_json(argv, timeout=600):
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}{proc.stdout[-2000:]}")
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------
# The tools: the load generator, the publish function alone, the claim statement.

def loadgen(pg, rd, rate, seconds=None, count=None, producers=LOAD_PRODUCERS, wait=10,
            group="bench", pgq=None, async_commit=False):
    argv = [LOADGEN_BIN, "--postgres", pg.dsn(), "--redis-port", str(rd.port),
            "--rate", str(rate), "--producers", str(producers), "--topics", str(TOPICS),
            "--payload", str(PAYLOAD), "--group", group, "--wait", str(wait)]
    argv += ["--pgq", pgq] if pgq else []
    argv += ["--async-commit", "1"] if async_commit else []
    argv += ["--count", str(count)] if count else ["--seconds", str(seconds)]
    return run_json(argv, timeout=(seconds or 0) + (count or 0) / max(rate, 1) + wait + 120)


def publish_alone(rd, call_rows=0, function=None):
    """redis-benchmark, one connection, BATCH messages' calls pipelined: the relay's argv,
    new ids.

    call_rows 0: one message a call, the argv of a row sent after another of
    its stream (most rows of a batch): it names that row's record, created
    here, which the function checks. call_rows N: the relay's call of N rows
    of one stream (relay_batch_append_publish_call), which names that record
    before its first row; BATCH / N calls in flight, as a batch of BATCH rows
    of one stream sends them. rps counts calls, msgs messages a second.
    function: another function called with the same keys and arguments
    (bench/extra/record_layouts.py)."""
    extra = ["--call-rows", str(call_rows)] if call_rows else []
    argv_lines = subprocess.run([NAIVE_BIN, "--print-argv", "--publish-timeout", "86400000"]
                                + extra, stdout=subprocess.PIPE, text=True,
                                check=True).stdout.splitlines()
    uuid0 = "00000000-0000-0000-0000-000000000000"
    # redis-benchmark draws each __rand_int__ of a command on its own.
    args = [a.replace(uuid0, "00000000-0000-0000-0000-__rand_int__") for a in argv_lines]
    if function is not None:
        args[1] = function
    stream, before = argv_lines[3], argv_lines[4 if call_rows else 5]
    if not before.endswith(":dedup:ffffffff-ffff-ffff-ffff-ffffffffffff"):
        raise RuntimeError(f"bench-naive --print-argv names no record before: {argv_lines[:6]}")
    per_call = max(1, call_rows)
    calls = PUBLISH_CALLS // per_call
    with contextlib.closing(rd.client()) as c:
        c.delete(stream)
        c.set(before, "0-1")
        cmd = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(rd.port), "-c", "1",
               "-P", str(max(1, -(-BATCH // per_call))), "-n", str(calls), "-r", "2000000000",
               "--csv"] + args
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=600)
        rows = list(csv.reader(proc.stdout.strip().splitlines()))
        if proc.returncode != 0 or len(rows) < 2:
            raise RuntimeError(f"redis-benchmark failed:\n{proc.stdout[-2000:]}")
        # redis-benchmark counts a refused call as done: every call must have
        # added its entries (random ids may meet once in a while).
        added = c.xlen(stream)
        if added < calls * per_call * 0.99:
            raise RuntimeError(f"only {added} of {calls * per_call} messages of {calls} publish"
                               " calls were added")
    header, values = rows[0], rows[-1]
    res = {h: (float(v) if re.fullmatch(r"[\d.]+", v) else v) for h, v in zip(header, values)
           if h != "test"}
    if "rps" in res:
        res["msgs"] = res["rps"] * per_call
    return res


def claim_sql_filled(batch):
    """The relay's claim statement with its parameters written in: `batch` rows, no topic
    paused ($2), no partition owned ($3-$5), a walk of the whole pending index ($6), as a
    claim takes when no full batch is in flight."""
    sql = subprocess.run([NAIVE_BIN, "--print-claim-sql"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if sql.returncode != 0:
        raise RuntimeError(f"bench-naive --print-claim-sql: {sql.stderr}")
    filled = sql.stdout.strip()
    for param, value in (("$6", "0"), ("$5", "0"), ("$4", "'{}'"), ("$3", "'{}'"),
                         ("$2", "'{}'"), ("$1", str(batch))):
        filled = filled.replace(param, value)
    return filled
