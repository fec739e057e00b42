#!/usr/bin/python3
"""What marking a claimed batch costs PostgreSQL: the relay's UPDATE against a DELETE.

An experiment behind docs/PERFORMANCE.md ("Where the time goes"), not part of the run:
a fresh PostgreSQL (the benchmark's settings, fsync on), 200,000 pending rows, then
rounds of 40 batches: claim 500 rows with the relay's own claim statement, then either
UPDATE ... SET sent_at (as the relay marks them) or DELETE them, then COMMIT. Prints the
median time of the mark statement and of the commit per round. Needs build-bench (run
bench/run.sh once first).

    PYTHONPATH=. /usr/bin/python3 bench/extra/mark_cost.py
"""
import statistics
import time

from bench import benchlib

BATCH, ROUNDS, BATCHES = 500, 3, 40


def main():
    sql = benchlib.claim_sql_filled(BATCH)
    with benchlib.BenchPostgres() as pg:
        conn = pg.connect()
        benchlib.insert_backlog(conn, 200000)
        conn.autocommit = False
        cur = conn.cursor()
        for rnd in range(1, ROUNDS + 1):
            for mode in ("update", "delete"):
                marks, commits = [], []
                for _ in range(BATCHES):
                    cur.execute(sql)
                    ids = [r[0] for r in cur.fetchall()]
                    t0 = time.perf_counter()
                    if mode == "update":
                        cur.execute("UPDATE outbox.messages SET sent_at = statement_timestamp()"
                                    " WHERE id = ANY(%s)", (ids,))
                    else:
                        cur.execute("DELETE FROM outbox.messages WHERE id = ANY(%s)", (ids,))
                    t1 = time.perf_counter()
                    conn.commit()
                    t2 = time.perf_counter()
                    marks.append(t1 - t0)
                    commits.append(t2 - t1)
                print(f"round {rnd}: {mode:6} {BATCH} rows: mark {statistics.median(marks) * 1e3:6.2f} ms,"
                      f" commit {statistics.median(commits) * 1e3:5.2f} ms (medians of {BATCHES})",
                      flush=True)
        conn.close()


if __name__ == "__main__":
    main()
