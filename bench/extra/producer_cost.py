#!/usr/bin/python3
"""What each of the relay's additions to outbox.messages costs its producers (issue 40's
target 6), one addition taken away at a time.

An experiment behind docs/PERFORMANCE.md ("What each addition costs the producers"), not
part of the run. The benchmark's PostgreSQL (fsync on) and Redis (only for benchlib's CPU
meter), the relay's schema as its migrations leave it and a session holding the wake-up
lock as a busy relay holds it (no notification: migrations/007), as in bench/bench.py's
section producers. pgbench, 16 clients, -M prepared, each transaction one INSERT of a
200-byte payload, into:

  plain        bench_plain.messages: the producers' columns, PRIMARY KEY (id) and
               UNIQUE (message_id), nothing the relay adds (bench/bench.py's PLAIN_TABLE)
  outbox       outbox.messages as it is
  topic_idx    outbox.messages with the (topic, id) index that schema 22 dropped
               (messages_pending_topic_idx, partial on sent_at and failed_at IS NULL)
  no_notify    outbox.messages without the wake-up trigger (messages_notify)
  no_txid_idx  outbox.messages without messages_txid_idx (what the batch reads walk)

in turns, PRODUCER_COST_ROUNDS rounds (default 3) of PRODUCER_COST_SECONDS (default 8),
synchronous_commit on and off (PRODUCER_COST_SYNC, default "on,off"); PRODUCER_COST_CLIENTS
(default 16) clients, PRODUCER_COST_CASES (default all, comma-separated) the cases; each
round from bench/benchlib.fresh_round's state. Prints,
per mode and case, the median rate, its ratio to plain's and PostgreSQL's CPU per 100k rows,
and writes bench/results/producer-cost.csv.

    PYTHONPATH=. /usr/bin/python3 bench/extra/producer_cost.py
"""
import csv
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import bench as B  # noqa: E402
from bench import benchlib  # noqa: E402
from bench.benchlib import execute, log, scalar  # noqa: E402

OUT = os.path.join(benchlib.RESULTS, "producer-cost.csv")
CLIENTS = int(os.environ.get("PRODUCER_COST_CLIENTS", "16"))
ROUNDS = int(os.environ.get("PRODUCER_COST_ROUNDS", "3"))
SECONDS = int(os.environ.get("PRODUCER_COST_SECONDS", "8"))
ALL_CASES = ("plain", "outbox", "topic_idx", "no_notify", "no_txid_idx")
TOPIC_IDX = ("CREATE INDEX messages_pending_topic_idx ON outbox.messages (topic, id)"
             " WHERE sent_at IS NULL AND failed_at IS NULL")
CASES = tuple(os.environ.get("PRODUCER_COST_CASES", ",".join(ALL_CASES)).split(","))
SYNC = tuple(os.environ.get("PRODUCER_COST_SYNC", "on,off").split(","))
if "plain" not in CASES or not set(CASES) <= set(ALL_CASES):
    sys.exit(f"PRODUCER_COST_CASES: plain and any of {', '.join(ALL_CASES[1:])}")


def index_def(conn, name):
    return scalar(conn, "SELECT (SELECT indexdef FROM pg_indexes WHERE schemaname = 'outbox'"
                        " AND indexname = %s)", (name,))


def main():
    rows = []
    with benchlib.servers() as (pg, rd, conn, rc):
        execute(conn, B.PLAIN_TABLE)
        txid_idx = index_def(conn, "messages_txid_idx")
        trigger = dict(B.wake_triggers(conn))["messages_notify"]
        if not (txid_idx and trigger) or index_def(conn, "messages_pending_topic_idx"):
            raise RuntimeError("the outbox is not as schema 22 leaves it")
        tmp = tempfile.mkdtemp(prefix="outbox-producer-cost-")
        payload = bytes((i * 37 + 11) & 0xFF for i in range(benchlib.PAYLOAD)).hex()
        scripts = {}
        for table in ("outbox.messages", "bench_plain.messages"):
            scripts[table] = os.path.join(tmp, f"insert-{table}.sql")
            with open(scripts[table], "w") as f:
                f.write(f"INSERT INTO {table} (topic, payload) VALUES ('bench',"
                        f" '\\x{payload}');\n")
        undo = {"topic_idx": [TOPIC_IDX],
                "no_notify": ["DROP TRIGGER messages_notify ON outbox.messages"],
                "no_txid_idx": ["DROP INDEX outbox.messages_txid_idx"]}
        redo = {"topic_idx": ["DROP INDEX outbox.messages_pending_topic_idx"],
                "no_notify": [trigger], "no_txid_idx": [txid_idx]}
        busy = pg.connect()
        execute(busy, f"SELECT pg_advisory_lock({B.WAKEUP_LOCK})")
        try:
            for sync in SYNC:
                execute(conn, f"ALTER SYSTEM SET synchronous_commit = {sync}")
                execute(conn, "SELECT pg_reload_conf()")
                time.sleep(0.2)
                for rnd in range(ROUNDS):
                    k = rnd % len(CASES)
                    order = CASES[k:] + CASES[:k]
                    if rnd % 2:
                        order = tuple(reversed(order))
                    for case in order:
                        benchlib.fresh_round(conn, rc, "bench")
                        execute(conn, "TRUNCATE bench_plain.messages")
                        for sql in undo.get(case, ()):
                            execute(conn, sql)
                        execute(conn, "CHECKPOINT")
                        meter = benchlib.CpuMeter(pg, rd)
                        try:
                            res = B.pgbench(pg, scripts["bench_plain.messages" if case == "plain"
                                                        else "outbox.messages"],
                                            CLIENTS, SECONDS)
                        finally:
                            pg_cpu, _ = meter.read()
                            for sql in redo.get(case, ()):
                                execute(conn, sql)
                        per = pg_cpu / max(1, res["transactions"] or 0) * 1e5
                        rows.append((sync, case, rnd + 1, res["tps"], per))
                        log(f"producer cost: synchronous_commit {sync}, round {rnd + 1},"
                            f" {case}: {res['tps']:,.0f} tx/s, PostgreSQL {per:.2f} s per 100k")
        finally:
            busy.close()
            execute(conn, "ALTER SYSTEM RESET synchronous_commit")
            execute(conn, "SELECT pg_reload_conf()")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("synchronous_commit", "case", "round", "tps", "pg_cpu_per_100k_s"))
        w.writerows(rows)
    print("| synchronous_commit | case | tx/s, median | × plain (median of rounds) |"
          " PostgreSQL CPU per 100k, median |")
    print("|---|---|---|---|---|")
    for sync in SYNC:
        plain = {r[2]: r[3] for r in rows if r[0] == sync and r[1] == "plain"}
        for case in CASES:
            mine = [r for r in rows if r[0] == sync and r[1] == case]
            ratios = [r[3] / plain[r[2]] for r in mine if plain.get(r[2])]
            print(f"| {sync} | {case} | {statistics.median(r[3] for r in mine):,.0f} |"
                  f" {statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) |"
                  f" {statistics.median(r[4] for r in mine):.2f} s |")


if __name__ == "__main__":
    main()
