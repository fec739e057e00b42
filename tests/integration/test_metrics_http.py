"""The metrics endpoint under idle, half-open and slow clients.

A liveness probe on /healthz that gets no answer restarts a healthy relay, so
clients that connect and send nothing, or half a request, or a byte a second,
must never keep /healthz and /metrics from answering. Promises tested:

- with 200 idle connections open (half silent, half with half a request
  line), every one of 20 fresh GET /healthz answers 200, each within 1 s
  (a bound far above the milliseconds it takes, so a shared machine cannot
  fail it; a locked-out endpoint never answers), and GET /metrics answers;
- with more idle connections than the endpoint holds (1000), fresh requests
  are still served: the oldest idle connections are closed to admit them,
  and one warning says so;
- a slow client that sends one byte a second is closed within its request
  deadline, and never holds its slot for good;
- with an open-files limit below the number of connections (64), fresh
  requests are still served (idle connections are closed to free a
  descriptor) and the relay does not spin on its listening socket: it uses
  well under a second of CPU while 200 idle connections are held for 3 s;
- the endpoint's clients never take the relay's last SPARE_FDS descriptors:
  with 64 open files and a flood of idle connections, at least that many
  stay free, and the relay reconnects to a restarted Redis and delivers
  while the flood goes on.

Times are printed (p50 and max) for the record, not asserted beyond the bound.
"""

import os
import re
import resource
import socket
import statistics
import time
import unittest

from testkit import harness

harness.require_relay()
harness.set_deadline(240)

IDLE = 200
MANY_IDLE = 1000
PROBES = 20
ANSWER_WITHIN = 1.0  # seconds; see the module docstring
SPARE_FDS = 16  # descriptors the endpoint leaves to the relay (relay/metrics.c)


def open_idle(port, n):
    """n connections that never finish a request: every other one sends half a line."""
    conns = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 2:
            s.sendall(b"GET /heal")
        conns.append(s)
    return conns


def closed_by_peer(s):
    """True when the server has closed s (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class MetricsHttpTest(harness.ServerTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = MANY_IDLE + 200
        if soft < want:
            if hard != resource.RLIM_INFINITY and hard < want:
                raise unittest.SkipTest(f"needs {want} open files, the limit is {hard}")
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

    def setUp(self):
        super().setUp()
        self.conns = []
        self.addCleanup(self.close_all)

    def start_relay(self, open_files=None):
        """A relay with the endpoint on a free port; open_files limits its descriptors."""
        self.port = harness.free_port()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, hard))  # inherited
        try:
            self.relay_proc = self.relay(metrics_listen=f"127.0.0.1:{self.port}",
                                         poll_interval="200ms")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        harness.wait_until(lambda: harness.http_get(self.port, "/healthz")[0] == 200, timeout=15,
                           relay=self.relay_proc, message="the metrics endpoint to answer")
        return self.relay_proc

    def cpu_seconds(self):
        with open(f"/proc/{self.relay_proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def free_descriptors(self, limit):
        """How many of the relay's descriptors below limit are not open."""
        return limit - sum(1 for fd in os.listdir(f"/proc/{self.relay_proc.pid}/fd")
                           if int(fd) < limit)

    def close_all(self):
        for s in self.conns:
            s.close()
        self.conns = []

    def probe(self, what):
        times = []
        for i in range(PROBES):
            status, body, elapsed = harness.http_get(self.port, "/healthz")
            self.assertEqual(status, 200, f"{what}: /healthz probe {i} got no answer"
                                          f" after {elapsed:.3f}s")
            self.assertEqual(body, b"ok\n")
            times.append(elapsed)
        print(f"{what}: /healthz p50 {statistics.median(times) * 1000:.1f} ms,"
              f" max {max(times) * 1000:.1f} ms over {PROBES} probes", flush=True)
        self.assertLess(max(times), ANSWER_WITHIN, f"{what}: a /healthz probe was too slow")
        status, body, elapsed = harness.http_get(self.port, "/metrics")
        self.assertEqual(status, 200, f"{what}: /metrics got no answer after {elapsed:.3f}s")
        self.assertIn(b"outbox_relay_up", body)
        print(f"{what}: /metrics {len(body)} bytes in {elapsed * 1000:.1f} ms", flush=True)
        self.assertLess(elapsed, ANSWER_WITHIN)

    def test_idle_connections_do_not_lock_out_probes(self):
        self.start_relay()
        self.conns = open_idle(self.port, IDLE)
        self.probe(f"{IDLE} idle connections")
        self.assertTrue(self.relay_proc.alive())

    def test_more_idle_connections_than_slots(self):
        self.start_relay()
        self.conns = open_idle(self.port, MANY_IDLE)
        self.probe(f"{MANY_IDLE} idle connections")
        # The oldest idle connections made room; the newest are still open.
        harness.wait_until(lambda: closed_by_peer(self.conns[0]), timeout=5,
                           message="the oldest idle connection to be closed")
        self.assertFalse(closed_by_peer(self.conns[-1]), "the newest idle connection was closed")
        self.assertTrue(self.relay_proc.alive())
        # Said once, not once per connection.
        self.relay_proc.wait_for_log(r"WARNING metrics: closed \d+ client\(s\) that sent no")
        self.assertEqual(len(re.findall(r"metrics: closed", self.relay_proc.log())), 1)

    def test_a_byte_a_second_does_not_hold_a_slot(self):
        self.start_relay()
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.conns = [s]
        line = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 30 + b"\r\n\r\n"
        started = time.monotonic()
        closed_after = None
        for byte in line:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - started
                break
            if closed_by_peer(s):
                closed_after = time.monotonic() - started
                break
            # Meanwhile the endpoint answers others.
            self.assertEqual(harness.http_get(self.port, "/healthz")[0], 200)
            time.sleep(1.0)
        self.assertIsNotNone(closed_after, "a client sending a byte a second was never closed")
        print(f"a byte a second: closed after {closed_after:.1f} s", flush=True)
        self.assertLess(closed_after, 15.0)

    def test_a_low_open_files_limit(self):
        self.start_relay(open_files=64)
        before = self.cpu_seconds()
        self.conns = open_idle(self.port, IDLE)
        self.probe(f"{IDLE} idle connections, 64 open files")
        # Keep idle connections coming for 3 s, more than the descriptors left.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            self.conns += open_idle(self.port, 20)
            time.sleep(0.1)
        self.probe("after 3 s more")
        used = self.cpu_seconds() - before
        print(f"relay CPU while flooded with a low open-files limit: {used:.2f} s", flush=True)
        self.assertLess(used, 1.0, "the relay spins on its listening socket")
        self.assertTrue(self.relay_proc.alive())

    def test_idle_clients_leave_descriptors_for_the_relay(self):
        relay = self.start_relay(open_files=64)
        self.conns = open_idle(self.port, IDLE)
        self.probe(f"{IDLE} idle connections, 64 open files")
        free = self.free_descriptors(64)
        print(f"{IDLE} idle connections, 64 open files: {free} descriptors free", flush=True)
        self.assertGreaterEqual(free, SPARE_FDS, "idle HTTP clients took the relay's last"
                                                 " descriptors")
        # Redis restarts while idle connections keep coming: the relay needs a
        # descriptor for its new connection, and must deliver.
        self.redis.kill()
        flood_until = time.monotonic() + 1.0
        while time.monotonic() < flood_until:  # the descriptors it closed get taken
            self.conns += open_idle(self.port, 20)
            time.sleep(0.1)
        self.redis.start()
        harness.insert(self.db, "fds", b"after the restart")
        deadline = time.monotonic() + 30
        while harness.count_unsent(self.db) > 0:
            self.assertLess(time.monotonic(), deadline,
                            "the row was not delivered while idle clients flooded the"
                            " endpoint:\n" + harness.tail(relay.log()))
            self.conns += open_idle(self.port, 20)
            time.sleep(0.1)
        self.assertEqual(len(harness.stream_entries(self.r, harness.stream_names(self.r)[0])), 1)
        self.assertTrue(relay.alive())


if __name__ == "__main__":
    unittest.main()
