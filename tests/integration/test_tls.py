"""TLS to both servers, with the certificates checked (docs/OPERATIONS.md, "TLS").

A test certificate authority and server certificates are made with openssl
for each run. Promises tested:
- PostgreSQL that refuses TCP without TLS, and the relay logging in as a
  login role of outbox_relay with a password (SCRAM): with
  sslmode=verify-full and the CA as sslrootcert, rows are delivered, and
  every connection of the relay is encrypted (pg_stat_ssl);
- the same with a CA that did not sign the server's certificate: the relay
  never connects, its log says the certificate could not be verified, and
  nothing is marked sent;
- Redis through stunnel (hiredis 0.14 has no TLS): the relay talks to a
  local stunnel client that verifies the server's certificate (CAfile,
  checkHost) and a stunnel server in front of Redis; rows are delivered end
  to end, and the TLS port does not speak plain Redis;
- the stunnel client given a CA that did not sign the certificate: the
  handshake fails, the relay is never ready and marks nothing sent.
"""

import contextlib
import os
import shutil
import tempfile
import time
import unittest

import redis as redis_py

from testkit import harness
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
        cls.cert = harness.make_cert(cls.dir, cls.ca, "server")
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


if __name__ == "__main__":
    unittest.main()
