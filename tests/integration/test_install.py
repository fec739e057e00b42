"""`cmake --install` into any prefix gives a tree that stands on its own.

- Installed with `--prefix DIR` and then moved elsewhere, the pkg-config file
  still names the tree it lies in: every -I and -L that
  `pkg-config --cflags --libs outbox-consumer` prints is a directory inside
  the moved tree, and a C file that includes <outbox/consumer.h> compiles with
  those flags alone.
- The reference consumer is installed with its manual page and its table:
  bin/outbox-email-consumer runs (--help), share/man/man1 holds
  outbox-email-consumer(1), which names every option --help lists, and
  share/outbox-relay/examples/email_schema.sql is the file of examples/.

Needs no server: it reads the build directory of the binary under test.
"""

import gzip
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unittest

SKIP = 77

BIN = os.environ.get("OUTBOX_RELAY_BIN")
if not BIN or not shutil.which("pkg-config") or not shutil.which("cmake"):
    print("SKIP: needs OUTBOX_RELAY_BIN, cmake and pkg-config", file=sys.stderr)
    sys.exit(SKIP)
BUILD_DIR = os.path.dirname(os.path.abspath(BIN))
SOURCE_DIR = os.environ.get("OUTBOX_RELAY_SOURCE_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..")


class InstallTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="outbox-install-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def install(self):
        prefix = os.path.join(self.tmp, "prefix")
        subprocess.run(["cmake", "--install", BUILD_DIR, "--prefix", prefix], check=True,
                       stdout=subprocess.DEVNULL)
        return prefix

    def test_reference_consumer_installed(self):
        prefix = self.install()
        exe = os.path.join(prefix, "bin", "outbox-email-consumer")
        self.assertTrue(os.access(exe, os.X_OK), f"{exe} is not installed")
        usage = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30)
        self.assertEqual(usage.returncode, 0, usage.stderr)
        options = re.findall(r"(?m)^  (--[a-z-]+)", usage.stdout)
        self.assertIn("--redis", usage.stdout)
        self.assertGreater(len(options), 10, usage.stdout)
        page = os.path.join(prefix, "share", "man", "man1", "outbox-email-consumer.1.gz")
        with gzip.open(page, "rt") as f:
            roff = f.read()
        for option in ["--redis", "--postgres"] + options:
            self.assertIn(option.replace("-", "\\-"), roff,
                          f"outbox-email-consumer(1) does not describe {option}")
        schema = os.path.join(prefix, "share", "outbox-relay", "examples", "email_schema.sql")
        with open(schema) as f, open(os.path.join(SOURCE_DIR, "examples",
                                                  "email_schema.sql")) as g:
            self.assertEqual(f.read(), g.read())

    def test_pkg_config_follows_a_moved_tree(self):
        first = os.path.join(self.tmp, "first")
        subprocess.run(["cmake", "--install", BUILD_DIR, "--prefix", first], check=True,
                       stdout=subprocess.DEVNULL)
        moved = os.path.join(self.tmp, "moved")
        os.rename(first, moved)
        pcs = subprocess.run(["find", moved, "-name", "outbox-consumer.pc"], check=True,
                             capture_output=True, text=True).stdout.split()
        self.assertEqual(len(pcs), 1, pcs)
        env = dict(os.environ, PKG_CONFIG_PATH=os.path.dirname(pcs[0]))
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "outbox-consumer"],
                               env=env, check=True, capture_output=True, text=True).stdout
        dirs = [f[2:] for f in shlex.split(flags) if f.startswith(("-I", "-L"))]
        ours = [d for d in dirs if "hiredis" not in d]
        self.assertTrue(ours, flags)
        for d in ours:
            real = os.path.realpath(d)
            self.assertTrue(real.startswith(os.path.realpath(moved) + os.sep),
                            f"{d} is outside the moved tree {moved}: {flags}")
            self.assertTrue(os.path.isdir(real), f"{d} does not exist: {flags}")
        src = os.path.join(self.tmp, "uses.c")
        with open(src, "w") as f:
            f.write("#include <outbox/consumer.h>\nint main(void) { return 0; }\n")
        subprocess.run(["sh", "-c", f"cc -c -o {shlex.quote(src)}.o {shlex.quote(src)} "
                        f"$(pkg-config --cflags outbox-consumer)"], env=env, check=True)


if __name__ == "__main__":
    unittest.main()
