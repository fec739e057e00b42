"""Dead-letter tools and the consumer's SQL (docs/DESIGN.md P7, docs/CONSUMERS.md).

`outbox-relay dlq ...` against a real Redis, with dead letters written
directly with redis-py in the documented format (include/outbox/consumer.h:
the original contract fields plus dlq.*), one of them with a binary payload.
Only OUTBOX_RELAY_REDIS is set: the dlq commands must not demand `postgres`.
Promises tested:
- `dlq list STREAM GROUP [--count N]` shows one line per dead letter, oldest
  first (entry id, message id, reason, deliveries, failed_at, the error on one
  line cut at about 80 columns) and a footer with the total (XLEN);
- `dlq show STREAM GROUP ID` shows every field, bytes that are not printable as
  \\xNN; an unknown id exits 65;
- `dlq replay` by one id, by a range FROM-TO and with --all: each replayed dead
  letter is on `{<stream>}.<group>.replay` with exactly its original fields
  (binary payload byte for byte, the same `id`, no dlq.* field) in the order of
  the dead letters, and gone from the dead-letter stream; the main stream and
  the other groups see nothing new: only the failed group can read the replay;
  an unknown id is reported (exit 65) while the other ids are still replayed; a
  dead letter with no original fields (reason lost) is not replayed and stays;
- a replay Redis refuses keeps the dead letter and exits 69 with Redis's reason:
  an XADD refused only when it runs (a replay stream whose last id is the
  largest possible; MULTI/EXEC deleted the dead letter anyway) and OOM under
  maxmemory with noeviction; a Redis user without FUNCTION LOAD is told the ACL
  permissions a replay needs, and nothing changes;
- the replay function's contract (FCALL outbox_consumer_replay_v1): the new id,
  nil for a missing dead letter, NOTREPLAYABLE for a lost one, usage and
  WRONGTYPE errors that write nothing;
- `dlq purge` by ids, a range and --all (which deletes the key), with the count;
- errors: a missing stream or group exits 65 with `stream "x" does not exist` /
  `group "g" does not exist on stream "x"` and changes nothing; bad usage exits
  64 with the usage text; an unreachable Redis or a wrong password exits 69 with
  the reason and never prints the password.

The consumer's SQL (migrations/consumer/*.sql) on a fresh database of its own:
- applying every file twice (three times) fails nothing and changes nothing
  (schema dump, roles, schema_version);
- begin_message is true for a new (consumer, message id), false for the same
  again, true for another consumer; with an effect in the same transaction a
  rollback leaves neither the effect nor the processed row, and the next try
  is new again; a concurrent second delivery waits for the first and then
  answers false (first committed) or true (first rolled back);
- purge_processed refuses '1 hour' (and NULL) with a clear error and deletes
  rows older than '1 day', returning the count;
- the NOLOGIN role outbox_consumer can use the table and the functions, and a
  role without it cannot call them.
"""

import contextlib
import datetime
import difflib
import glob
import os
import re
import threading
import unittest
import uuid

import psycopg2
import redis as redis_py

from testkit import harness
from testkit.harness import scalar

harness.require_relay()
harness.set_deadline(300)

STREAM, GROUP, OTHER_GROUP = "orders", "email", "invoice"
DLQ = f"{{{STREAM}}}.{GROUP}.dlq"
REPLAY = f"{{{STREAM}}}.{GROUP}.replay"
REPLAY_FUNCTION = "outbox_consumer_replay_v1"
CONSUMER_MIGRATIONS = sorted(glob.glob(os.path.join(harness.SOURCE_DIR, "migrations",
                                                    "consumer", "*.sql")))
BINARY_PAYLOAD = b"\x00\x01bin\xff\n\"q\"\\"
LONG_ERROR = ("smtp said: 451 temporary failure\nplease retry later; " + "x" * 200)


def now_rfc3339():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class DlqToolTest(harness.ServerTestCase):

    def setUp(self):
        super().setUp()
        # The stream with two groups and two messages the relay published.
        self.r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        self.r.xgroup_create(STREAM, OTHER_GROUP, id="0")
        for n in (1, 2):
            self.r.xadd(STREAM, self.original(payload=b'{"order":%d}' % n, outbox_id=n))

    # ---- helpers -------------------------------------------------------

    @staticmethod
    def original(payload=b'{"order":9001}', key=b"9001", outbox_id=1, headers=None):
        """A contract entry as the relay writes it (README, stream contract)."""
        fields = {b"id": str(uuid.uuid4()).encode(), b"topic": STREAM.encode()}
        if key is not None:
            fields[b"key"] = key
        fields[b"payload"] = payload
        fields[b"created_at"] = now_rfc3339().encode()
        fields[b"outbox_id"] = str(outbox_id).encode()
        for name, value in (headers or {b"content-type": b"application/json"}).items():
            fields[b"h." + name] = value
        return fields

    def dead_letter(self, reason="exhausted", error="handler gave up", deliveries=5,
                    original=None, stream=STREAM, group=GROUP):
        """XADDs a dead letter as the consumer library writes it; (entry id, original fields)."""
        original = self.original() if original is None else original
        fields = dict(original)
        fields.update({
            b"dlq.stream": stream.encode(),
            b"dlq.group": group.encode(),
            b"dlq.consumer": b"host-1234",
            b"dlq.entry_id": b"1796039028031-0",
            b"dlq.deliveries": str(deliveries).encode(),
            b"dlq.reason": reason.encode(),
            b"dlq.error": error.encode() if isinstance(error, str) else error,
            b"dlq.failed_at": now_rfc3339().encode(),
        })
        entry_id = self.r.xadd(f"{{{stream}}}.{group}.dlq", fields).decode()
        return entry_id, original

    def dlq(self, *args, redis_url=None, extra_env=None):
        """`outbox-relay dlq ARGS...` with only the Redis setting in the environment."""
        env = harness.relay_env(redis=self.redis, extra=extra_env)
        if redis_url is not None:
            env["OUTBOX_RELAY_REDIS"] = redis_url
        self.assertNotIn("OUTBOX_RELAY_POSTGRES", env)
        done = harness.run_relay(["dlq", *args], env=env, timeout=30)
        print(f"$ outbox-relay dlq {' '.join(args)}  -> {done.returncode}\n{done.output}",
              flush=True)
        return done

    def dlq_ids(self):
        return [eid for eid, _ in harness.stream_entries(self.r, DLQ)]

    def replayed(self):
        return harness.stream_entries(self.r, REPLAY)

    def main_state(self):
        """What the main stream and its groups look like, to prove a replay left them alone."""
        groups = sorted((g["name"], g["pending"], g["last-delivered-id"], g.get("entries-read"))
                        for g in self.r.xinfo_groups(STREAM))
        return harness.stream_entries(self.r, STREAM), groups

    def assert_replayed_exactly(self, originals):
        """The replay stream holds these original field sets, in this order, and nothing else."""
        got = [fields for _, fields in self.replayed()]
        self.assertEqual(got, originals)
        for fields in got:
            self.assertFalse([f for f in fields if f.startswith(b"dlq.")],
                             "a dlq.* field reached the replay stream")

    # ---- list and show -------------------------------------------------

    def test_list_shows_oldest_first_with_a_total(self):
        empty = self.dlq("list", STREAM, GROUP)
        self.assertEqual(empty.returncode, 0, empty.output)
        self.assertIn("no dead letters in {orders}.email.dlq", empty.stdout)

        e1, o1 = self.dead_letter("permanent", "invalid address", deliveries=1)
        e2, o2 = self.dead_letter("exhausted", LONG_ERROR, deliveries=5,
                                  original=self.original(payload=BINARY_PAYLOAD))
        e3, o3 = self.dead_letter("malformed", "malformed: no payload field", deliveries=1)
        done = self.dlq("list", STREAM, GROUP)
        self.assertEqual(done.returncode, 0, done.output)
        lines = done.stdout.splitlines()
        self.assertRegex(lines[0], r"^ENTRY\s+MESSAGE_ID\s+REASON\s+DELIVERIES\s+FAILED_AT\s+ERROR")
        body = lines[1:-1]
        self.assertEqual([line.split()[0] for line in body], [e1, e2, e3], "oldest first")
        for line, (orig, reason, deliveries) in zip(body, [(o1, "permanent", "1"),
                                                           (o2, "exhausted", "5"),
                                                           (o3, "malformed", "1")]):
            cols = line.split()
            self.assertEqual(cols[1], orig[b"id"].decode())
            self.assertEqual(cols[2], reason)
            self.assertEqual(cols[3], deliveries)
            self.assertIsNotNone(harness.parse_rfc3339_utc(cols[4]), line)
        self.assertIn("invalid address", body[0])
        # The long multi-line error: one line, the newline escaped, cut near 80 columns.
        error_part = body[1][body[1].index("smtp said"):]
        self.assertIn("\\x0a", error_part)
        self.assertTrue(error_part.endswith("..."), error_part)
        self.assertLessEqual(len(error_part), 90)
        self.assertEqual(lines[-1], "3 dead letter(s) in {orders}.email.dlq")

        two = self.dlq("list", STREAM, GROUP, "--count", "2")
        self.assertEqual(two.returncode, 0, two.output)
        self.assertEqual([line.split()[0] for line in two.stdout.splitlines()[1:-1]], [e1, e2])
        self.assertIn("3 dead letter(s) in {orders}.email.dlq (showing the oldest 2; use --count)",
                      two.stdout)

    def test_list_pages_past_one_read(self):
        ids = [self.dead_letter(error=f"e{n}")[0] for n in range(250)]
        done = self.dlq("list", STREAM, GROUP, "--count", "1000")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertEqual([line.split()[0] for line in done.stdout.splitlines()[1:-1]], ids)
        self.assertEqual(done.stdout.splitlines()[-1], "250 dead letter(s) in {orders}.email.dlq")
        default = self.dlq("list", STREAM, GROUP)
        self.assertEqual(len(default.stdout.splitlines()), 102, "default --count is 100")

    def test_show_prints_every_field_escaped(self):
        self.dead_letter()
        entry, orig = self.dead_letter("permanent", "bad\taddress \u00e9",
                                       original=self.original(payload=BINARY_PAYLOAD))
        done = self.dlq("show", STREAM, GROUP, entry)
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn(f"dead letter {entry} in {{orders}}.email.dlq", done.stdout)
        stored = self.r.xrange(DLQ, entry, entry)[0][1]
        for name in stored:
            self.assertRegex(done.stdout, rf"(?m)^  {re.escape(name.decode())}\s+\"",
                             f"field {name!r} missing")
        payload_line = next(l for l in done.stdout.splitlines() if l.lstrip().startswith("payload"))
        self.assertIn('"\\x00\\x01bin\\xff\\x0a\\"q\\"\\\\"', payload_line)
        self.assertIn(f"({len(BINARY_PAYLOAD)} bytes)", payload_line)
        self.assertIn('"bad\\x09address \u00e9"', done.stdout, "valid UTF-8 is shown as is")
        self.assertIn(orig[b"id"].decode(), done.stdout)

        missing = self.dlq("show", STREAM, GROUP, "1-0")
        self.assertEqual(missing.returncode, 65, missing.output)
        self.assertIn("no dead letter 1-0 in {orders}.email.dlq", missing.stderr)

    # ---- replay --------------------------------------------------------

    def test_replay_one_id_reaches_only_the_failed_group(self):
        before = self.main_state()
        keep, _ = self.dead_letter()
        entry, orig = self.dead_letter(original=self.original(payload=BINARY_PAYLOAD, key=None))
        done = self.dlq("replay", STREAM, GROUP, entry)
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("replayed 1 dead letter(s)", done.stdout)
        self.assert_replayed_exactly([orig])
        self.assertEqual(self.replayed()[0][1][b"payload"], BINARY_PAYLOAD)
        self.assertEqual(self.dlq_ids(), [keep], "the replayed dead letter is gone, the other stays")
        self.assertEqual(self.main_state(), before, "the main stream or its groups changed")
        # Only the failed group reads the replay stream.
        self.assertEqual([g["name"] for g in self.r.xinfo_groups(REPLAY)], [GROUP.encode()])
        got = self.r.xreadgroup(GROUP, "c1", {REPLAY: ">"})
        self.assertEqual([fields for _, fields in got[0][1]], [orig])
        with self.assertRaises(redis_py.exceptions.ResponseError):
            self.r.xreadgroup(OTHER_GROUP, "c1", {REPLAY: ">"})
        self.assertEqual(self.r.xreadgroup(OTHER_GROUP, "c1", {STREAM: ">"})[0][1][-1][1][b"outbox_id"],
                         b"2", "the other group sees only what the relay published")

        again = self.dlq("replay", STREAM, GROUP, entry)
        self.assertEqual(again.returncode, 65, again.output)
        self.assertIn(f"no dead letter {entry} in {{orders}}.email.dlq", again.stderr)
        self.assertEqual(len(self.replayed()), 1)

    def test_replay_a_range_then_all(self):
        before = self.main_state()
        letters = [self.dead_letter(error=f"e{n}", original=self.original(outbox_id=n))
                   for n in range(6)]
        ids = [e for e, _ in letters]
        done = self.dlq("replay", STREAM, GROUP, f"{ids[1]}-{ids[3]}")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("replayed 3 dead letter(s)", done.stdout)
        self.assert_replayed_exactly([o for _, o in letters[1:4]])
        self.assertEqual(self.dlq_ids(), [ids[0], ids[4], ids[5]])

        done = self.dlq("replay", STREAM, GROUP, "--all")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("replayed 3 dead letter(s)", done.stdout)
        self.assert_replayed_exactly([o for _, o in letters[1:4]] +
                                     [letters[0][1], letters[4][1], letters[5][1]])
        self.assertEqual(self.dlq_ids(), [])
        self.assertEqual(self.main_state(), before)

        nothing = self.dlq("replay", STREAM, GROUP, "--all")
        self.assertEqual(nothing.returncode, 0, nothing.output)
        self.assertIn("replayed 0 dead letter(s)", nothing.stdout)

    def test_replay_all_pages_through_many(self):
        letters = [self.dead_letter(original=self.original(outbox_id=n)) for n in range(230)]
        done = self.dlq("replay", STREAM, GROUP, "--all")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("replayed 230 dead letter(s)", done.stdout)
        self.assert_replayed_exactly([o for _, o in letters])
        self.assertEqual(self.r.xlen(DLQ), 0)

    def test_replay_unknown_id_is_reported_and_the_others_still_go(self):
        (e1, o1), (e2, o2) = self.dead_letter(), self.dead_letter()
        done = self.dlq("replay", STREAM, GROUP, e1, "1-0", e2)
        self.assertEqual(done.returncode, 65, done.output)
        self.assertIn("no dead letter 1-0 in {orders}.email.dlq", done.stderr)
        self.assertIn("replayed 2 dead letter(s)", done.stdout)
        self.assert_replayed_exactly([o1, o2])
        self.assertEqual(self.dlq_ids(), [])

    def test_replay_of_a_lost_entry_is_refused(self):
        lost, _ = self.dead_letter("lost", "the entry was deleted", original={})
        good, orig = self.dead_letter()
        done = self.dlq("replay", STREAM, GROUP, "--all")
        self.assertEqual(done.returncode, 65, done.output)
        self.assertIn(f"dead letter {lost} has no original fields", done.stderr)
        self.assertIn("replayed 1 dead letter(s)", done.stdout)
        self.assert_replayed_exactly([orig])
        self.assertEqual(self.dlq_ids(), [lost], "the lost dead letter stays for an operator")

    def test_replay_refused_at_execution_keeps_the_dead_letter(self):
        """The replay stream is a stream (so no type check can object) whose last id is
        the largest there is: every XADD * to it is refused when it runs, with "ERR The
        stream has exhausted the last possible ID". The dead letters must stay, the
        replay stream must stay empty, and the tool must say why and exit 69."""
        (e1, o1), (e2, o2) = self.dead_letter(), self.dead_letter()
        self.r.xgroup_create(REPLAY, GROUP, id="0", mkstream=True)
        self.r.execute_command("XSETID", REPLAY, "18446744073709551615-18446744073709551615")
        for args in ([e2], [f"{e1}-{e2}"], ["--all"]):
            done = self.dlq("replay", STREAM, GROUP, *args)
            self.assertEqual(done.returncode, 69, done.output)
            self.assertIn(f"replay of {e1 if args != [e2] else e2}: ERR The stream has "
                          "exhausted the last possible ID", done.stderr)
            self.assertIn("replayed 0 dead letter(s)", done.stdout)
            self.assertEqual(self.dlq_ids(), [e1, e2], f"replay {args} lost a dead letter")
            self.assertEqual(self.r.xlen(REPLAY), 0)

        # Once the replay stream is usable again, both go, in order.
        self.r.delete(REPLAY)
        done = self.dlq("replay", STREAM, GROUP, "--all")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("replayed 2 dead letter(s)", done.stdout)
        self.assert_replayed_exactly([o1, o2])
        self.assertEqual(self.dlq_ids(), [])

    def test_replay_under_oom_keeps_the_dead_letter(self):
        """maxmemory 1 byte with noeviction: Redis refuses every write with OOM. The
        replay reports it (exit 69) and leaves the dead letter where it was; called
        directly, the replay function is refused too and changes nothing."""
        (e1, o1), (e2, o2) = self.dead_letter(), self.dead_letter()
        loaded = self.dlq("replay", STREAM, GROUP, e1)  # loads the function library
        self.assertEqual(loaded.returncode, 0, loaded.output)
        self.assertEqual(self.r.config_get("maxmemory-policy")["maxmemory-policy"], "noeviction")
        self.addCleanup(lambda: self.redis.client().config_set("maxmemory", 0))
        self.r.config_set("maxmemory", 1)
        done = self.dlq("replay", STREAM, GROUP, e2)
        self.assertEqual(done.returncode, 69, done.output)
        self.assertIn("OOM command not allowed", done.stderr)
        with self.assertRaises(redis_py.exceptions.ResponseError) as refused:
            self.r.fcall(REPLAY_FUNCTION, 2, DLQ, REPLAY, e2)
        # redis-py 4.3 (Debian 12) keeps Redis's "OOM command not allowed ...";
        # 6.1 (Debian 13) raises OutOfMemoryError, a ResponseError, without "OOM ".
        self.assertRegex(str(refused.exception), r"OOM|maxmemory")
        self.r.config_set("maxmemory", 0)
        self.assertEqual(self.dlq_ids(), [e2], "the refused dead letter stays")
        self.assert_replayed_exactly([o1])

        done = self.dlq("replay", STREAM, GROUP, e2)
        self.assertEqual(done.returncode, 0, done.output)
        self.assert_replayed_exactly([o1, o2])
        self.assertEqual(self.dlq_ids(), [])

    def test_replay_function_contract(self):
        """FCALL outbox_consumer_replay_v1 2 <dlq> <replay> <entry id>, as
        docs/CONSUMERS.md documents it for callers other than the tool."""
        entry, orig = self.dead_letter(original=self.original(payload=BINARY_PAYLOAD))
        lost, _ = self.dead_letter("lost", "the entry was deleted", original={})
        self.assertEqual(self.dlq("replay", STREAM, GROUP, "1-0").returncode, 65)  # loads it

        new_id = self.r.fcall(REPLAY_FUNCTION, 2, DLQ, REPLAY, entry)
        self.assertEqual(self.replayed(), [(new_id.decode(), orig)],
                         "the original fields, in order, no dlq.* field, under the new id")
        self.assertEqual(self.dlq_ids(), [lost])
        self.assertIsNone(self.r.fcall(REPLAY_FUNCTION, 2, DLQ, REPLAY, entry),
                          "a dead letter replayed already is not there any more")

        with self.assertRaises(redis_py.exceptions.ResponseError) as e:
            self.r.fcall(REPLAY_FUNCTION, 2, DLQ, REPLAY, lost)
        self.assertRegex(str(e.exception), r"^NOTREPLAYABLE dead letter " + re.escape(lost))
        for bad in ((1, DLQ, entry), (2, DLQ, REPLAY), (2, DLQ, REPLAY, "x-1"),
                    (2, DLQ, REPLAY, entry, "extra")):
            with self.assertRaises(redis_py.exceptions.ResponseError) as e:
                self.r.fcall(REPLAY_FUNCTION, *bad)
            self.assertRegex(str(e.exception), r"^(usage|entry id)", bad)
        self.r.set("plain", b"x")
        with self.assertRaises(redis_py.exceptions.ResponseError) as e:
            self.r.fcall(REPLAY_FUNCTION, 2, DLQ, "plain", lost)
        self.assertIn("WRONGTYPE replay key plain holds a string", str(e.exception))
        with self.assertRaises(redis_py.exceptions.ResponseError) as e:
            self.r.fcall(REPLAY_FUNCTION, 2, "plain", REPLAY, lost)
        self.assertIn("WRONGTYPE dead-letter key plain holds a string", str(e.exception))
        self.assertEqual(self.dlq_ids(), [lost], "no error changed anything")
        self.assertEqual(len(self.replayed()), 1)

    def test_replay_needs_function_load(self):
        """A Redis user without FUNCTION LOAD can list dead letters but not replay them;
        the tool names the permissions it needs and changes nothing."""
        entry, orig = self.dead_letter()
        self.r.execute_command("ACL", "SETUSER", "operator", "reset", "on", ">secret", "~*",
                               "&*", "+@all", "-function")
        self.addCleanup(self.r.execute_command, "ACL", "DELUSER", "operator")
        url = f"redis://operator:secret@127.0.0.1:{self.redis.port}/0"
        self.assertEqual(self.dlq("list", STREAM, GROUP, redis_url=url).returncode, 0)
        done = self.dlq("replay", STREAM, GROUP, entry, redis_url=url)
        self.assertEqual(done.returncode, 69, done.output)
        self.assertIn("NOPERM", done.stderr)
        self.assertIn("+function|load and +fcall", done.stderr)
        self.assertEqual(self.dlq_ids(), [entry])
        self.assertFalse(self.r.exists(REPLAY), "nothing created before the refusal")
        self.r.execute_command("ACL", "SETUSER", "operator", "+function|load")
        done = self.dlq("replay", STREAM, GROUP, entry, redis_url=url)
        self.assertEqual(done.returncode, 0, done.output)
        self.assert_replayed_exactly([orig])

    # ---- purge ---------------------------------------------------------

    def test_purge_ids_range_and_all(self):
        ids = [self.dead_letter(error=f"e{n}")[0] for n in range(8)]
        done = self.dlq("purge", STREAM, GROUP, ids[0], f"{ids[2]}-{ids[4]}")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("purged 4 dead letter(s) from {orders}.email.dlq", done.stdout)
        self.assertEqual(self.dlq_ids(), [ids[1], ids[5], ids[6], ids[7]])

        done = self.dlq("purge", STREAM, GROUP, ids[1], "1-0")
        self.assertEqual(done.returncode, 65, done.output)
        self.assertIn("no dead letter 1-0", done.stderr)
        self.assertIn("purged 1 dead letter(s)", done.stdout)
        self.assertEqual(self.dlq_ids(), [ids[5], ids[6], ids[7]])

        done = self.dlq("purge", STREAM, GROUP, "--all")
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("purged 3 dead letter(s)", done.stdout)
        self.assertEqual(self.r.exists(DLQ), 0, "--all deletes the key")
        self.assertFalse(self.r.exists(REPLAY), "purge replays nothing")
        self.assertEqual(self.r.xlen(STREAM), 2)

    # ---- errors --------------------------------------------------------

    def test_migrate_from_the_names_before_0_2(self):
        """`dlq migrate` renames orders.email.dlq/.replay to {orders}.email.dlq/.replay,
        keeping the replay stream's group; when the new name exists already it
        moves the entries; a second run has nothing to move."""
        for i in range(3):
            self.r.xadd("orders.email.dlq", {"n": str(i)})
            self.r.xadd("orders.email.replay", {"n": str(i)})
        self.r.xgroup_create("orders.email.replay", GROUP, id="0")
        self.r.xadd(DLQ, {"n": "new"})  # a consumer of 0.2 dead-lettered already
        done = self.dlq("migrate", STREAM, GROUP)
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("moved 3 entries from orders.email.dlq to {orders}.email.dlq", done.stdout)
        self.assertIn("renamed orders.email.replay to {orders}.email.replay", done.stdout)
        self.assertFalse(self.r.exists("orders.email.dlq", "orders.email.replay"))
        self.assertEqual([f[b"n"] for _, f in self.r.xrange(DLQ)], [b"new", b"0", b"1", b"2"])
        self.assertEqual(self.r.xlen(REPLAY), 3)
        self.assertEqual(self.r.xinfo_groups(REPLAY)[0]["name"], GROUP.encode())
        again = self.dlq("migrate", STREAM, GROUP)
        self.assertEqual(again.returncode, 0, again.output)
        self.assertIn("orders.email.dlq: nothing to move", again.stdout)
        self.r.set("orders.email.dlq", "not a stream")
        refused = self.dlq("migrate", STREAM, GROUP)
        self.assertEqual(refused.returncode, 65, refused.output)
        self.assertIn("orders.email.dlq is not a stream: left as it is", refused.stderr)

    def test_missing_stream_or_group(self):
        entry, _ = self.dead_letter()
        self.dead_letter(stream="gone", group=GROUP)
        for verb, extra in (("list", []), ("show", [entry]), ("replay", ["--all"]),
                            ("purge", ["--all"])):
            done = self.dlq(verb, "gone", GROUP, *extra)
            self.assertEqual(done.returncode, 65, done.output)
            self.assertIn('stream "gone" does not exist', done.stderr)
            done = self.dlq(verb, STREAM, "nobody", *extra)
            self.assertEqual(done.returncode, 65, done.output)
            self.assertIn('group "nobody" does not exist on stream "orders"', done.stderr)
        self.assertEqual(self.dlq_ids(), [entry], "nothing changed")
        self.assertEqual(self.r.xlen("{gone}.email.dlq"), 1)
        self.assertFalse(self.r.exists(REPLAY) or self.r.exists("{gone}.email.replay"))

        self.r.set("plain", b"x")
        done = self.dlq("list", "plain", GROUP)
        self.assertEqual(done.returncode, 65, done.output)
        self.assertIn('"plain" is not a stream', done.stderr)

    def test_bad_usage(self):
        entry, _ = self.dead_letter()
        for args in ([], ["list"], ["list", STREAM], ["frob", STREAM, GROUP],
                     ["list", STREAM, GROUP, "--count", "0"],
                     ["list", STREAM, GROUP, "--count"],
                     ["list", STREAM, GROUP, "extra"],
                     ["show", STREAM, GROUP], ["show", STREAM, GROUP, "abc"],
                     ["show", STREAM, GROUP, entry, entry],
                     ["show", STREAM, GROUP, f"{entry}-{entry}"],
                     ["replay", STREAM, GROUP], ["replay", STREAM, GROUP, "--all", entry],
                     ["replay", STREAM, GROUP, "12"], ["replay", STREAM, GROUP, "1-x"],
                     ["replay", STREAM, GROUP, "5-0-1-0"], ["replay", STREAM, GROUP, "1-0-2"],
                     ["purge", STREAM, GROUP], ["purge", STREAM, GROUP, "--all", "x"]):
            done = self.dlq(*args)
            self.assertEqual(done.returncode, 64, f"dlq {args}: {done.output}")
            self.assertIn("Usage: outbox-relay", done.stderr, f"dlq {args}")
        self.assertEqual(self.dlq_ids(), [entry])
        helped = self.dlq("--help")
        self.assertEqual(helped.returncode, 0, helped.output)
        self.assertIn("FROM-TO", helped.stdout)
        top = harness.run_relay(["--help"])
        self.assertIn("dlq replay", top.stdout)

    def test_redis_unreachable_or_refusing(self):
        secret = "pa55-Not-Printed"
        down = harness.free_port()
        done = self.dlq("list", STREAM, GROUP,
                        redis_url=f"redis://someone:{secret}@127.0.0.1:{down}/0")
        self.assertEqual(done.returncode, 69, done.output)
        self.assertIn("cannot connect to Redis", done.stderr)
        self.assertIn(f"127.0.0.1:{down}", done.stderr)
        self.assertNotIn(secret, done.output)

        with harness.Redis(password="right-password") as guarded:
            guarded.client().xgroup_create(STREAM, GROUP, id="0", mkstream=True)
            done = self.dlq("list", STREAM, GROUP,
                            redis_url=f"redis://:{secret}@127.0.0.1:{guarded.port}/0")
            self.assertEqual(done.returncode, 69, done.output)
            self.assertIn("AUTH", done.stderr)
            self.assertNotIn(secret, done.output)
            ok = self.dlq("list", STREAM, GROUP, redis_url=guarded.url())
            self.assertEqual(ok.returncode, 0, ok.output)
            self.assertNotIn("right-password", ok.output)

        # Without any Redis setting the command is a configuration error.
        env = harness.relay_env()
        done = harness.run_relay(["dlq", "list", STREAM, GROUP], env=env)
        self.assertEqual(done.returncode, 78, done.output)
        self.assertIn("redis", done.stderr)


class ConsumerSchemaTest(harness.PostgresTestCase):
    """migrations/consumer/*.sql on a fresh database of its own."""

    DATABASE = "consumer_app"
    # A cluster with an empty database and none of the producer's migrations.
    pg_options = dict(migrations=False, database=DATABASE)
    reset_outbox = False  # there is no outbox here

    @classmethod
    def setUpClass(cls):
        if not CONSUMER_MIGRATIONS:
            raise AssertionError("no migrations/consumer/*.sql")
        super().setUpClass()
        cls.pg.apply_migrations(CONSUMER_MIGRATIONS)
        with cls.db.cursor() as cur:
            cur.execute("CREATE TABLE effects (message_id uuid, what text);"
                        "GRANT INSERT, SELECT ON effects TO outbox_consumer;"
                        "CREATE ROLE consumer_login LOGIN IN ROLE outbox_consumer;"
                        "CREATE ROLE stranger LOGIN")

    def setUp(self):
        super().setUp()
        with self.db.cursor() as cur:
            cur.execute("TRUNCATE outbox_consumer.processed, effects")

    def connect(self, autocommit=True, user="postgres"):
        conn = self.pg.connect(autocommit=autocommit, user=user)
        self.addCleanup(conn.close)
        return conn

    def begin(self, conn, consumer, message_id):
        with conn.cursor() as cur:
            cur.execute("SELECT outbox_consumer.begin_message(%s, %s)", (consumer, message_id))
            return cur.fetchone()[0]

    def processed(self):
        with self.db.cursor() as cur:
            cur.execute("SELECT consumer, message_id::text FROM outbox_consumer.processed"
                        " ORDER BY 1, 2")
            return cur.fetchall()

    def snapshot(self):
        text = harness.run_command([os.path.join(self.pg.bindir, "pg_dump"), "-h", "127.0.0.1",
                                    "-p", str(self.pg.port), "-U", "postgres", "-d", self.DATABASE,
                                    "--schema-only"], "pg_dump")
        dump = [line for line in text.splitlines()
                if not line.startswith(("\\restrict", "\\unrestrict"))]
        with self.db.cursor() as cur:
            cur.execute("SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname LIKE 'outbox%'"
                        " ORDER BY 1")
            roles = cur.fetchall()
            cur.execute("SELECT version, name, applied_at FROM outbox_consumer.schema_version"
                        " ORDER BY 1")
            versions = cur.fetchall()
        return dump, roles, versions

    def test_apply_twice_changes_nothing(self):
        message_id = str(uuid.uuid4())
        self.assertTrue(self.begin(self.db, "email", message_id))
        before = self.snapshot()
        for _ in range(2):
            self.pg.apply_migrations(CONSUMER_MIGRATIONS)  # raises if any file fails
        after = self.snapshot()
        diff = "\n".join(difflib.unified_diff(before[0], after[0], "first", "again",
                                               lineterm=""))
        self.assertEqual(diff, "", "applying the consumer migrations again changed the schema")
        self.assertEqual(before[1:], after[1:])
        self.assertEqual(before[1], [("outbox_consumer", False)], "one NOLOGIN role")
        self.assertEqual([v[:2] for v in after[2]], [(2, "002_schema_version.sql"),
                                                     (3, "003_purge_processed.sql")])
        self.assertEqual(self.processed(), [("email", message_id)], "data kept")
        self.assertFalse(scalar(self.db, "SELECT to_regclass('outbox.messages') IS NOT NULL"),
                         "the consumer set does not need or create the producer's outbox")

    def test_begin_message_true_once_per_consumer(self):
        m1, m2 = str(uuid.uuid4()), str(uuid.uuid4())
        self.assertIs(self.begin(self.db, "email", m1), True)
        self.assertIs(self.begin(self.db, "email", m1), False)
        self.assertIs(self.begin(self.db, "invoice", m1), True)
        self.assertIs(self.begin(self.db, "email", m2), True)
        self.assertIs(self.begin(self.db, "invoice", m1), False)
        self.assertEqual(len(self.processed()), 3)
        for bad in (("", m1), (None, m1), ("email", None)):
            with self.assertRaises(psycopg2.errors.InvalidParameterValue):
                self.begin(self.db, *bad)

    def effect_in_transaction(self, conn, consumer, message_id, commit):
        """The documented pattern: begin_message and the effect in one transaction."""
        new = self.begin(conn, consumer, message_id)
        if new:
            with conn.cursor() as cur:
                cur.execute("INSERT INTO effects VALUES (%s, 'email sent')", (message_id,))
        if commit:
            conn.commit()
        else:
            conn.rollback()
        return new

    def test_rolled_back_transaction_leaves_no_processed_row(self):
        conn = self.connect(autocommit=False, user="consumer_login")
        m = str(uuid.uuid4())
        self.assertTrue(self.effect_in_transaction(conn, "email", m, commit=False))
        self.assertEqual(self.processed(), [])
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM effects"), 0)
        self.assertTrue(self.effect_in_transaction(conn, "email", m, commit=True),
                        "after a rollback the next delivery is new again")
        self.assertFalse(self.effect_in_transaction(conn, "email", m, commit=True),
                         "a redelivery after the commit is a no-op")
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM effects"), 1)
        self.assertEqual(self.processed(), [("email", m)])

    def test_concurrent_delivery_waits_for_the_first(self):
        for first_commits in (True, False):
            m = str(uuid.uuid4())
            first = self.connect(autocommit=False)
            second = self.connect(autocommit=False)
            self.assertTrue(self.begin(first, "email", m))
            answer = {}

            def run():
                try:
                    answer["new"] = self.begin(second, "email", m)
                    second.commit()
                except Exception as e:  # reported below
                    answer["error"] = e
            t = threading.Thread(target=run, daemon=True)
            t.start()
            t.join(1.0)
            self.assertTrue(t.is_alive(), "the second delivery did not wait for the first")
            if first_commits:
                first.commit()
            else:
                first.rollback()
            t.join(30)
            self.assertFalse(t.is_alive())
            self.assertNotIn("error", answer)
            self.assertIs(answer["new"], not first_commits)
            self.assertEqual(self.processed().count(("email", m)), 1)

    def test_purge_processed(self):
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox_consumer.processed (consumer, message_id, handled_at)"
                        " VALUES ('email', gen_random_uuid(), now() - interval '40 days'),"
                        "        ('email', gen_random_uuid(), now() - interval '25 hours'),"
                        "        ('email', gen_random_uuid(), now() - interval '2 hours'),"
                        "        ('invoice', gen_random_uuid(), now())")
        for short in ("1 hour", "23 hours 59 minutes", "-5 days", None):
            with self.assertRaises(psycopg2.errors.InvalidParameterValue) as ctx:
                scalar(self.db, "SELECT outbox_consumer.purge_processed(%s::interval)", (short,))
            self.assertIn("shorter than 1 day", str(ctx.exception))
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox_consumer.processed"), 4)
        conn = self.connect(user="consumer_login")
        self.assertEqual(scalar(conn, "SELECT outbox_consumer.purge_processed('30 days')"), 1)
        self.assertEqual(scalar(conn, "SELECT outbox_consumer.purge_processed('1 day')"), 1)
        self.assertEqual(scalar(conn, "SELECT outbox_consumer.purge_processed('1 day')"), 0)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox_consumer.processed"), 2)
        # In batches: at most max_rows a call, oldest first; again until fewer come back.
        with self.db.cursor() as cur:
            cur.execute("INSERT INTO outbox_consumer.processed (consumer, message_id, handled_at)"
                        " SELECT 'email', gen_random_uuid(), now() - interval '40 days' - i"
                        " * interval '1 minute' FROM generate_series(1, 25) AS i")
        got = [scalar(conn, "SELECT outbox_consumer.purge_processed('30 days', 10)")
               for _ in range(4)]
        self.assertEqual(got, [10, 10, 5, 0])
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox_consumer.processed"), 2)

    def test_role_rights(self):
        m = str(uuid.uuid4())
        member = self.connect(user="consumer_login")
        self.assertTrue(self.begin(member, "email", m))
        self.assertEqual(scalar(member, "SELECT max(version) FROM outbox_consumer.schema_version"),
                         3)
        stranger = self.connect(user="stranger")
        with self.assertRaises(psycopg2.errors.InsufficientPrivilege):
            self.begin(stranger, "email", str(uuid.uuid4()))
        with contextlib.suppress(psycopg2.Error):
            stranger.rollback()
        with self.assertRaises(psycopg2.errors.InsufficientPrivilege):
            scalar(stranger, "SELECT outbox_consumer.purge_processed('30 days')")


if __name__ == "__main__":
    unittest.main()
