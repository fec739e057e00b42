"""Behind a connection pooler: PgBouncer in session mode works, transaction mode is refused.

Promises tested (docs/DESIGN.md, "Behind a connection pooler"):
- with postgres pointing at PgBouncer in session mode, rows committed before
  and after the start arrive exactly once, and an idle relay is woken by
  NOTIFY (LISTEN through the pooler) long before its 30 s poll;
- with PgBouncer in transaction mode, the relay exits at start with code 78
  (a configuration error, like a bad value) and an ERROR line that
  names transaction pooling and says what to do, and publishes nothing;
- the same refusal with the pool down to one server, where every statement of
  every connection shares one session;
- nothing is claimed before every connection has passed its check: with all
  connections but the claim connection held back at connect, that one passes
  both of its looks alone, and still claims nothing before the refusal;
- a connection that cannot connect holds no one back: with the others held
  past connect_timeout, the one claim connection delivers on its own;
- PostgreSQL itself, without a pooler, passes the check (every other file).
"""

import re
import struct
import threading
import time
import unittest

from testkit import faults
from testkit import harness
from testkit.harness import insert, wait_until

harness.require_relay()
harness.set_deadline(240)

EX_CONFIG = 78

SSL_REQUEST, GSSENC_REQUEST = 80877103, 80877104


def recv_exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("client closed during its startup")
        data += chunk
    return data


def read_startup(client):
    """A PostgreSQL client's startup message and its application_name. TLS
    and GSS encryption are turned down, so the startup comes in clear."""
    while True:
        head = recv_exactly(client, 8)
        length, code = struct.unpack("!ii", head)
        if code in (SSL_REQUEST, GSSENC_REQUEST):
            client.sendall(b"N")
            continue
        body = recv_exactly(client, length - 8)
        fields = body.split(b"\0")
        params = dict(zip(fields[0::2], fields[1::2]))
        return head + body, params.get(b"application_name", b"").decode()


class HoldAllButFirst:
    """A faults.HoldingProxy hold: the first connection whose application_name
    is `first` goes through at once, every other one waits `delay` seconds.
    held lists the application_names held back."""

    def __init__(self, first, delay):
        self.first = first
        self.delay = delay
        self.let_through = False
        self.held = []
        self.lock = threading.Lock()

    def __call__(self, client):
        startup, app = read_startup(client)
        with self.lock:
            if app == self.first and not self.let_through:
                self.let_through = True
                return 0, startup
            self.held.append(app)
        return self.delay, startup


class PgBouncerTest(harness.ServerTestCase):

    def relay_through(self, bouncer, dsn=None, **flags):
        return self.enterContext(harness.Relay(
            None, self.redis, env={"OUTBOX_RELAY_POSTGRES": dsn or bouncer.dsn()}, **flags))

    def test_session_mode_delivers_and_wakes_on_notify(self):
        bouncer = self.enterContext(harness.PgBouncer(self.pg, pool_mode="session"))
        before = [insert(self.db, "pooled", b"before %d" % i) for i in range(50)]
        relay = self.relay_through(bouncer, poll_interval="30s")
        wait_until(lambda: set(before) <= set(harness.entries_by_message_id(self.r)),
                   timeout=30, relay=relay, message="the rows committed before the start")
        # Every connection passed the session check and is ready.
        for role in ("listen", "owner", "claim"):
            relay.wait_for_log(rf"INFO pg: {role} connection to .* ready", timeout=10)
        # Idle with a 30 s poll: only a notification can bring these in time.
        last_id = harness.stream_entries(self.r, "pooled")[-1][0]
        for i in range(10):
            message_id = insert(self.db, "pooled", b"after %d" % i)
            committed = time.monotonic()
            reply = self.r.xread({"pooled": last_id}, count=1, block=5000)
            self.assertTrue(reply, f"row {i} did not arrive within 5 s of its commit through"
                                   f" the session pool (poll interval 30 s)\n{relay.log_tail()}")
            entry_id, fields = reply[0][1][0]
            self.assertEqual(fields[b"id"].decode(), message_id)
            self.assertLess(time.monotonic() - committed, 5.0)
            last_id = entry_id
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        figures = self.verifier().report(" (through PgBouncer, session mode)")
        figures.assert_exactly_once(self)
        self.assertEqual((figures.committed, figures.published), (60, 60), figures.line())
        self.assertTrue(relay.alive(), relay.log_tail())
        self.assertNotIn("transaction pooling", relay.log())

    def assert_refused(self, bouncer, dsn=None):
        insert(self.db, "refused", b"must stay in the outbox")
        relay = self.relay_through(bouncer, dsn, poll_interval="200ms")
        code = relay.wait(timeout=30)
        log = relay.log()
        self.assertEqual(code, EX_CONFIG, f"exit code through a transaction pool\n{log}")
        line = re.search(r"^\S+ ERROR \S+: .*transaction pooling.*$", log, re.MULTILINE)
        self.assertIsNotNone(line, f"an ERROR line naming transaction pooling\n{log}")
        self.assertIn("pool_mode = session", line.group(0), "the line says what to do")
        self.assertIn("PostgreSQL directly", line.group(0))
        self.assertEqual(harness.count_unsent(self.db), 1, "nothing was claimed")
        self.assertEqual(harness.stream_names(self.r), [], "nothing was published")
        return line.group(0)

    def test_transaction_mode_is_refused_at_start(self):
        bouncer = self.enterContext(harness.PgBouncer(self.pg, pool_mode="transaction"))
        line = self.assert_refused(bouncer)
        print(f"refusal: {line}", flush=True)

    def test_transaction_mode_with_one_server_is_refused(self):
        bouncer = self.enterContext(harness.PgBouncer(self.pg, pool_mode="transaction",
                                                      pool_size=1))
        self.assert_refused(bouncer)

    def test_nothing_is_claimed_before_every_connection_is_checked(self):
        # The claim connection connects alone and passes both of its looks in
        # a session no one else uses yet; the other connections (listen,
        # owner, ...) arrive 2 s later and are handed that same session. A
        # batch read in those 2 s would publish the row before the refusal.
        bouncer = self.enterContext(harness.PgBouncer(self.pg, pool_mode="transaction"))
        hold = HoldAllButFirst("outbox-relay", delay=2.0)
        proxy = faults.HoldingProxy(bouncer.port, hold)
        self.addCleanup(proxy.close)
        self.assert_refused(bouncer, bouncer.dsn(port=proxy.port))
        # The relay reads and publishes batches on one claim connection
        # ("outbox-relay"), the one let through.
        self.assertTrue(hold.let_through, "no claim connection came")
        self.assertLessEqual({"outbox-relay listen", "outbox-relay owner"}, set(hold.held),
                             "the listen and owner connections were held back")

    def test_a_connection_that_cannot_connect_holds_no_one_back(self):
        # The wait for the other connections' checks ends when they fail:
        # a connection with no session shares none.
        bouncer = self.enterContext(harness.PgBouncer(self.pg, pool_mode="session"))
        hold = HoldAllButFirst("outbox-relay", delay=120.0)
        proxy = faults.HoldingProxy(bouncer.port, hold)
        self.addCleanup(proxy.close)
        rows = [insert(self.db, "alone", b"row %d" % i) for i in range(20)]
        relay = self.relay_through(bouncer, bouncer.dsn(port=proxy.port), connect_timeout="1s",
                                   poll_interval="200ms")
        wait_until(lambda: set(rows) <= set(harness.entries_by_message_id(self.r)),
                   timeout=30, relay=relay,
                   message="the rows, through the one claim connection that connected")
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertTrue(relay.alive(), relay.log_tail())
        self.assertLessEqual({"outbox-relay listen", "outbox-relay owner"}, set(hold.held))
        self.assertRegex(relay.log(), r"listen connection .*no connection within connect_timeout")
        figures = self.verifier().report(" (the others cannot connect)")
        figures.assert_exactly_once(self)

    def test_refusal_is_repeatable(self):
        # The check must not depend on luck: five starts, five refusals.
        bouncer = self.enterContext(harness.PgBouncer(self.pg, pool_mode="transaction"))
        for _ in range(5):
            self.assert_refused(bouncer)
            harness.reset(self.db, self.r)


if __name__ == "__main__":
    unittest.main(verbosity=2)
