"""The outbox-relay demo: an order service, the relay and a consumer group, live.

Starts a throwaway PostgreSQL and Redis on loopback, applies the migrations,
starts the relay, and then for a few seconds:
  - an order service writes each order and its outbox row in ONE transaction,
    a few hundred per second, from two connections;
  - a consumer group "email" reads the stream "orders" and acknowledges;
and shows live progress. It ends with a summary (orders written, messages
relayed, messages consumed, commit-to-consume latency) and removes everything,
also on Ctrl-C.

Run it with scripts/demo.sh, which installs and builds what it needs.
"""

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "integration"))
import harness  # noqa: E402

ORDERS_SQL = """
CREATE TABLE IF NOT EXISTS orders (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text    NOT NULL,
    total    numeric NOT NULL,
    placed   timestamptz NOT NULL DEFAULT now()
)"""


class OrderService(threading.Thread):
    """Writes orders at a fixed rate; each order and its outbox row commit together."""

    def __init__(self, pg, rate, seconds, commits, lock, number):
        super().__init__(daemon=True)
        self.conn = pg.connect(autocommit=False)
        self.rate, self.seconds = rate, seconds
        self.commits, self.lock = commits, lock
        self.number = number
        self.written = 0
        self.error = None

    def run(self):
        try:
            interval = 1.0 / self.rate
            start = time.monotonic()
            n = 0
            cur = self.conn.cursor()
            while time.monotonic() - start < self.seconds:
                customer = f"customer-{(n * 7 + self.number) % 50}"
                total = 10 + (n % 90)
                cur.execute("INSERT INTO orders (customer, total) VALUES (%s, %s) RETURNING id",
                            (customer, total))
                order_id = cur.fetchone()[0]
                payload = ('{"order": %d, "customer": "%s", "total": %d}'
                           % (order_id, customer, total))
                cur.execute("SELECT outbox.enqueue('orders', %s, %s::jsonb,"
                            " '{\"content-type\": \"application/json\"}')",
                            (str(order_id), payload))
                message_id = cur.fetchone()[0]
                self.conn.commit()
                committed = time.time()
                with self.lock:
                    self.commits[message_id] = committed
                self.written += 1
                n += 1
                # Keep the rate without drifting: sleep until the next slot.
                delay = start + n * interval - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        except Exception as e:  # shown in the summary
            self.error = e
        finally:
            self.conn.close()


class EmailConsumer(threading.Thread):
    """Consumer group "email" on stream "orders": read, handle, acknowledge."""

    def __init__(self, redis, commits, lock):
        super().__init__(daemon=True)
        self.client = redis.client()
        self.commits, self.lock = commits, lock
        self.consumed = 0
        self.latencies = []
        self.stop = threading.Event()
        self.error = None

    def run(self):
        try:
            # From the start of the stream (id 0), creating it if needed, so
            # nothing published before the group existed is missed.
            try:
                self.client.xgroup_create("orders", "email", id="0", mkstream=True)
            except Exception as e:
                if "BUSYGROUP" not in str(e):
                    raise
            while not self.stop.is_set():
                reply = self.client.xreadgroup("email", "demo-1", {"orders": ">"}, count=200,
                                               block=200)
                now = time.time()
                for _, entries in reply or []:
                    ids = []
                    for entry_id, fields in entries:
                        message_id = fields[b"id"].decode()
                        with self.lock:
                            committed = self.commits.get(message_id)
                        if committed is not None:
                            self.latencies.append((now - committed) * 1000.0)
                        ids.append(entry_id)
                    if ids:
                        self.client.xack("orders", "email", *ids)
                        self.consumed += len(ids)
        except Exception as e:
            self.error = e


def percentile(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(p / 100.0 * (len(values) - 1)))))
    return values[k]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="how long orders are written")
    parser.add_argument("--rate", type=int, default=300, help="orders per second in all")
    args = parser.parse_args()

    harness.require_relay()
    live = sys.stdout.isatty()
    print("Starting PostgreSQL and Redis on loopback (temporary directories)...")
    with harness.Postgres() as pg, harness.Redis(appendonly=True, appendfsync="always") as rd:
        with pg.connect() as conn, conn.cursor() as cur:
            cur.execute(ORDERS_SQL)
        print(f"  PostgreSQL: {pg.dsn()}")
        print(f"  Redis:      {rd.url()} (appendonly yes, appendfsync always)")
        with harness.Relay(pg, rd, poll_interval="1s", batch_size=500) as relay:
            harness.wait_until(lambda: "ready" in relay.log() and "claim connection" in relay.log(),
                               timeout=30, message="relay did not connect")
            print(f"Relay running (pid {relay.pid}); writing {args.rate} orders/s for "
                  f"{args.seconds:g} s from 2 connections...\n")
            commits, lock = {}, threading.Lock()
            consumer = EmailConsumer(rd, commits, lock)
            consumer.start()
            services = [OrderService(pg, args.rate / 2.0, args.seconds, commits, lock, i)
                        for i in range(2)]
            for s in services:
                s.start()
            watcher = pg.connect()
            started = time.monotonic()

            def progress():
                with watcher.cursor() as cur:
                    cur.execute("SELECT count(*) FILTER (WHERE sent_at IS NOT NULL),"
                                " count(*) FILTER (WHERE sent_at IS NULL) FROM outbox.messages")
                    relayed, pending = cur.fetchone()
                written = sum(s.written for s in services)
                return (f"  t={time.monotonic() - started:4.1f}s  orders written {written:6d}"
                        f" | relayed {relayed:6d} | consumed {consumer.consumed:6d}"
                        f" | waiting in outbox {pending:4d}"), written, relayed

            while any(s.is_alive() for s in services):
                line, _, _ = progress()
                print(("\r" + line) if live else line, end="" if live else "\n", flush=True)
                time.sleep(0.25 if live else 1.0)
            # Let the last orders through the relay and the consumer.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                line, written, relayed = progress()
                if relayed >= written and consumer.consumed >= written:
                    break
                time.sleep(0.1)
            line, written, relayed = progress()
            print(("\r" + line) if live else line)
            consumer.stop.set()
            consumer.join(timeout=5)
            watcher.close()

            errors = [s.error for s in services if s.error] + (
                [consumer.error] if consumer.error else [])
            lat = consumer.latencies
            print("\nSummary")
            print(f"  orders written       {written}")
            print(f"  messages relayed     {relayed}")
            print(f"  messages consumed    {consumer.consumed}")
            print(f"  commit-to-consume    p50 {percentile(lat, 50):.1f} ms, "
                  f"p99 {percentile(lat, 99):.1f} ms, max {max(lat) if lat else float('nan'):.1f} ms"
                  f" ({len(lat)} samples)")
            for e in errors:
                print(f"  error: {e}")
    print("\nStopped the relay, PostgreSQL and Redis and removed their directories.")
    ok = not errors and written > 0 and relayed == written and consumer.consumed == written
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
