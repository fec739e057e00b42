"""TLS to both servers, with the certificates checked (docs/OPERATIONS.md, "TLS").

A test certificate authority and server certificates are made with openssl
for each run. Promises tested:
- PostgreSQL that refuses TCP without TLS, and the relay logging in as a
  login role of outbox_relay with a password (SCRAM): with
  sslmode=verify-full and the CA as sslrootcert, rows are delivered, and
  every connection of the relay is encrypted (pg_stat_ssl); the certificate
  names localhost and no address, so this holds only if the host name the
  relay looked up stays what libpq verifies (docs/OPERATIONS.md, "Host
  names");
- the same with a CA that did not sign the server's certificate: the relay
  never connects, its log says the certificate could not be verified, and
  nothing is marked sent;
- Redis through stunnel (hiredis 0.14 has no TLS): the relay talks to a
  local stunnel client that verifies the server's certificate (CAfile,
  checkHost) and a stunnel server in front of Redis; rows are delivered end
  to end, and the TLS port does not speak plain Redis;
- the stunnel client given a CA that did not sign the certificate: the
  handshake fails, the relay is never ready and marks nothing sent.

Redis over its own TLS port (redis-server --tls-port, client certificates
required), with rediss:// URLs (docs/REDIS.md, "TLS to Redis"):
- built with TLS (hiredis 1.x with hiredis_ssl): the relay delivers rows
  with mutual TLS, the example consumer (the consumer library) handles each
  once, and `outbox-relay status` reads the streams, all through rediss://;
- a CA that did not sign the server's certificate, or a server name the
  certificate does not carry: the relay never connects, marks nothing sent,
  and its log and the status command's error say which (verify=ca drops the
  name check, and then rows are delivered);
- ca_dir, a directory of CA certificates named by their hash, in place of
  ca_file: rows are delivered and `status` reads, and one holding another
  CA refuses the server as ca_file does;
- --check-config refuses an unknown option, a missing CA file, and a key
  that is not the certificate's, naming the file;
- built without TLS (hiredis 0.14): --check-config refuses rediss:// and
  says what to do.
"""

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import unittest
import urllib.parse

import redis as redis_py

from testkit import consumers, harness
from testkit.harness import insert_many, scalar, wait_until

harness.require_relay()
harness.set_deadline(300)

RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="500ms",
                   connect_timeout="1s")
PASSWORD = "tls-Relay-Pw-" + os.urandom(6).hex()


class TlsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="outbox-tls-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.ca = harness.make_ca(cls.dir, "outbox-test-ca")
        cls.other_ca = harness.make_ca(cls.dir, "another-ca")
        # The server's certificate names localhost alone, no address: the
        # relay looks the name up itself and gives libpq the address in
        # hostaddr, with the name kept in host, which verify-full checks.
        cls.cert = harness.make_cert(cls.dir, cls.ca, "server", hosts=("localhost",))
        os.chmod(cls.dir, 0o755)
        harness.keep_secret(PASSWORD)
        cls.pg = cls.enterClassContext(harness.Postgres(tls=cls.cert))
        cls.db = cls.pg.connect()
        cls.addClassCleanup(cls.db.close)
        with cls.db.cursor() as cur:
            cur.execute(f"CREATE ROLE tls_relay LOGIN PASSWORD '{PASSWORD}' IN ROLE outbox_relay")

    def setUp(self):
        harness.reset(self.db)

    def dsn(self, ca):
        return (f"host=localhost port={self.pg.port} dbname={self.pg.database} user=tls_relay "
                f"password={PASSWORD} sslmode=verify-full sslrootcert={ca}")

    def relay(self, redis, pg_ca=None, redis_url=None):
        env = {"OUTBOX_RELAY_POSTGRES": self.dsn(pg_ca or self.ca[0])}
        if redis_url:
            env["OUTBOX_RELAY_REDIS"] = redis_url
        return self.enterContext(harness.Relay(None, redis, env=env, **RELAY_FLAGS))

    def deliver(self, relay, redis, n=50):
        insert_many(self.db, [("orders", b'{"n": %d}' % i) for i in range(n)])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(redis.client().xlen("orders"), n)

    def test_postgres_with_verify_full(self):
        redis = self.enterContext(harness.Redis())
        relay = self.relay(redis)
        self.deliver(relay, redis)
        rows = self.db.cursor()
        rows.execute("SELECT s.ssl, s.version FROM pg_stat_ssl s JOIN pg_stat_activity a"
                     " USING (pid) WHERE a.usename = 'tls_relay'")
        conns = rows.fetchall()
        print(f"relay's PostgreSQL connections: {conns}", flush=True)
        self.assertGreaterEqual(len(conns), 2)
        self.assertTrue(all(ssl for ssl, _ in conns), conns)

    def test_postgres_certificate_of_another_ca_is_refused(self):
        redis = self.enterContext(harness.Redis())
        relay = self.relay(redis, pg_ca=self.other_ca[0])
        insert_many(self.db, [("orders", b'{"n": 1}')])
        line = relay.wait_for_log(r"^.*certificate verify failed.*", timeout=20)
        self.assertIn("point sslrootcert in postgres at the CA", line.group(0))
        print(f"refused: {line.group(0).strip()[:400]}", flush=True)
        time.sleep(1)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages"
                                         " WHERE sent_at IS NOT NULL"), 0)
        self.assertEqual(redis.client().exists("orders"), 0)

    def tunnel(self, redis, ca):
        """stunnel server in front of Redis, and a client that checks it."""
        server = self.enterContext(harness.Stunnel(connect=redis.port, server=self.cert))
        client = self.enterContext(harness.Stunnel(connect=server.port, client_ca=ca))
        return server, client

    def test_redis_through_stunnel(self):
        redis = self.enterContext(harness.Redis())
        server, client = self.tunnel(redis, self.ca[0])
        url = redis.url().replace(f"127.0.0.1:{redis.port}/", f"127.0.0.1:{client.port}/")
        relay = self.relay(redis, redis_url=url)
        self.deliver(relay, redis)
        # The relay's connections reach Redis from the stunnel server only.
        clients = redis.client().client_list()
        relay_conns = [c for c in clients if c.get("user") == "outbox-relay"]
        self.assertGreater(len(relay_conns), 0)
        # The TLS side does not speak plain Redis.
        with contextlib.closing(redis_py.Redis(host="127.0.0.1", port=server.port,
                                                       socket_timeout=2)) as plain:
            with self.assertRaises(redis_py.exceptions.RedisError):
                plain.ping()
        self.assertIn("Certificate accepted", client.log())

    def test_redis_certificate_of_another_ca_is_refused(self):
        redis = self.enterContext(harness.Redis())
        server, client = self.tunnel(redis, self.other_ca[0])
        url = redis.url().replace(f"127.0.0.1:{redis.port}/", f"127.0.0.1:{client.port}/")
        relay = self.relay(redis, redis_url=url)
        insert_many(self.db, [("orders", b'{"n": 1}')])
        wait_until(lambda: "certificate verify failed" in client.log().lower()
                   or "Certificate check failed" in client.log(), timeout=20,
                   message="stunnel to refuse the certificate")
        relay.wait_for_log(r"ERROR redis: .*", timeout=20)
        time.sleep(1)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages"
                                         " WHERE sent_at IS NOT NULL"), 0)
        self.assertEqual(redis.client().exists("orders"), 0)


def built_with_tls():
    """Whether the relay under test speaks TLS to Redis itself (its --version)."""
    done = harness.run_relay(["--version"])
    return "with TLS to Redis" in done.stdout


class RedisTlsTest(consumers.ConsumerTestCase):
    """rediss:// to redis-server's own TLS port, which asks for client certificates."""

    @classmethod
    def setUpClass(cls):
        cls.tls = built_with_tls()
        cls.dir = tempfile.mkdtemp(prefix="outbox-redis-tls-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.ca = harness.make_ca(cls.dir, "outbox-test-ca")
        cls.other_ca = harness.make_ca(cls.dir, "another-ca")
        # Redis's and the Sentinel's, which they also show as clients (to
        # each other, with tls-replication).
        cls.server_cert = harness.make_cert(cls.dir, cls.ca, "redis",
                                            usage="serverAuth,clientAuth")
        cls.client_cert = harness.make_cert(cls.dir, cls.ca, "relay", hosts=("outbox-relay",),
                                            usage="clientAuth")
        os.chmod(cls.dir, 0o755)
        for f in os.listdir(cls.dir):
            os.chmod(os.path.join(cls.dir, f), 0o644)
        cls.tls_port = harness.free_port()
        cls.redis_options = dict(extra_args=[
            "--tls-port", str(cls.tls_port), "--tls-cert-file", cls.server_cert[0],
            "--tls-key-file", cls.server_cert[1], "--tls-ca-cert-file", cls.ca[0],
            "--tls-auth-clients", "yes"])
        super().setUpClass()

    def url(self, user="outbox-relay", **options):
        """A rediss:// URL of the TLS port for user, with the test's CA and
        client certificate unless options say otherwise (None: left out)."""
        opts = dict(ca_file=self.ca[0], cert_file=self.client_cert[0],
                    key_file=self.client_cert[1])
        opts.update(options)
        query = "&".join(f"{k}={urllib.parse.quote(v, safe='/')}" for k, v in opts.items()
                         if v is not None)
        plain = self.redis.url(user)
        return (plain.replace("redis://", "rediss://", 1)
                .replace(f"127.0.0.1:{self.redis.port}/", f"localhost:{self.tls_port}/")
                + ("?" + query if query else ""))

    def check_config(self, url):
        env = harness.relay_env(self.pg, extra={"OUTBOX_RELAY_REDIS": url})
        return harness.run_relay(["--check-config"], env=env)

    def tools(self, args, url):
        env = harness.relay_env(self.pg, extra={"OUTBOX_RELAY_REDIS": url})
        return harness.run_relay(args, env=env, timeout=30)

    def need_tls(self):
        if not self.tls:
            self.skipTest("this build has no TLS to Redis (hiredis 0.14)")

    def test_without_tls_rediss_is_refused(self):
        if self.tls:
            self.skipTest("this build has TLS to Redis")
        done = self.check_config(self.url())
        self.assertNotEqual(done.returncode, 0, done.output)
        self.assertIn("rediss:// (TLS) needs outbox-relay built against hiredis 1.x", done.output)
        self.assertIn("stunnel", done.output)

    def test_relay_consumer_and_tools_over_tls(self):
        self.need_tls()
        self.assertEqual(self.check_config(self.url()).returncode, 0)
        relay = self.relay(env={"OUTBOX_RELAY_REDIS": self.url()}, **RELAY_FLAGS)
        n = 50
        insert_many(self.db, [("orders", b'{"n": %d}' % i) for i in range(n)])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(self.r.xlen("orders"), n)
        relay_conns = [c for c in self.r.client_list() if c.get("user") == "outbox-relay"]
        self.assertGreater(len(relay_conns), 0)
        # The consumer library, through rediss:// with the consumers' user.
        consumer = self.enterContext(consumers.Consumer(
            self.pg, self.redis, consumer="tls1", block="100ms",
            redis_url=self.url("outbox-consumer")))
        wait_until(lambda: consumers.effects(self.db) == (n, n), timeout=30,
                   message="the consumer to handle every message over TLS", relay=consumer)
        self.assertNotIn("ERROR", consumer.log())
        # The operator commands, with the tools' user.
        done = self.tools(["status"], self.url("outbox-tools"))
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("orders", done.stdout)

    def assert_refused(self, why, **options):
        relay = self.relay(env={"OUTBOX_RELAY_REDIS": self.url(**options)}, **RELAY_FLAGS)
        insert_many(self.db, [("orders", b'{"n": 1}')])
        line = relay.wait_for_log(r"^.*the certificate of Redis at localhost:\d+ was refused.*$",
                                  timeout=20)
        print(f"refused: {line.group(0).strip()[:400]}", flush=True)
        self.assertRegex(line.group(0), why)
        time.sleep(1)
        self.assertEqual(scalar(self.db, "SELECT count(*) FROM outbox.messages"
                                         " WHERE sent_at IS NOT NULL"), 0)
        self.assertEqual(self.r.exists("orders"), 0)
        # The blocking connect of the tools says the same.
        done = self.tools(["status"], self.url("outbox-tools", **options))
        self.assertNotEqual(done.returncode, 0, done.output)
        self.assertRegex(done.output, r"the certificate of Redis at localhost:\d+ was refused")
        self.assertRegex(done.output, why)

    def test_without_a_client_certificate_the_relay_says_which_option_is_missing(self):
        self.need_tls()
        relay = self.relay(env={"OUTBOX_RELAY_REDIS": self.url(cert_file=None, key_file=None)},
                           **RELAY_FLAGS)
        insert_many(self.db, [("orders", b'{"n": 1}')])
        # TLS 1.3: the server refuses after the handshake, as an alert or as
        # the connection closed or reset, whichever the relay reads first.
        line = relay.wait_for_log(r"^.*ERROR redis: .*$", timeout=20)
        print(f"refused: {line.group(0).strip()[:400]}", flush=True)
        self.assertRegex(line.group(0), r"cert_file and key_file")
        self.assertEqual(self.r.exists("orders"), 0)
        done = self.tools(["status"], self.url("outbox-tools", cert_file=None, key_file=None))
        self.assertNotEqual(done.returncode, 0, done.output)
        self.assertRegex(done.output, r"cert_file and key_file")

    def test_certificate_of_another_ca_is_refused(self):
        self.need_tls()
        # OpenSSL names it by the chain the server sends: with or without its root.
        self.assert_refused(r"(unable to get local issuer certificate|self-signed certificate in "
                            r"certificate chain)", ca_file=self.other_ca[0])

    def test_wrong_server_name_is_refused(self):
        self.need_tls()
        self.assert_refused("hostname mismatch", server_name="redis.example")

    def ca_dir(self, name, ca):
        """A directory holding ca alone, named by its hash (openssl rehash)."""
        path = os.path.join(self.dir, name)
        os.makedirs(path, exist_ok=True)
        shutil.copy(ca[0], os.path.join(path, "ca.crt"))
        subprocess.run(["openssl", "rehash", path], check=True, capture_output=True)
        return path

    def test_ca_directory(self):
        """ca_dir in place of ca_file: the relay and the tools find the CA in
        the directory."""
        self.need_tls()
        ca_dir = self.ca_dir("ca-dir", self.ca)
        relay = self.relay(env={"OUTBOX_RELAY_REDIS": self.url(ca_file=None, ca_dir=ca_dir)},
                           **RELAY_FLAGS)
        insert_many(self.db, [("orders", b'{"n": %d}' % i) for i in range(5)])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(self.r.xlen("orders"), 5)
        done = self.tools(["status"], self.url("outbox-tools", ca_file=None, ca_dir=ca_dir))
        self.assertEqual(done.returncode, 0, done.output)

    def test_ca_directory_of_another_ca_is_refused(self):
        self.need_tls()
        self.assert_refused(r"(unable to get local issuer certificate|self-signed certificate in "
                            r"certificate chain)", ca_file=None,
                            ca_dir=self.ca_dir("other-ca-dir", self.other_ca))

    def test_verify_ca_leaves_the_name_unchecked(self):
        self.need_tls()
        relay = self.relay(env={"OUTBOX_RELAY_REDIS": self.url(server_name="redis.example",
                                                               verify="ca")}, **RELAY_FLAGS)
        insert_many(self.db, [("orders", b'{"n": 1}')])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(self.r.xlen("orders"), 1)

    def test_sentinel_over_tls(self):
        """A Sentinel reached on its TLS port names the primary by its TLS
        port and IP address: the relay and the tools connect to both with the
        URL's options, and rows are delivered."""
        self.need_tls()
        sentinel_tls = harness.free_port()
        sentinel = self.enterContext(harness.Sentinel(
            self.redis, quorum=1, primary_port=self.tls_port, extra_conf=[
                f"tls-port {sentinel_tls}", f"tls-cert-file {self.server_cert[0]}",
                f"tls-key-file {self.server_cert[1]}", f"tls-ca-cert-file {self.ca[0]}",
                "tls-replication yes", "tls-auth-clients yes"]))
        wait_until(lambda: sentinel.primary() == self.tls_port, timeout=20,
                   message="the Sentinel to name the primary's TLS port")
        env = {"OUTBOX_RELAY_REDIS": self.url(),
               "OUTBOX_RELAY_REDIS_SENTINEL": f"127.0.0.1:{sentinel_tls}",
               "OUTBOX_RELAY_REDIS_MASTER": sentinel.master}
        relay = self.relay(env=env, **RELAY_FLAGS)
        insert_many(self.db, [("orders", b'{"n": %d}' % i) for i in range(20)])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        self.assertEqual(self.r.xlen("orders"), 20)
        relay.wait_for_log(rf"names 127\.0\.0\.1:{self.tls_port} as the primary", timeout=5)
        done = harness.run_relay(["status"], timeout=30, env=harness.relay_env(self.pg, extra={
            **env, "OUTBOX_RELAY_REDIS": self.url("outbox-tools")}))
        self.assertEqual(done.returncode, 0, done.output)
        self.assertIn("orders", done.stdout)
        # A Sentinel certificate from another CA: never asked.
        env["OUTBOX_RELAY_REDIS"] = self.url(ca_file=self.other_ca[0])
        refused = harness.run_relay(["status"], timeout=30, env=harness.relay_env(
            self.pg, extra={**env, "OUTBOX_RELAY_REDIS": self.url("outbox-tools",
                                                                  ca_file=self.other_ca[0])}))
        self.assertNotEqual(refused.returncode, 0, refused.output)
        self.assertRegex(refused.output, rf"no Sentinel named the primary .*the certificate of "
                                         rf"Redis at 127\.0\.0\.1:{sentinel_tls} was refused")

    def test_cluster_over_tls(self):
        """A Redis Cluster whose nodes talk TLS (tls-cluster): seeded with
        their TLS ports, the relay follows the slot map, which names TLS ports
        to a TLS client, and delivers to every primary."""
        self.need_tls()
        cluster = self.enterContext(harness.RedisCluster(
            primaries=3, replicas=0, tls=(self.server_cert, self.ca[0])))
        query = self.url().split("?", 1)[1]
        env = {"OUTBOX_RELAY_REDIS": cluster.tls_url(query)}
        relay = self.enterContext(harness.Relay(self.pg, None, env=env, **RELAY_FLAGS))
        topics = [f"t{i}" for i in range(12)]
        insert_many(self.db, [(topic, b'{"n": %d}' % i) for topic in topics for i in range(5)])
        harness.wait_all_sent(self.db, timeout=60, relay=relay)
        reader = cluster.reader()
        self.addCleanup(reader.close)
        lengths = {t: reader.owner_xlen(t) for t in topics}
        self.assertEqual(lengths, {t: 5 for t in topics})
        owners = {id(reader.owner[t.encode()]) for t in topics}
        self.assertEqual(len(owners), 3, "the topics are spread over the three primaries")
        relay.wait_for_log(r"redis cluster of 3 primaries", timeout=5)

    def test_bad_tls_options_are_refused_at_check_config(self):
        self.need_tls()
        missing = os.path.join(self.dir, "missing-ca.crt")
        cases = [
            (self.url(cafile="x"), "unknown option \"cafile\""),
            (self.url(ca_file=missing), f"TLS option ca_file {missing}: No such file or directory"),
            (self.url(key_file=self.server_cert[1]),
             f"TLS option key_file {self.server_cert[1]}: "),
            (self.url(key_file=self.server_cert[1]), "give the private key of cert_file"),
            (self.url(key_file=None), "cert_file and key_file go together"),
        ]
        for url, message in cases:
            with self.subTest(message=message):
                done = self.check_config(url)
                self.assertNotEqual(done.returncode, 0, done.output)
                self.assertIn(message, done.output)


if __name__ == "__main__":
    unittest.main()
