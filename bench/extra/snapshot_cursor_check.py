#!/usr/bin/python3
"""Correctness of the snapshot-and-cursor prototype (bench/extra/snapshot_cursor.*), at
small scale, on throwaway servers (the integration tests' harness: PostgreSQL, and Redis
with appendonly yes).

Every committed row must be in its stream exactly once, and each stream in publish
order: by batch (the first tick whose snapshot sees the row's transaction, which is
commit order at the ticks' grain), then transaction id, then row id. Checked after:

  i    a normal drain: a backlog of transactions of 1 to 40 rows, and producers
       committing during the drain (headers, keys, binary payloads; every field of
       every entry compared with the row)
  ii   the prototype killed with SIGKILL six times mid-drain and started again: four
       times inside the backlog's batch (30,000 rows of it one transaction), twice
       among the small batches of producers committing throughout
  iii  two instances at the same time on the same batches: the cursor's
       compare-and-set refuses the one behind
  iv   a long-open transaction that holds a transaction id: rows committed after it
       began are published at once, with commit -> stream times
  v    a transaction that writes a row, then stays open while a later transaction
       (higher xid) commits and is published; it commits after that tick: its row is
       still published, after the other

Each case runs with both ways to publish (bench-cursor --publish fcall, the cursor key
and its function; --publish ids, the entry ids as the cursor; CURSOR_MODES to choose).
Needs build-bench/bench-cursor (cmake --build build-bench --target bench-cursor).
Prints the figures and exits non-zero on any failure.

    PYTHONPATH=. /usr/bin/python3 bench/extra/snapshot_cursor_check.py
"""
import bisect
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

from bench import benchlib
from testkit import harness

BIN = os.path.join(benchlib.BUILD, "bench-cursor")
SQL = os.path.join(benchlib.HERE, "extra", "snapshot_cursor.sql")
TOPICS = ["t0", "t1", "t2", "t3"]
FAILED = []


def log(msg):
    print(msg, flush=True)


def check(ok, what):
    if not ok:
        FAILED.append(what)
        log(f"  FAILED: {what}")


# --------------------------------------------------------------------------
# Servers, rows, the prototype.

def setup(pg):
    pg.psql("-f", SQL)
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute("SELECT cursor_proto.register('bench')")
    return conn


def insert_tx(conn, rng, rows, hold=0.0):
    """One transaction of `rows` rows over TOPICS; hold: seconds between the
    last insert and the commit, so that transactions overlap and commit out of
    xid order."""
    values = []
    for _ in range(rows):
        topic = rng.choice(TOPICS)
        key = rng.choice([None, "k1", "k2", "k3"])
        headers = rng.choice([None, None, '{"trace": "abc", "n": 1, "nested": {"a": [1]}}'])
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        values.append((topic, key, payload, headers))
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.executemany("INSERT INTO cursor_proto.messages (topic, partition_key, payload,"
                        " headers) VALUES (%s, %s, %s, %s::jsonb)", values)
        if hold:
            time.sleep(hold)
        cur.execute("COMMIT")


def backlog(pg, transactions, seed, big=0):
    """Transactions of 1 to 40 rows from 4 connections at once (and one of
    `big` rows): returns nothing; the table is the truth."""
    if big:
        with pg.connect() as c, c.cursor() as cur:
            cur.execute("INSERT INTO cursor_proto.messages (topic, partition_key, payload)"
                        " SELECT 't' || (g %% 4), 'k' || (g %% 3), int8send(g)"
                        " FROM generate_series(1, %s) AS g", (big,))

    def work(i):
        rng = random.Random(seed * 100 + i)
        conn = pg.connect()
        for _ in range(transactions // 4):
            insert_tx(conn, rng, rng.randint(1, 40), hold=rng.choice([0, 0, 0.002]))
        conn.close()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Producers:
    """Threads committing small transactions (1 to 10 rows) until stopped, some
    holding their transaction open a few ms so that commits land out of xid order."""

    def __init__(self, pg, n=3, seed=7):
        self.stop_flag = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(pg, seed + i), daemon=True)
                        for i in range(n)]
        self.transactions = 0
        for t in self.threads:
            t.start()

    def run(self, pg, seed):
        rng = random.Random(seed)
        conn = pg.connect()
        while not self.stop_flag.is_set():
            insert_tx(conn, rng, rng.randint(1, 10), hold=rng.choice([0, 0.001, 0.005]))
            self.transactions += 1
            time.sleep(rng.random() * 0.004)
        conn.close()

    def stop(self):
        self.stop_flag.set()
        for t in self.threads:
            t.join()


MODE = ["fcall"]  # bench-cursor --publish: the case being checked


def start(pg, rd, tag=""):
    err = open(f"/tmp/bench-cursor-check{tag}.log", "a")
    return subprocess.Popen([BIN, "--postgres", pg.dsn(), "--redis-port", str(rd.port),
                             "--fetch", "500", "--publish", MODE[0]],
                            stdout=subprocess.PIPE, stderr=err, text=True)


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"bench-cursor exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def stream_total(rc):
    return sum(rc.xlen(t) for t in TOPICS)


def committed(conn):
    return benchlib.scalar(conn, "SELECT count(*) FROM cursor_proto.messages")


def wait_all(conn, rc, procs, timeout=120):
    """Until every committed row is in Redis and nothing more comes for 0.5 s."""
    deadline = time.monotonic() + timeout
    while True:
        want, have = committed(conn), stream_total(rc)
        if have >= want:
            time.sleep(0.5)
            if stream_total(rc) == have and committed(conn) == want:
                return
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"bench-cursor exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{have} of {want} rows in Redis after {timeout} s")
        time.sleep(0.05)


# --------------------------------------------------------------------------
# The verdict.

def visible(snap, xid):
    xmin, xmax, xip = snap
    return xid < xmin or (xid < xmax and xid not in xip)


def verify(conn, rc, label, fields=False):
    """Every row once, each stream in publish order. Returns the figures."""
    with conn.cursor() as cur:
        cur.execute("SELECT tick_id, snap::text FROM cursor_proto.ticks ORDER BY tick_id")
        ticks = []
        for tick_id, snap in cur.fetchall():
            xmin, xmax, xip = snap.split(":")
            ticks.append((tick_id, (int(xmin), int(xmax),
                                    {int(x) for x in xip.split(",") if x})))
        cur.execute("SELECT id, txid::text, topic FROM cursor_proto.messages")
        rows = {r[0]: (int(r[1]), r[2]) for r in cur.fetchall()}
    batch_of = {}
    late = 0  # transactions batched with a lower xid than the xmax of the tick before
    for xid in {x for x, _ in rows.values()}:
        # The first tick that sees xid: visibility only grows from tick to tick.
        k = bisect.bisect_left(range(len(ticks)), True, key=lambda i: visible(ticks[i][1], xid))
        batch_of[xid] = ticks[k][0] if k < len(ticks) else None
        if 0 < k < len(ticks) and xid < ticks[k - 1][1][1]:
            late += 1
    seen, dup, disorder, wrong_stream, unknown = {}, 0, 0, 0, 0
    entries = 0
    for topic in TOPICS:
        prev = None
        for _, f in rc.xrange(topic):
            entries += 1
            oid = int(f[b"outbox_id"])
            if oid in seen:
                dup += 1
            seen[oid] = f
            if oid not in rows:
                unknown += 1
                continue
            xid, t = rows[oid]
            wrong_stream += t != topic
            pos = (batch_of[xid] or 0, xid, oid)
            if prev is not None and pos <= prev:
                disorder += 1
            prev = pos
    lost = sum(1 for oid in rows if oid not in seen)
    unbatched = sum(1 for xid, _ in rows.values() if batch_of[xid] is None)
    mismatched = 0
    if fields:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT id, message_id::text, topic, partition_key, payload,"
                " to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),"
                " (SELECT jsonb_object_agg(k, CASE WHEN jsonb_typeof(v) = 'string' THEN v #>> '{}'"
                "  ELSE v::text END) FROM jsonb_each(headers) AS h(k, v))"
                " FROM cursor_proto.messages")
            for oid, mid, topic, key, payload, created, headers in cur.fetchall():
                want = {b"id": mid.encode(), b"topic": topic.encode(), b"payload": bytes(payload),
                        b"created_at": created.encode(), b"outbox_id": str(oid).encode()}
                if key is not None:
                    want[b"key"] = key.encode()
                for k, v in (headers or {}).items():
                    want[b"h." + k.encode()] = v.encode()
                if seen.get(oid) != want:
                    mismatched += 1
    res = dict(rows=len(rows), entries=entries, duplicates=dup, lost=lost, out_of_order=disorder,
               wrong_stream=wrong_stream, unknown=unknown, unbatched=unbatched,
               transactions=len(batch_of), late_transactions=late, ticks=len(ticks))
    if fields:
        res["fields_mismatched"] = mismatched
    log(f"  {label}: " + ", ".join(f"{k} {v:,}" for k, v in res.items()))
    for k in ("duplicates", "lost", "out_of_order", "wrong_stream", "unknown", "unbatched",
              "fields_mismatched"):
        check(res.get(k, 0) == 0, f"{label}: {k} {res.get(k)}")
    check(entries == len(rows), f"{label}: {entries} entries for {len(rows)} rows")
    return res


# --------------------------------------------------------------------------
# The cases.

def case_drain():
    log("i. a normal drain")
    with harness.Postgres() as pg, harness.Redis(appendonly=True) as rd:
        conn, rc = setup(pg), rd.client()
        backlog(pg, 400, seed=1)
        proc = start(pg, rd)
        load = Producers(pg)
        time.sleep(3)
        load.stop()
        wait_all(conn, rc, [proc])
        out = stop(proc)
        log(f"  prototype: {out}")
        res = verify(conn, rc, "normal drain", fields=True)
        check(out["refused"] == 0, "normal drain: a call was refused")
        res["cursor_bytes"] = sum(rc.memory_usage("{" + t + "}:cursor") or 0 for t in TOPICS)
        res["keys"] = rc.dbsize()
        return res


def case_kill():
    log("ii. SIGKILL mid-drain, six times")
    with harness.Postgres() as pg, harness.Redis(appendonly=True) as rd:
        conn, rc = setup(pg), rd.client()
        backlog(pg, 800, seed=2, big=30000)
        total = committed(conn)
        load = Producers(pg, seed=20)
        proc = start(pg, rd, "-kill")
        kills = []
        # Four kills inside the first batch (the whole backlog, 30,000 rows of it
        # one transaction), then two among the producers' small batches.
        for at in [int(total * f) for f in (0.2, 0.4, 0.6, 0.8)] + [total + 1000, total + 3000]:
            harness.wait_until(lambda: stream_total(rc) >= at, timeout=120,
                               interval=0.001, message=f"{at:,} entries in Redis")
            proc.kill()
            proc.wait()
            kills.append(stream_total(rc))
            proc = start(pg, rd, "-kill")
        time.sleep(1)
        load.stop()
        wait_all(conn, rc, [proc])
        out = stop(proc)
        log(f"  killed with {', '.join(f'{k:,}' for k in kills)} entries in Redis;"
            f" the last start: {out}")
        res = verify(conn, rc, "SIGKILL x6")
        res["kills_at"] = kills
        res["last_start_skipped"] = out["skipped"]
        return res


def case_two():
    log("iii. two instances at once")
    with harness.Postgres() as pg, harness.Redis(appendonly=True) as rd:
        conn, rc = setup(pg), rd.client()
        backlog(pg, 600, seed=3, big=10000)
        a, b = start(pg, rd, "-a"), start(pg, rd, "-b")
        load = Producers(pg, seed=30)
        time.sleep(3)
        load.stop()
        wait_all(conn, rc, [a, b])
        oa, ob = stop(a), stop(b)
        log(f"  A: {oa}\n  B: {ob}")
        res = verify(conn, rc, "two instances")
        res["refused"] = oa["refused"] + ob["refused"]
        res["appended_by"] = (oa["appended"], ob["appended"])
        check(oa["appended"] + ob["appended"] == res["rows"],
              "two instances: appended by A and B do not add up to the rows")
        return res


def case_long_open():
    log("iv. a long-open transaction that is not the outbox's")
    with harness.Postgres() as pg, harness.Redis(appendonly=True) as rd:
        conn, rc = setup(pg), rd.client()
        benchlib.execute(conn, "CREATE TABLE unrelated (x int)")
        proc = start(pg, rd)
        holder = pg.connect()
        with holder.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("INSERT INTO unrelated VALUES (1)")
            cur.execute("SELECT pg_current_xact_id()::text")
            held = int(cur.fetchone()[0])
        rng = random.Random(4)
        lat = []
        for i in range(100):
            before = stream_total(rc)
            insert_tx(conn, rng, 1)
            t0 = time.monotonic()
            harness.wait_until(lambda: stream_total(rc) > before, timeout=10, interval=0.0005,
                               message="a row committed behind the open transaction")
            lat.append((time.monotonic() - t0) * 1e3)
        still_open = benchlib.scalar(conn, "SELECT count(*) FROM pg_stat_activity"
                                           " WHERE state = 'idle in transaction'")
        benchlib.execute(holder, "ROLLBACK")
        holder.close()
        wait_all(conn, rc, [proc])
        out = stop(proc)
        lat.sort()
        res = verify(conn, rc, "long-open transaction")
        res.update(held_xid=held, p50_ms=lat[len(lat) // 2], max_ms=lat[-1],
                   open_during=still_open)
        log(f"  100 single-row commits while xid {held} stayed open: commit -> stream"
            f" p50 {res['p50_ms']:.2f} ms, max {res['max_ms']:.2f} ms; prototype {out}")
        check(still_open == 1, "long-open: the transaction was not open throughout")
        return res


def case_late_commit():
    log("v. a lower xid that commits after a tick took higher ones")
    with harness.Postgres() as pg, harness.Redis(appendonly=True) as rd:
        conn, rc = setup(pg), rd.client()
        proc = start(pg, rd)
        a = pg.connect()
        with a.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("INSERT INTO cursor_proto.messages (topic, payload) VALUES ('t0', 'A')"
                        " RETURNING id, txid::text")
            a_id, a_xid = cur.fetchone()
        with conn.cursor() as cur:
            cur.execute("INSERT INTO cursor_proto.messages (topic, payload) VALUES ('t0', 'B')"
                        " RETURNING id, txid::text")
            b_id, b_xid = cur.fetchone()
        harness.wait_until(lambda: rc.xlen("t0") >= 1, timeout=10,
                           message="B's row in Redis")
        ticks_before = benchlib.scalar(conn, "SELECT max(tick_id) FROM cursor_proto.ticks")
        time.sleep(0.3)  # a few more idle ticks' chances while A is open
        benchlib.execute(a, "COMMIT")
        a.close()
        harness.wait_until(lambda: rc.xlen("t0") >= 2, timeout=10,
                           message="A's row in Redis")
        wait_all(conn, rc, [proc])
        stop(proc)
        order = [int(f[b"outbox_id"]) for _, f in rc.xrange("t0")]
        res = verify(conn, rc, "late commit")
        res.update(a_xid=int(a_xid), b_xid=int(b_xid), order=order,
                   b_tick=ticks_before)
        log(f"  A: xid {a_xid}, row {a_id}, committed after tick {ticks_before} had"
            f" published B (xid {b_xid}, row {b_id}); stream t0: outbox_id {order}")
        check(int(a_xid) < int(b_xid), "late commit: A's xid is not the lower")
        check(order == [b_id, a_id], f"late commit: stream order {order}")
        return res


def main():
    if not os.path.exists(BIN):
        sys.exit(f"{BIN} not found: cmake --build {benchlib.BUILD} --target bench-cursor")
    started = time.monotonic()
    results = {}
    for mode in (os.environ.get("CURSOR_MODES") or "fcall,ids").split(","):
        MODE[0] = mode
        log(f"== bench-cursor --publish {mode}")
        results[mode] = dict(drain=case_drain(), kill=case_kill(), two=case_two(),
                             long_open=case_long_open(), late_commit=case_late_commit())
    log("\nsummary")
    for mode, cases in results.items():
        log(f"  --publish {mode}")
        for name, r in cases.items():
            log(f"    {name}: rows {r['rows']:,}, duplicates {r['duplicates']}, lost {r['lost']},"
                f" out of order {r['out_of_order']}, transactions {r['transactions']:,}"
                f" (committed late, below the last tick's xmax: {r['late_transactions']:,}),"
                f" ticks {r['ticks']:,}"
                + (f", refused calls {r['refused']:,}, appended by A/B {r['appended_by']}"
                   if name == "two" else "")
                + (f", kills with {', '.join(f'{k:,}' for k in r['kills_at'])} in Redis"
                   if name == "kill" else "")
                + (f", keys in Redis {r['keys']} of which cursors {r['cursor_bytes']} bytes"
                   if name == "drain" else "")
                + (f", commit -> stream p50 {r['p50_ms']:.2f} ms, max {r['max_ms']:.2f} ms"
                   if name == "long_open" else ""))
    log(f"{len(FAILED)} failed in {time.monotonic() - started:.0f} s")
    for f in FAILED:
        log(f"  {f}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
