"""A malformed or unexpected reply from Redis is an error for the batch, never a crash.

No real Redis answers EXEC with an integer, nests arrays nine deep or sends
bytes that are not RESP, so this file uses a small peer that speaks just
enough RESP to pass the relay's set-up (AUTH, CLUSTER SLOTS, SELECT, CLIENT
SETNAME, FUNCTION LOAD, CONFIG GET, TIME, XINFO STREAM of a stream that does
not exist yet) and then answers the publishing commands of every batch
(MULTI, XADD <id> ..., EXEC) with one chosen bad reply: in EXEC's place, or
in place of an XADD's QUEUED. For each kind the relay must stay up, record
nothing (every row stays in outbox.unsent, none is quarantined: the failure
is the batch's, not a row's), say in its log that the batch was not
published, and exit 0 on SIGTERM. A last test points the same relay
configuration at a real Redis and shows the rows arrive once the peer is
gone.
"""

import socket
import threading
import time
import unittest

from testkit import harness
from testkit.harness import insert

harness.require_relay()
harness.set_deadline(240)

BAD_REPLIES = {
    "integer": b":1\r\n",
    "nil": b"$-1\r\n",
    "array": b"*2\r\n$1\r\na\r\n$1\r\nb\r\n",
    "nested-too-deep": b"*1\r\n" * 9 + b":1\r\n",
    "not-resp": b"?garbage\r\n",
    "bulk-length-lies": b"$99999999999999999999\r\n",
}


def read_command(f):
    """Reads one RESP array of bulk strings; None at EOF."""
    line = f.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        return [line.strip()]
    n = int(line[1:])
    args = []
    for _ in range(n):
        size = int(f.readline()[1:])
        args.append(f.read(size + 2)[:-2])
    return args


class BadPeer:
    """Answers the set-up like Redis 7, queues MULTI's commands, and answers
    every publish with self.reply: in EXEC's place (bad_command b"EXEC"), or
    in place of each XADD's QUEUED (b"XADD"; EXEC then aborts as Redis does
    after a command that could not be queued)."""

    def __init__(self, reply, bad_command=b"EXEC"):
        self.reply = reply
        self.bad_command = bad_command
        self.publishes = 0
        self.connections = 0
        self.other = set()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        f = conn.makefile("rb")
        in_multi = False
        try:
            while True:
                args = read_command(f)
                if args is None:
                    return
                cmd = args[0].upper()
                if cmd == b"MULTI":
                    in_multi = True
                    conn.sendall(b"+OK\r\n")
                elif cmd == b"EXEC":
                    in_multi = False
                    if self.bad_command == b"EXEC":
                        self.publishes += 1
                        conn.sendall(self.reply)
                    else:
                        conn.sendall(b"-EXECABORT Transaction discarded because of previous"
                                     b" errors.\r\n")
                elif cmd == b"DISCARD":
                    in_multi = False
                    conn.sendall(b"+OK\r\n")
                elif cmd in (b"XADD", b"FCALL"):
                    if cmd == self.bad_command or cmd == b"FCALL":
                        self.publishes += 1
                        conn.sendall(self.reply)
                    elif in_multi:
                        conn.sendall(b"+QUEUED\r\n")
                    else:
                        conn.sendall(b"-ERR XADD outside MULTI is not expected here\r\n")
                elif in_multi:
                    conn.sendall(b"+QUEUED\r\n")
                elif cmd == b"SCAN":
                    conn.sendall(b"*2\r\n$1\r\n0\r\n*0\r\n")
                elif cmd == b"XINFO":
                    conn.sendall(b"-ERR no such key\r\n")
                elif cmd == b"CONFIG":
                    conn.sendall(b"*6\r\n$10\r\nappendonly\r\n$3\r\nyes\r\n$11\r\nappendfsync\r\n"
                                 b"$6\r\nalways\r\n$16\r\nmaxmemory-policy\r\n$10\r\nnoeviction\r\n")
                elif cmd == b"TIME":
                    now = time.time()
                    secs, usecs = str(int(now)).encode(), str(int(now % 1 * 1e6)).encode()
                    conn.sendall(b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
                                 % (len(secs), secs, len(usecs), usecs))
                elif cmd == b"CLUSTER":
                    conn.sendall(b"-ERR This instance has cluster support disabled\r\n")
                elif cmd == b"FUNCTION":
                    conn.sendall(b"$12\r\noutbox_relay\r\n")
                else:
                    self.other.add(cmd)
                    conn.sendall(b"+OK\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.closed = True
        self.sock.close()


class MalformedReplyTest(harness.ServerTestCase):

    def check_bad_reply(self, kind, bad_command=b"EXEC"):
        peer = BadPeer(BAD_REPLIES[kind], bad_command)
        self.addCleanup(peer.close)
        for i in range(5):
            insert(self.db, "orders", f"row {i}".encode())
        relay = self.relay(env={"OUTBOX_RELAY_REDIS": peer.url()}, poll_interval="200ms",
                           reconnect_min="50ms", reconnect_max="300ms", publish_timeout="1s")
        harness.wait_until(lambda: peer.publishes >= 1, timeout=20, relay=relay,
                           message=f"a publish answered with a bad reply ({kind}"
                                   f" to {bad_command.decode()})")
        # Let it retry a few times against the same bad peer.
        calls = peer.publishes
        harness.wait_until(lambda: peer.publishes > calls, timeout=20, relay=relay,
                           message="a retry after backoff")
        self.assertTrue(relay.alive(), f"relay died on a {kind} reply\n{relay.log_tail()}")
        self.assertEqual(harness.count_unsent(self.db), 5,
                         "a row was recorded as sent without a valid publish reply")
        self.assertEqual(harness.scalar(self.db, "SELECT count(*) FROM outbox.stream_positions"
                                                 " WHERE topic <> ''"), 0,
                         "a stream's position was recorded without a valid publish reply")
        self.assertEqual(harness.quarantined(self.db), {}, "a batch-level failure blamed a row")
        # The log says the batch was not published, and why.
        relay.wait_for_log(r"WARNING batch: batch not published: \S", timeout=10)
        self.assertEqual(relay.terminate(), 0)

    def test_integer_reply(self):
        self.check_bad_reply("integer")

    def test_nil_reply(self):
        self.check_bad_reply("nil")

    def test_array_reply(self):
        self.check_bad_reply("array")

    def test_nesting_beyond_the_parser_limit(self):
        self.check_bad_reply("nested-too-deep")

    def test_bytes_that_are_not_resp(self):
        self.check_bad_reply("not-resp")

    def test_bulk_length_that_lies(self):
        self.check_bad_reply("bulk-length-lies")

    def test_integer_in_place_of_queued(self):
        self.check_bad_reply("integer", b"XADD")

    def test_array_in_place_of_queued(self):
        self.check_bad_reply("array", b"XADD")

    def test_bytes_that_are_not_resp_in_place_of_queued(self):
        self.check_bad_reply("not-resp", b"XADD")

    def test_rows_arrive_once_a_real_redis_answers(self):
        peer = BadPeer(BAD_REPLIES["integer"])
        for i in range(5):
            insert(self.db, "orders", f"row {i}".encode())
        with harness.Relay(self.pg, env={"OUTBOX_RELAY_REDIS": peer.url()},
                           poll_interval="200ms", reconnect_min="50ms",
                           reconnect_max="300ms") as relay:
            harness.wait_until(lambda: peer.publishes >= 2, timeout=20, relay=relay)
            self.assertEqual(relay.terminate(), 0)
        peer.close()
        relay = self.relay(poll_interval="200ms")
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(len(harness.stream_entries(self.r, "orders")), 5)


if __name__ == "__main__":
    unittest.main()
