"""The outbox-relay demo: orders, the relay and an e-mail consumer group, live.

The story of the messaging lesson, on throwaway servers (PostgreSQL and Redis on
loopback, in temporary directories, removed at the end, also on Ctrl-C):
  - an order service writes each order and its outbox row in ONE transaction,
    a few hundred per second, from two connections; exactly one order is
    malformed (its payload is not JSON);
  - the relay publishes the outbox to the Redis stream "orders";
  - the consumer group "email" is two outbox-email-consumer processes: each
    "sends an e-mail" by inserting into emails in the same transaction as its
    outbox_consumer.processed row, so a redelivery does nothing. A flaky mail
    provider fails 10% of first deliveries (--fail-rate 0.1): those are retried
    after a backoff of 1 s, 2 s, 4 s. The malformed order fails for good and
    lands in the dead-letter stream {orders}.email.dlq.
  - each order also writes an invoice to the topic "invoices", in the same
    transaction: 4 partitions by customer, with the customer's own running
    number. The consumer group "ledger" is two `outbox-email-consumer --ordered
    4` processes: they divide the 4 partition streams through leases in Redis
    and book each customer's invoices in order, retries included. Half-way one
    of them is killed (SIGKILL); the other takes its partitions over when
    their leases (3 s) run out.
The live view shows orders written, messages relayed, e-mails sent, retries and
dead letters; the summary shows that every order got exactly one e-mail, the
commit-to-e-mail latency, the dead-letter stream as
`outbox-relay dlq list orders email` prints it, and that every customer's
invoices were booked once each, in order, across the takeover.

Run it with scripts/demo.sh, which installs and builds what it needs.
"""

import argparse
import re
import signal
import sys
import threading
import time

from testkit import consumers, harness

ORDERS_SQL = """
CREATE TABLE IF NOT EXISTS orders (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text    NOT NULL,
    total    numeric NOT NULL,
    placed   timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS invoice_numbers (
    customer text   PRIMARY KEY,
    last     bigint NOT NULL
)"""
INVOICE_PARTITIONS = 4

MALFORMED_AT = 150  # the first service's 150th order is the malformed one
RETRY_LINE = re.compile(r"\(message ([0-9a-f-]{36})\) will be retried in")


class OrderService(threading.Thread):
    """Writes orders at a fixed rate; each order and its outbox row commit together."""

    def __init__(self, pg, rate, seconds, commits, lock, number):
        super().__init__(daemon=True)
        self.conn = pg.connect(autocommit=False)
        self.rate, self.seconds = rate, seconds
        self.commits, self.lock = commits, lock
        self.number = number
        self.written = 0
        self.malformed = None  # message id of the malformed order
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
                if self.number == 0 and n == MALFORMED_AT:
                    # A bug in the order service: this payload is not JSON.
                    cur.execute("SELECT outbox.enqueue('orders', %s, %s::text,"
                                " '{\"content-type\": \"application/json\"}')",
                                (str(order_id), f"order {order_id} for {customer}: oops"))
                else:
                    payload = ('{"order": %d, "customer": "%s", "total": %d}'
                               % (order_id, customer, total))
                    cur.execute("SELECT outbox.enqueue('orders', %s, %s::jsonb,"
                                " '{\"content-type\": \"application/json\"}')",
                                (str(order_id), payload))
                message_id = str(cur.fetchone()[0])
                # The customer's next invoice number: the row lock orders the
                # customer's transactions, so their invoices commit in order.
                cur.execute("INSERT INTO invoice_numbers VALUES (%s, 1) ON CONFLICT (customer)"
                            " DO UPDATE SET last = invoice_numbers.last + 1 RETURNING last",
                            (customer,))
                number = cur.fetchone()[0]
                cur.execute("SELECT outbox.enqueue('invoices', %s, %s::jsonb)",
                            (customer, '{"order": %d, "customer": "%s"}' % (number, customer)))
                self.conn.commit()
                committed = time.time()
                if self.number == 0 and n == MALFORMED_AT:
                    self.malformed = message_id
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


def percentile(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(p / 100.0 * (len(values) - 1)))))
    return values[k]


def retried_ids(group):
    ids = set()
    for c in group:
        ids.update(RETRY_LINE.findall(c.log()))
    return ids


def ledger_booked(pg):
    with pg.connect() as conn, conn.cursor() as cur:
        cur.execute("SELECT count(DISTINCT message_id) FROM emails WHERE consumer = 'ledger'")
        return cur.fetchone()[0]


def ledger_in_order(pg):
    """Whether each customer's invoices were booked once each, 1..n in order."""
    with pg.connect() as conn, conn.cursor() as cur:
        cur.execute("SELECT customer, order_id FROM emails WHERE consumer = 'ledger' ORDER BY id")
        rows = cur.fetchall()
    per = {}
    for customer, number in rows:
        per.setdefault(customer, []).append(number)
    in_order = all(got == list(range(1, len(got) + 1)) for got in per.values())
    return dict(messages=len(rows), customers=len(per), in_order=in_order)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long orders are written")
    parser.add_argument("--rate", type=int, default=300, help="orders per second in all")
    parser.add_argument("--fail-rate", type=float, default=0.1,
                        help="share of first deliveries the mail provider fails")
    args = parser.parse_args()

    harness.require_relay()
    consumers.require_consumer()
    live = sys.stdout.isatty()
    errors = []
    ok = False
    print("Starting PostgreSQL and Redis on loopback (temporary directories)...")
    try:
        with harness.Postgres() as pg, \
                harness.Redis(appendonly=True, appendfsync="always") as rd:
            with pg.connect() as conn, conn.cursor() as cur:
                cur.execute(ORDERS_SQL)
                cur.execute("SELECT outbox.set_partitions('invoices', %s)",
                            (INVOICE_PARTITIONS,))
            consumers.apply_consumer_schema(pg)
            print(f"  PostgreSQL: {pg.dsn()} (orders, outbox, outbox_consumer, emails)")
            print(f"  Redis:      {rd.url()} (appendonly yes, appendfsync always)")
            with harness.Relay(pg, rd, poll_interval="1s", batch_size=500) as relay:
                harness.wait_until(lambda: "ready" in relay.log()
                                   and "claim connection" in relay.log(),
                                   timeout=30, message="relay did not connect", relay=relay)
                flags = dict(backoff="1s,2s,4s", fail_rate=args.fail_rate, block="250ms")
                ordered = dict(flags, group="ledger", stream="invoices",
                               args=["--ordered", str(INVOICE_PARTITIONS), "--lease", "3s"])
                with consumers.Consumer(pg, rd, consumer="email-1", **flags) as c1, \
                        consumers.Consumer(pg, rd, consumer="email-2", **flags) as c2, \
                        consumers.Consumer(pg, rd, consumer="ledger-1", **ordered) as l1, \
                        consumers.Consumer(pg, rd, consumer="ledger-2", **ordered) as l2:
                    group = [c1, c2]
                    for c in group:
                        c.wait_for_log(r"reading orders", timeout=20)
                    for c in (l1, l2):
                        c.wait_for_log(r"took invoices:", timeout=20)
                    print(f"Relay running (pid {relay.pid}); consumer group \"email\": "
                          f"outbox-email-consumer pids {c1.pid} and {c2.pid}\n"
                          f"  (--fail-rate {args.fail_rate:g}: a flaky mail provider;"
                          f" --backoff 1s,2s,4s; dead letters to {{orders}}.email.dlq)\n"
                          f"Consumer group \"ledger\" on invoices ({INVOICE_PARTITIONS}"
                          f" partitions by customer): outbox-email-consumer --ordered pids"
                          f" {l1.pid} and {l2.pid} (leases of 3 s)")
                    print(f"Writing {args.rate} orders/s for {args.seconds:g} s from 2"
                          " connections; one order is malformed...\n")
                    ok = run(pg, rd, group, args, errors, live, (l1, l2))
    finally:
        print("\nStopped the consumers, the relay, PostgreSQL and Redis and removed their"
              " directories.")
    return 0 if ok else 1


def run(pg, rd, group, args, errors, live, ledger):
    commits, lock = {}, threading.Lock()
    services = [OrderService(pg, args.rate / 2.0, args.seconds, commits, lock, i)
                for i in range(2)]
    for s in services:
        s.start()
    watcher = pg.connect()
    r = rd.client()
    started = time.monotonic()

    def progress():
        # Relayed: in its stream, past the position the relay recorded
        # (rows are not marked one by one).
        relayed = harness.count_sent(watcher)
        with watcher.cursor() as cur:
            cur.execute("SELECT count(*), count(DISTINCT message_id) FROM emails"
                        " WHERE consumer = 'email'")
            emails, distinct = cur.fetchone()
            cur.execute("SELECT count(*) FROM emails WHERE consumer = 'ledger'")
            booked = cur.fetchone()[0]
        written = sum(s.written for s in services)
        retries = sum(len(RETRY_LINE.findall(c.log())) for c in group)
        dead = r.xlen("{orders}.email.dlq")
        line = (f"  t={time.monotonic() - started:4.1f}s  written {written:5d} | relayed"
                f" {relayed:5d} | emails sent {emails:5d} | retries {retries:3d}"
                f" | dead letters {dead} | invoices booked {booked:5d}")
        return line, dict(written=written, relayed=relayed, emails=emails, distinct=distinct,
                          retries=retries, dead=dead)

    killed = None
    while any(s.is_alive() for s in services):
        if killed is None and time.monotonic() - started >= args.seconds / 2:
            ledger[1].kill(signal.SIGKILL)
            killed = time.time()
            print(("\n" if live else "") + f"  killed ledger-2 (pid {ledger[1].pid}) with"
                  " SIGKILL: ledger-1 takes its partitions when their leases run out",
                  flush=True)
        line, _ = progress()
        print(("\r" + line) if live else line, end="" if live else "\n", flush=True)
        time.sleep(0.25 if live else 1.0)
    # Let the last orders through the relay, the consumers and their retries.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line, f = progress()
        print(("\r" + line) if live else line, end="" if live else "\n", flush=True)
        if (f["relayed"] >= 2 * f["written"] and f["distinct"] >= f["written"] - 1
                and f["dead"] >= 1 and consumers.pending_count(r) == 0
                and ledger_booked(pg) >= f["written"]):
            break
        time.sleep(0.25 if live else 1.0)
    line, f = progress()
    print(("\r" + line) if live else line)

    errors += [s.error for s in services if s.error]
    booked = ledger_in_order(pg)
    takeovers = [t for t, m in consumers.log_events(ledger[0].log(), r": took (invoices:\d+)")
                 if killed is not None and t > killed]
    malformed = next((s.malformed for s in services if s.malformed), None)
    with watcher.cursor() as cur:
        cur.execute("SELECT e.message_id::text, extract(epoch FROM e.sent_at)"
                    " FROM emails e WHERE e.consumer = 'email'")
        sent = cur.fetchall()
    watcher.close()
    retried = retried_ids(group)
    lat_all, lat_first = [], []
    for message_id, sent_at in sent:
        committed = commits.get(message_id)
        if committed is None:
            continue
        ms = (float(sent_at) - committed) * 1000.0
        lat_all.append(ms)
        if message_id not in retried:
            lat_first.append(ms)
    pending = consumers.pending_count(r)
    dlq = consumers.relay_tool(["dlq", "list", "orders", "email"], redis=rd)
    dead = consumers.dlq_entries(r)
    r.close()

    duplicates = f["emails"] - f["distinct"]
    print("\nSummary")
    print(f"  orders written       {f['written']} (1 malformed: its payload is not JSON)")
    print(f"  messages relayed     {f['relayed']} (an order and its invoice each)")
    print(f"  emails sent          {f['emails']} rows for {f['distinct']} distinct orders"
          f" (duplicates: {duplicates}); every good order once:"
          f" {'yes' if f['distinct'] == f['written'] - 1 and duplicates == 0 else 'NO'}")
    print(f"  retries              {f['retries']} transient failures, each retried after its"
          f" backoff ({len(retried)} orders)")
    print(f"  commit-to-email      p50 {percentile(lat_all, 50):.1f} ms, p99"
          f" {percentile(lat_all, 99):.1f} ms, max"
          f" {max(lat_all) if lat_all else float('nan'):.1f} ms ({len(lat_all)} emails);"
          f" first-try only: p50 {percentile(lat_first, 50):.1f} ms, p99"
          f" {percentile(lat_first, 99):.1f} ms")
    print(f"  still pending        {pending}")
    print(f"  ledger (ordered)     {booked['messages']} invoices of {booked['customers']}"
          f" customers booked, each customer's in sequence, once each:"
          f" {'yes' if booked['in_order'] else 'NO'}; ledger-2 killed half-way,"
          + (f" its {len(takeovers)} partitions taken over by ledger-1"
             f" {max(takeovers) - killed:.1f} s later" if takeovers else " nothing taken over"))
    print("  dead-letter stream   $ outbox-relay dlq list orders email")
    for text in (dlq.stdout + dlq.stderr).rstrip().splitlines():
        print(f"    {text}")
    for e in errors:
        print(f"  error: {e}")
    dead_ok = (len(dead) == 1 and dead[0][1].get(b"id", b"").decode() == malformed
               and dead[0][1].get(b"dlq.reason") == b"permanent")
    if not dead_ok:
        print("  error: the dead-letter stream should hold exactly the malformed order"
              f" {malformed}, reason permanent")
    return (not errors and f["written"] > 0 and f["relayed"] == 2 * f["written"]
            and booked["in_order"] and booked["messages"] == f["written"]
            and f["distinct"] == f["written"] - 1 and duplicates == 0 and pending == 0
            and dead_ok and dlq.returncode == 0)


if __name__ == "__main__":
    sys.exit(main())
