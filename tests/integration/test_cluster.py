"""Redis Cluster: the relay publishes to every primary of a cluster, through failover and resharding.

Promises tested (README, "Redis Cluster"; docs/DESIGN.md, "Redis Cluster"), on a
cluster of 3 primaries with a replica each, every node on loopback:
- `redis` lists seed nodes; the relay reads the slot map, connects to each
  primary, loads its functions there, and 20,000 rows over 12 topics (4 on
  each primary) arrive exactly once, each stream in its primary;
- a primary killed with SIGKILL under load (its replica promoted by the
  cluster, the old primary back as a replica): with min_replicas = 1 nothing
  is lost and nothing doubled;
- the observer, `status` and stream trimming cover the streams of every
  primary, dead letters counted on their stream's primary;
- the consumer library and `outbox-relay dlq`, given the seed list, work on
  the primary of their stream's slot; ordered consumers reach each
  partition's primary and keep every key in order;
- the slot of a busy stream migrated to another primary under load
  (MIGRATING/IMPORTING, MIGRATE, SETSLOT NODE: the ASK, TRYAGAIN and MOVED
  answers; ASK followed with ASKING, under min_replicas = 1): nothing lost
  or doubled, and each stream keeps its order.
- the observer and stream trimming follow a stream whose slot is migrated
  to another primary: once the move is done every observation shows the
  stream with its group (read on the new primary), and retention trims it
  there;
- a fourth primary joins under load (without the functions) and a busy
  stream's slot is migrated to it: the relay loads its functions there and
  publishes go on, nothing lost or doubled.
"""

import contextlib
import json
import time
import unittest

from testkit import consumers
from testkit import harness
from testkit.harness import insert_many, scalar, wait_until

harness.require_relay()
harness.set_deadline(600)

RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="500ms",
                   publish_timeout="2s", connect_timeout="1s", batch_size=100)


def sent_count(conn):
    return harness.count_sent(conn)


def spread_topics(cluster, per_primary=4):
    """Topics whose streams fall on every primary, per_primary on each."""
    ports = list(cluster.primaries())
    slots = cluster.slots()
    chosen = {port: [] for port in ports}
    i = 0
    with contextlib.closing(cluster.nodes[0].client()) as c:
        while any(len(v) < per_primary for v in chosen.values()):
            topic = f"t{i:03d}"
            i += 1
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", topic))
            port = next(p for lo, hi, p in slots if lo <= slot <= hi)
            if len(chosen[port]) < per_primary:
                chosen[port].append(topic)
    return [t for port in ports for t in chosen[port]]


def assert_in_order(test, reader):
    """Every stream's entries in outbox id order (the relay publishes each
    stream's rows in claim order)."""
    for stream in harness.stream_names(reader):
        ids = [int(f[b"outbox_id"]) for _, f in harness.stream_entries(reader, stream)]
        test.assertEqual(ids, sorted(ids), f"stream {stream!r} out of order")


class ClusterTest(harness.PostgresTestCase):
    """The class's PostgreSQL; each test starts a cluster of its own."""

    def cluster(self):
        return self.enterContext(harness.RedisCluster(primaries=3, replicas=1))

    def relay_for(self, cluster, **flags):
        return self.enterContext(harness.Relay(
            self.pg, None, env={"OUTBOX_RELAY_REDIS": cluster.url()},
            **{**RELAY_FLAGS, **flags}))

    def load(self, relay, topics, before):
        """Producers committing 1,000 rows a second over topics, once 3,000
        of their rows are sent."""
        producer = harness.Producer(self.pg, rows=10**9, tx_rows=(1, 10), rate=1000,
                                    topics=topics)
        producer.start()
        self.addCleanup(producer.stop)
        wait_until(lambda: sent_count(self.db) >= 3000, timeout=90, relay=relay,
                   message=f"3,000 rows sent before {before}")
        return producer

    def verify(self, cluster, what):
        reader = cluster.reader()
        self.addCleanup(reader.close)
        fig = harness.Verifier(self.db, reader, compare_payloads=True).report(what)
        fig.assert_exactly_once(self)
        assert_in_order(self, reader)
        return fig, reader

    def test_rows_over_twelve_topics_reach_every_primary(self):
        cluster = self.cluster()
        topics = spread_topics(cluster)
        relay = self.relay_for(cluster)
        relay.wait_for_log(r"redis cluster of 3 primaries .* ready", timeout=20)
        rows = [(topics[i % len(topics)], b"row %d" % i) for i in range(20000)]
        insert_many(self.db, rows)
        harness.wait_all_sent(self.db, timeout=120, relay=relay)
        fig, reader = self.verify(cluster, "cluster of 3")
        self.assertEqual(fig.committed, 20000)
        # Each primary holds its four streams, with both function libraries.
        for port, node in cluster.primaries().items():
            with contextlib.closing(node.client()) as c:
                streams = sorted(k.decode() for k in c.scan_iter(_type="stream")
                                 if b":dedup:" not in k)
                self.assertEqual(len(streams), 4, f"primary {port}: {streams}")
                libs = sorted(lib[1].decode() for lib in c.execute_command("FUNCTION", "LIST"))
                self.assertEqual(libs, ["outbox_consumer", "outbox_relay"])

    def test_observer_status_and_trimming_on_every_primary(self):
        """The observer reads, `status` lists, and retention trims the streams
        of all three primaries; the consumer groups' dead letters are counted
        on the primary of their stream."""
        cluster = self.cluster()
        topics = spread_topics(cluster)
        relay = self.relay_for(cluster, stream_retention="1s", allow_short_stream_retention="on",
                               observe_interval="200ms")
        insert_many(self.db, [(topics[i % len(topics)], b"row %d" % i) for i in range(1200)])
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        # Each stream's group and dead letter, on the stream's own primary.
        for t in topics:
            node = cluster.primary_of(t)
            with contextlib.closing(node.client()) as c:
                c.xgroup_create(t, "g", id="$")
                c.xadd(f"{{{t}}}.g.dlq", {"dlq.reason": "permanent"})

        def observed():
            text = harness.metrics_text(relay)
            return all(harness.metric(text, "outbox_relay_stream_memory_bytes", stream=t)
                       for t in topics)
        wait_until(observed, timeout=30, relay=relay, message="all 12 streams in the metrics")

        def trimmed():
            return all(cluster.primary_of(t).client().xlen(t) == 0 for t in topics)
        wait_until(trimmed, timeout=40, relay=relay, message="every stream trimmed")
        done = harness.run_relay(["status", "--json"], env=harness.relay_env(
            self.pg, extra={"OUTBOX_RELAY_REDIS": cluster.url()}))
        self.assertEqual(done.returncode, 0, done.output)
        status = json.loads(done.stdout)
        self.assertEqual(sorted(t["stream"] for t in status["topics"]), sorted(topics))
        self.assertEqual(sorted((g["stream"], g["dead_letters"]) for g in status["groups"]),
                         sorted((t, 1) for t in topics))
        self.assertEqual([line for line in harness.problem_lines(relay.log(), "retention")
                          if "allow_short_stream_retention allows" not in line], [])

    def test_consumer_and_dlq_commands_on_the_streams_primary(self):
        """The consumer library and `outbox-relay dlq` find the primary of their
        stream's slot from any seed node: every message handled once, the
        malformed one dead-lettered and replayed to the group on that
        primary."""
        cluster = self.cluster()
        topics = spread_topics(cluster, per_primary=1)
        stream = next(t for t in topics if cluster.primary_of(t).port != cluster.nodes[0].port)
        consumers.apply_consumer_schema(self.pg)
        relay = self.relay_for(cluster)
        c = self.enterContext(consumers.Consumer(self.pg, None, consumer="k1", stream=stream,
                                                 redis_url=cluster.url(), block="100ms",
                                                 backoff="100ms"))
        c.wait_for_log(r"reading " + stream, timeout=20)
        rows = [(stream, b'{"order": %d, "customer": "c%d"}' % (i, i % 7)) for i in range(300)]
        rows.append((stream, b"not json"))
        insert_many(self.db, rows)
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        wait_until(lambda: consumers.effects(self.db) == (300, 300), timeout=60,
                   message="300 emails, one per message")
        primary = cluster.primary_of(stream)
        with contextlib.closing(primary.client()) as p:
            wait_until(lambda: p.xlen(f"{{{stream}}}.email.dlq") == 1, timeout=20,
                       message="the malformed message dead-lettered")
        env = harness.relay_env(extra={"OUTBOX_RELAY_REDIS": cluster.url()})
        listed = harness.run_relay(["dlq", "list", stream, "email"], env=env)
        self.assertEqual(listed.returncode, 0, listed.output)
        self.assertIn(f"1 dead letter(s) in {{{stream}}}.email.dlq", listed.stdout)
        replayed = harness.run_relay(["dlq", "replay", stream, "email", "--all"], env=env)
        self.assertEqual(replayed.returncode, 0, replayed.output)
        with contextlib.closing(primary.client()) as p:
            wait_until(lambda: p.xlen(f"{{{stream}}}.email.dlq") == 1
                       and p.xinfo_groups(f"{{{stream}}}.email.replay")[0]["pending"] == 0,
                       timeout=20, message="the replayed message handled (and dead again)")
        self.assertEqual(consumers.effects(self.db), (300, 300))
        self.assertEqual(c.terminate(), 0)

    def test_ordered_consumers_read_partitions_on_every_primary(self):
        """Two ordered consumers of one group on a topic in 8 partitions,
        whose streams hash to slots on different primaries: each partition's
        calls go to its own primary, and per key every message is handled
        once, in order."""
        cluster = self.cluster()
        consumers.apply_consumer_schema(self.pg)
        scalar(self.db, "SELECT outbox.set_partitions('ordc', 8)")
        streams = [f"ordc:{p:03d}" for p in range(8)]
        on = {cluster.primary_of(s).port for s in streams}
        self.assertGreater(len(on), 1, "the partition streams should span primaries")
        relay = self.relay_for(cluster)
        keys = [f"k{i:02d}" for i in range(40)]
        group = []
        for name in ("o1", "o2"):
            c = self.enterContext(consumers.Consumer(
                self.pg, None, consumer=name, stream="ordc", redis_url=cluster.url(),
                block="100ms", backoff="100ms", fail_rate=0.1,
                args=["--ordered", "8", "--lease", "2s"]))
            group.append(c)
        for c in group:
            c.wait_for_log(r"took ordc:", timeout=30)
        for seq in range(1, 11):
            insert_many(self.db, [("ordc", json.dumps({"order": seq, "customer": k}).encode(), k,
                                   None) for k in keys])
        harness.wait_all_sent(self.db, timeout=60, relay=relay)

        def effects():
            with self.db.cursor() as cur:
                cur.execute("SELECT customer, order_id FROM emails WHERE customer LIKE 'k__'"
                            " ORDER BY id")
                out = {}
                for customer, order_id in cur.fetchall():
                    out.setdefault(customer, []).append(order_id)
                return out
        wait_until(lambda: sum(map(len, effects().values())) >= 400, timeout=90,
                   message="400 messages handled")
        got = effects()
        self.assertEqual({k: got.get(k) for k in keys}, {k: list(range(1, 11)) for k in keys})
        for c in group:
            self.assertEqual(c.terminate(), 0)
        print(f"ordered: 8 partitions on {len(on)} primaries, 40 keys x 10 handled in order",
              flush=True)

    def test_primary_killed_under_load(self):
        cluster = self.cluster()
        topics = spread_topics(cluster)
        relay = self.relay_for(cluster, min_replicas=1, replica_timeout="500ms")
        producer = self.load(relay, topics, "the failover")
        victim = cluster.primary_of(topics[0])
        started = time.monotonic()
        victim.kill()
        # The cluster promotes the victim's replica; the victim comes back as
        # its replica, so that min_replicas = 1 can be met again.
        wait_until(lambda: victim.port not in cluster.primaries(), timeout=60, interval=0.2,
                   message="the cluster to promote the replica")
        promoted = time.monotonic()
        victim.start()
        before = sent_count(self.db)
        wait_until(lambda: sent_count(self.db) >= before + 3000, timeout=120, relay=relay,
                   message="3,000 more rows sent after the failover")
        print(f"failover: replica promoted {promoted - started:.1f} s after the kill;"
              f" 3,000 more rows sent {time.monotonic() - started:.1f} s after it", flush=True)
        producer.stop()
        producer.check()
        harness.wait_all_sent(self.db, timeout=120, relay=relay)
        cluster.wait_ok()
        fig, _ = self.verify(cluster, "primary killed")
        self.assertGreater(fig.committed, 6000)

    def test_busy_slot_migrated_under_load(self):
        cluster = self.cluster()
        topics = spread_topics(cluster)
        # min_replicas = 1: a write the relay sends on after an ASK is
        # acknowledged by the importing primary's replica too.
        relay = self.relay_for(cluster, min_replicas=1, replica_timeout="500ms")
        producer = self.load(relay, topics, "the migration")
        busy = topics[0]
        slot = cluster.keyslot(busy)
        source = cluster.primary_of(busy)
        target = next(n for p, n in cluster.primaries().items() if p != source.port)
        mark = relay.mark()
        moved, took = cluster.migrate_slot(slot, source, target)
        cluster.wait_ok()
        before = sent_count(self.db)
        wait_until(lambda: sent_count(self.db) >= before + 2000, timeout=90, relay=relay,
                   message="2,000 more rows sent after the migration")
        producer.stop()
        producer.check()
        harness.wait_all_sent(self.db, timeout=120, relay=relay)
        print(f"migration: slot {slot} ({moved} keys) moved in {took:.1f} s", flush=True)
        relay.wait_for_log(r"MOVED", since=mark, timeout=10)
        log = relay.log()[mark:]
        met = {what: log.count(what) for what in ("ASK ", "TRYAGAIN", "MOVED", "ORDER")}
        asks = harness.metric(harness.metrics_text(relay), "outbox_relay_redis_ask_redirects_total")
        print(f"migration: the relay's log names {met}; {asks:.0f} ASK replies followed",
              flush=True)
        # A publish names its stream and a new dedup record, which the
        # importing primary cannot have yet: it answers TRYAGAIN and the
        # batch is retried. A retire whose records all moved is served there
        # after an ASK, when one meets the short migration (most runs).
        self.assertGreater(met["ASK "] + met["TRYAGAIN"] + asks, 0, "the migration met no publish")
        fig, _ = self.verify(cluster, f"slot {slot} migrated")
        self.assertGreater(fig.committed, 5000)
        self.assertEqual(cluster.primary_of(busy).port, target.port)

    def test_observer_and_trimming_follow_a_migrated_stream(self):
        cluster = self.cluster()
        busy = spread_topics(cluster, per_primary=1)[0]
        relay = self.relay_for(cluster, stream_retention="1s", allow_short_stream_retention="on",
                               observe_interval="200ms")
        insert_many(self.db, [(busy, b"before %d" % i) for i in range(100)])
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        source = cluster.primary_of(busy)
        with contextlib.closing(source.client()) as c:
            c.xgroup_create(busy, "g", id="0")  # nothing delivered: nothing can be trimmed

        def lag():
            return harness.metric(harness.metrics_text(relay), "outbox_relay_group_lag_entries",
                                  stream=busy, group="g")
        wait_until(lambda: lag() == 100, timeout=30, relay=relay,
                   message="the group's lag of 100 observed on the first primary")
        target = next(n for p, n in cluster.primaries().items() if p != source.port)
        moved, _ = cluster.migrate_slot(cluster.keyslot(busy), source, target, pause=0)
        moved_wall = time.time()  # the slot's owner is the target on every primary
        cluster.wait_ok()
        self.assertEqual(cluster.primary_of(busy).port, target.port)
        # Every observation taken after the move must show the group: one
        # that meets the stream missing on the first primary starts again
        # from a fresh scan (docs/DESIGN.md, "Finding the streams"). One
        # taken while the slot was migrating is shown until the next, and is
        # left out: its age on the page says when it was taken.
        moved_at = time.monotonic()
        samples = []
        while time.monotonic() < moved_at + 3.0:
            page = harness.metrics_text(relay)
            taken = time.time() - harness.metric(page, "outbox_relay_observation_age_seconds")
            value = harness.metric(page, "outbox_relay_group_lag_entries", stream=busy, group="g")
            if taken > moved_wall:
                samples.append((time.monotonic() - moved_at, value))
            time.sleep(0.02)
        missing = [f"{t:.2f} s" for t, v in samples if v is None]
        print(f"migrated stream: {moved} keys moved; the group missing in {len(missing)} of"
              f" {len(samples)} samples over 3 s taken after the move", flush=True)
        self.assertGreater(len(samples), 50, "too few observations taken after the move")
        self.assertEqual(missing, [], "observations after the move showed the stream without"
                                      " its group")
        self.assertEqual({v for _, v in samples}, {100.0})
        insert_many(self.db, [(busy, b"after %d" % i) for i in range(50)])
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        wait_until(lambda: lag() == 150, timeout=30, relay=relay,
                   message="the group's lag of 150 observed on the new primary")
        # Retention trims the stream on its new primary once the group has
        # read and acknowledged everything.
        with contextlib.closing(target.client()) as c:
            read = c.xreadgroup("g", "c1", {busy: ">"}, count=1000)
            ids = [eid for _, entries in read for eid, _ in entries]
            self.assertEqual(len(ids), 150)
            c.xack(busy, "g", *ids)
            wait_until(lambda: c.xlen(busy) == 0, timeout=30, relay=relay,
                       message="the moved stream trimmed on its new primary")
        self.assertEqual([line for line in harness.problem_lines(relay.log(), "retention")
                          if "allow_short_stream_retention allows" not in line], [])

    def test_a_primary_that_joins_gets_the_functions(self):
        """A fourth primary joins the cluster under load and a busy stream's
        slot is migrated to it: the relay's MOVED reconnect reads the new map,
        loads its functions on the new primary, and publishes go on there."""
        cluster = self.cluster()
        topics = spread_topics(cluster, per_primary=1)
        relay = self.relay_for(cluster)
        producer = self.load(relay, topics, "the new primary")
        newcomer = cluster.add_primary()
        with contextlib.closing(newcomer.client()) as c:
            # redis-cli --cluster add-node copies the functions over; a node
            # joined otherwise (CLUSTER MEET) has none.
            c.execute_command("FUNCTION", "FLUSH")
            self.assertEqual(c.execute_command("FUNCTION", "LIST"), [])
        busy = topics[0]
        moved, took = cluster.migrate_slot(cluster.keyslot(busy), cluster.primary_of(busy),
                                           newcomer)
        cluster.wait_ok()
        self.assertEqual(cluster.primary_of(busy).port, newcomer.port)
        with contextlib.closing(newcomer.client()) as c:
            before = c.xlen(busy)
            wait_until(lambda: c.xlen(busy) >= before + 300, timeout=60, relay=relay,
                       message="300 more entries published to the new primary")
            libraries = {lib[1].decode() for lib in c.execute_command("FUNCTION", "LIST")}
        producer.stop()
        producer.check()
        harness.wait_all_sent(self.db, timeout=120, relay=relay)
        print(f"new primary: slot of {busy} ({moved} keys) moved to it in {took:.1f} s; "
              f"functions there: {sorted(libraries)}", flush=True)
        self.assertIn("outbox_relay", libraries)
        fig, _ = self.verify(cluster, "a primary joined")
        self.assertGreater(fig.committed, 3000)


if __name__ == "__main__":
    unittest.main()
