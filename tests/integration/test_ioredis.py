"""The stream contract, checked by a client the project did not write: ioredis on Node.js.

Promise tested (the README's stream contract, read with a client the project did not write):
rows written to PostgreSQL and relayed by the real relay are read by
tests/integration/ioredis/check.js through a consumer group it creates at id 0
(XGROUP CREATE ... 0 MKSTREAM, XREADGROUP, XACK), and every documented field is
as the README says: id a UUID, topic, key absent for a NULL key, payload bytes
verbatim (NUL and 0xff bytes included), created_at RFC 3339 in UTC (Z),
outbox_id decimal, one h.<name> field per header. Consumers need nothing of
ours but the contract. And the ordered consumer's steps (docs/CONSUMERS.md,
"Ordered consumers"), called by tests/integration/ioredis/leases.js through
FCALL on the functions the relay loaded: a lease taken, renewed and refused to
another consumer; once it expired and another took it, every fenced call with
the old token answers LEASELOST and changes nothing; the new holder takes the
old one's entries over, reads, acknowledges, dead-letters and releases.

ioredis (pinned in ioredis/package.json) is installed from the npm registry
with `npm install --no-audit --no-fund` into a temporary copy of that
directory; node_modules is cached in the build tree (next to the relay binary)
between runs. Without node, npm or the registry, the file exits 77 (skipped)
and says why.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from testkit import harness
from testkit.harness import wait_until

harness.require_relay()
harness.set_deadline(400)

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK_DIR = os.path.join(HERE, "ioredis")
NPM_TIMEOUT = 240


def skip(reason):
    print(f"SKIP: {reason}", file=sys.stderr, flush=True)
    sys.exit(harness.SKIP)


def cache_dir():
    """node_modules cache in the build tree, keyed by package.json's content."""
    with open(os.path.join(CHECK_DIR, "package.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    build = os.path.dirname(harness.relay_binary())
    return os.path.join(build, "ioredis-cache", digest)


def prepare_check_dir():
    """A temporary copy of ioredis/ with ioredis installed; returns its path."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            skip(f"{tool} is not installed (the ioredis check needs Node.js and npm)")
    work = tempfile.mkdtemp(prefix="outbox-ioredis-")
    for name in ("package.json", "check.js", "leases.js"):
        shutil.copy(os.path.join(CHECK_DIR, name), work)
    cached = os.path.join(cache_dir(), "node_modules")
    if os.path.isdir(os.path.join(cached, "ioredis")):
        shutil.copytree(cached, os.path.join(work, "node_modules"), symlinks=True)
        print(f"ioredis: node_modules from the cache {cached}", file=sys.stderr)
        return work
    env = dict(os.environ, npm_config_update_notifier="false", npm_config_fund="false",
               npm_config_audit="false")
    try:
        proc = subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=work, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=NPM_TIMEOUT)
    except subprocess.TimeoutExpired:
        shutil.rmtree(work, ignore_errors=True)
        skip(f"npm install did not finish within {NPM_TIMEOUT}s (is the npm registry"
             " reachable?)")
    if proc.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        skip("npm install failed (npm registry unreachable?):\n"
             + harness.tail(proc.stdout.decode(errors="replace"), 15))
    print(f"ioredis: installed from the npm registry into {work}", file=sys.stderr)
    try:  # cache it for the next run; a failure here only costs the next run a download
        os.makedirs(os.path.dirname(cache_dir()), exist_ok=True)
        staging = tempfile.mkdtemp(prefix="staging-", dir=os.path.dirname(cache_dir()))
        shutil.copytree(os.path.join(work, "node_modules"), os.path.join(staging, "node_modules"),
                        symlinks=True)
        try:
            os.rename(staging, cache_dir())  # atomic; fails if another run cached it first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        print(f"ioredis: not cached ({e})", file=sys.stderr)
    return work


class IoredisContractTest(harness.ServerTestCase):

    @classmethod
    def setUpClass(cls):
        cls.check_dir = prepare_check_dir()
        cls.addClassCleanup(shutil.rmtree, cls.check_dir, True)
        super().setUpClass()

    def test_ioredis_reads_every_documented_field(self):
        """Rows through PostgreSQL and the real relay; ioredis reads them with a group at 0."""
        binary = bytes([0x00, 0xff, 0x00, 0x01, 0x7f, 0x80, 0xfe, 0xff]) + b"\x00tail\xff"
        with self.db.cursor() as cur:
            # A binary payload with a NULL key and two headers.
            cur.execute("SELECT outbox.enqueue('orders', NULL, %s::bytea,"
                        " '{\"content-type\": \"application/octet-stream\", \"trace\": \"t-1\"}')",
                        (binary,))
            # A JSON payload with a key, and a header that is not a string.
            cur.execute("SELECT outbox.enqueue('orders', '9001', %s::jsonb,"
                        " '{\"content-type\": \"application/json\", \"attempt\": 42}')",
                        ('{"order": 9001, "total": 42.50}',))
            # Text with non-ASCII characters, an empty key, no headers.
            cur.execute("SELECT outbox.enqueue('orders', '', %s::text)", ("grüße ✓",))
            # An empty payload with a NULL key.
            cur.execute("SELECT outbox.enqueue('orders', NULL, ''::bytea)")
        relay = self.relay(poll_interval="200ms")
        harness.wait_all_sent(self.db, timeout=30, relay=relay)

        with self.db.cursor() as cur:
            cur.execute("SELECT message_id::text, id, topic, partition_key, payload, headers"
                        " FROM outbox.messages ORDER BY id")
            rows = cur.fetchall()
        entries = []
        for message_id, row_id, topic, key, payload, headers in rows:
            entries.append({
                "id": message_id, "topic": topic, "key": key,
                "payload_hex": bytes(payload).hex(), "outbox_id": str(row_id),
                "headers": {k: v if isinstance(v, str) else json.dumps(v)
                            for k, v in (headers or {}).items()}})
        self.assertEqual(len(entries), 4)
        self.assertEqual(entries[0]["payload_hex"], binary.hex())
        wait_until(lambda: self.r.xlen("orders") == 4, timeout=10, relay=relay,
                   message="4 entries in the stream")

        expected_path = os.path.join(self.check_dir, "expected.json")
        with open(expected_path, "w") as f:
            json.dump({"stream": "orders", "group": "ioredis-check", "entries": entries}, f)
        proc = subprocess.run(["node", "check.js", self.redis.url("outbox-consumer"), expected_path],
                              cwd=self.check_dir, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        output = proc.stdout.decode(errors="replace").strip()
        print(output, file=sys.stderr, flush=True)
        self.assertEqual(proc.returncode, 0, f"check.js failed:\n{output}")
        self.assertRegex(output, r"ioredis 5\.\d+\.\d+: read 4 entries of orders")

        # The group it created is a plain Redis group: nothing left pending.
        self.assertEqual(self.r.xpending("orders", "ioredis-check")["pending"], 0)

    def test_ioredis_calls_the_lease_functions(self):
        """The ordered consumer's steps from Node.js, on the functions the relay loads."""
        relay = self.relay(poll_interval="200ms")
        wait_until(lambda: self.r.execute_command("FUNCTION", "LIST", "LIBRARYNAME",
                                                  "outbox_consumer"),
                   timeout=15, relay=relay, message="the relay to load the consumer library")
        stream, group = "orders:005", "shipping"
        self.r.xgroup_create(stream, group, id="0", mkstream=True)
        for i in range(5):
            self.r.xadd(stream, {"id": f"m{i}", "key": "k", "payload": str(i)})
        proc = subprocess.run(["node", "leases.js", self.redis.url("outbox-consumer"), stream, group],
                              cwd=self.check_dir, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        output = proc.stdout.decode(errors="replace").strip()
        print(output, file=sys.stderr, flush=True)
        self.assertEqual(proc.returncode, 0, f"leases.js failed:\n{output}")
        self.assertRegex(output, r"ioredis 5\.\d+\.\d+: lease contract, \d+ checks, 0 problems")
        self.assertEqual(self.r.xpending(stream, group)["pending"], 0)
        self.assertEqual(self.r.xlen(f"{{{stream}}}.{group}.dlq"), 1)


if __name__ == "__main__":
    unittest.main()
