"""What the benchmark's programs share: bench.py, soak.py and bench/extra/*.

Their settings (the BENCH_* variables they have in common and the tools'
paths), the raw numbers of a run, the CPU time and memory of processes from
/proc, the servers (the harness's, PostgreSQL with fsync on), the relay
started and stopped for a measurement, and the tools: the load generator
and the relay's publish (MULTI / XADD with explicit ids / EXEC) alone.
"""

import contextlib
import json
import os
import re
import socket
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


# No automatic AOF rewrite during a measurement: Redis rewrites once the file
# has grown past 64 MB, which a 200,000-row drain passes with the relay's
# entries (five fields, in MULTI / EXEC) and not with bench-pgq's (three), so
# one side had a forked child compressing the whole dataset on one of the two
# cores and the other not. The AOF's bytes per message are reported instead
# (aof_bytes_per_msg): what a rewrite costs grows with them.
REDIS_NO_REWRITE = ["--auto-aof-rewrite-percentage", "0"]


def bench_redis(extra_args=()):
    if REDIS_AOF == "no":
        return harness.Redis(appendonly=False, extra_args=REDIS_ARGS + list(extra_args))
    return harness.Redis(appendonly=True, appendfsync=REDIS_AOF,
                         extra_args=REDIS_NO_REWRITE + REDIS_ARGS + list(extra_args))


def aof_bytes(rc):
    """Bytes in the AOF so far (0 without one)."""
    return int(rc.info("persistence").get("aof_current_size") or 0)


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


def reset_outbox(conn, rc=None):
    """No rows, ticks, stream positions, quarantine or partitioned topics (the
    harness's reset between tests), and with rc no key in Redis: the state a
    relay started now meets on a new installation. Only with no relay running:
    a running relay keeps its streams' positions in memory."""
    harness.reset(conn, rc)


def reset_servers(conn, rc):
    reset_outbox(conn, rc)
    execute(conn, "CHECKPOINT")


def stream_total(rc):
    pipe = rc.pipeline(transaction=False)
    for i in range(TOPICS):
        pipe.xlen(f"bench{i}")
    return sum(pipe.execute())


def pending(conn):
    """Rows not yet in their stream and not quarantined (outbox.unsent). It
    reads every row committed since the oldest stream position: on a drained
    backlog of 200,000 rows about 100 ms of PostgreSQL's CPU, so timed loops
    use recorded() and count once the clock is stopped."""
    return scalar(conn, "SELECT count(*) FROM outbox.unsent")


def recorded(conn, rc):
    """Whether each bench stream's last entry is its recorded position in
    outbox.stream_positions: the batch that wrote it is recorded. Four XREVRANGE
    and a read of a table of a few rows, where pending() reads the backlog."""
    pipe = rc.pipeline(transaction=False)
    for i in range(TOPICS):
        pipe.xrevrange(f"bench{i}", count=1)
    last = {f"bench{i}": (e[0][0].decode() if isinstance(e[0][0], bytes) else e[0][0])
            for i, e in enumerate(pipe.execute()) if e}
    if len(last) < TOPICS:
        return False
    with conn.cursor() as cur:
        cur.execute("SELECT topic, max(entry_id) FROM outbox.stream_positions"
                    " WHERE topic = ANY(%s) GROUP BY topic", (list(last),))
        have = dict(cur.fetchall())
    return all(have.get(t) == e for t, e in last.items())


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


PHASES = ("read", "publish", "record")


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
# The tools: the load generator, the relay's publish alone, the batch read alone.

def loadgen(pg, rd, rate, seconds=None, count=None, producers=LOAD_PRODUCERS, wait=10,
            group="bench", pgq=None, async_commit=False):
    argv = [LOADGEN_BIN, "--postgres", pg.dsn(), "--redis-port", str(rd.port),
            "--rate", str(rate), "--producers", str(producers), "--topics", str(TOPICS),
            "--payload", str(PAYLOAD), "--group", group, "--wait", str(wait)]
    argv += ["--pgq", pgq] if pgq else []
    argv += ["--async-commit", "1"] if async_commit else []
    argv += ["--count", str(count)] if count else ["--seconds", str(seconds)]
    return run_json(argv, timeout=(seconds or 0) + (count or 0) / max(rate, 1) + wait + 120)




def _bulk(b):
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _command(*args):
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


CALL_ROWS = 64  # RELAY_CALL_ROWS (relay/batch.h): the most rows of one stream in a call


def publish_batch_bytes(tick_ms, first_id, batch=None):
    """What the relay sends for one batch of `batch` rows over the TOPICS
    streams (round-robin, as the benchmark's backlog): per stream, calls of
    MULTI, up to CALL_ROWS XADD <stream> <tick_ms>-<rank> with the relay's
    fields (relay/batch.c), EXEC. Returns (bytes, calls)."""
    batch = batch or BATCH
    payload = bytes((i * 37 + 11) & 0xFF for i in range(PAYLOAD))
    created = b"2026-12-06 12:00:00.123456+00"
    per_stream = {}
    for i in range(batch):
        per_stream.setdefault(i % TOPICS, []).append(first_id + i)
    out, calls = [], 0
    for t, ids in per_stream.items():
        stream = b"bench%d" % t
        for start in range(0, len(ids), CALL_ROWS):
            out.append(_command(b"MULTI"))
            for rank, oid in enumerate(ids[start:start + CALL_ROWS], start + 1):
                out.append(_command(
                    b"XADD", stream, b"%d-%d" % (tick_ms, rank),
                    b"id", b"00000000-0000-4000-8000-%012d" % oid, b"topic", stream,
                    b"payload", payload, b"created_at", created, b"outbox_id", b"%d" % oid))
            out.append(_command(b"EXEC"))
            calls += 1
    return b"".join(out), calls


def publish_alone(rd, messages=None):
    """The relay's publish alone: `messages` rows in batches of BATCH, each
    batch's calls (publish_batch_bytes) sent at once over one connection and
    its replies read before the next batch, as the relay has a batch's calls
    in flight. Only sending and reading is timed; the bytes of each batch are
    built before. Every XADD must have added its entry (no error reply, and
    the streams' lengths add up). Returns {msgs: rows/s, calls: calls/s, ...}."""
    messages = messages or PUBLISH_CALLS
    batches = max(1, messages // BATCH)
    with contextlib.closing(rd.client()) as c:
        c.delete(*[f"bench{i}" for i in range(TOPICS)])
    sock = socket.create_connection(("127.0.0.1", rd.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    took, calls, errors = 0.0, 0, 0
    try:
        for b in range(batches):
            data, n = publish_batch_bytes(1000 + b, b * BATCH + 1)
            data += _command(b"PING")
            started = time.perf_counter()
            sock.sendall(data)
            reply = bytearray()
            while not reply.endswith(b"+PONG\r\n"):
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise RuntimeError("Redis closed the connection during the publish")
                reply += chunk
            took += time.perf_counter() - started
            calls += n
            errors += reply.count(b"\r\n-") + reply.startswith(b"-")
    finally:
        sock.close()
    with contextlib.closing(rd.client()) as c:
        added = sum(c.xlen(f"bench{i}") for i in range(TOPICS))
    if errors or added != batches * BATCH:
        raise RuntimeError(f"publish alone: {errors} error replies, {added} of"
                           f" {batches * BATCH} entries added")
    rows = batches * BATCH
    return dict(messages=rows, batches=batches, calls=calls, seconds=took, msgs=rows / took,
                calls_per_s=calls / took, batch_ms=took / batches * 1e3)


def tick(conn):
    """outbox.tick(): a new tick if anything committed since the last one; the latest."""
    return scalar(conn, "SELECT outbox.tick()")


BATCH_READ_SQL = ("SELECT r.* FROM outbox.batch_bounds(%(prev)s, %(next)s) AS b,"
                  " LATERAL outbox.batch_rows(%(prev)s, %(next)s, b.lo - 1, b.hi, %(limit)s) AS r")


def batch_read_alone(conn, rows, batch=None):
    """The relay's PostgreSQL side alone: `rows` pending rows committed in
    transactions of `batch` rows with a tick after each (the batches a relay
    that keeps up meets), then per batch, timed: outbox.tick() (the relay's
    call each cycle; nothing new), the batch's bounds and its rows
    (outbox.batch_bounds, outbox.batch_rows, every column fetched through COPY
    to the client) and outbox.record_batch with the batch's streams and their
    last entry ids. Returns {rate: rows/s, ...}."""
    batch = batch or BATCH
    conn.autocommit = True
    first = tick(conn)
    ticks = [first]
    for i in range(max(1, rows // batch)):
        execute(conn, "INSERT INTO outbox.messages (topic, payload)"
                      " SELECT 'bench' || (g %% %s),"
                      " substring(decode(repeat(md5(g::text), 13), 'hex') FROM 1 FOR %s)"
                      " FROM generate_series(%s, %s) AS g",
                (TOPICS, PAYLOAD, i * batch + 1, (i + 1) * batch))
        ticks.append(tick(conn))
    execute(conn, "VACUUM ANALYZE outbox.messages")
    execute(conn, "CHECKPOINT")
    with conn.cursor() as cur:
        cur.execute("SELECT tick_id, ms FROM outbox.ticks WHERE tick_id > %s", (first,))
        ms = dict(cur.fetchall())
    topics = [f"bench{i}" for i in range(TOPICS)]
    sink = _Sink()
    times = dict(tick=0.0, read=0.0, record=0.0)
    read = 0
    with conn.cursor() as cur:
        for prev, nxt in zip(ticks, ticks[1:]):
            t0 = time.perf_counter()
            cur.execute("SELECT outbox.tick()")
            cur.fetchone()
            t1 = time.perf_counter()
            before = sink.rows
            cur.copy_expert(cur.mogrify(f"COPY ({BATCH_READ_SQL}) TO STDOUT (FORMAT binary)",
                                        dict(prev=prev, next=nxt, limit=batch)).decode(), sink)
            t2 = time.perf_counter()
            per = -(-batch // TOPICS)
            cur.execute("SELECT outbox.record_batch(%s, true, %s, %s, %s, '{}', '{}', '{}', '{}',"
                        " '{}', '{}')",
                        (nxt, topics, [-1] * TOPICS, [f"{ms[nxt]}-{per}"] * TOPICS))
            cur.fetchone()
            t3 = time.perf_counter()
            times["tick"] += t1 - t0
            times["read"] += t2 - t1
            times["record"] += t3 - t2
            read += sink.rows - before - 1  # the format's trailer is a write of its own
    total = sum(times.values())
    n = len(ticks) - 1
    if read != n * batch:
        raise RuntimeError(f"batch read alone: {read} rows read of {n * batch}")
    return dict(rows=read, batches=n, seconds=total, rate=read / total,
                **{f"{k}_ms": v / n * 1e3 for k, v in times.items()})


class _Sink:
    """A file for COPY ... TO STDOUT that keeps nothing; counts its writes: one per
    tuple of the binary format (the header comes with the first), and the trailer."""

    def __init__(self):
        self.rows = 0
        self.bytes = 0

    def write(self, data):
        self.bytes += len(data)
        self.rows += 1
        return len(data)
