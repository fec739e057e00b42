"""The Debian packages install a working relay and consumer library.

- scripts/package.sh builds outbox-relay, liboutbox-consumer1 and
  liboutbox-consumer-dev from this source tree in a build directory of its
  own, and lintian reports no error in them (package.sh fails otherwise).
- The daemon package depends on the packages of the libpq, hiredis and libev
  it loads (libpq5, libhiredis0.14 and libev4 on Debian 12; libhiredis1.1.0
  and libev4t64 on Debian 13), has no maintainer scripts, and `dpkg -i` enables and starts nothing.
- Installed, /usr/bin/outbox-relay applies nothing itself but relays a row end
  to end against a database migrated from /usr/share/outbox-relay/migrations/.
- The installed reference consumer, /usr/bin/outbox-email-consumer, handles
  the message the installed relay published, with a database made from the
  installed files alone (/usr/share/outbox-relay/migrations/consumer/ and
  /usr/share/outbox-relay/examples/email_schema.sql).
- The manual pages outbox-relay(8), outbox-relay.conf(5) and
  outbox-email-consumer(1) are found by man;
  the configuration page and the example configuration name every key that
  `outbox-relay --help` lists, and the example, uncommented, validates.
- The installed units start /usr/bin/outbox-relay.
- A C program using the public API builds with nothing but
  `cc $(pkg-config --cflags --libs outbox-consumer)` and runs, loading
  liboutbox_consumer.so.1 by its soname; `pkg-config --static` links it fully
  statically; find_package(OutboxConsumer) links it from CMake. The shared
  library exports the public API only.
- The Redis function libraries are installed in
  /usr/share/outbox-relay/functions/, and each loads with FUNCTION LOAD as it
  stands.
- The packages are purged at the end, also on failure.

Needs root (dpkg -i); installs over, then purges, any installed copy.
"""

import contextlib
import glob
import os
import re
import subprocess
import sys
import tempfile
import shutil
import textwrap
import unittest

from testkit import harness
from testkit.harness import insert, wait_until

if os.geteuid() != 0:
    print("SKIP: installing packages with dpkg -i needs root", file=sys.stderr)
    sys.exit(harness.SKIP)

harness.set_deadline(400)

PACKAGES = ("outbox-relay", "liboutbox-consumer1", "liboutbox-consumer-dev")
BIN = "/usr/bin/outbox-relay"
CONSUMER_BIN = "/usr/bin/outbox-email-consumer"

CONSUMER_C = r"""
#include <outbox/consumer.h>
#include <stdio.h>

static enum outbox_handled handle(const struct outbox_message *m, void *arg, char *err,
                                  size_t errlen)
{
    (void)m; (void)arg; (void)err; (void)errlen;
    return OUTBOX_HANDLED_DONE;
}

int main(void)
{
    struct outbox_consumer_options o = {0};
    char err[256];
    o.redis_url = "redis://127.0.0.1:6379/0";
    o.stream = "orders";
    o.group = "email";
    struct outbox_consumer *c = outbox_consumer_new(&o, handle, NULL, err, sizeof(err));
    if (c == NULL) {
        fprintf(stderr, "outbox_consumer_new: %s\n", err);
        return 1;
    }
    printf("dlq %s\n", outbox_consumer_dlq(c));
    outbox_consumer_free(c);
    return 0;
}
"""
CONSUMER_OUTPUT = "dlq {orders}.email.dlq\n"


def run(argv, **kwargs):
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)


def project_version():
    with open(os.path.join(harness.SOURCE_DIR, "CMakeLists.txt")) as f:
        return re.search(r"project\(outbox-relay VERSION (\S+)", f.read()).group(1)


def purge():
    run(["dpkg", "--purge", *PACKAGES])


def library_package(name):
    """The Debian package of the library the installed relay loads as libNAME.so.*:
    libhiredis0.14 on Debian 12, libhiredis1.1.0 on Debian 13; libev4, libev4t64."""
    ldd = run(["ldd", "/usr/bin/outbox-relay"]).stdout
    # "\tlibhiredis.so.0.14 => /lib/x86_64-linux-gnu/libhiredis.so.0.14 (0x...)"
    found = re.search(rf"\blib{re.escape(name)}\.so\S* => (\S+)", ldd)
    if not found:
        raise AssertionError(f"outbox-relay does not load lib{name}:\n" + ldd)
    owner = run(["dpkg-query", "-S", os.path.realpath(found.group(1))]).stdout
    # "libhiredis0.14:amd64: /usr/lib/x86_64-linux-gnu/libhiredis.so.0.14"
    if not owner:
        raise AssertionError(f"no package owns {found.group(1)}")
    return owner.split(":")[0]


class PackageTest(harness.ServerTestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="outbox-relay-package-")
        cls.addClassCleanup(shutil.rmtree, cls.tmp, True)
        build = os.path.join(cls.tmp, "build")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ASAN_", "UBSAN_"))}
        env["PACKAGE_BUILD_DIR"] = build
        proc = run(["bash", os.path.join(harness.SOURCE_DIR, "scripts", "package.sh")], env=env)
        if proc.returncode != 0:
            raise AssertionError("scripts/package.sh failed:\n" + harness.tail(proc.stderr, 60))
        cls.debs = proc.stdout.split()
        cls.lintian = proc.stderr
        names = sorted(run(["dpkg-deb", "-f", d, "Package"]).stdout.strip() for d in cls.debs)
        if names != sorted(PACKAGES):
            raise AssertionError(f"package.sh built {names}, not {sorted(PACKAGES)}")
        cls.addClassCleanup(purge)
        proc = run(["dpkg", "-i", *cls.debs])
        if proc.returncode != 0:
            raise AssertionError("dpkg -i failed:\n" + proc.stdout + proc.stderr)
        super().setUpClass()

    def deb(self, name):
        return next(d for d in self.debs if os.path.basename(d).startswith(name + "_"))

    def test_package_metadata(self):
        depends = run(["dpkg-deb", "-f", self.deb("outbox-relay"), "Depends"]).stdout
        for lib in (library_package(name) for name in ("pq", "hiredis", "ev")):
            self.assertRegex(depends, rf"(^|, ){re.escape(lib)} ", depends)
        # No maintainer script: installing enables and starts nothing.
        control = run(["dpkg-deb", "-I", self.deb("outbox-relay")]).stdout
        for script in ("preinst", "postinst", "prerm", "postrm"):
            self.assertNotIn(script, control)
        self.assertFalse(glob.glob("/etc/systemd/system/*.wants/outbox-relay*"))
        for pkg in PACKAGES:
            doc = f"/usr/share/doc/{pkg}"
            self.assertTrue(os.path.isfile(f"{doc}/copyright"), pkg)
            self.assertTrue(os.path.isfile(f"{doc}/changelog.gz"), pkg)
            with open(f"{doc}/copyright") as f:
                self.assertIn("License: BSD-3-Clause", f.read())
        # Stripped: no symbol table left in the daemon.
        self.assertNotIn(".symtab", run(["readelf", "-S", BIN]).stdout)
        self.assertNotRegex(self.lintian, r"(?m)^E: ")

    def test_installed_daemon_relays(self):
        version = run([BIN, "--version"])
        self.assertEqual(version.stdout.splitlines()[0], f"outbox-relay {project_version()}")
        # A database migrated from the installed files alone.
        pg = self.enterContext(harness.Postgres(migrations=False))
        files = sorted(glob.glob("/usr/share/outbox-relay/migrations/*.sql"))
        self.assertEqual([os.path.basename(f) for f in files],
                         [os.path.basename(f) for f in pg.migration_files()])
        pg.apply_migrations(files)
        self.assertTrue(glob.glob("/usr/share/outbox-relay/migrations/consumer/*.sql"))
        env = harness.relay_env(pg, self.redis)
        self.assertEqual(run([BIN, "--check-config"], env=env).returncode, 0)
        relay = self.enterContext(harness.Daemon([BIN, "--sent-retention", "1h"], env, "relay"))
        db = pg.connect()
        self.addCleanup(db.close)
        message_id = insert(db, "orders", b'{"order":1}')
        wait_until(lambda: self.r.xlen("orders") == 1, timeout=30, relay=relay,
                   message="the installed relay did not publish the row")
        (_, fields), = self.r.xrange("orders")
        self.assertEqual(fields[b"id"].decode(), message_id)
        # The reference consumer, with its schema from the installed files alone.
        with contextlib.closing(pg.connect(dbname="postgres")) as admin:
            admin.cursor().execute("CREATE DATABASE email")
        for path in (sorted(glob.glob("/usr/share/outbox-relay/migrations/consumer/*.sql"))
                     + ["/usr/share/outbox-relay/examples/email_schema.sql"]):
            pg.psql("-f", path, dbname="email")
        consumer = self.enterContext(harness.Daemon(
            [CONSUMER_BIN, "--redis", self.redis.url("outbox-consumer"),
             "--postgres", pg.dsn("email"), "--stream", "orders", "--group", "email"],
            harness.relay_env(), "consumer"))
        email = pg.connect(dbname="email")
        self.addCleanup(email.close)
        wait_until(lambda: harness.scalar(email, "SELECT count(*) FROM emails "
                                          "WHERE message_id = %s", (message_id,)) == 1,
                   timeout=30, relay=consumer,
                   message="the installed outbox-email-consumer did not handle the message")

    def test_manual_pages_and_example(self):
        for page, section in (("outbox-relay", "8"), ("outbox-relay.conf", "5"),
                              ("outbox-email-consumer", "1")):
            proc = run(["man", "-w", page])
            self.assertEqual(proc.returncode, 0, proc.stderr)
            self.assertEqual(proc.stdout.strip(), f"/usr/share/man/man{section}/{page}.{section}.gz")
        keys = re.findall(r"(?m)^  ([a-z_]+) \(", run([BIN, "--help"]).stdout)
        self.assertGreater(len(keys), 30)
        page = run(["sh", "-c", "zcat /usr/share/man/man5/outbox-relay.conf.5.gz"]).stdout
        rendered = run(["man", "--warnings", "-P", "cat", "outbox-relay.conf"],
                       env={**os.environ, "MANWIDTH": "80"})
        self.assertEqual(rendered.returncode, 0, rendered.stderr)
        self.assertEqual(rendered.stderr, "")
        example_path = "/usr/share/doc/outbox-relay/examples/relay.conf"
        with open(example_path) as f:
            example = f.read()
        for key in keys:
            self.assertIn(".B " + key.replace("-", "\\-") + "\n", page, key)
            self.assertRegex(example, rf"(?m)^#{key} = ", key)
        # Every key uncommented, at its default: the file validates.
        conf = os.path.join(self.tmp, "all.conf")
        with open(conf, "w") as f:
            f.write(re.sub(r"(?m)^#([a-z_]+ = )", r"\1", example))
        proc = run([BIN, "-c", conf, "--postgres", "dbname=app", "--redis",
                    "redis://127.0.0.1:6379/0", "--check-config"], env=harness.relay_env())
        self.assertEqual(proc.returncode, 0, proc.stderr)

    def test_installed_functions_load(self):
        directory = "/usr/share/outbox-relay/functions"
        self.assertEqual(sorted(os.listdir(directory)), ["outbox_consumer.lua", "outbox_relay.lua"])
        for name in ("outbox_relay", "outbox_consumer"):
            with open(os.path.join(directory, name + ".lua")) as f:
                self.assertEqual(self.r.function_load(f.read(), replace=True), name.encode())
        functions = set()
        for library in self.r.function_list():
            library = dict(zip(library[::2], library[1::2]))
            functions.update(dict(zip(fn[::2], fn[1::2]))[b"name"].decode()
                             for fn in library[b"functions"])
        self.assertIn("outbox_relay_trim_v1", functions)
        self.assertIn("outbox_consumer_dead_letter_v1", functions)

    def test_units_name_installed_binary(self):
        for unit in ("outbox-relay.service", "outbox-relay@.service"):
            with open(f"/usr/lib/systemd/system/{unit}") as f:
                text = f.read()
            self.assertRegex(text, r"(?m)^ExecStart=/usr/bin/outbox-relay -c /etc/outbox-relay/")
            self.assertNotIn("/usr/local", text)
            self.assertNotRegex(text, r"@[A-Z_]+@")

    def build_consumer(self, name, flags):
        src = os.path.join(self.tmp, "consumer.c")
        with open(src, "w") as f:
            f.write(CONSUMER_C)
        exe = os.path.join(self.tmp, name)
        proc = run(["sh", "-c", f'cc -o "{exe}" "{src}" {flags}'])
        self.assertEqual(proc.returncode, 0, proc.stderr)
        out = run([exe])
        self.assertEqual((out.returncode, out.stdout), (0, CONSUMER_OUTPUT), out.stderr)
        return exe

    def test_consumer_shared_link(self):
        exe = self.build_consumer("shared", "$(pkg-config --cflags --libs outbox-consumer)")
        dynamic = run(["readelf", "-d", exe]).stdout
        self.assertIn("Shared library: [liboutbox_consumer.so.1]", dynamic)
        ldd = run(["ldd", exe]).stdout
        self.assertRegex(ldd,
                         r"liboutbox_consumer\.so\.1 => (/usr)?/lib/\S+/liboutbox_consumer\.so\.1")

    def test_consumer_static_link(self):
        exe = self.build_consumer(
            "static", "-static $(pkg-config --static --cflags --libs outbox-consumer)")
        self.assertNotIn("NEEDED", run(["readelf", "-d", exe]).stdout)

    def test_library_exports_public_api_only(self):
        lib = glob.glob("/usr/lib/*/liboutbox_consumer.so.1")
        self.assertEqual(len(lib), 1)
        symbols = run(["nm", "-D", "--defined-only", lib[0]]).stdout.split("\n")
        names = [line.split()[-1].split("@")[0] for line in symbols if line.strip()]
        names = [n for n in names if n != "OUTBOX_CONSUMER_1"]
        self.assertIn("outbox_consumer_new", names)
        self.assertNotIn("outbox_order_next", names)
        self.assertEqual([n for n in names if not n.startswith("outbox_consumer_")],
                         [])

    def test_cmake_find_package(self):
        project = os.path.join(self.tmp, "cmake-consumer")
        os.makedirs(project, exist_ok=True)
        with open(os.path.join(project, "consumer.c"), "w") as f:
            f.write(CONSUMER_C)
        with open(os.path.join(project, "CMakeLists.txt"), "w") as f:
            f.write(textwrap.dedent(f"""\
                cmake_minimum_required(VERSION 3.18)
                project(consumer LANGUAGES C)
                find_package(OutboxConsumer {project_version()} REQUIRED)
                add_executable(consumer consumer.c)
                target_link_libraries(consumer PRIVATE OutboxConsumer::outbox_consumer)
                """))
        build = os.path.join(project, "build")
        proc = run(["cmake", "-S", project, "-B", build])
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        proc = run(["cmake", "--build", build])
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        out = run([os.path.join(build, "consumer")])
        self.assertEqual(out.stdout, CONSUMER_OUTPUT, out.stderr)


if __name__ == "__main__":
    unittest.main()
