"""The consumer in Python, examples/python/outbox_consumer.py, over TLS (rediss://).

It takes the relay's rediss:// URLs and their options (docs/REDIS.md, "TLS to Redis"). One
redis-server has a plain port, where the relay publishes (this build of the relay may have
no TLS: hiredis 0.14), and a TLS port (tls-port) whose certificate, from a CA made for the
run, names "localhost" only; the consumers read through the TLS port as the
outbox-consumer user. Promises tested:
- with ca_file, every message has its effect once, and the consumer's connections are to
  the TLS port (CLIENT LIST laddr);
- with a CA that did not sign the server's certificate, it never processes anything, makes
  no consumer group, and logs that the certificate of Redis was refused, and why;
- the name (verify=full, the default): a server_name the certificate does not carry, or a
  URL host it does not carry (127.0.0.1), is refused with a message naming the mismatch and
  the name; verify=ca drops the name check, and server_name=localhost makes the host
  127.0.0.1 pass;
- mutual TLS (tls-auth-clients yes): with cert_file and key_file it processes every message;
  without them Redis refuses it and nothing is processed;
- an unknown option, a missing ca_file, cert_file without key_file, a key that is not the
  certificate's, verify=maybe: exit code 2 with a message that names it, before any
  connection (a listening socket sees none), and never the password.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse

try:  # python3-redis (and python3-psycopg2): the example and the testkit need them
    import redis as redis_py
    from testkit import consumers, harness
    Base, MISSING = harness.PostgresTestCase, None
except ImportError as e:
    redis_py, harness, Base, MISSING = None, None, unittest.TestCase, e

if harness is not None:
    harness.require_relay()
    harness.set_deadline(180)
    SCRIPT = os.path.join(harness.SOURCE_DIR, "examples", "python", "outbox_consumer.py")

N = 30  # rows per test


def tls_unsupported():
    """Why the Redis server under test cannot serve TLS, or None."""
    done = subprocess.run([harness.redis_server_binary(), "--port", "0", "--tls-port", "0",
                           "--save", ""], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=30)
    out = (done.stdout + done.stderr).decode(errors="replace")
    if "FATAL CONFIG" in out or "Bad directive" in out:
        return f"{harness.REDIS_SERVER} was built without TLS: " + " ".join(out.split())[-200:]
    return None


class PythonConsumer(harness.Daemon if harness else object):
    """examples/python/outbox_consumer.py as a process (see harness.Daemon)."""

    def __init__(self, test, name, url, group="email"):
        argv = [sys.executable, SCRIPT, "--redis", url, "--postgres", test.pg.dsn(),
                "--consumer", name, "--group", group, "--backoff", "100ms,200ms",
                "--block", "100ms"]
        super().__init__(argv, harness.relay_env(), f"consumer {name}")


class PythonTlsTest(Base):

    @classmethod
    def setUpClass(cls):
        if MISSING is not None:
            raise unittest.SkipTest(f"python3-redis or python3-psycopg2 is missing: {MISSING}")
        why = tls_unsupported()
        if why:
            raise unittest.SkipTest(why)
        cls.dir = tempfile.mkdtemp(prefix="outbox-python-tls-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.ca = harness.make_ca(cls.dir, "outbox-test-ca")
        cls.other_ca = harness.make_ca(cls.dir, "another-ca")
        cls.server_cert = harness.make_cert(cls.dir, cls.ca, "redis", hosts=("localhost",))
        cls.client_cert = harness.make_cert(cls.dir, cls.ca, "consumer",
                                            hosts=("outbox-consumer",), usage="clientAuth")
        os.chmod(cls.dir, 0o755)
        for f in os.listdir(cls.dir):
            os.chmod(os.path.join(cls.dir, f), 0o644)
        super().setUpClass()  # PostgreSQL
        consumers.apply_consumer_schema(cls.pg)
        cls.tls_port = harness.free_port()
        cls.redis = cls.enterClassContext(harness.Redis(extra_args=[
            "--tls-port", str(cls.tls_port), "--tls-cert-file", cls.server_cert[0],
            "--tls-key-file", cls.server_cert[1], "--tls-ca-cert-file", cls.ca[0],
            "--tls-auth-clients", "no"]))
        cls.r = cls.redis.client()
        cls.addClassCleanup(cls.r.close)

    def setUp(self):
        super().setUp()
        self.r.flushall()
        consumers.reset_effects(self.db)

    def url(self, host="localhost", **options):
        """The consumer's rediss:// URL of the TLS port, with the test's CA unless options
        say otherwise (None: left out)."""
        opts = dict(ca_file=self.ca[0])
        opts.update(options)
        query = "&".join(f"{k}={urllib.parse.quote(v, safe='/')}" for k, v in opts.items()
                         if v is not None)
        return (self.redis.url("outbox-consumer").replace("redis://", "rediss://", 1)
                .replace(f"127.0.0.1:{self.redis.port}/", f"{host}:{self.tls_port}/")
                + ("?" + query if query else ""))

    def consumer(self, name, url, group="email"):
        c = PythonConsumer(self, name, url, group)
        self.addCleanup(c.close)
        self.addCleanup(c.stop)
        return c.start()

    def relayed(self, n=N):
        """n rows committed and published by the relay (over the plain port)."""
        relay = self.enterContext(harness.Relay(self.pg, self.redis, poll_interval="100ms"))
        harness.insert_many(self.db, [("orders", b'{"order": %d, "customer": "c%d"}' % (i, i))
                                      for i in range(n)])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(self.r.xlen("orders"), n)

    def assert_all_once(self, c, group="email"):
        harness.wait_until(lambda: consumers.effects(self.db, group) == (N, N), timeout=30,
                           relay=c, message=f"group {group} to handle every message over TLS")
        self.assertNotIn("Traceback", c.log())

    def assert_refused(self, c, group, regex):
        """c logs regex at its first connection and retries, and never gets a command
        through: no effect, no consumer group."""
        line = c.wait_for_log(r"^.* ERROR consumer: Redis: .*$", timeout=20).group(0)
        print(f"refused: {line.strip()[:300]}", flush=True)
        self.assertRegex(line, regex)
        time.sleep(1.5)  # a retry or two
        self.assertTrue(c.alive(), c.log_tail())
        self.assertEqual(consumers.effects(self.db, group), (0, 0))
        groups = {g["name"].decode() for g in self.r.xinfo_groups("orders")}
        self.assertNotIn(group, groups)
        self.assertNotIn("Traceback", c.log())

    def test_ca_file_each_effect_once(self):
        self.relayed()
        c = self.consumer("tls-a", self.url())
        self.assert_all_once(c)
        ports = {int(x["laddr"].rsplit(":", 1)[1]) for x in self.r.client_list()
                 if x.get("user") == "outbox-consumer"}
        self.assertEqual(ports, {self.tls_port}, "the consumer reads through the TLS port")
        self.assertEqual(c.terminate(), 0)
        self.assertRegex(c.log(), rf"(?m)^consumer tls-a: delivered=\d+ done={N} ")

    def test_certificate_of_another_ca_is_refused(self):
        self.relayed()
        c = self.consumer("tls-b", self.url(ca_file=self.other_ca[0]))
        # OpenSSL names it by the chain the server sends: with or without its root.
        self.assert_refused(c, "email", r"the certificate of Redis at localhost:\d+ was refused: "
                                         r"(unable to get local issuer certificate|self-signed "
                                         r"certificate in certificate chain) \(check ca_file")

    def test_server_name(self):
        self.relayed()
        name_full = self.consumer("name-full", self.url(server_name="redis.example"), "g1")
        ip_full = self.consumer("ip-full", self.url("127.0.0.1"), "g2")
        name_ca = self.consumer("name-ca", self.url(server_name="redis.example", verify="ca"),
                                "g3")
        ip_named = self.consumer("ip-named", self.url("127.0.0.1", server_name="localhost"),
                                 "g4")
        self.assert_all_once(name_ca, "g3")
        self.assert_all_once(ip_named, "g4")
        self.assert_refused(name_full, "g1", r"was refused: Hostname mismatch, certificate is "
                                             r"not valid for 'redis\.example'")
        self.assert_refused(ip_full, "g2", r"at 127\.0\.0\.1:\d+ was refused: IP address "
                                           r"mismatch, certificate is not valid for "
                                           r"'127\.0\.0\.1'")

    def test_mutual_tls(self):
        self.r.config_set("tls-auth-clients", "yes")  # for the connections from now on
        self.addCleanup(self.r.config_set, "tls-auth-clients", "no")
        self.relayed()
        mutual = self.consumer("mutual", self.url(cert_file=self.client_cert[0],
                                                  key_file=self.client_cert[1]), "mutual")
        anonymous = self.consumer("anonymous", self.url(), "anonymous")
        self.assert_all_once(mutual, "mutual")
        # TLS 1.3: the refusal comes after the handshake, as an alert, as the
        # connection closed or, if the client was writing, as the connection reset.
        self.assert_refused(anonymous, "anonymous", r"(certificate required|TLS handshake|"
                            r"ended the TLS connection: if it asks for client certificates)")

    def test_bad_options_exit_2_before_connecting(self):
        missing = os.path.join(self.dir, "missing-ca.crt")
        cases = [
            (dict(cafile="x"), 'unknown option "cafile"'),
            (dict(ca_file=missing), f"TLS option ca_file {missing}: No such file or directory"),
            (dict(cert_file=self.client_cert[0]), "cert_file and key_file go together"),
            (dict(cert_file=self.client_cert[0], key_file=self.server_cert[1]),
             f"TLS option key_file {self.server_cert[1]} is not the key of cert_file"),
            (dict(verify="maybe"), "option verify must be full"),
        ]
        password = self.redis.passwords["outbox-consumer"]
        for options, message in cases:
            with self.subTest(message=message), socket.socket() as listener:
                listener.bind(("127.0.0.1", 0))  # where the URL points: a connection waits
                listener.listen(8)
                listener.setblocking(False)
                url = self.url("127.0.0.1", **options).replace(
                    f":{self.tls_port}/", f":{listener.getsockname()[1]}/")
                try:
                    done = subprocess.run(
                        [sys.executable, SCRIPT, "--redis", url, "--postgres", self.pg.dsn()],
                        stdin=subprocess.DEVNULL, capture_output=True, timeout=15,
                        env=harness.relay_env())
                except subprocess.TimeoutExpired:
                    self.fail("it did not stop at the URL: it ran on for 15 s")
                err = done.stderr.decode(errors="replace")
                self.assertEqual(done.returncode, 2, err)
                self.assertIn("error: --redis: " + message, err)
                self.assertNotIn(password, err)
                with self.assertRaises(BlockingIOError, msg="it connected"):
                    listener.accept()[0].close()


if __name__ == "__main__":
    unittest.main()
