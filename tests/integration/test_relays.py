"""Several relays share a partitioned topic (docs/DESIGN.md, "Several relays").

Promises tested, with three relays against one database and one Redis, a
topic of 8 partitions, 1,000 keys and 8 producers that write each key's
sequence numbers in transactions serialised per key (the aggregate's row is
locked, then the outbox row inserted):
- the relays divide the 8 partitions among themselves (3, 3 and 2);
- a relay SIGKILLed has its partitions taken over by the others within 5 s,
  measured from the kill to the last "took" line, and gets its share back
  when it is restarted;
- a relay frozen with SIGSTOP for longer than its publish deadline loses its
  partitions to the others within 10 s and, resumed, publishes nothing late;
- a relay cut off from PostgreSQL by a proxy has its partitions taken over
  within 5 s of the cut; behind a half-open connection (the proxy forwards
  nothing and closes nothing), within 10 s: the server ends its silent owner
  session after 3 s and a claim transaction it left open after two publish
  deadlines and 2 s;
- a row too large to publish, in the middle of one key, holds back that key
  only, through all of the above; fixed and retried with "failed retry", it
  and the rows behind it are published in order;
- at the end every key's entries are in the stream of its partition alone,
  their sequence numbers 1..n in order, none missing, none doubled;
- a relay publishes a partition only from a batch it began while owning it:
  from the relays' logs, every batch a relay published to a partition comes
  after it took the partition. (A batch begun before a release may still
  publish after the next owner took over: the spans where two relays
  publish one partition are counted and printed, and what keeps them safe is
  the entry id, which the checks of order and duplicates above prove.)

And the unpartitioned topics: two relays publish 8 of them, each topic by
one relay only (the one its name's hash gives among the members), and when
one relay stops the other publishes its topics from where they stand.

And the fence, step by step: the entry id (docs/DESIGN.md, "Batches from
snapshots"). Relay A reads a key's rows and sends their publish into a
blackholed Redis connection; A is frozen and its PostgreSQL sessions end;
relay B takes the partition and publishes the rows and later ones; then A's
publish reaches Redis, long after, and A is resumed. Redis refuses all of
A's appends (their ids are at or below the stream's last): the key's entries
are 1..n once each. The same holds when A reads the batch's tick late, after
B published it, and when A's publish is held while its PostgreSQL sessions
are cut.
"""

import collections
import contextlib
import json
import random
import re
import signal
import statistics
import sys
import threading
import time
import unittest

from testkit import harness
from testkit.faults import TcpProxy
from testkit.harness import scalar, wait_until

harness.require_relay()
harness.set_deadline(420)

PARTITIONS = 8
KEYS = [f"k{i:04d}" for i in range(1000)]
POISON_KEY = "k0042"

LINE = re.compile(r"^(\S+) (\w+) (\w+): (.*)$")
TOOK = re.compile(r"^took (\S+)/(\d+): ")
RELEASED = re.compile(r"^released (\S+)/(\d+) ")
GAVE_UP = re.compile(r"^gave up \d+ partitions")
PUBLISHED = re.compile(r"^published a batch of \d+ rows to partitions (.*)$")


def fnv1a32(data):
    h = 0x811c9dc5
    for b in data:
        h = ((h ^ b) * 16777619) & 0xffffffff
    return h


def log_time(stamp):
    when, _ = harness.parse_rfc3339_utc(stamp)
    return when.timestamp()


def events(log):
    """[(time, kind, unit)] of one relay's log: took, released, gave_up, published."""
    out = []
    for line in log.splitlines():
        m = LINE.match(line)
        if not m or not m.group(1).endswith("Z"):
            continue
        t, comp, text = log_time(m.group(1)), m.group(3), m.group(4)
        if comp == "owner":
            if TOOK.match(text):
                g = TOOK.match(text)
                out.append((t, "took", f"{g.group(1)}/{g.group(2)}"))
            elif RELEASED.match(text):
                g = RELEASED.match(text)
                out.append((t, "released", f"{g.group(1)}/{g.group(2)}"))
            elif GAVE_UP.match(text):
                out.append((t, "gave_up", None))
        elif comp in ("relay", "batch") and PUBLISHED.match(text):
            for unit in PUBLISHED.match(text).group(1).split():
                out.append((t, "published", unit))
    return out


def owned_at_end(evs):
    owned = set()
    for _, kind, unit in evs:
        if kind == "took":
            owned.add(unit)
        elif kind == "released":
            owned.discard(unit)
        elif kind == "gave_up":
            owned.clear()
    return owned


def spans(evs, deaths):
    """{unit: [(start, end of its last publish)]} of one relay, and the publishes
    that fell outside any ownership. deaths: times the process was killed.

    A span starts when the relay took the partition. A batch claimed before it
    released the partition (or lost its owner connection) may still publish
    after that, until its transaction ends; the next owner's fence waits for
    it. So a span ends at its last publish before the relay takes the
    partition again or dies; that end must come before another relay's span
    begins."""
    stream = sorted(evs + [(t, "dead", None) for t in deaths], key=lambda e: e[0])
    open_ = {}      # unit -> [took time, last publish or None]
    out = collections.defaultdict(list)
    stray = []

    def close(unit):
        start, last = open_.pop(unit)
        if last is not None:
            out[unit].append((start, last))

    for t, kind, unit in stream:
        if kind == "took":
            if unit in open_:
                close(unit)
            open_[unit] = [t, None]
        elif kind == "dead":
            for u in list(open_):
                close(u)
        elif kind == "published":
            if unit in open_:
                open_[unit][1] = t
            else:
                stray.append((t, unit))
    for u in list(open_):
        close(u)
    return out, stray


class SeveralRelaysTest(unittest.TestCase):

    def test_three_relays_share_partitions_through_faults(self):
        with harness.Postgres() as pg, harness.Redis() as redis, \
                TcpProxy(pg.port, name="pg proxy") as proxy:
            db = pg.connect()
            r = redis.client()
            with db.cursor() as cur:
                cur.execute("SELECT outbox.set_partitions('orders', %s)", (PARTITIONS,))
                cur.execute("CREATE TABLE test_keys (key text PRIMARY KEY, seq int NOT NULL)")
                cur.execute("INSERT INTO test_keys SELECT k, 0 FROM unnest(%s::text[]) AS k",
                            (KEYS,))
            flags = dict(poll_interval="100ms", batch_size="100", publish_timeout="2s",
                         max_payload_bytes="1000", log_level="debug")
            proxied = pg.dsn().replace(f"port={pg.port}", f"port={proxy.port}")
            relays = [harness.Relay(pg, redis, **flags), harness.Relay(pg, redis, **flags),
                      harness.Relay(pg, redis, env={"OUTBOX_RELAY_POSTGRES": proxied}, **flags)]
            deaths = {i: [] for i in range(3)}
            for relay in relays:
                harness.register(relay)
                relay.start()
            self.redis = redis
            try:
                self.run_faults(pg, db, r, relays, proxy, deaths)
            except BaseException:
                for relay in relays:
                    print(relay.log_tail(60), file=sys.stderr)
                raise
            finally:
                for relay in relays:
                    relay.stop()
                    report = harness.sanitizer_report(relay.log())
                    relay_logs = relay.log()
                    relay.close()
                    self.assertIsNone(report, report)
                    self.logs = getattr(self, "logs", []) + [relay_logs]

    def share(self, relay, since=0):
        return relay.wait_for_log(r"owner: relay \d of 3 \(member slot \d+\): its share is"
                                  r" (\d) of 8", timeout=20, since=since)

    def took_after(self, relays, skip, units, t0):
        """The latest first "took" time after t0, over units, in the other relays; None
        while one is missing."""
        first = {}
        for i, relay in enumerate(relays):
            if i == skip:
                continue
            for t, kind, unit in events(relay.log()):
                if kind == "took" and unit in units and t >= t0:
                    first[unit] = min(first.get(unit, t), t)
        return max(first.values()) if len(first) == len(units) else None

    def run_faults(self, pg, db, r, relays, proxy, deaths):
        for relay in relays:
            self.share(relay)
        # The first relay held all 8 until the others joined: its share is
        # logged before it gives the rest up, so wait for the division.
        def shares():
            return sorted(len(owned_at_end(events(x.log()))) for x in relays)
        wait_until(lambda: shares() == [2, 3, 3], timeout=20,
                   message="the 8 partitions divided 3, 3 and 2")
        self.assertEqual(shares(), [2, 3, 3])

        # Seen from outside: each relay's metrics, and status.
        def figures(relay):
            text = harness.metrics_text(relay)
            return tuple(int(float(harness.metric(text, name) or -1)) for name in
                         ("outbox_relay_relays", "outbox_relay_partitions",
                          "outbox_relay_partitions_owned"))
        wait_until(lambda: sorted(figures(x) for x in relays) ==
                   [(3, 8, 2), (3, 8, 3), (3, 8, 3)], timeout=15,
                   message="each relay's metrics to show 3 relays and its share of 8")
        status = harness.run_relay(["status", "--json"], env=harness.relay_env(pg, self.redis))
        self.assertEqual(json.loads(status.stdout)["relays"],
                         {"running": 3, "partitions": 8, "partitions_owned": 8}, status.output)
        text = harness.run_relay(["status"], env=harness.relay_env(pg, self.redis))
        self.assertIn("Relays      3 running; 8 of 8 partitions owned", text.stdout)

        stop = threading.Event()
        errors = []
        written = collections.Counter()

        def produce(index):
            rng = random.Random(index)
            conn = pg.connect(autocommit=False)
            try:
                while not stop.is_set():
                    key = rng.choice(KEYS)
                    with conn.cursor() as cur:
                        cur.execute("UPDATE test_keys SET seq = seq + 1 WHERE key = %s"
                                    " RETURNING seq", (key,))
                        seq = cur.fetchone()[0]
                        payload = str(seq).encode()
                        if key == POISON_KEY and seq == 3:
                            payload += b" " * 2000  # over max_payload_bytes
                        cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload)"
                                    " VALUES ('orders', %s, %s)", (key, payload))
                    conn.commit()
                    written[index] += 1
                    time.sleep(0.003)
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(repr(e))
            finally:
                conn.close()

        producers = [threading.Thread(target=produce, args=(i,), daemon=True) for i in range(8)]
        for t in producers:
            t.start()
        takeovers = []
        try:
            wait_until(lambda: scalar(db, "SELECT count(*) FROM outbox.quarantine"
                                          " WHERE error NOT LIKE 'held behind%%'") == 1,
                       timeout=60, message="the poison row to be quarantined")

            def fault(index, kind, begin, end, hold):
                """begin() a fault of relay index, time the takeover of its partitions
                by the others, keep the fault hold seconds in all, end() it, and wait
                until the relay has its share again."""
                owned = owned_at_end(events(relays[index].log()))
                self.assertTrue(owned, f"relay {index} owns nothing before the {kind}")
                t0 = time.time()
                begin()
                took = wait_until(lambda: self.took_after(relays, index, owned, t0),
                                  timeout=20, message=f"the partitions {sorted(owned)} of"
                                  f" relay {index} to be taken over after the {kind}")
                takeovers.append((kind, took - t0))
                time.sleep(max(0.0, t0 + hold - time.time()))
                mark = relays[index].mark()
                end(mark)
                self.share(relays[index], since=mark)
                time.sleep(2.0)

            def kill(index):
                relays[index].kill()
                deaths[index].append(time.time())  # reaped: it logs nothing after this

            # SIGKILL, four times, each relay back at once.
            for round_ in range(4):
                victim = round_ % 2
                fault(victim, "kill", lambda: kill(victim), lambda mark: relays[victim].start(),
                      0)

            # SIGSTOP for three publish deadlines, then SIGCONT.
            def resume(mark):
                relays[1].kill(signal.SIGCONT)
                relays[1].wait_for_log(r"owner: gave up \d+ partitions", timeout=15, since=mark)
            fault(1, "stop", lambda: relays[1].kill(signal.SIGSTOP), resume, 6.0)

            # The third relay cut off from PostgreSQL for 6 s.
            fault(2, "cut", proxy.cut, lambda mark: proxy.restore(), 6.0)

            # The same relay behind a half-open connection: the proxy keeps
            # every connection open and forwards nothing. The server ends the
            # silent owner session after 3 s and an open claim transaction
            # after two publish deadlines and 2 s.
            fault(2, "half-open", proxy.blackhole, lambda mark: proxy.restore(held="drop"), 8.0)
        finally:
            stop.set()
            for t in producers:
                t.join(timeout=30)
        self.assertEqual(errors, [])

        # The poison row, fixed and retried: its key goes on, in order.
        self.assertEqual(scalar(db, "SELECT count(*) FROM outbox.quarantine"
                                    " WHERE error NOT LIKE 'held behind%%'"), 1)
        wait_until(lambda: scalar(db, "SELECT count(*) FROM outbox.unsent"
                                      " WHERE partition_key <> %s", (POISON_KEY,)) == 0,
                   timeout=60, message="every row of the other keys to be sent")
        wait_until(lambda: scalar(db, "SELECT count(*) FROM outbox.unsent") == 0,
                   timeout=60, message="the poison row's key held behind it")
        held = scalar(db, "SELECT count(*) FROM outbox.quarantine WHERE partition_key = %s"
                          " AND error LIKE 'held behind%%'", (POISON_KEY,))
        poison_id = scalar(db, "SELECT id FROM outbox.quarantine"
                               " WHERE error NOT LIKE 'held behind%%'")
        with db.cursor() as cur:
            cur.execute("UPDATE outbox.quarantine SET payload = '3' WHERE id = %s", (poison_id,))
        done = harness.run_relay(["failed", "retry", str(poison_id)],
                                 env=harness.relay_env(pg, self.redis))
        self.assertEqual(done.returncode, 0, done.output)
        harness.wait_all_sent(db, timeout=60)
        self.assertEqual(scalar(db, "SELECT count(*) FROM outbox.unsent")
                         + scalar(db, "SELECT count(*) FROM outbox.quarantine"), 0)

        # Every key: one stream, the right one, 1..n in order.
        with db.cursor() as cur:
            cur.execute("SELECT key, seq FROM test_keys")
            final = dict(cur.fetchall())
        per_key = collections.defaultdict(list)
        streams_of = collections.defaultdict(set)
        for p in range(PARTITIONS):
            for _, f in harness.stream_entries(r, f"orders:{p:03d}"):
                key = f[b"key"].decode()
                per_key[key].append(int(f[b"payload"]))
                streams_of[key].add(p)
        wrong_stream = [k for k in per_key
                        if streams_of[k] != {fnv1a32(k.encode()) % PARTITIONS}]
        missing = doubled = disorder = 0
        for key, n in final.items():
            got = per_key.get(key, [])
            missing += len(set(range(1, n + 1)) - set(got))
            doubled += len(got) - len(set(got))
            disorder += sum(1 for a, b in zip(got, got[1:]) if b <= a)
        entries = sum(len(v) for v in per_key.values())

        # One relay at a time per partition, from the logs.
        by_unit = collections.defaultdict(list)
        strays = []
        for i, relay in enumerate(relays):
            sp, stray = spans(events(relay.log()), deaths[i])
            strays += [(i, s) for s in stray]
            for unit, lst in sp.items():
                by_unit[unit] += [(a, b, i) for a, b in lst]
        overlaps = []
        for unit, lst in by_unit.items():
            lst.sort()
            for j, (a, b, i) in enumerate(lst):
                for a2, b2, i2 in lst[j + 1:]:
                    if i2 != i and a2 < b:
                        overlaps.append((unit, i, (a, b), i2, (a2, b2)))
        times = sorted(t for _, t in takeovers)
        print(f"\nseveral relays: {entries} entries of {len(final)} keys; {len(takeovers)}"
              f" takeovers: min {times[0]:.2f} s, median {statistics.median(times):.2f} s,"
              f" max {times[-1]:.2f} s ({', '.join(f'{k} {t:.2f}' for k, t in takeovers)});"
              f" {held} rows of the poison row's key waited behind it while every other key"
              f" was published; missing {missing}, doubled {doubled}, out of order"
              f" {disorder}, in a wrong stream {len(wrong_stream)}; ownership spans"
              f" {sum(len(v) for v in by_unit.values())}, overlapping {len(overlaps)},"
              f" publishes outside ownership {len(strays)}", file=sys.stderr)
        self.assertEqual((missing, doubled, disorder, wrong_stream), (0, 0, 0, []))
        self.assertGreater(held, 0, "no row of the poison row's key was held behind it")
        self.assertEqual(strays, [])
        for kind, t in takeovers:
            if kind in ("kill", "cut"):
                self.assertLess(t, 5.0, f"takeover after {kind} took {t:.2f} s")
            else:  # the server's idle limits: 3 s, or 2 x 2 s + 2 s with a claim open
                self.assertLess(t, 10.0, f"takeover after {kind} took {t:.2f} s")
        self.assertEqual(len(per_key), len(final))


def claims_ready(relay):
    """Waits until the claiming connection is set up (its batch statement
    prepared): a test that holds the outbox must not catch the PREPARE."""
    wait_until(lambda: re.search(r"pg: claim connection .* ready", relay.log()), timeout=30,
               relay=relay, message="the relay's claim connection")


def wait_batch_read(db, relay, after):
    """Waits until the relay's claiming connection has read a batch since the
    log mark after: its last statement is the batch's, and it is idle (the
    publish goes on in Redis)."""
    def read():
        return scalar(db, "SELECT count(*) FROM pg_stat_activity"
                          " WHERE application_name = 'outbox-relay' AND state = 'idle'"
                          " AND query LIKE 'SELECT id, message_id, topic, %%'") > 0
    wait_until(read, timeout=20, relay=relay, message="relay A to read the batch")


def refused_appends(r):
    """How many XADD calls Redis has refused since it started."""
    stat = r.info("commandstats").get("cmdstat_xadd", {})
    return int(stat.get("failed_calls", 0)) if isinstance(stat, dict) else 0


def key_payloads(r, stream, key):
    return [int(f[b"payload"]) for _, f in harness.stream_entries(r, stream)
            if f[b"key"] == key.encode()]


class FenceTest(unittest.TestCase):

    def test_a_late_publish_never_lands_behind_the_new_owner(self):
        with harness.Postgres() as pg, harness.Redis() as redis, \
                TcpProxy(redis.port, name="redis proxy") as proxy:
            db = pg.connect()
            r = redis.client()
            scalar(db, "SELECT outbox.set_partitions('orders', 2)")
            flags = dict(poll_interval="100ms", publish_timeout="30s", log_level="debug")
            a = harness.Relay(pg, redis, env={"OUTBOX_RELAY_REDIS":
                                              f"redis://127.0.0.1:{proxy.port}/0"}, **flags)
            with a:
                a.wait_for_log(r"owner: took orders/1: ", timeout=20)
                a.wait_for_log(r"owner: took orders/0: ", timeout=20)
                claims_ready(a)
                harness.insert(db, "orders", b"0", key="warm-up")
                wait_until(lambda: r.xlen("orders:%03d" % (fnv1a32(b"warm-up") % 2)) == 1,
                           timeout=20, relay=a, message="the warm-up entry")
                harness.wait_all_sent(db, timeout=20, relay=a)
                proxy.blackhole()
                mark = a.mark()
                harness.insert_many(db, [("orders", str(i).encode(), "k") for i in range(1, 6)])
                # Read by A, whose publish now waits in the proxy.
                wait_batch_read(db, a, mark)
                time.sleep(0.3)
                a.kill(signal.SIGSTOP)
                try:
                    scalar(db, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                               " WHERE application_name LIKE 'outbox-relay%'")
                    with harness.Relay(pg, redis, **flags) as b:
                        harness.wait_all_sent(db, timeout=30, relay=b)
                        stream = "orders:%03d" % (fnv1a32(b"k") % 2)
                        self.assertEqual(key_payloads(r, stream, "k"), [1, 2, 3, 4, 5])
                        # B goes on: rows A never saw land after A's five.
                        harness.insert_many(db, [("orders", str(i).encode(), "k")
                                                 for i in range(6, 9)])
                        harness.wait_all_sent(db, timeout=30, relay=b)
                        refused = refused_appends(r)
                        mark = a.mark()
                        proxy.restore(held="deliver")
                        a.kill(signal.SIGCONT)
                        wait_until(lambda: refused_appends(r) >= refused + 5, timeout=20,
                                   relay=a, message="Redis to refuse A's five late appends")
                        time.sleep(1.0)
                        self.assertEqual(key_payloads(r, stream, "k"), list(range(1, 9)))
                        self.assertEqual(refused_appends(r), refused + 5)
                finally:
                    a.kill(signal.SIGCONT)

    def test_a_tick_answered_late_publishes_nothing_twice(self):
        """Relay A's tick is answered only after B has taken the partition
        and published the batch: A reads it and publishes it late, and Redis
        refuses every row, already there."""
        with harness.Postgres() as pg, harness.Redis() as redis, \
                TcpProxy(pg.port, name="pg proxy") as proxy:
            db = pg.connect()
            r = redis.client()
            scalar(db, "SELECT outbox.set_partitions('orders', 2)")
            flags = dict(poll_interval="100ms", log_level="debug")
            proxied = pg.dsn().replace(f"port={pg.port}", f"port={proxy.port}")
            a = harness.Relay(pg, redis, env={"OUTBOX_RELAY_POSTGRES": proxied}, **flags)
            with a:
                a.wait_for_log(r"owner: took orders/1: ", timeout=20)
                a.wait_for_log(r"owner: took orders/0: ", timeout=20)
                claims_ready(a)
                stream = "orders:%03d" % (fnv1a32(b"k") % 2)
                # The ticks wait for a transaction that holds them: A's next
                # tick waits in the server.
                locker = pg.connect(autocommit=False)
                with locker.cursor() as cur:
                    cur.execute("LOCK TABLE outbox.ticks IN ACCESS EXCLUSIVE MODE")
                harness.insert_many(db, [("orders", str(i).encode(), "k") for i in range(1, 6)])
                wait_until(lambda: scalar(db, "SELECT count(*) FROM pg_stat_activity"
                                              " WHERE wait_event_type = 'Lock' AND query LIKE"
                                              " '%%FROM outbox.tick_bounds(%%'") > 0,
                           timeout=20, relay=a, message="relay A's tick to wait for the lock")
                proxy.blackhole()
                locker.commit()
                locker.close()
                with harness.Relay(pg, redis, **flags) as b:
                    # A's sessions end on the server's idle limit (3 s).
                    harness.wait_all_sent(db, timeout=30, relay=b)
                    self.assertEqual(key_payloads(r, stream, "k"), [1, 2, 3, 4, 5])
                    mark = a.mark()
                    proxy.restore(held="deliver")
                    wait_until(lambda: a.mark() > mark, timeout=20, relay=a,
                               message="relay A to read the late answer")
                    time.sleep(2.0)
                    self.assertEqual(key_payloads(r, stream, "k"), [1, 2, 3, 4, 5],
                                     "A published the batch it read late again")

    def test_a_publish_delayed_past_its_sessions_end_appends_nothing(self):
        """Relay A's PostgreSQL connections are cut while its publish is held
        on the way to Redis: B takes the partition over and publishes the
        rows. A's publish then reaches Redis: every append is refused."""
        with harness.Postgres() as pg, harness.Redis() as redis, \
                TcpProxy(pg.port, name="pg proxy") as pg_proxy, \
                TcpProxy(redis.port, name="redis proxy") as redis_proxy:
            db = pg.connect()
            r = redis.client()
            scalar(db, "SELECT outbox.set_partitions('orders', 2)")
            flags = dict(poll_interval="100ms", publish_timeout="20s", log_level="debug")
            proxied = pg.dsn().replace(f"port={pg.port}", f"port={pg_proxy.port}")
            a = harness.Relay(pg, redis, env={
                "OUTBOX_RELAY_POSTGRES": proxied,
                "OUTBOX_RELAY_REDIS": f"redis://127.0.0.1:{redis_proxy.port}/0"}, **flags)
            with a:
                a.wait_for_log(r"owner: took orders/1: ", timeout=20)
                a.wait_for_log(r"owner: took orders/0: ", timeout=20)
                claims_ready(a)
                stream = "orders:%03d" % (fnv1a32(b"k") % 2)
                redis_proxy.blackhole()
                mark = a.mark()
                harness.insert_many(db, [("orders", str(i).encode(), "k") for i in range(1, 6)])
                wait_batch_read(db, a, mark)
                time.sleep(0.3)
                pg_proxy.cut()
                with harness.Relay(pg, redis, **flags) as b:
                    harness.wait_all_sent(db, timeout=30, relay=b)
                    self.assertEqual(key_payloads(r, stream, "k"), [1, 2, 3, 4, 5])
                    refused = refused_appends(r)
                    redis_proxy.restore(held="deliver")
                    wait_until(lambda: refused_appends(r) >= refused + 5, timeout=20,
                               relay=a, message="Redis to refuse A's five delayed appends")
                    time.sleep(1.0)
                    self.assertEqual(key_payloads(r, stream, "k"), [1, 2, 3, 4, 5],
                                     "A's delayed publish appended the rows again")

@contextlib.contextmanager
def running(relays):
    """Starts the relays for the block; on a failure prints the end of their logs;
    then stops them, and fails on a sanitizer report in any log."""
    for relay in relays:
        harness.register(relay)
        relay.start()
    try:
        yield relays
    except BaseException:
        for relay in relays:
            print(relay.log_tail(40), file=sys.stderr)
        raise
    finally:
        reports = []
        for relay in relays:
            relay.stop()
            reports.append(harness.sanitizer_report(relay.log()))
            relay.close()
        reports = [x for x in reports if x is not None]
        if reports:
            raise AssertionError("\n".join(reports))


def partitions_owned(relays):
    """outbox_relay_partitions_owned of each relay, sorted (-1: not reported)."""
    return sorted(int(harness.metric(harness.metrics_text(x), "outbox_relay_partitions_owned")
                      or -1) for x in relays)


class UnpartitionedTopicsTest(unittest.TestCase):
    """The relays divide the unpartitioned topics too: each is published by one
    relay at a time, the one whose position among the members is the hash of
    the topic's name mod their number; a relay that stops leaves its topics to
    the others."""

    TOPICS = [f"plain{i}" for i in range(8)]

    def test_two_relays_divide_the_unpartitioned_topics(self):
        with harness.Postgres() as pg, harness.Redis() as redis:
            db = pg.connect()
            r = redis.client()
            flags = dict(poll_interval="100ms", batch_size="50")
            relays = [harness.Relay(pg, redis, **flags), harness.Relay(pg, redis, **flags)]
            with running(relays):
                for relay in relays:
                    relay.wait_for_log(r"owner: relay \d of 2 \(member slot", timeout=20)
                harness.insert_many(db, [(t, b"row %d" % i) for i in range(25)
                                         for t in self.TOPICS])
                harness.wait_all_sent(db, timeout=30, relay=relays[0])

                def published(relay):
                    text = harness.metrics_text(relay)
                    return {t: int(harness.metric(text, "outbox_relay_messages_published_total",
                                                  topic=t) or 0) for t in self.TOPICS}
                counts = [published(x) for x in relays]
                owners = {t: [i for i in range(2) if counts[i][t]] for t in self.TOPICS}
                for t in self.TOPICS:
                    self.assertEqual(len(owners[t]), 1, f"relays that published {t}: {counts}")
                    self.assertEqual(sum(c[t] for c in counts), 25, f"{t}: {counts}")
                # The same relay has every topic of one hash class.
                classes = {}
                for t in self.TOPICS:
                    classes.setdefault(fnv1a32(t.encode()) % 2, set()).add(owners[t][0])
                self.assertEqual(sorted(len(v) for v in classes.values()),
                                 [1] * len(classes), f"owners by hash class: {classes}")

                # One relay stops: the other takes its topics from their positions.
                relays[1].stop()
                relays[0].wait_for_log(r"owner: relay 1 of 1 \(member slot", timeout=20)
                harness.insert_many(db, [(t, b"after %d" % i) for i in range(10)
                                         for t in self.TOPICS])
                harness.wait_all_sent(db, timeout=30, relay=relays[0])
                after = published(relays[0])
                for t in self.TOPICS:
                    self.assertEqual(after[t] - counts[0][t], 10, f"{t}: {counts[0]} -> {after}")
                figures = harness.Verifier(db, r).report(" (two relays, 8 unpartitioned topics)")
                figures.assert_exactly_once(self)
                self.assertEqual(figures.committed, 8 * 35, figures.line())


class SteppingBackTest(unittest.TestCase):
    """A relay that cannot publish (its Redis cut off) for 3 s steps back: it gives
    up its member slot and its partitions, the other relay takes every topic and
    partition, and it takes its share again once it can publish."""

    def test_a_relay_cut_off_from_redis_leaves_its_share(self):
        with harness.Postgres() as pg, harness.Redis() as redis, \
                TcpProxy(redis.port, name="redis proxy") as proxy:
            db = pg.connect()
            r = redis.client()
            scalar(db, "SELECT outbox.set_partitions('keyed', 4)")
            flags = dict(poll_interval="100ms", batch_size="50", reconnect_max="500ms")
            url = redis.url().replace(f":{redis.port}/", f":{proxy.port}/")
            relays = [harness.Relay(pg, redis, **flags),
                      harness.Relay(pg, redis, env={"OUTBOX_RELAY_REDIS": url}, **flags)]
            topics = [f"plain{i}" for i in range(6)]
            with running(relays):
                for relay in relays:
                    relay.wait_for_log(r"owner: relay \d of 2 \(member slot", timeout=20)
                wait_until(lambda: partitions_owned(relays) == [2, 2], timeout=20,
                           message="2 partitions each")
                proxy.cut()
                relays[1].wait_for_log(r"WARNING owner: this relay cannot publish \(Redis is"
                                       r" not connected\) for \d+ s", timeout=20)
                harness.insert_many(db, [(t, b"row %d" % i) for i in range(10) for t in topics]
                                    + [("keyed", b"k %d" % i, f"key{i}") for i in range(40)])
                # Every topic and partition goes on through the other relay.
                harness.wait_all_sent(db, timeout=20, relay=relays[0])
                text = harness.metrics_text(relays[0])
                self.assertEqual(harness.metric(text, "outbox_relay_partitions_owned"), 4)
                proxy.restore()
                relays[1].wait_for_log(r"INFO owner: this relay can publish again", timeout=20)
                wait_until(lambda: partitions_owned(relays) == [2, 2], timeout=20,
                           message="the share taken again")
                harness.insert_many(db, [(t, b"again %d" % i) for i in range(5) for t in topics])
                harness.wait_all_sent(db, timeout=20, relay=relays[1])
                # Each row once, in the stream of its topic or of its partition.
                found = harness.entries_by_message_id(r)
                with db.cursor() as cur:
                    cur.execute("SELECT message_id::text, topic, partition_no"
                                " FROM outbox.messages")
                    rows = cur.fetchall()
                self.assertEqual(len(rows), 6 * 15 + 40)
                for mid, topic, part in rows:
                    stream = topic if part is None else f"{topic}:{part:03d}"
                    self.assertEqual([e[0] for e in found.get(mid, [])], [stream.encode()], mid)
                self.assertEqual(harness.count_unsent(db), 0)


if __name__ == "__main__":
    unittest.main()
