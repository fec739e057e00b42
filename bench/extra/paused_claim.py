#!/usr/bin/python3
"""What a paused topic's backlog costs the claim.

An experiment behind docs/PERFORMANCE.md ("The claim while a topic is paused"), not part
of the run: a fresh PostgreSQL (the benchmark's settings), ROWS pending rows of the topic
"orders" (the relay pauses it: a consumer group lags), then 2,000 rows of two healthy
topics, "invoices" and "mail", each followed by one more "orders" row; VACUUM ANALYZE and
CHECKPOINT, as a backlog that built up over time. Then, for each bench-naive given, the
claim the relay runs with "orders" paused ($2 = '{orders}') and the one it runs with
nothing paused ($2 = '{}'), BATCH rows, each ROUNDS times inside BEGIN ... ROLLBACK:
  - EXPLAIN (ANALYZE, BUFFERS, TIMING OFF): median execution time, shared buffers touched,
    rows the scans returned or filtered out;
  - the prepared statement through psycopg2: median time of EXECUTE with its rows fetched.
A bench-naive that knows --paused prints the statement the relay prepares for paused
topics; an older one prints its single claim, which served both cases.

    PYTHONPATH=. /usr/bin/python3 bench/extra/paused_claim.py [LABEL=path/to/bench-naive ...]

Without arguments it measures build-bench/bench-naive (run bench/run.sh once first).
BENCH_PAUSED_ROWS sets ROWS (default 1,000,000).
"""
import json
import os
import statistics
import subprocess
import sys
import time

from bench import benchlib

ROWS = int(os.environ.get("BENCH_PAUSED_ROWS") or 1_000_000)
HEALTHY_ROWS = 1000
BATCH, ROUNDS = 500, 15


def other_params(sql):
    """The claim's parameters after $2: no partition owned ($3-$5) and the walk of the
    whole index ($6), as a relay's first claim; a bench-naive older than them has none."""
    return ", '{}', '{}', 0, 0" if "$6" in sql else ", '{}', '{}', 0" if "$5" in sql else ""


def claim_sql(naive, paused):
    """The claim statement of this bench-naive, for paused topics or for none."""
    if paused:
        done = subprocess.run([naive, "--print-claim-sql", "--paused", "{orders}"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if done.returncode == 0:
            return done.stdout.strip()
    return subprocess.run([naive, "--print-claim-sql"], stdout=subprocess.PIPE, text=True,
                          check=True).stdout.strip()


def walk(plan):
    yield plan
    for child in plan.get("Plans", []):
        yield from walk(child)


def measure(conn, sql, paused):
    """Medians over ROUNDS of (execution ms, buffers, rows read, client ms, rows returned)."""
    cur = conn.cursor()
    cur.execute("DEALLOCATE ALL")
    rest = other_params(sql)
    cur.execute(f"PREPARE claim(int, text[]) AS {sql}")
    conn.commit()
    param = "{orders}" if paused else "{}"
    explained, client = [], []
    for _ in range(ROUNDS):
        cur.execute("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) EXECUTE claim(%s, %s"
                    + rest + ")",
                    (BATCH, param))
        doc = cur.fetchone()[0][0]
        conn.rollback()
        plan = doc["Plan"]
        read = sum((n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0))
                   * n.get("Actual Loops", 1) for n in walk(plan) if "Relation Name" in n)
        explained.append((doc["Execution Time"],
                          plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0),
                          int(read), plan.get("Actual Rows", 0)))
        t0 = time.perf_counter()
        cur.execute("EXECUTE claim(%s, %s" + rest + ")", (BATCH, param))
        got = len(cur.fetchall())
        client.append(time.perf_counter() - t0)
        conn.rollback()
    return dict(exec_ms=statistics.median(e[0] for e in explained),
                buffers=statistics.median(e[1] for e in explained),
                rows_read=statistics.median(e[2] for e in explained),
                rows=got, client_ms=statistics.median(client) * 1e3)


def main():
    naives = [a.split("=", 1) for a in sys.argv[1:]] or [("this build", benchlib.NAIVE_BIN)]
    with benchlib.BenchPostgres() as pg:
        conn = pg.connect()
        started = time.monotonic()
        benchlib.execute(conn, "INSERT INTO outbox.messages (topic, payload)"
                               " SELECT 'orders', convert_to(rpad(g::text, 200, 'x'), 'UTF8')"
                               " FROM generate_series(1, %s) AS g", (ROWS,))
        benchlib.execute(conn, "INSERT INTO outbox.messages (topic, payload)"
                               " SELECT CASE WHEN g %% 2 = 1 THEN 'orders'"
                               "  ELSE (ARRAY['invoices', 'mail'])[1 + g / 2 %% 2] END,"
                               "  convert_to(rpad(g::text, 200, 'y'), 'UTF8')"
                               " FROM generate_series(0, %s) AS g", (2 * HEALTHY_ROWS - 1,))
        benchlib.execute(conn, "VACUUM ANALYZE outbox.messages")
        benchlib.execute(conn, "CHECKPOINT")
        print(f"{ROWS} rows of the paused topic in front of {HEALTHY_ROWS} healthy rows"
              f" (interleaved with {HEALTHY_ROWS} more paused ones), filled in"
              f" {time.monotonic() - started:.0f}s; batch {BATCH}, medians of {ROUNDS}",
              flush=True)
        conn.autocommit = False
        for label, naive in naives:
            for paused in (True, False):
                m = measure(conn, claim_sql(naive, paused), paused)
                what = "orders paused" if paused else "nothing paused"
                print(f"{label:12} {what:15} exec {m['exec_ms']:8.2f} ms  client"
                      f" {m['client_ms']:8.2f} ms  buffers {m['buffers']:7.0f}"
                      f"  rows read {m['rows_read']:8.0f}  rows {m['rows']}", flush=True)
                print(json.dumps(dict(label=label, paused=paused, rows_paused=ROWS, **m)),
                      file=sys.stderr, flush=True)
        conn.close()


if __name__ == "__main__":
    main()
