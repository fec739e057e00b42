"""`cmake --install` into any prefix gives a tree that stands on its own.

- Installed with `--prefix DIR` and then moved elsewhere, the pkg-config file
  still names the tree it lies in: every -I and -L that
  `pkg-config --cflags --libs outbox-consumer` prints is a directory inside
  the moved tree, and a C file that includes <outbox/consumer.h> compiles with
  those flags alone.

Needs no server: it reads the build directory of the binary under test.
"""

import os
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


class InstallTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="outbox-install-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

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
