"""No password in any log line of the whole test suite.

Every log the suite produced is kept in OUTBOX_TEST_LOG_DIR
(testkit/cleanup.py: the relays', the consumers' and the tools'
output, the PostgreSQL and Redis server logs), with every password the
harness handed out (the Redis users of docs/OPERATIONS.md, requirepass). This
file runs after every other integration test (tests/CMakeLists.txt) and reads
them all: a password in any line fails it, with the file and the line.
"""

import os
import sys
import unittest

from testkit import harness

MIN_PASSWORD_LEN = 6  # shorter ones would match ordinary words

if not harness.LOG_DIR or not os.path.isdir(harness.LOG_DIR):
    print("SKIP: no suite logs (OUTBOX_TEST_LOG_DIR): run the integration tests first",
          flush=True)
    sys.exit(harness.SKIP)


class SecretsTest(unittest.TestCase):

    def setUp(self):
        self.dir = harness.LOG_DIR
        with open(os.path.join(self.dir, "secrets.txt"), encoding="utf-8") as f:
            self.secrets = sorted({line.strip() for line in f
                                   if len(line.strip()) >= MIN_PASSWORD_LEN})
        self.logs = sorted(name for name in os.listdir(self.dir) if name != "secrets.txt")

    def leaks(self, path):
        """(line number, secret) of each line of path that holds a password."""
        found = []
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                line = raw.decode("utf-8", errors="replace")
                found += [(number, secret) for secret in self.secrets if secret in line]
        return found

    def test_the_check_finds_a_planted_password(self):
        self.assertGreater(len(self.secrets), 0, "the harness recorded no password")
        planted = os.path.join(self.dir, "secrets-planted.check")
        with open(planted, "w", encoding="utf-8") as f:
            f.write(f"connected as redis://outbox-relay:{self.secrets[0]}@host\n")
        try:
            self.assertEqual(self.leaks(planted), [(1, self.secrets[0])])
        finally:
            os.unlink(planted)

    def test_no_log_line_holds_a_password(self):
        kinds = {name.split("-", 1)[0] for name in self.logs}
        print(f"{len(self.logs)} logs ({', '.join(sorted(kinds))}), "
              f"{len(self.secrets)} passwords", flush=True)
        self.assertTrue({"daemon", "redis", "postgres", "tool"} <= kinds,
                        f"logs of every kind should be kept, found {sorted(kinds)}")
        leaked = []
        for name in self.logs:
            for number, secret in self.leaks(os.path.join(self.dir, name)):
                leaked.append(f"{name}:{number}: holds the password {secret[:3]}...")
        self.assertEqual(leaked, [], "passwords in logs:\n" + "\n".join(leaked[:50]))


if __name__ == "__main__":
    unittest.main()
