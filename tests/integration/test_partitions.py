"""Partitioned topics (docs/PARTITIONS.md, migrations/011_partitions.sql).

Promises tested:
- outbox.fnv1a32 gives the documented test vectors and agrees with a plain
  FNV-1a 32 over the UTF-8 bytes for 2,000 keys of every script;
  outbox.partition_of is that hash mod the topic's partitions (1 when the
  topic is not listed) and NULL for a NULL key;
- each row of a partitioned topic records its partition on insert
  (partition_no: the key's, or id mod n without a key), a row of another
  topic none; the trigger that does it exists only while a topic is
  partitioned and names those topics in its WHEN clause;
- outbox.set_partitions refuses a bad topic name or a count outside 1..1000
  (SQLSTATE 22023), refuses while the topic has a row not yet sent, pending or
  quarantined (55000, with a hint that says what to do), returns the count
  before, and may be run by the schema's owner alone; the relay's and the
  producers' roles may read outbox.topics;
- the relay publishes each row of a topic with 8 partitions to
  "<prefix><topic>:<ppp>", ppp = partition_of(topic, key) in three digits,
  a row without a key to its id mod 8, a row of an unpartitioned topic to
  "<prefix><topic>" as before; with 4 producers writing 50 keys each in
  order while the relay runs, every key's entries are in one stream, in the
  order of their sequence numbers, none missing, none doubled;
- stream_retention trims the streams of partitions as it trims the others;
- a row that fails on its own (an oversized payload, quarantined at once) in
  the middle of a key holds back the later rows of that key, and only of that
  key: the rows behind it in its batch and those inserted after; the other
  keys of its partition go on; outbox_relay_outbox_blocked_keys and
  "status --json" count the held keys; once max_payload_bytes is raised,
  "failed retry" publishes it and then the rows behind it, in order; "failed
  drop" gives another one up and its key goes on without it;
- a producer in REPEATABLE READ or SERIALIZABLE whose snapshot predates a
  change of a topic's count (or its partitioning) is refused with 40001 for
  that topic's rows, and stamps the new count once retried; READ COMMITTED
  producers stamp the count in force; other topics' rows go through;
- in a LATIN1 database, keys with letters outside ASCII land in the stream of
  the partition the trigger stamped (the hash of their UTF-8 bytes), and the
  entries carry their keys and headers in UTF-8: the relay reads in UTF-8
  whatever the database's encoding or the connection string says;
- status and the metrics see the streams of partitions: "status --json"
  lists each with its topic and partition, the groups on them with their
  lag, and /metrics has their group series and the topic's series once.
"""

import json
import random
import threading
import time
import unittest
import urllib.request
import uuid

import psycopg2
import psycopg2.errors

from testkit import harness
from testkit.harness import insert, insert_many, scalar, wait_until

harness.require_relay()
harness.set_deadline(240)

# docs/PARTITIONS.md lists the same; tests/unit/test_batch.c checks the C hash.
VECTORS = [("", 0x811c9dc5), ("a", 0xe40c292c), ("foobar", 0xbf9cf968),
           ("123456789", 0xbb86b11c), ("\u00e9", 0x1e9de8c1), ("\u65e5\u672c", 0x9f26ee51),
           ("order-42", 0x572446f4)]


def fnv1a32(data):
    h = 0x811c9dc5
    for b in data:
        h = ((h ^ b) * 16777619) & 0xffffffff
    return h


def partition_of(key, n):
    return fnv1a32(key.encode("utf-8")) % n


def random_key(rng):
    alphabet = "abcXYZ019-_.:{} \u00e9\u00df\u65e5\u672c\U0001f600"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))


class PartitionSchemaTest(harness.PostgresTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with cls.db.cursor() as cur:
            cur.execute("CREATE ROLE part_producer LOGIN IN ROLE outbox_producer;"
                        "CREATE ROLE part_relay LOGIN IN ROLE outbox_relay")

    def sql(self, query, args=None):
        return scalar(self.db, query, args)

    def assert_sqlstate(self, state, query, args=None, conn=None):
        conn = conn or self.db
        with self.assertRaises(psycopg2.Error) as cm:
            with conn.cursor() as cur:
                cur.execute(query, args)
        if not conn.autocommit:
            conn.rollback()
        self.assertEqual(cm.exception.pgcode, state, cm.exception.pgerror)
        return cm.exception

    def test_a_snapshot_older_than_a_count_change_cannot_stamp_the_old_count(self):
        """A producer in REPEATABLE READ or SERIALIZABLE whose snapshot predates a
        change of the topic's count is refused (40001: retry) rather than stamp the
        count it still sees; in READ COMMITTED, and with a newer snapshot, each row
        is stamped with the count in force."""
        self.sql("SELECT outbox.set_partitions('iso', 4)")
        key, h = "key-7", fnv1a32(b"key-7")
        self.assertNotEqual(h % 4, h % 8)

        def producer(level):
            conn = self.pg.connect(autocommit=False, user="part_producer")
            self.addCleanup(conn.close)
            with conn.cursor() as cur:
                cur.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
                cur.execute("SELECT count(*) FROM outbox.topics")  # the snapshot is taken
            return conn

        def stamp(conn):
            with conn.cursor() as cur:
                mid = str(uuid.uuid4())
                cur.execute("INSERT INTO outbox.messages (message_id, topic, partition_key,"
                            " payload) VALUES (%s, 'iso', %s, '\\x00')", (mid, key))
            conn.commit()
            return self.sql("SELECT partition_no FROM outbox.messages WHERE message_id = %s",
                            (mid,))

        old = {level: producer(level) for level in
               ("REPEATABLE READ", "SERIALIZABLE", "READ COMMITTED")}
        self.sql("SELECT outbox.set_partitions('iso', 8)")
        for level in ("REPEATABLE READ", "SERIALIZABLE"):
            error = self.assert_sqlstate("40001", "INSERT INTO outbox.messages"
                                         " (topic, partition_key, payload)"
                                         " VALUES ('iso', %s, '\\x00')", (key,), conn=old[level])
            self.assertIn("partition", error.pgerror)
            # Retried, with a snapshot that sees the change: the new count.
            self.assertEqual(stamp(producer(level)), h % 8, level)
        self.assertEqual(stamp(old["READ COMMITTED"]), h % 8)
        # A topic partitioned after the snapshot is refused too; rows of the
        # topics whose count did not change are not held up.
        self.sql("SELECT outbox.set_partitions('iso3', 2)")
        conn = producer("REPEATABLE READ")
        self.sql("SELECT outbox.set_partitions('iso2', 2)")
        self.assert_sqlstate("40001", "INSERT INTO outbox.messages (topic, partition_key, payload)"
                             " VALUES ('iso2', 'k', '\\x00')", conn=conn)
        conn = producer("REPEATABLE READ")
        self.sql("SELECT outbox.set_partitions('iso2', 4)")
        with conn.cursor() as cur:
            cur.execute("INSERT INTO outbox.messages (topic, payload) VALUES ('plain', '\\x00')")
            cur.execute("INSERT INTO outbox.messages (topic, partition_key, payload)"
                        " VALUES ('iso3', 'k', '\\x00')")
        conn.commit()
        with self.db.cursor() as cur:
            cur.execute("DELETE FROM outbox.messages")
            cur.execute("SELECT outbox.set_partitions('iso', 1), outbox.set_partitions('iso2', 1),"
                        " outbox.set_partitions('iso3', 1)")

    def test_hash_vectors_and_agreement(self):
        for text, want in VECTORS:
            got = self.sql("SELECT outbox.fnv1a32(convert_to(%s, 'UTF8'))", (text,))
            self.assertEqual(got, want, f"fnv1a32({text!r})")
        rng = random.Random(13)
        keys = [random_key(rng) for _ in range(2000)]
        with self.db.cursor() as cur:
            cur.execute("SELECT k, outbox.fnv1a32(convert_to(k, 'UTF8'))"
                        " FROM unnest(%s::text[]) AS k", (keys,))
            for key, got in cur.fetchall():
                self.assertEqual(got, fnv1a32(key.encode("utf-8")), repr(key))

    def test_partition_of(self):
        self.assertEqual(self.sql("SELECT outbox.partition_of('orders', 'order-42')"), 0)
        self.assertIsNone(self.sql("SELECT outbox.partition_of('orders', NULL)"))
        self.assertEqual(self.sql("SELECT outbox.set_partitions('orders', 8)"), 1)
        self.assertEqual(self.sql("SELECT outbox.partition_of('orders', 'order-42')"),
                         0x572446f4 % 8)
        self.assertIsNone(self.sql("SELECT outbox.partition_of('orders', NULL)"))
        self.assertEqual(self.sql("SELECT outbox.partition_of('other', 'order-42')"), 0)
        rng = random.Random(8)
        keys = [random_key(rng) for _ in range(500)]
        with self.db.cursor() as cur:
            cur.execute("SELECT k, outbox.partition_of('orders', k) FROM unnest(%s::text[]) AS k",
                        (keys,))
            for key, got in cur.fetchall():
                self.assertEqual(got, partition_of(key, 8), repr(key))
        self.assertEqual(self.sql("SELECT outbox.set_partitions('orders', 1000)"), 8)
        self.assertEqual(self.sql("SELECT outbox.partition_of('orders', 'order-42')"),
                         0x572446f4 % 1000)

    def test_rows_record_their_partition(self):
        def trigger():
            return self.sql("SELECT max(pg_get_triggerdef(oid)) FROM pg_trigger"
                            " WHERE tgname = 'messages_partition'")
        with self.db.cursor() as cur:
            cur.execute("TRUNCATE outbox.messages, outbox.topics;"
                        " SELECT outbox.sync_partition_trigger()")
        self.assertIsNone(trigger(), "no trigger while no topic is partitioned")
        self.sql("SELECT outbox.set_partitions('orders', 8)")
        self.sql("SELECT outbox.set_partitions('b.c-2', 3)")
        self.assertIn("WHEN ((new.topic = ANY (ARRAY['b.c-2'::text, 'orders'::text])))",
                      trigger())
        keys = [f"k{i}" for i in range(200)]
        insert_many(self.db, [("orders", b"x", k) for k in keys]
                    + [("orders", b"x", None)] * 5 + [("plain", b"x", "k1")])
        with self.db.cursor() as cur:
            cur.execute("SELECT id, topic, partition_key, partition_no FROM outbox.messages")
            rows = cur.fetchall()
        for row_id, topic, key, part in rows:
            if topic == "plain":
                self.assertIsNone(part)
            elif key is None:
                self.assertEqual(part, row_id % 8)
            else:
                self.assertEqual(part, partition_of(key, 8), key)
        with self.db.cursor() as cur:
            cur.execute("TRUNCATE outbox.messages")
        self.sql("SELECT outbox.set_partitions('orders', 1)")
        self.sql("SELECT outbox.set_partitions('b.c-2', 1)")
        self.assertIsNone(trigger(), "the trigger goes with the last partitioned topic")

    def test_set_partitions_refuses_bad_input(self):
        for topic in ["", "a b", "a{b}", "orders:001", "x" * 201, None]:
            e = self.assert_sqlstate("22023", "SELECT outbox.set_partitions(%s, 4)", (topic,))
            self.assertIn("A-Z a-z 0-9", e.diag.message_hint)
        for n in [0, -1, 1001, None]:
            e = self.assert_sqlstate("22023", "SELECT outbox.set_partitions('orders', %s)", (n,))
            self.assertIn("1 to 1000", e.diag.message_hint)
        self.assertEqual(self.sql("SELECT count(*) FROM outbox.topics"), 0)

    def test_set_partitions_refuses_more_than_the_relays_divide(self):
        """The relays divide at most 4096 partitions in all (relay/owner.c);
        the rows of a partition past it would never be claimed, so the count
        that would pass it is refused where it is set."""
        self.addCleanup(self.sql, "SELECT outbox.sync_partition_trigger()")
        self.addCleanup(self.sql, "DELETE FROM outbox.topics RETURNING 1")
        for i in range(4):
            self.sql(f"SELECT outbox.set_partitions('t{i}', 1000)")
        e = self.assert_sqlstate("54000", "SELECT outbox.set_partitions('t4', 97)")
        self.assertIn("4097", e.diag.message_primary)
        self.assertIn("4096", e.diag.message_hint)
        self.assertEqual(self.sql("SELECT outbox.set_partitions('t4', 96)"), 1)
        # Lowering one topic makes room; setting a topic to 1 always succeeds.
        e = self.assert_sqlstate("54000", "SELECT outbox.set_partitions('t5', 2)")
        self.assertEqual(self.sql("SELECT outbox.set_partitions('t0', 998)"), 1000)
        self.assertEqual(self.sql("SELECT outbox.set_partitions('t5', 2)"), 1)
        self.assertEqual(self.sql("SELECT outbox.set_partitions('t5', 1)"), 2)
        self.assertEqual(self.sql("SELECT sum(partitions) FROM outbox.topics"
                                  " WHERE partitions > 1"), 4094)

    def test_set_partitions_refused_while_rows_are_unsent(self):
        insert(self.db, "orders", b"x", key="k1")
        insert(self.db, "other", b"x", key="k1")
        e = self.assert_sqlstate("55000", "SELECT outbox.set_partitions('orders', 4)")
        self.assertIn("topic orders has 1 unsent rows", e.diag.message_primary)
        self.assertIn("let the relay publish what is left", e.diag.message_hint)
        # The same count changes nothing, so it is not refused.
        self.assertEqual(self.sql("SELECT outbox.set_partitions('orders', 1)"), 1)
        # Published: its stream's recorded position has passed it.
        with self.db.cursor() as cur:
            cur.execute("SELECT outbox.tick()")
            cur.execute("SELECT outbox.record_batch(outbox.tick(), true, '{orders}', '{-1}',"
                        " '{1-0}', '{}', '{}', '{}', '{}', '{}', '{}')")
        self.assertEqual(self.sql("SELECT outbox.set_partitions('orders', 4)"), 1)
        self.assertEqual(self.sql("SELECT outbox.set_partitions('orders', 1)"), 4)
        # Quarantined is not sent either.
        insert(self.db, "orders", b"y", key="k1")
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox.quarantine SELECT id, txid, message_id, topic,"
                        " partition_key, payload, headers, created_at, 'bad'"
                        " FROM outbox.unsent WHERE topic = 'orders'")
            cur.execute("SELECT outbox.record_batch(outbox.tick(), true, '{orders}', '{-1}',"
                        " '{2-0}', '{}', '{}', '{}', '{}', '{}', '{}')")
        self.assert_sqlstate("55000", "SELECT outbox.set_partitions('orders', 4)")
        with self.db.cursor() as cur:
            cur.execute("DELETE FROM outbox.quarantine")
        self.assertEqual(self.sql("SELECT outbox.set_partitions('orders', 4)"), 1)
        self.assertEqual(self.sql("SELECT partitions FROM outbox.topics WHERE topic = 'orders'"), 4)
        # Another topic's rows are another topic's business: "other" is unsent.
        self.assertEqual(self.sql("SELECT outbox.set_partitions('third', 2)"), 1)

    def test_only_the_owner_sets_partitions(self):
        self.sql("SELECT outbox.set_partitions('orders', 4)")
        for role in ["part_producer", "part_relay"]:
            conn = self.pg.connect(user=role, autocommit=True)
            self.addCleanup(conn.close)
            self.assert_sqlstate("42501", "SELECT outbox.set_partitions('orders', 2)", conn=conn)
            self.assertEqual(scalar(conn, "SELECT partitions FROM outbox.topics"), 4)
            self.assertEqual(scalar(conn, "SELECT outbox.partition_of('orders', 'order-42')"),
                             0x572446f4 % 4)


class PartitionRelayTest(harness.ServerTestCase):

    def entries(self, stream):
        return harness.stream_entries(self.r, stream)

    def test_keys_in_order_in_their_partition_streams(self):
        self.assertEqual(scalar(self.db, "SELECT outbox.set_partitions('orders', 8)"), 1)
        relay = self.relay(stream_prefix="app:", batch_size=50)
        producers, keys_each, seqs = 4, 50, 20
        errors = []

        def produce(p):
            try:
                conn = self.pg.connect(autocommit=True)
                try:
                    rng = random.Random(p)
                    keys = [f"k{p}-{i}-\u00e9" for i in range(keys_each)]
                    nxt = {k: 0 for k in keys}
                    while keys:
                        k = rng.choice(keys)
                        insert(conn, "orders", str(nxt[k]).encode(), key=k)
                        nxt[k] += 1
                        if nxt[k] == seqs:
                            keys.remove(k)
                finally:
                    conn.close()
            except Exception as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        for t in threads:
            t.start()
        keyless = insert_many(self.db, [("orders", b"nokey")] * 40)
        plain = insert_many(self.db, [("plain", b"p", "k1")] * 10)
        for t in threads:
            t.join(120)
        self.assertEqual(errors, [])
        total = producers * keys_each * seqs + len(keyless) + len(plain)
        harness.wait_all_sent(self.db, timeout=60, relay=relay)

        names = {n.decode() for n in harness.stream_names(self.r)}
        self.assertEqual(names, {f"app:orders:{p:03d}" for p in range(8)} | {"app:plain"})
        seen, per_key = 0, {}
        for p in range(8):
            stream = f"app:orders:{p:03d}"
            for _, f in self.entries(stream):
                seen += 1
                key = f.get(b"key")
                if key is None:
                    self.assertEqual(f[b"payload"], b"nokey")
                    self.assertEqual(int(f[b"outbox_id"]) % 8, p, "a keyless row spread by id")
                    continue
                key = key.decode()
                self.assertEqual(partition_of(key, 8), p, f"{key!r} in {stream}")
                per_key.setdefault(key, []).append(int(f[b"payload"]))
        self.assertEqual(len(per_key), producers * keys_each)
        for key, got in per_key.items():
            self.assertEqual(got, list(range(seqs)), f"{key!r}: in order, none missing or doubled")
        plain_entries = self.entries("app:plain")
        self.assertEqual(len(plain_entries), 10)
        self.assertEqual(seen + len(plain_entries), total)
        # Each dedup record was in its stream's slot, and was removed with its
        # stream's UNLINK publish_timeout (5 s by default) after its commit.
        wait_until(lambda: harness.unretired_dedup_records(self.r, 5000) == [], timeout=10,
                   interval=0.2, message="the dedup records to be removed")

    def test_partitions_whose_keys_collide_share_an_owner(self):
        """A partition's lock key is a 31-bit hash: fnv1a32("t37922") is
        fnv1a32("t268696") + 2, so t268696/0 and t37922/2 are one lock. In
        plan order they fall to different relays; given apart, the second
        relay waits for ever for the lock the first holds, and the rows of
        that partition stay unsent (docs/DESIGN.md, "Several relays")."""
        t1, t2 = "t268696", "t37922"
        self.assertEqual((fnv1a32(t1.encode()) + 0) & 0x7fffffff,
                         (fnv1a32(t2.encode()) + 2) & 0x7fffffff)
        scalar(self.db, f"SELECT outbox.set_partitions('{t1}', 3),"
                        f" outbox.set_partitions('{t2}', 3)")
        flags = dict(poll_interval="100ms", batch_size=50, log_level="debug")
        a = self.relay(**flags)
        a.wait_for_log(r"its share is 6 of 6 partitions", timeout=20)
        b = self.relay(**flags)
        for relay in (a, b):
            # 4 and 2: the colliding pair counts once, for the first relay.
            relay.wait_for_log(r"relay \d of 2 .*its share is \d of 6", timeout=20)
        rows = [(t, str(seq).encode(), f"key{i}") for t in (t1, t2) for i in range(30)
                for seq in range(3)]
        insert_many(self.db, rows)
        try:
            harness.wait_all_sent(self.db, timeout=30)
        except AssertionError:
            pass
        with self.db.cursor() as cur:
            cur.execute("SELECT topic || '/' || partition_no, count(*) FROM outbox.unsent"
                        " GROUP BY 1 ORDER BY 1")
            unsent = dict(cur.fetchall())
        self.assertEqual(unsent, {}, "rows of a partition no relay could take")
        # Each row once, in its partition's stream.
        found = harness.entries_by_message_id(self.r)
        with self.db.cursor() as cur:
            cur.execute("SELECT message_id::text, topic, partition_no FROM outbox.messages")
            placed = [(len(found.get(m, [])), [e[0] for e in found.get(m, [])],
                       f"{t}:{p:03d}".encode()) for m, t, p in cur.fetchall()]
        self.assertEqual(len(placed), len(rows))
        wrong = [x for x in placed if x[0] != 1 or x[1] != [x[2]]]
        self.assertEqual(wrong, [], "rows not in their partition's stream exactly once")

    def test_retention_trims_partition_streams(self):
        scalar(self.db, "SELECT outbox.set_partitions('orders', 4)")
        self.r.xgroup_create("app:orders:001", "g1", id="0", mkstream=True)
        relay = self.relay(stream_prefix="app:", stream_retention="1s", dedup_ttl="1s",
                           publish_timeout="1s")
        keys = [f"key-{i}" for i in range(200)]
        insert_many(self.db, [("orders", b"x", k) for k in keys])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        streams = [f"app:orders:{p:03d}" for p in range(4)]
        self.assertEqual(sum(self.r.xlen(s) for s in streams), 200)
        in_001 = self.r.xlen("app:orders:001")
        self.assertGreater(in_001, 0)
        time.sleep(1.2)
        # Nobody reads the other three: trimmed once past stream_retention. The
        # group of 001 has not read its entries: they stay.
        wait_until(lambda: all(self.r.xlen(s) == 0 for s in streams if s != "app:orders:001"),
                   timeout=30, relay=relay, message="the partitions' streams to be trimmed")
        self.assertEqual(self.r.xlen("app:orders:001"), in_001)


    def test_a_failed_row_holds_back_its_key_only(self):
        scalar(self.db, "SELECT outbox.set_partitions('orders', 4)")
        port = harness.free_port()
        flags = dict(max_payload_bytes="1000", poll_interval="200ms", observe_interval="200ms",
                     metrics_listen=f"127.0.0.1:{port}")
        relay = self.relay(**flags)
        keys = [f"key-{i}" for i in range(20)]
        poison = {"key-3": 4, "key-7": 2}  # the sequence number that is too large

        def rows(seqs):
            out = []
            for seq in seqs:
                for k in keys:
                    big = poison.get(k) == seq
                    out.append(("orders", str(seq).encode() + (b" " * 2000 if big else b""), k))
            return out

        # Rows 0-5 in one transaction: the held rows share the poison's batch.
        insert_many(self.db, rows(range(6)))
        wait_until(lambda: scalar(self.db, "SELECT count(*) FROM outbox.quarantine"
                                           " WHERE error NOT LIKE 'held behind%%'") == 2,
                   timeout=30, relay=relay, message="the two oversized rows to be quarantined")
        # Rows 6-9 later: held by the batch statement itself.
        insert_many(self.db, rows(range(6, 10)))

        def published():
            got = {}
            for p in range(4):
                for _, f in self.entries(f"orders:{p:03d}"):
                    got.setdefault(f[b"key"].decode(), []).append(int(f[b"payload"]))
            return got

        want = {k: list(range(10)) for k in keys}
        want["key-3"] = [0, 1, 2, 3]
        want["key-7"] = [0, 1]
        wait_until(lambda: published() == want, timeout=30, relay=relay,
                   message="every key but the two held ones to be published in full")
        time.sleep(0.5)  # nothing more comes
        self.assertEqual(published(), want)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.quarantine"
                                         " WHERE error LIKE 'held behind row %%'"), 5 + 7)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.unsent"), 0)

        def metric():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            for line in text.splitlines():
                if line.startswith("outbox_relay_outbox_blocked_keys "):
                    return int(float(line.split()[1]))
            return None

        wait_until(lambda: metric() == 2, timeout=15, relay=relay,
                   message="outbox_relay_outbox_blocked_keys to be 2")
        env = harness.relay_env(self.pg, self.redis)
        status = harness.run_relay(["status", "--json"], env=env)
        self.assertEqual(json.loads(status.stdout)["outbox"]["blocked_keys"], 2, status.output)
        text = harness.run_relay(["status"], env=env)
        self.assertIn("2 held back behind a quarantined or retrying row", text.stdout)

        # key-3: the cause fixed (a larger max_payload_bytes), the row retried.
        relay.stop()
        relay = self.relay(**{**flags, "max_payload_bytes": "4096"})
        ids = {k: scalar(self.db, "SELECT id FROM outbox.quarantine WHERE partition_key = %s"
                                  " AND error NOT LIKE 'held behind%%'", (k,)) for k in poison}
        done = harness.run_relay(["failed", "retry", str(ids["key-3"])], env=env)
        self.assertEqual(done.returncode, 0, done.output)
        want["key-3"] = list(range(10))
        wait_until(lambda: published() == want, timeout=30, relay=relay,
                   message="key-3 to be published in order once its row is retried")
        # key-7: given up; the key goes on without it.
        done = harness.run_relay(["failed", "drop", str(ids["key-7"])], env=env)
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("dropped 1 row(s)", done.stdout)
        want["key-7"] = [0, 1] + list(range(3, 10))
        wait_until(lambda: published() == want, timeout=30, relay=relay,
                   message="key-7 to go on without its dropped row")
        wait_until(lambda: metric() == 0, timeout=15, relay=relay,
                   message="outbox_relay_outbox_blocked_keys to be 0")
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.quarantine"
                                         " WHERE partition_key IN ('key-3', 'key-7')"), 0)
        again = harness.run_relay(["failed", "drop", str(ids["key-7"])], env=env)
        self.assertNotEqual(again.returncode, 0)
        self.assertIn("not quarantined", again.stderr)


    def test_status_and_metrics_see_partition_streams(self):
        scalar(self.db, "SELECT outbox.set_partitions('orders', 4)")
        streams = [f"orders:{p:03d}" for p in range(4)]
        for st in streams:
            self.r.xgroup_create(st, "g1", id="0", mkstream=True)
        port = harness.free_port()
        relay = self.relay(observe_interval="200ms", metrics_listen=f"127.0.0.1:{port}")
        keys = [f"key-{i}" for i in range(40)]
        insert_many(self.db, [("orders", b"x", k) for k in keys] + [("plain", b"y")])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        per_stream = {st: self.r.xlen(st) for st in streams}
        self.assertEqual(sum(per_stream.values()), 40)

        env = harness.relay_env(self.pg, self.redis)
        status = harness.run_relay(["status", "--json"], env=env)
        self.assertEqual(status.returncode, 0, status.output)
        doc = json.loads(status.stdout)
        seen = {t["stream"]: (t["topic"], t["partition"]) for t in doc["topics"]}
        for p, st in enumerate(streams):
            self.assertEqual(seen.get(st), ("orders", p), doc["topics"])
        self.assertEqual(seen.get("plain"), ("plain", None))
        lags = {g["stream"]: g["lag"] for g in doc["groups"] if g["group"] == "g1"}
        self.assertEqual(lags, per_stream)
        text = harness.run_relay(["status"], env=env).stdout
        for st in streams:
            self.assertIn(st, text)

        def scrape():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()

        def lag_series(text):
            return {line.split("\"")[1]: int(float(line.split()[-1]))
                    for line in text.splitlines()
                    if line.startswith("outbox_relay_group_lag_entries{")
                    and 'group="g1"' in line}

        text = wait_until(lambda: (t := scrape()) and lag_series(t) == per_stream and t,
                          timeout=15, relay=relay, message="the partitions' group series")
        series = [line.split(" ")[0] for line in text.splitlines()
                  if line and not line.startswith("#")]
        self.assertEqual(len(series), len(set(series)), "no series twice")


class Latin1DatabaseTest(harness.ServerTestCase):
    """A database in LATIN1: the partition the trigger stamps (the key's UTF-8
    bytes) is the stream the relay publishes to."""

    pg_options = {"encoding": "LATIN1"}
    KEYS = ["caf\u00e9", "\u00c4rger", "na\u00efve", "\u00fcber", "plain", "\u00f1and\u00fa",
            "gar\u00e7on", "\u00d8re", "s\u00e9ance", "\u00e0-la-carte"]

    def test_non_ascii_keys_go_to_their_partition(self):
        self.assertEqual(scalar(self.db, "SELECT pg_encoding_to_char(encoding) FROM pg_database"
                                         " WHERE datname = current_database()"), "LATIN1")
        scalar(self.db, "SELECT outbox.set_partitions('latin', 8)")
        # A connection string that asks for LATIN1 does not change what the relay reads.
        relay = self.relay(poll_interval="100ms", env={
            "OUTBOX_RELAY_POSTGRES": self.pg.dsn() + " client_encoding=LATIN1"})
        rows = [("latin", f"{k} {i}".encode(), k, {"who": k}) for k in self.KEYS
                for i in range(3)]
        insert_many(self.db, rows)
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        with self.db.cursor() as cur:
            cur.execute("SELECT message_id::text, partition_key, partition_no"
                        " FROM outbox.messages WHERE topic = 'latin'")
            stamped = {mid: (key, part) for mid, key, part in cur.fetchall()}
        self.assertEqual(len(stamped), len(rows))
        found = 0
        for p in range(8):
            for _, fields in harness.stream_entries(self.r, f"latin:{p:03d}"):
                mid = fields[b"id"].decode()
                key, part = stamped[mid]
                self.assertEqual(part, p, f"the row of key {key!r} in stream latin:{p:03d}")
                self.assertEqual(part, fnv1a32(key.encode("utf-8")) % 8, key)
                self.assertEqual(fields[b"key"], key.encode("utf-8"))
                self.assertEqual(fields[b"h.who"], key.encode("utf-8"))
                found += 1
        self.assertEqual(found, len(rows))


if __name__ == "__main__":
    unittest.main()
