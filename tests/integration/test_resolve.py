"""Host names are resolved without blocking: a silent DNS server stops nothing else.

The relay resolves the host names of its `postgres` conninfo and its `redis`
URL off its event loop. Promises tested (docs/OPERATIONS.md, "Connections" and
"Host names"):

- while the DNS server does not answer, the relay runs on: its endpoint
  serves from the start (a first answer within 10 s), its connections to
  the other server are made and none fails, every GET of
  /healthz and /metrics is answered, each within 1.5 s (far above the
  milliseconds it takes, so a shared machine cannot fail it; a loop blocked
  in the resolver answers only after the resolver's timeouts), SIGHUP is
  acted on (its reload line within 3 s) and SIGTERM stops it with code 0
  within 10 s;
- a log line names the host that cannot be resolved
  (`cannot resolve redis.outbox.test: ...`, `cannot resolve pg.outbox.test:
  ...`), and the relay did ask the name server;
- once the name resolves, the relay connects and delivers the rows committed
  before and after, exactly once; by a PostgreSQL host name, its sessions are
  on the server (pg_stat_activity, application_name outbox-relay...);
- a name the DNS says does not exist (NXDOMAIN) is logged as unknown, and
  the endpoint keeps answering.

The DNS server is this file's own (UDP and TCP on 127.0.0.77 port 53): silent
(it takes queries and never answers) or answering (an A record of 127.0.0.1
for the names under outbox.test, no AAAA record, NXDOMAIN for
nosuch.outbox.test and any other name). The relay runs in a mount namespace
of its own whose /etc/resolv.conf names that server alone; its network is
the machine's, so it reaches the loopback servers of the harness.

Needs root, unshare(1) and a free port 53 on 127.0.0.77; skipped without them.
"""

import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import tempfile
import threading
import time
import unittest

from testkit import harness
from testkit.harness import insert

harness.require_relay()
harness.set_deadline(180)

DNS_ADDR = "127.0.0.77"
ZONE = ".outbox.test"
UNKNOWN_NAME = "nosuch.outbox.test"
PG_NAME = "pg.outbox.test"
REDIS_NAME = "redis.outbox.test"
SENTINEL_NAME = "sentinel.outbox.test"
CLUSTER_NAME = "cluster.outbox.test"
RESOLV_CONF = f"nameserver {DNS_ADDR}\noptions timeout:1 attempts:2\n"
# The wrapper that gives the relay that resolv.conf: $0 is the file, "$@" the
# relay's command line (valgrind's too, under OUTBOX_RELAY_VALGRIND=1).
NAMESPACE_SCRIPT = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'

ANSWER_WITHIN = 1.5   # seconds for each GET; see the module docstring
RELOAD_WITHIN = 3.0   # seconds from SIGHUP to the reload line
EXIT_WITHIN = 10.0    # seconds from SIGTERM to the exit
PROBE_FOR = 12.0      # seconds of probing while the name server is silent
SERVES_WITHIN = 10.0  # seconds from the start to the endpoint's first answer
RELOADED = r"^\S+ \S+ config: reloaded"
RELAY_SESSIONS = ("SELECT application_name, host(client_addr) FROM pg_stat_activity"
                  " WHERE application_name LIKE 'outbox-relay%%'")


# --------------------------------------------------------------------------
# A DNS server of our own.

QTYPE_A, QTYPE_AAAA = 1, 28
RCODE_NOERROR, RCODE_FORMERR, RCODE_NXDOMAIN, RCODE_NOTIMP = 0, 1, 3, 4


def parse_query(msg):
    """(id, flags, qname, qtype, end of the question) of a DNS query, or None
    when it is not one question we can read (a name is a run of labels: no
    compression pointer in a question of a query)."""
    if len(msg) < 12:
        return None
    qid, flags, qdcount = struct.unpack("!HHH", msg[:6])
    if flags & 0x8000 or qdcount != 1:
        return (qid, flags, None, None, None)
    labels, pos = [], 12
    while True:
        if pos >= len(msg):
            return (qid, flags, None, None, None)
        n = msg[pos]
        pos += 1
        if n == 0:
            break
        if n & 0xC0 or pos + n > len(msg):
            return (qid, flags, None, None, None)
        labels.append(msg[pos:pos + n].decode("ascii", "replace"))
        pos += n
    if pos + 4 > len(msg):
        return (qid, flags, None, None, None)
    qtype, _qclass = struct.unpack("!HH", msg[pos:pos + 4])
    return (qid, flags, ".".join(labels), qtype, pos + 4)


def build_response(msg, qid, flags, qname, qtype, end):
    """The answer of the answering mode to a parsed query: its question
    copied, QR and RA set, RD and the opcode kept; an A record of 127.0.0.1
    for a name under outbox.test, no record for its other types, NXDOMAIN for
    nosuch.outbox.test and every other name."""
    opcode = flags & 0x7800
    head = 0x8000 | opcode | (flags & 0x0100) | 0x0080
    if qname is None:
        return struct.pack("!HHHHHH", qid, head | RCODE_FORMERR, 0, 0, 0, 0)
    question = msg[12:end]
    if opcode != 0:
        return struct.pack("!HHHHHH", qid, head | RCODE_NOTIMP, 1, 0, 0, 0) + question
    name = qname.lower().rstrip(".")
    answers = b""
    if name.endswith(ZONE) and name != UNKNOWN_NAME:
        rcode, count = RCODE_NOERROR, 0
        head |= 0x0400  # authoritative
        if qtype == QTYPE_A:
            # A pointer to the name in the question, A, IN, TTL 5 s, 4 bytes.
            answers = struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, 5, 4) + socket.inet_aton(
                "127.0.0.1")
            count = 1
    else:
        rcode, count = RCODE_NXDOMAIN, 0
    return struct.pack("!HHHHHH", qid, head | rcode, 1, count, 0, 0) + question + answers


class FakeDns:
    """A DNS server on DNS_ADDR port 53, UDP and TCP, as a context manager.

    mode "silent": every query is taken and none is answered (TCP connections
    are held open); "answer": see build_response. Switch with set_mode at any
    time. Counts the queries it receives, per name.
    """

    def __init__(self, addr=DNS_ADDR, port=53):
        self.addr, self.port = addr, port
        self.mode = "silent"
        self.lock = threading.Lock()
        self.queries = []  # (proto, name, qtype, mode), in arrival order
        self.stopping = threading.Event()
        self.threads = []
        self.conns = []
        self.udp = self.tcp = None

    def __enter__(self):
        try:
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind((self.addr, self.port))
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp.bind((self.addr, self.port))
            self.tcp.listen(64)
        except OSError:
            self.close_sockets()
            raise
        self.udp.settimeout(0.2)
        self.tcp.settimeout(0.2)
        self.spawn(self.serve_udp)
        self.spawn(self.serve_tcp)
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.close_sockets()
        for t in list(self.threads):
            t.join(5)
        return False

    def close_sockets(self):
        for s in [self.udp, self.tcp, *self.conns]:
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass

    def spawn(self, target, *args):
        t = threading.Thread(target=target, args=args, daemon=True,
                             name=f"fake-dns-{target.__name__}")
        self.threads.append(t)
        t.start()

    def set_mode(self, mode):
        assert mode in ("silent", "answer"), mode
        self.mode = mode

    def count(self, name=None):
        """Queries received (for name, any type and protocol)."""
        with self.lock:
            return sum(1 for q in self.queries if name is None or q[1] == name)

    def summary(self):
        with self.lock:
            seen = {}
            for proto, name, qtype, mode in self.queries:
                key = f"{name} type {qtype} over {proto} ({mode})"
                seen[key] = seen.get(key, 0) + 1
        return "; ".join(f"{k}: {n}" for k, n in seen.items()) or "no query"

    def handle(self, msg, proto):
        """The response to one query, or None (silent, or not a query)."""
        parsed = parse_query(msg)
        if parsed is None:
            return None
        qid, flags, qname, qtype, end = parsed
        mode = self.mode
        with self.lock:
            self.queries.append((proto, (qname or "?").lower().rstrip("."), qtype, mode))
        if mode == "silent" or flags & 0x8000:
            return None
        return build_response(msg, qid, flags, qname, qtype, end)

    def serve_udp(self):
        while not self.stopping.is_set():
            try:
                msg, peer = self.udp.recvfrom(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            reply = self.handle(msg, "udp")
            if reply is not None:
                try:
                    self.udp.sendto(reply, peer)
                except OSError:
                    pass

    def serve_tcp(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.tcp.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.conns.append(conn)
            self.spawn(self.serve_tcp_conn, conn)

    def serve_tcp_conn(self, conn):
        """Queries with their 2-byte length prefix, one after the other, until
        the client closes or the server stops."""
        conn.settimeout(0.2)
        buf = b""
        try:
            while not self.stopping.is_set():
                try:
                    chunk = conn.recv(4096)
                except socket.timeout:
                    continue
                if not chunk:
                    return
                buf += chunk
                while len(buf) >= 2 and len(buf) >= 2 + struct.unpack("!H", buf[:2])[0]:
                    n = struct.unpack("!H", buf[:2])[0]
                    msg, buf = buf[2:2 + n], buf[2 + n:]
                    reply = self.handle(msg, "tcp")
                    if reply is not None:
                        conn.sendall(struct.pack("!H", len(reply)) + reply)
        except OSError:
            return
        finally:
            try:
                conn.close()
            except OSError:
                pass


# --------------------------------------------------------------------------
# The endpoint.

def metrics_port(relay):
    return int(relay.env["OUTBOX_RELAY_METRICS_LISTEN"].rsplit(":", 1)[1])


class ResolveTest(harness.ServerTestCase):

    @classmethod
    def setUpClass(cls):
        # Whether the relay can be given a resolv.conf of its own, before
        # any server is started.
        unshare = shutil.which("unshare")
        if os.geteuid() != 0 or unshare is None:
            raise unittest.SkipTest("needs root and unshare(1) for a mount namespace")
        probe = subprocess.run([unshare, "-m", "true"], capture_output=True, text=True,
                               timeout=30)
        if probe.returncode != 0:
            raise unittest.SkipTest(f"unshare -m does not work here: {probe.stderr.strip()}")
        with open("/etc/hosts") as f:
            hosts = f.read().lower()
        for name in (PG_NAME, REDIS_NAME, SENTINEL_NAME, CLUSTER_NAME, UNKNOWN_NAME):
            if re.search(r"(?m)^[^#]*\s" + re.escape(name) + r"(\s|$)", hosts):
                raise unittest.SkipTest(f"{name} is in /etc/hosts: the DNS would not be asked")
        tmp = tempfile.mkdtemp(prefix="outbox-resolve-")
        try:
            cls.resolv_conf = os.path.join(tmp, "resolv.conf")
            with open(cls.resolv_conf, "w") as f:
                f.write(RESOLV_CONF)
            cls.prefix = [unshare, "-m", "sh", "-c", NAMESPACE_SCRIPT, cls.resolv_conf]
            seen = subprocess.run([*cls.prefix, "cat", "/etc/resolv.conf"], capture_output=True,
                                  text=True, timeout=30)
            if seen.returncode != 0 or seen.stdout != RESOLV_CONF:
                raise unittest.SkipTest("cannot bind-mount a resolv.conf in a mount namespace: "
                                        + (seen.stderr.strip() or repr(seen.stdout)))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        cls.addClassCleanup(shutil.rmtree, tmp, True)
        try:
            cls.dns = cls.enterClassContext(FakeDns())
        except OSError as e:
            raise unittest.SkipTest(f"cannot serve DNS on {DNS_ADDR} port 53: {e}")
        super().setUpClass()

    def setUp(self):
        super().setUp()
        self.dns.set_mode("silent")
        # The sessions of the test before have ended: those seen are this test's.
        harness.wait_until(lambda: not self.relay_sessions(), timeout=10,
                           message="the sessions of an earlier relay to end")

    # -- helpers
    def start_relay(self, redis_host=None, pg_host=None, env=None, **flags):
        """A relay with its resolv.conf naming the fake DNS alone; redis_host
        and pg_host replace the servers' address in its URL and conninfo.
        Reconnects at least once a second (reconnect_max), so that each
        name is looked up again and again while the test watches."""
        env = dict(env or {})
        if redis_host is not None:
            url, n = re.subn(r"@(?:127\.0\.0\.1|localhost):", f"@{redis_host}:",
                             self.redis.url())
            self.assertEqual(n, 1, "no host to replace in the Redis URL")  # (it has a password)
            env["OUTBOX_RELAY_REDIS"] = url
        if pg_host is not None:
            dsn, n = re.subn(r"\bhost=\S+", f"host={pg_host}", self.pg.dsn())
            self.assertEqual(n, 1, f"no host to replace in {self.pg.dsn()}")
            env["OUTBOX_RELAY_POSTGRES"] = dsn
        flags = {"poll_interval": "200ms", "reconnect_max": "1s", **flags}
        started = time.monotonic()
        relay = self.relay(prefix=self.prefix, env=env, **flags)
        port = metrics_port(relay)
        harness.wait_until(lambda: harness.http_get(port, "/healthz")[0] is not None,
                           timeout=SERVES_WITHIN, relay=relay,
                           message="the metrics endpoint to answer at all (it serves from the"
                                   " start, whatever the names)")
        took = time.monotonic() - started
        print(f"metrics endpoint: first answer {took:.2f} s after the start", flush=True)
        self.assertLess(took, SERVES_WITHIN, "the endpoint began to serve only after the"
                                             " lookups\n" + relay.log_tail())
        return relay

    def wait_unresolved(self, relay, name, reason=r"", timeout=20):
        """The log line that names the host; returns it."""
        try:
            line = relay.wait_for_log(r"^.*cannot resolve " + re.escape(name) + r"\b" + reason
                                      + r".*$", timeout=timeout).group(0)
        except AssertionError as e:
            raise AssertionError(f"{e}\nDNS queries: {self.dns.summary()}") from None
        print(f"logged: {line}", flush=True)
        return line

    def assert_asked(self, name):
        self.assertGreater(self.dns.count(name), 0,
                           f"the relay never asked the DNS server for {name}:"
                           f" {self.dns.summary()}")

    def probe(self, relay, seconds=PROBE_FOR, hup_after=None):
        """GETs /healthz and /metrics for seconds, one after the other; with
        hup_after, sends SIGHUP that many seconds in and waits for the reload
        line. Fails if a request went unanswered or took over ANSWER_WITHIN."""
        port = metrics_port(relay)
        results = []
        started = time.monotonic()
        hupped = hup_after is None
        while time.monotonic() - started < seconds:
            for path in ("/healthz", "/metrics"):
                status, _, elapsed = harness.http_get(port, path)
                results.append((path, status, elapsed, time.monotonic() - started))
            if not hupped and time.monotonic() - started >= hup_after:
                hupped = True
                since = relay.mark()
                sent = time.monotonic()
                relay.kill(signal.SIGHUP)
                relay.wait_for_log(RELOADED, timeout=RELOAD_WITHIN, since=since)
                print(f"SIGHUP: reload line after {time.monotonic() - sent:.2f} s", flush=True)
            self.assertTrue(relay.alive(), "the relay exited\n" + relay.log_tail())
            time.sleep(0.1)
        times = [r[2] for r in results]
        bad = [r for r in results if r[1] is None or r[2] > ANSWER_WITHIN]
        print(f"{len(results)} requests over {seconds:g} s:"
              f" p50 {statistics.median(times) * 1000:.1f} ms,"
              f" max {max(times) * 1000:.1f} ms; statuses"
              f" {sorted({str(r[1]) for r in results})}", flush=True)
        self.assertFalse(bad, f"{len(bad)} of {len(results)} requests unanswered or slower"
                              f" than {ANSWER_WITHIN:g} s, e.g. "
                         + ", ".join(f"{p} -> {s} after {e:.2f} s (at {at:.1f} s)"
                                     for p, s, e, at in bad[:5])
                         + "\n" + relay.log_tail())

    def stop(self, relay, what):
        sent = time.monotonic()
        code = relay.terminate(timeout=EXIT_WITHIN)
        print(f"SIGTERM {what}: exit code {code} after {time.monotonic() - sent:.2f} s",
              flush=True)
        self.assertEqual(code, 0, relay.log_tail())

    def relay_sessions(self):
        with self.db.cursor() as cur:
            cur.execute(RELAY_SESSIONS)
            return cur.fetchall()

    def wait_sessions(self, relay, timeout):
        """Waits for the relay's claim, listen and owner sessions on the server."""
        want = {"outbox-relay", "outbox-relay listen", "outbox-relay owner"}
        harness.wait_until(lambda: want <= {name for name, _ in self.relay_sessions()},
                           timeout=timeout, relay=relay,
                           message=f"the relay's sessions {sorted(want)} in pg_stat_activity")
        sessions = self.relay_sessions()
        print(f"sessions: {sorted(sessions)}", flush=True)
        return sessions

    # -- tests
    def test_redis_by_name_while_the_dns_is_silent(self):
        relay = self.start_relay(redis_host=REDIS_NAME)
        self.probe(relay, hup_after=PROBE_FOR / 2)
        self.wait_unresolved(relay, REDIS_NAME)
        self.assert_asked(REDIS_NAME)
        self.assertEqual(self.r.dbsize(), 0, "something reached Redis without its name")
        # Its other connections went on: PostgreSQL's are up, and none failed.
        self.wait_sessions(relay, timeout=10)
        self.assertEqual(harness.problem_lines(relay.log(), "pg"), [],
                         "a PostgreSQL connection failed while the Redis name did not"
                         " resolve")
        insert(self.db, "orders", b"before the name resolved")
        self.dns.set_mode("answer")
        insert(self.db, "orders", b"after the name resolved")
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.verifier().report("redis by name").assert_exactly_once(self)
        self.stop(relay, "after delivery")

    def test_postgres_by_name_while_the_dns_is_silent(self):
        relay = self.start_relay(pg_host=PG_NAME)
        self.probe(relay, hup_after=PROBE_FOR / 2)
        self.wait_unresolved(relay, PG_NAME)
        self.assert_asked(PG_NAME)
        self.assertEqual(self.relay_sessions(), [], "a session without its host's name")
        self.stop(relay, "while the name does not resolve")

    def test_postgres_by_name_once_it_resolves(self):
        relay = self.start_relay(pg_host=PG_NAME)
        self.wait_unresolved(relay, PG_NAME)
        self.probe(relay, seconds=3)
        insert(self.db, "orders", b"before the name resolved")
        self.dns.set_mode("answer")
        insert(self.db, "orders", b"after the name resolved")
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.verifier().report("postgres by name").assert_exactly_once(self)
        sessions = self.wait_sessions(relay, timeout=30)
        self.assertEqual({addr for _, addr in sessions}, {"127.0.0.1"},
                         "sessions from the address the name resolved to")
        self.stop(relay, "after delivery")

    def test_a_name_that_does_not_exist(self):
        self.dns.set_mode("answer")
        relay = self.start_relay(redis_host=UNKNOWN_NAME)
        self.wait_unresolved(relay, UNKNOWN_NAME,
                             reason=r".*(?i:not found|does not exist|unknown)")
        self.assert_asked(UNKNOWN_NAME)
        self.probe(relay, seconds=4)
        self.stop(relay, "with an unknown name")

    def test_sentinels_by_name(self):
        """A Sentinel named by host name is looked up on the loop as well:
        while the DNS is silent the endpoint serves and the log names the
        Sentinel's host; once it resolves, the Sentinel names the primary and
        the rows reach it."""
        sentinel = self.enterContext(harness.Sentinel(self.redis, quorum=1))
        harness.wait_until(lambda: sentinel.primary() == self.redis.port, timeout=20,
                           message="the Sentinel to name the primary")
        relay = self.start_relay(env={
            "OUTBOX_RELAY_REDIS_SENTINEL": f"{SENTINEL_NAME}:{sentinel.port}",
            "OUTBOX_RELAY_REDIS_MASTER": sentinel.master})
        self.wait_unresolved(relay, SENTINEL_NAME)
        self.probe(relay, seconds=3)
        self.assert_asked(SENTINEL_NAME)
        insert(self.db, "orders", b"before the name resolved")
        self.dns.set_mode("answer")
        insert(self.db, "orders", b"after the name resolved")
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        self.assertEqual(self.r.xlen("orders"), 2)
        self.stop(relay, "after delivery")

    def test_cluster_seeds_by_name(self):
        """Cluster seed nodes named by host name: looked up on the loop, then
        the slot map is followed to every primary."""
        cluster = self.enterContext(harness.RedisCluster(primaries=3, replicas=0))
        url = cluster.url().replace("127.0.0.1", CLUSTER_NAME)
        relay = self.start_relay(env={"OUTBOX_RELAY_REDIS": url})
        self.wait_unresolved(relay, CLUSTER_NAME)
        self.probe(relay, seconds=3)
        self.dns.set_mode("answer")
        topics = [f"t{i}" for i in range(12)]
        for topic in topics:
            insert(self.db, topic, b"by name")
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        reader = cluster.reader()
        self.addCleanup(reader.close)
        self.assertEqual({t: reader.owner_xlen(t) for t in topics}, {t: 1 for t in topics})
        relay.wait_for_log(r"redis cluster of 3 primaries", timeout=5)
        self.stop(relay, "after delivery")

    def test_status_command_by_name(self):
        """The operator commands (and the daemon's observation thread, which
        connects the same way) look names up within connect_timeout: with the
        DNS silent, `status` gives up in about that long and says which name;
        once it resolves, it answers."""
        def url_by_name(url):
            return re.sub(r"@(?:127\.0\.0\.1|localhost):", f"@{REDIS_NAME}:", url)

        env = harness.relay_env(self.pg, extra={
            "OUTBOX_RELAY_REDIS": url_by_name(self.redis.url("outbox-tools")),
            "OUTBOX_RELAY_POSTGRES": re.sub(r"\bhost=\S+", f"host={PG_NAME}", self.pg.dsn()),
            "OUTBOX_RELAY_CONNECT_TIMEOUT": "2s"})
        argv = [*self.prefix, harness.require_relay(), "status"]
        started = time.monotonic()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
        output = done.stdout + done.stderr
        print(f"status, DNS silent: exit {done.returncode} after {took:.1f} s", flush=True)
        self.assertNotEqual(done.returncode, 0, output)
        self.assertRegex(output, rf"cannot resolve ({re.escape(PG_NAME)}|{re.escape(REDIS_NAME)})"
                                 r": no answer from the name servers")
        self.assertLess(took, 30, "status waited for the resolver, not for connect_timeout")
        self.dns.set_mode("answer")
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
