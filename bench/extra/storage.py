#!/usr/bin/python3
"""Which storage design makes the relay's PostgreSQL work per message cheapest.

An experiment, not part of the run. Each candidate gets a fresh PostgreSQL (the benchmark's
settings: fsync on, full_page_writes on, shared_buffers 1GB) with every file of migrations/
applied in name order, then altered as the candidate needs:

  U   today: claim through messages_pending_idx, UPDATE ... SET sent_at (never HOT).
  D   DELETE the published rows in the finishing transaction (sent_retention = 0).
  A   DELETE ... RETURNING into an append-only outbox.sent with a primary key (id).
  AB  the same into an outbox.sent without a primary key, with BRIN (sent_at).
  H   a HOT mark: sent_at in no index and no index predicate (the pending indexes keep only
      "failed_at IS NULL"), fillfactor 50 so that the new versions fit on their page. The
      claim can then no longer skip sent rows through an index, so the drain here claims
      with "AND id > $3", the highest id of the previous batch: a watermark that is only
      right with one relay, no concurrent producers and no retries. After the 1M drain
      the correct claim (no watermark) is timed too.
  P   a separate outbox.pending (id bigint primary key), filled by a statement-level AFTER
      INSERT trigger on outbox.messages (transition table, SECURITY DEFINER, search_path
      pinned, as 009 does for enqueue); the two pending indexes of outbox.messages are
      dropped (nothing would ever leave them). The relay claims pending rows in id order,
      each joined to its outbox.messages row by one primary-key lookup (LATERAL ... OFFSET 0:
      a merge join would walk every sent row), FOR UPDATE OF pending SKIP LOCKED, and
      deletes its pending rows; outbox.messages is never updated (so sent_at is no longer
      recorded).
  PV  P, and the relay runs VACUUM outbox.pending itself every 100,000 rows it deleted and
      when a claim comes back short after a drain (a relay policy; claim phase only).
  DV  D with the same relay policy, VACUUM outbox.messages (it holds only pending rows).

The claim is the relay's own statement (bench-naive --print-claim-sql: the select list
as is; the FROM/WHERE changed only for H and P). Batches of 500: BEGIN; claim (prepared,
psycopg2); the finishing statement with its id array as a literal, and COMMIT, in one
simple query, as the relay sends it.

cpu phase (ROUNDS rounds, candidates in a rotated order each round): producers first,
10,000 single-row INSERT statements (prepared, synchronous_commit off: CPU, not the flush,
is measured; a session holds the relay's advisory lock, so the wake-up trigger does not
notify, as with a busy relay), for P also with a plain statement trigger and with a plain
row trigger; then TRUNCATE, a backlog of CPU_ROWS (200,000) rows, VACUUM ANALYZE,
CHECKPOINT, autovacuum off; then the drain. Measured: utime + stime of the server backend
(/proc/<pid>/stat, pid from pg_backend_pid()) per message for claim + mark + commit and per
producer row; WAL bytes per message (pg_current_wal_lsn) and its full-page images
(pg_walinspect); the share of HOT updates; then VACUUM of the table the drain left dead
rows in, its backend CPU per drained message.

producer phase: the producers' cost again, U's schema against P's (statement trigger, and a
plain row trigger), alternated 6 times on one server, 5,000 rows each: on a shared machine
the cpu phase's separate servers vary too much for a difference of a few microseconds.

claim phase, per candidate, autovacuum off and on (on: the 008 settings for
outbox.messages, the same ones set on outbox.pending): 100,000 pending rows, VACUUM ANALYZE,
CHECKPOINT, the claim timed (CLAIMS times BEGIN; claim; ROLLBACK, client-side mean of the
EXECUTE with its rows fetched; and the median server "Execution Time" of 30 EXPLAIN
(ANALYZE, TIMING OFF, BUFFERS)); then 900,000 more rows, a drain of all 1,000,000 (the
backend's CPU per message over it is recorded too), 100,000 new rows, and right away the
same claim timing (H: also the correct claim, without the watermark). No VACUUM is run
after the backlog is in, except by PV's and DV's relay policy.

    PYTHONPATH=. /usr/bin/python3 bench/extra/storage.py [cpu] [producer] [claim] [report]

Without arguments: cpu, producer, claim, report. Raw records (plans included) are appended
to /tmp/storage-candidates-raw.jsonl (STORAGE_RAW); "report" prints the markdown table and
every run from that file, so phases can be run (and repeated) separately. Needs
build-bench/bench-naive (run bench/run.sh once first). Environment: STORAGE_CANDIDATES (cpu phase, default U,D,A,AB,H,P), STORAGE_CLAIM_CANDIDATES
(default U,D,DV,A,P,PV,H), STORAGE_CLAIM_MODES (off,on), STORAGE_ROUNDS (3), STORAGE_CPU_ROWS
(200000), STORAGE_DRAIN_ROWS (1000000), STORAGE_PRODUCER_ROWS (10000).
About 17 minutes on 2 cores with the defaults. Results: bench/results/storage-candidates.md.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time

from bench import benchlib

BATCH = 500
ROUNDS = benchlib.env_int("STORAGE_ROUNDS", 3)
CPU_ROWS = benchlib.env_int("STORAGE_CPU_ROWS", 200000)
BEFORE_ROWS = 100000
DRAIN_ROWS = benchlib.env_int("STORAGE_DRAIN_ROWS", 1000000)
PRODUCER_ROWS = benchlib.env_int("STORAGE_PRODUCER_ROWS", 10000)
CLAIMS, EXPLAINS = 300, 30
PV_EVERY = 100000
WAKEUP_LOCK = 122550254464888
CANDIDATES = (os.environ.get("STORAGE_CANDIDATES") or "U,D,A,AB,H,P").split(",")
CLAIM_CANDIDATES = (os.environ.get("STORAGE_CLAIM_CANDIDATES") or "U,D,DV,A,P,PV,H").split(",")
CLAIM_MODES = (os.environ.get("STORAGE_CLAIM_MODES") or "off,on").split(",")
RAW = os.environ.get("STORAGE_RAW") or "/tmp/storage-candidates-raw.jsonl"

# The relay's claim, as bench-naive prints it: the select list is kept; the rest is the
# relay's walk of the pending index without its floor ($6) and its clauses for partitioned
# topics, which pass every row of an outbox whose topics have one partition, as here.
RELAY_FROM = (" FROM outbox.messages AS c"
              " WHERE sent_at IS NULL AND failed_at IS NULL AND (retry_at IS NULL OR retry_at <= now())"
              "  AND topic <> ALL ($2::text[])"
              " ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED")
H_FROM = RELAY_FROM.replace(" ORDER BY", " AND id > $3::bigint ORDER BY")
# One primary-key lookup in outbox.messages per pending id (OFFSET 0 keeps the planner
# from flattening it into a merge join, which would walk every sent row of outbox.messages).
P_FROM = (" FROM outbox.pending AS p CROSS JOIN LATERAL ("
          "SELECT m.message_id, m.topic, m.partition_key, m.payload, m.headers, m.created_at,"
          " m.attempts, m.retry_at, m.failed_at FROM outbox.messages AS m WHERE m.id = p.id"
          " OFFSET 0) AS c"
          " WHERE c.failed_at IS NULL AND (c.retry_at IS NULL OR c.retry_at <= now())"
          "  AND c.topic <> ALL ($2::text[])"
          " ORDER BY id LIMIT $1 FOR UPDATE OF p SKIP LOCKED")

QUEUE_VACUUM = "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 10000," \
               " vacuum_index_cleanup = on"
SENT_COLUMNS = ("id, message_id, topic, partition_key, payload, headers, created_at, sent_at,"
                " attempts, last_error")
SENT_TABLE = ("CREATE TABLE outbox.sent (id bigint NOT NULL, message_id uuid NOT NULL,"
              " topic text NOT NULL, partition_key text, payload bytea NOT NULL, headers jsonb,"
              " created_at timestamptz NOT NULL, sent_at timestamptz NOT NULL,"
              " attempts integer NOT NULL, last_error text)")
ARCHIVE = ("WITH d AS (DELETE FROM outbox.messages WHERE id = ANY({ids})"
           " RETURNING id, message_id, topic, partition_key, payload, headers, created_at,"
           " attempts, last_error)"
           f" INSERT INTO outbox.sent ({SENT_COLUMNS})"
           " SELECT id, message_id, topic, partition_key, payload, headers, created_at,"
           " statement_timestamp(), attempts, last_error FROM d")
PENDING_TABLE = f"CREATE TABLE outbox.pending (id bigint PRIMARY KEY) WITH ({QUEUE_VACUUM})"
TRIGGER_STMT = """
CREATE FUNCTION outbox.pending_add() RETURNS trigger LANGUAGE plpgsql {secdef} AS $$
BEGIN
    INSERT INTO outbox.pending (id) SELECT n.id FROM new_rows AS n;
    RETURN NULL;
END
$$;
CREATE TRIGGER messages_pending AFTER INSERT ON outbox.messages
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION outbox.pending_add();
"""
TRIGGER_ROW = """
CREATE FUNCTION outbox.pending_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outbox.pending (id) VALUES (NEW.id);
    RETURN NULL;
END
$$;
CREATE TRIGGER messages_pending AFTER INSERT ON outbox.messages
    FOR EACH ROW EXECUTE FUNCTION outbox.pending_add();
"""
DROP_TRIGGER = ("DROP TRIGGER messages_pending ON outbox.messages;"
                " DROP FUNCTION outbox.pending_add();")
SECDEF = "SECURITY DEFINER SET search_path = pg_catalog, pg_temp"

U_MARK = "UPDATE outbox.messages SET sent_at = statement_timestamp() WHERE id = ANY({ids})"
CAND = {
    "U": dict(setup=[], mark=U_MARK, claim=RELAY_FROM, vacuum="outbox.messages"),
    "D": dict(setup=[], mark="DELETE FROM outbox.messages WHERE id = ANY({ids})",
              claim=RELAY_FROM, vacuum="outbox.messages"),
    "A": dict(setup=[SENT_TABLE, "ALTER TABLE outbox.sent ADD PRIMARY KEY (id)"], mark=ARCHIVE,
              claim=RELAY_FROM, vacuum="outbox.messages", archive=True),
    "AB": dict(setup=[SENT_TABLE, "CREATE INDEX sent_sent_at_brin ON outbox.sent USING brin (sent_at)"],
               mark=ARCHIVE, claim=RELAY_FROM, vacuum="outbox.messages", archive=True),
    "H": dict(setup=["DROP INDEX outbox.messages_pending_idx, outbox.messages_pending_topic_idx,"
                     " outbox.messages_failed_idx",
                     "CREATE INDEX messages_pending_idx ON outbox.messages (id) WHERE failed_at IS NULL",
                     "CREATE INDEX messages_pending_topic_idx ON outbox.messages (topic, id)"
                     " WHERE failed_at IS NULL",
                     "CREATE INDEX messages_failed_idx ON outbox.messages (id)"
                     " WHERE failed_at IS NOT NULL",
                     "ALTER TABLE outbox.messages SET (fillfactor = 50)"],
              mark=U_MARK, claim=H_FROM, vacuum="outbox.messages", watermark=True),
    "P": dict(setup=["DROP INDEX outbox.messages_pending_idx, outbox.messages_pending_topic_idx",
                     PENDING_TABLE, TRIGGER_STMT.format(secdef=SECDEF)],
              mark="DELETE FROM outbox.pending WHERE id = ANY({ids})", claim=P_FROM,
              vacuum="outbox.pending", pending=True),
}
CAND["PV"] = dict(CAND["P"], relay_vacuum=True)
CAND["DV"] = dict(CAND["D"], relay_vacuum=True)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def record(rec):
    rec["at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(RAW, "a") as f:
        f.write(json.dumps(rec) + "\n")


def claim_select():
    sql = subprocess.run([benchlib.NAIVE_BIN, "--print-claim-sql"], stdout=subprocess.PIPE,
                         text=True, check=True).stdout.strip()
    head, sep, tail = sql.partition(" FROM outbox.messages AS c")
    where, order = RELAY_FROM.split("  AND topic <> ALL ($2::text[])")
    if not (sep + tail).startswith(where) or not tail.endswith(order) \
            or " AND topic <> ALL ($2::text[])" not in tail:
        sys.exit(f"storage.py: the relay's claim changed, update RELAY_FROM:\n{sql}")
    return head


def backend_cpu(pid):
    """utime + stime of the backend, seconds; and its run time from schedstat, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        st = f.read()
    fields = st[st.rindex(")") + 2:].split()
    with open(f"/proc/{pid}/schedstat") as f:
        run_ns = int(f.read().split()[0])
    return (int(fields[11]) + int(fields[12])) / benchlib.CLK_TCK, run_ns / 1e9


def machine_busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / benchlib.CLK_TCK


class Meter:
    """Backend CPU, WAL position, and the machine's other work over a window."""

    def __init__(self, conn, pid):
        self.conn, self.pid = conn, pid
        self.cpu, self.run = backend_cpu(pid)
        self.lsn = benchlib.scalar(conn, "SELECT pg_current_wal_lsn()::text")
        self.busy, self.own, self.t = machine_busy(), sum(os.times()[:2]), time.monotonic()

    def read(self):
        cpu, run = backend_cpu(self.pid)
        busy, own, t = machine_busy(), sum(os.times()[:2]), time.monotonic()
        lsn = benchlib.scalar(self.conn, "SELECT pg_current_wal_lsn()::text")
        wal = benchlib.scalar(self.conn, "SELECT pg_wal_lsn_diff(%s, %s)", (lsn, self.lsn))
        secs = t - self.t
        return dict(cpu=cpu - self.cpu, run=run - self.run, wal=int(wal), seconds=secs,
                    others_cores=max(0.0, (busy - self.busy - (cpu - self.cpu) - (own - self.own))
                                     / secs),
                    lsn0=self.lsn, lsn1=lsn)


def setup(pg, name, autovacuum):
    conn = pg.connect()
    for sql in CAND[name]["setup"]:
        benchlib.execute(conn, sql)
    benchlib.execute(conn, "CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    if not autovacuum:
        benchlib.execute(conn, "ALTER SYSTEM SET autovacuum = off")
        benchlib.execute(conn, "SELECT pg_reload_conf()")
        time.sleep(0.2)
    return conn


def backlog(conn, name, n, prepare):
    benchlib.insert_backlog(conn, n, prepare=False)
    if prepare:
        benchlib.execute(conn, "VACUUM ANALYZE outbox.messages")
        if CAND[name].get("pending"):
            benchlib.execute(conn, "VACUUM ANALYZE outbox.pending")
        benchlib.execute(conn, "CHECKPOINT")


def prepare_claim(cur, select, name, as_name="claim", from_=None):
    args = "int, text[], bigint" if (from_ or CAND[name]["claim"]) == H_FROM else "int, text[]"
    cur.execute(f"PREPARE {as_name}({args}) AS {select}{from_ or CAND[name]['claim']}")


def claim_args(name, watermark, limit=BATCH):
    return f"{limit}, '{{}}', {watermark}" if CAND[name].get("watermark") else f"{limit}, '{{}}'"


def ids_literal(ids):
    return "'{" + ",".join(str(i) for i in ids) + "}'::bigint[]"


def drain(conn, name, target, relay_vacuum=False):
    """Claims, marks and commits target rows in batches of BATCH; returns the meter's reading."""
    cur = conn.cursor()
    pid = benchlib.scalar(conn, "SELECT pg_backend_pid()")
    mark = CAND[name]["mark"]
    meter = Meter(conn, pid)
    done, watermark, since_vacuum, vacuums = 0, 0, 0, 0
    while done < target:
        cur.execute("BEGIN")
        cur.execute(f"EXECUTE claim({claim_args(name, watermark, min(BATCH, target - done))})")
        ids = [r[0] for r in cur.fetchall()]
        if not ids:
            cur.execute("ROLLBACK")
            raise RuntimeError(f"{name}: the claim came back empty after {done} of {target} rows")
        cur.execute(mark.format(ids=ids_literal(ids)) + "; COMMIT")
        done += len(ids)
        watermark = max(ids)
        since_vacuum += len(ids)
        if relay_vacuum and since_vacuum >= PV_EVERY:
            cur.execute(f"VACUUM {CAND[name]['vacuum']}")
            since_vacuum, vacuums = 0, vacuums + 1
    if relay_vacuum:
        # The relay's next claim comes back short (the backlog is drained): it vacuums.
        cur.execute("BEGIN")
        cur.execute(f"EXECUTE claim({claim_args(name, watermark)})")
        short = len(cur.fetchall()) < BATCH
        cur.execute("ROLLBACK")
        if short:
            cur.execute(f"VACUUM {CAND[name]['vacuum']}")
            vacuums += 1
    m = meter.read()
    m.update(rows=done, watermark=watermark, relay_vacuums=vacuums)
    return m


def verify(conn, name, drained, total):
    c = CAND[name]
    if c.get("pending"):
        left = benchlib.scalar(conn, "SELECT count(*) FROM outbox.pending")
        ok = left == total - drained
    elif c.get("archive"):
        ok = benchlib.scalar(conn, "SELECT count(*) FROM outbox.sent") == drained and \
            benchlib.scalar(conn, "SELECT count(*) FROM outbox.messages") == total - drained
    elif c["mark"].startswith("DELETE FROM outbox.messages"):
        ok = benchlib.scalar(conn, "SELECT count(*) FROM outbox.messages") == total - drained
    else:
        ok = benchlib.scalar(conn, "SELECT count(*) FROM outbox.messages"
                                   " WHERE sent_at IS NOT NULL") == drained
    if not ok:
        raise RuntimeError(f"{name}: the tables do not hold what {drained} of {total} rows sent means")


def wal_detail(conn, lsn0, lsn1):
    with conn.cursor() as cur:
        cur.execute("SELECT coalesce(sum(count), 0), coalesce(sum(record_size), 0),"
                    " coalesce(sum(fpi_size), 0) FROM pg_get_wal_stats(%s,"
                    " least(%s::pg_lsn, pg_current_wal_flush_lsn()))", (lsn0, lsn1))
        records, rec_bytes, fpi_bytes = cur.fetchone()
    return dict(wal_records=int(records), wal_record_bytes=int(rec_bytes), wal_fpi_bytes=int(fpi_bytes))


def table_counters(conn, table):
    benchlib.execute(conn, "SELECT pg_stat_force_next_flush()")
    time.sleep(0.05)
    benchlib.execute(conn, "SELECT pg_stat_clear_snapshot()")
    with conn.cursor() as cur:
        cur.execute("SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup, autovacuum_count,"
                    " coalesce(last_autovacuum::text, 'never'), pg_total_relation_size(relid)"
                    " FROM pg_stat_user_tables WHERE relid = %s::regclass", (table,))
        upd, hot, dead, avc, last, size = cur.fetchone()
    return dict(upd=upd, hot_upd=hot, dead=dead, autovacuum_count=avc, last_autovacuum=last,
                total_bytes=size)


def producer_cost(pg, conn, n):
    """Backend CPU and WAL per single-row INSERT statement, autocommit, prepared."""
    prod = pg.connect()
    try:
        cur = prod.cursor()
        cur.execute("SET synchronous_commit = off")
        cur.execute("PREPARE ins(text, bytea) AS"
                    " INSERT INTO outbox.messages (topic, payload) VALUES ($1, $2)")
        payload = bytes((i * 37) % 256 for i in range(benchlib.PAYLOAD))
        for i in range(300):  # warm-up: plans, caches
            cur.execute("EXECUTE ins(%s, %s)", (f"bench{i % 4}", payload))
        meter = Meter(prod, benchlib.scalar(prod, "SELECT pg_backend_pid()"))
        for i in range(n):
            cur.execute("EXECUTE ins(%s, %s)", (f"bench{i % 4}", payload))
        m = meter.read()
        m["rows"] = n
        return m
    finally:
        prod.close()


def cpu_run(select, name, rnd):
    log(f"cpu round {rnd}: {name}")
    with benchlib.BenchPostgres() as pg:
        conn = setup(pg, name, autovacuum=False)
        c = CAND[name]
        # Producers, while a relay holds the wake-up lock (busy: no NOTIFY).
        benchlib.execute(conn, f"SELECT pg_advisory_lock({WAKEUP_LOCK})")
        variants = [("", None)]
        if c.get("pending"):
            variants += [("stmt_plain", TRIGGER_STMT.format(secdef="")), ("row_plain", TRIGGER_ROW)]
        for label, trigger in variants:
            if trigger:
                benchlib.execute(conn, DROP_TRIGGER)
                benchlib.execute(conn, trigger)
            m = producer_cost(pg, conn, PRODUCER_ROWS)
            record(dict(phase="producer", round=rnd, cand=name, variant=label or "main", **m))
            log(f"  producer {label or 'main'}: {m['cpu'] / m['rows'] * 1e6:.1f} us/row"
                f" (schedstat {m['run'] / m['rows'] * 1e6:.1f}), {m['wal'] / m['rows']:.0f} WAL B/row")
        if len(variants) > 1:
            benchlib.execute(conn, DROP_TRIGGER)
            benchlib.execute(conn, TRIGGER_STMT.format(secdef=SECDEF))
        benchlib.execute(conn, f"SELECT pg_advisory_unlock({WAKEUP_LOCK})")
        benchlib.execute(conn, "TRUNCATE outbox.messages" +
                         (", outbox.pending" if c.get("pending") else "") + " RESTART IDENTITY")
        backlog(conn, name, CPU_ROWS, prepare=True)
        prepare_claim(conn.cursor(), select, name)
        m = drain(conn, name, CPU_ROWS)
        verify(conn, name, CPU_ROWS, CPU_ROWS)
        m.update(wal_detail(conn, m["lsn0"], m["lsn1"]))
        m["table"] = table_counters(conn, "outbox.messages")
        pid = benchlib.scalar(conn, "SELECT pg_backend_pid()")
        cpu0, run0 = backend_cpu(pid)
        t0 = time.monotonic()
        benchlib.execute(conn, f"VACUUM {c['vacuum']}")
        cpu1, run1 = backend_cpu(pid)
        m.update(vacuum_cpu=cpu1 - cpu0, vacuum_run=run1 - run0, vacuum_seconds=time.monotonic() - t0)
        record(dict(phase="cpu", round=rnd, cand=name, **m))
        t = m["table"]
        log(f"  drain {m['rows']}: {m['cpu'] / m['rows'] * 1e6:.1f} us/msg (schedstat"
            f" {m['run'] / m['rows'] * 1e6:.1f}), {m['wal'] / m['rows']:.0f} WAL B/msg"
            f" (FPI {m['wal_fpi_bytes'] / m['rows']:.0f}), {m['rows'] / m['seconds']:,.0f} msg/s,"
            f" HOT {t['hot_upd']}/{t['upd']}, VACUUM {m['vacuum_cpu'] / m['rows'] * 1e6:.2f} us/msg,"
            f" others {m['others_cores']:.2f} cores")
        conn.close()


PRODUCER_FORMS = {
    # U's producer path is also D's, A's and AB's (H differs only by fillfactor 50).
    "U": ["DROP TRIGGER IF EXISTS messages_pending ON outbox.messages",
          "DROP FUNCTION IF EXISTS outbox.pending_add()",
          "DROP TABLE IF EXISTS outbox.pending",
          "CREATE INDEX messages_pending_idx ON outbox.messages (id)"
          " WHERE sent_at IS NULL AND failed_at IS NULL",
          "CREATE INDEX messages_pending_topic_idx ON outbox.messages (topic, id)"
          " WHERE sent_at IS NULL AND failed_at IS NULL"],
    "P": ["DROP INDEX IF EXISTS outbox.messages_pending_idx, outbox.messages_pending_topic_idx",
          PENDING_TABLE, TRIGGER_STMT.format(secdef=SECDEF)],
    "P_row": ["DROP INDEX IF EXISTS outbox.messages_pending_idx, outbox.messages_pending_topic_idx",
              PENDING_TABLE, TRIGGER_ROW],
}


def producer_pairs(reps=6, rows=5000):
    """The producers' cost of U's and P's schemas, alternated on one server."""
    log("producer pairs")
    forms = list(PRODUCER_FORMS)
    with benchlib.BenchPostgres() as pg:
        conn = setup(pg, "U", autovacuum=False)
        benchlib.execute(conn, f"SELECT pg_advisory_lock({WAKEUP_LOCK})")
        current = "U"
        for rep in range(1, reps + 1):
            k = (rep - 1) % len(forms)
            for form in forms[k:] + forms[:k]:
                if form != current:
                    for sql in PRODUCER_FORMS["U"][:3] if current != "U" else PRODUCER_FORMS["P"][:1]:
                        benchlib.execute(conn, sql)
                    for sql in PRODUCER_FORMS[form][3:] if form == "U" else PRODUCER_FORMS[form][1:]:
                        benchlib.execute(conn, sql)
                    current = form
                benchlib.execute(conn, "TRUNCATE outbox.messages" +
                                 (", outbox.pending" if form != "U" else "") + " RESTART IDENTITY")
                m = producer_cost(pg, conn, rows)
                record(dict(phase="producer_pair", rep=rep, form=form, **m))
                log(f"  {rep} {form}: {m['cpu'] / m['rows'] * 1e6:.1f} us/row"
                    f" (schedstat {m['run'] / m['rows'] * 1e6:.1f}), others {m['others_cores']:.2f} cores")
        conn.close()


def claim_timing(conn, name, n, watermark=0, stmt="claim"):
    cur = conn.cursor()
    times, rows = [], 0
    pid = benchlib.scalar(conn, "SELECT pg_backend_pid()")
    run0 = backend_cpu(pid)[1]
    for _ in range(n):
        cur.execute("BEGIN")
        t0 = time.perf_counter()
        cur.execute(f"EXECUTE {stmt}({claim_args(name, watermark)})")
        rows += len(cur.fetchall())
        times.append(time.perf_counter() - t0)
        cur.execute("ROLLBACK")
    backend_ms = (backend_cpu(pid)[1] - run0) / n * 1e3
    server, buffers, plan = [], [], ""
    for _ in range(min(EXPLAINS, n)):
        cur.execute("BEGIN")
        cur.execute(f"EXPLAIN (ANALYZE, TIMING OFF, BUFFERS) EXECUTE {stmt}"
                    f"({claim_args(name, watermark)})")
        plan = "\n".join(r[0] for r in cur.fetchall())
        cur.execute("ROLLBACK")
        server.append(float(re.search(r"Execution Time: ([0-9.]+) ms", plan).group(1)))
        m = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
        buffers.append(int(m.group(1)) + int(m.group(2) or 0) if m else None)
    return dict(claims=n, rows_per_claim=rows / n, mean_ms=statistics.mean(times) * 1e3,
                p50_ms=statistics.median(times) * 1e3, first_ms=times[0] * 1e3,
                max_ms=max(times) * 1e3, backend_ms=backend_ms, server_p50_ms=statistics.median(server),
                buffers=statistics.median(buffers), plan=plan)


def claim_run(select, name, mode):
    log(f"claim {name}, autovacuum {mode}")
    c = CAND[name]
    table = c["vacuum"] if c.get("pending") else "outbox.messages"
    with benchlib.BenchPostgres() as pg:
        conn = setup(pg, name, autovacuum=(mode == "on"))
        prepare_claim(conn.cursor(), select, name)
        backlog(conn, name, BEFORE_ROWS, prepare=True)
        before = claim_timing(conn, name, CLAIMS)
        log(f"  before: mean {before['mean_ms']:.3f} ms, server p50 {before['server_p50_ms']:.3f} ms,"
            f" {before['buffers']} buffers")
        backlog(conn, name, DRAIN_ROWS - BEFORE_ROWS, prepare=False)
        d = drain(conn, name, DRAIN_ROWS, relay_vacuum=c.get("relay_vacuum", False))
        log(f"  drain {d['rows']}: {d['cpu'] / d['rows'] * 1e6:.1f} us/msg, {d['rows'] / d['seconds']:,.0f}"
            f" msg/s, relay VACUUMs {d['relay_vacuums']}, others {d['others_cores']:.2f} cores")
        verify(conn, name, DRAIN_ROWS, DRAIN_ROWS)
        backlog(conn, name, BEFORE_ROWS, prepare=False)
        stats = table_counters(conn, table)
        after = claim_timing(conn, name, CLAIMS, watermark=d["watermark"])
        stats_after = table_counters(conn, table)
        log(f"  after: mean {after['mean_ms']:.3f} ms, server p50 {after['server_p50_ms']:.3f} ms,"
            f" {after['buffers']} buffers; {stats['dead']} dead rows,"
            f" autovacuums {stats['autovacuum_count']} -> {stats_after['autovacuum_count']};"
            f" ratio {after['mean_ms'] / before['mean_ms']:.2f}")
        rec = dict(phase="claim", cand=name, mode=mode, before=before, after=after, drain=d,
                   stats=stats, stats_after=stats_after)
        if c.get("watermark"):
            prepare_claim(conn.cursor(), select, name, "claim_correct", RELAY_FROM)
            cur = conn.cursor()
            times = []
            for _ in range(5):
                cur.execute("BEGIN")
                t0 = time.perf_counter()
                cur.execute(f"EXECUTE claim_correct({BATCH}, '{{}}')")
                cur.fetchall()
                times.append(time.perf_counter() - t0)
                cur.execute("ROLLBACK")
            rec["after_correct_mean_ms"] = statistics.mean(times) * 1e3
            log(f"  after, the correct claim (no watermark): mean {rec['after_correct_mean_ms']:.1f} ms")
        record(rec)
        conn.close()


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def report():
    recs = [json.loads(line) for line in open(RAW)]
    cpu = [r for r in recs if r["phase"] == "cpu"]
    prod = [r for r in recs if r["phase"] == "producer"]
    runs = [r for r in recs if r["phase"] == "claim"]
    names = [n for n in CAND if any(r["cand"] == n for r in cpu + runs)]

    def per(rs, key, unit=1e6):
        return [r[key] / r["rows"] * unit for r in rs]

    def ratios(rs):
        return ", ".join(f"{r['after']['mean_ms'] / r['before']['mean_ms']:.2f}"
                         f" ({r['after']['server_p50_ms'] / r['before']['server_p50_ms']:.2f})"
                         for r in rs) or "–"

    pairs = [r for r in recs if r["phase"] == "producer_pair"]
    pair_by = {(r["rep"], r["form"]): r for r in pairs}

    def producer_cell(n):
        form = "P" if CAND[n].get("pending") else "U"
        v = [r["cpu"] / r["rows"] * 1e6 for r in pairs if r["form"] == form]
        if not v:
            return ""
        d = [(r["run"] - pair_by[(r["rep"], "U")]["run"]) / r["rows"] * 1e6
             for r in pairs if r["form"] == form and (r["rep"], "U") in pair_by]
        return f"{med(v):.0f}" + (f" ({med(d):+.0f} vs U)" if form != "U" else "")

    base = med(per([r for r in cpu if r["cand"] == "U"], "cpu"))
    print("| candidate | PostgreSQL CPU µs/msg (claim+mark+commit), median (range) | vs U"
          " | WAL B/msg (of it FPI) | producer insert µs/row | VACUUM µs/msg | claim before ms"
          " | claim after 1M drain ms | ratio, autovacuum off | ratio, autovacuum on |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        rs = [r for r in cpu if r["cand"] == n]
        c = per(rs, "cpu")
        cells = [n]
        if rs:
            cells += [f"{med(c):.1f} ({min(c):.1f}–{max(c):.1f})" if len(c) > 1 else f"{med(c):.1f}",
                      f"{med(c) / base:.2f}" if base else "",
                      f"{med(per(rs, 'wal', 1)):.0f} ({med(per(rs, 'wal_fpi_bytes', 1)):.0f})",
                      producer_cell(n), f"{med(per(rs, 'vacuum_cpu')):.2f}"]
        else:
            cells += ["", "", "", producer_cell(n), ""]
        cr = sorted((r for r in runs if r["cand"] == n), key=lambda r: r["at"])
        for part in ("before", "after"):
            cells.append(f"{med([r[part]['mean_ms'] for r in cr]):.2f}"
                         f" ({med([r[part]['server_p50_ms'] for r in cr]):.2f})" if cr else "")
        cells.append(ratios([r for r in cr if r["mode"] == "off"]))
        cells.append(ratios([r for r in cr if r["mode"] == "on"]))
        print("| " + " | ".join(cells) + " |")
    print()
    print("CPU: backend utime+stime per message, median of the rounds of the cpu phase; claim:"
          " client-side mean of the EXECUTE with its rows fetched (in brackets: the median server"
          " Execution Time of EXPLAIN ANALYZE), median over the runs; ratios after/before, one per run."
          " Producer: the producer phase's median (U's schema for every candidate but P's).")
    print()
    print("Repeats (cpu phase): CPU µs/msg per round, producer µs/row per round")
    for n in names:
        rs = sorted((r for r in cpu if r["cand"] == n), key=lambda r: r["round"])
        if rs:
            print(f"  {n}: drain " + ", ".join(f"{r['cpu'] / r['rows'] * 1e6:.1f}" for r in rs)
                  + "; schedstat " + ", ".join(f"{r['run'] / r['rows'] * 1e6:.1f}" for r in rs)
                  + "; WAL " + ", ".join(f"{r['wal'] / r['rows']:.0f}" for r in rs)
                  + "; others' cores " + ", ".join(f"{r['others_cores']:.2f}" for r in rs)
                  + "; HOT " + ", ".join(f"{r['table']['hot_upd']}/{r['table']['upd']}" for r in rs))
        for v in sorted({r["variant"] for r in prod if r["cand"] == n}):
            ps = sorted((r for r in prod if r["cand"] == n and r["variant"] == v),
                        key=lambda r: r["round"])
            print(f"  {n} producer {v}: " + ", ".join(f"{r['cpu'] / r['rows'] * 1e6:.1f}" for r in ps)
                  + " us/row; WAL " + ", ".join(f"{r['wal'] / r['rows']:.0f}" for r in ps) + " B/row")
    if pairs:
        print()
        print("Producer pairs (one server, forms alternated): us/row per repeat (utime+stime;"
              " schedstat), median; median of the per-repeat difference to U")
        reps = sorted({r["rep"] for r in pairs})
        by = {(r["rep"], r["form"]): r for r in pairs}
        for form in PRODUCER_FORMS:
            v = [by[(k, form)]["cpu"] / by[(k, form)]["rows"] * 1e6 for k in reps if (k, form) in by]
            w = [by[(k, form)]["run"] / by[(k, form)]["rows"] * 1e6 for k in reps if (k, form) in by]
            dv = [(by[(k, form)]["run"] - by[(k, "U")]["run"]) / by[(k, form)]["rows"] * 1e6
                  for k in reps if (k, form) in by and (k, "U") in by]
            print(f"  {form}: " + ", ".join(f"{x:.1f}" for x in v) + f"; median {med(v):.1f};"
                  f" schedstat median {med(w):.1f}; difference to U (schedstat) {med(dv):+.1f}"
                  f" (repeats {min(dv):+.1f} .. {max(dv):+.1f})")
    print()
    print("Claim phase: before / after (client mean ms; server p50 ms; buffers), drain CPU over 1M")
    for r in sorted(runs, key=lambda r: (r["cand"], r["mode"], r["at"])):
        n, m = r["cand"], r["mode"]
        b, a, d = r["before"], r["after"], r["drain"]
        extra = f"; correct claim after: {r['after_correct_mean_ms']:.1f} ms" \
            if "after_correct_mean_ms" in r else ""
        print(f"  {n} av {m}: {b['mean_ms']:.2f} -> {a['mean_ms']:.2f} ms (first {a['first_ms']:.2f});"
              f" server {b['server_p50_ms']:.2f} -> {a['server_p50_ms']:.2f} ms;"
              + (f" backend {b['backend_ms']:.2f} -> {a['backend_ms']:.2f} ms;" if "backend_ms" in a else "")
              + f" buffers {b['buffers']:.0f} -> {a['buffers']:.0f}; drain {d['cpu'] / d['rows'] * 1e6:.1f}"
              f" us/msg at {d['rows'] / d['seconds']:,.0f} msg/s; dead {r['stats']['dead']},"
              f" autovacuums {r['stats']['autovacuum_count']}->{r['stats_after']['autovacuum_count']},"
              f" relay VACUUMs {d['relay_vacuums']}{extra}")


def main():
    phases = sys.argv[1:] or ["cpu", "producer", "claim", "report"]
    if "cpu" in phases or "claim" in phases:
        select = claim_select()
    if "producer" in phases:
        producer_pairs()
    if "cpu" in phases:
        for rnd in range(1, ROUNDS + 1):
            k = (rnd - 1) % len(CANDIDATES)
            for name in CANDIDATES[k:] + CANDIDATES[:k]:
                cpu_run(select, name, rnd)
    if "claim" in phases:
        for mode in CLAIM_MODES:
            for name in CLAIM_CANDIDATES:
                if mode == "on" and CAND[name].get("watermark"):
                    continue  # H's claim never walks dead entries: autovacuum changes nothing
                claim_run(select, name, mode)
    if "report" in phases:
        report()


if __name__ == "__main__":
    main()
