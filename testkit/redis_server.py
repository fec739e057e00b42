"""Throwaway Redis servers: a single server, a Redis Cluster, Sentinels."""

import contextlib
import os
import random
import shlex
import shutil
import signal
import subprocess
import time

import redis as redis_py

from .cleanup import keep_log, keep_secret, register, unregister
from .common import SOURCE_DIR, free_port, run_command, tail, temp_dir, wait_until

# The server the tests run against: redis-server (Redis 7.0), or another
# binary that speaks its protocol and takes its options, such as
# valkey-server (Valkey 8). A server asked for and missing fails the test.
REDIS_SERVER = os.environ.get("OUTBOX_REDIS_SERVER") or "redis-server"


def aof_repair_argv(data_dir):
    """The command systemd/redis-aof-repair.conf runs before Redis starts, for a
    server whose --dir is data_dir: it cuts a torn last AOF write where it began
    (docs/GUARANTEES.md, "What Redis keeps is up to Redis"). Valkey's checker
    for valkey-server."""
    with open(os.path.join(SOURCE_DIR, "systemd", "redis-aof-repair.conf"), encoding="utf-8") as f:
        line = next(x for x in f if x.startswith("ExecStartPre="))
    argv = shlex.split(line.split("=", 1)[1].lstrip("-").strip())
    checker = "valkey-check-aof" if "valkey" in os.path.basename(REDIS_SERVER) else "redis-check-aof"
    argv[-1] = (argv[-1].replace("$$", "$").replace("/var/lib/redis", data_dir)
                .replace("redis-check-aof", checker))
    return argv


def redis_server_binary():
    """The server binary's path; raises when it is not installed."""
    found = shutil.which(REDIS_SERVER)
    if found is None:
        raise RuntimeError(f"{REDIS_SERVER} not found: OUTBOX_REDIS_SERVER names a server "
                           "that is not installed (scripts/deps.sh installs redis-server and "
                           "valkey-server)")
    return found

def _acl_rules():
    """{user: [rules]} of the Redis users docs/OPERATIONS.md ("Redis users")
    documents, read from its ACL SETUSER block, the password placeholder
    left in."""
    with open(os.path.join(SOURCE_DIR, "docs", "OPERATIONS.md"), encoding="utf-8") as f:
        text = f.read()
    users = {}
    for line in text.splitlines():
        if line.startswith("ACL SETUSER outbox-"):
            words = line.split()
            users[words[2]] = words[3:]
    if set(users) != {"outbox-relay", "outbox-consumer", "outbox-tools"}:
        raise RuntimeError(f"docs/OPERATIONS.md should give three ACL users, not {sorted(users)}")
    return users


ACL_USERS = _acl_rules()
_REDIS_BY_PORT = {}  # port -> Redis, for run_relay to give a tool its own user


def redis_on_port(port):
    """The Redis() of this process that listens on port, or None."""
    return _REDIS_BY_PORT.get(port)


class Redis:
    """A throwaway redis-server on 127.0.0.1; restartable on the same port and dir.

    Besides the default user (the tests' own client), it has the three users
    of docs/OPERATIONS.md ("Redis users"), with exactly their rules: url()
    names the relay's by default, url("outbox-consumer") a consumer's and
    url("outbox-tools") the operator commands'. At close, a command Redis
    refused one of them (ACL LOG) fails the test.
    """

    acl_users = True  # the documented users (a Sentinel has none)

    def __init__(self, port=None, appendonly=False, appendfsync="everysec", password=None,
                 extra_args=()):
        self.port = port or free_port()
        _REDIS_BY_PORT[self.port] = self
        self.extra_args = list(extra_args)  # more options, e.g. ["--replicaof", host, port]
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        # A test that sets a password checks that it never reaches a log:
        # every user then has it.
        self.passwords = {user: password or f"{user}-{random.getrandbits(48):012x}"
                          for user in ACL_USERS}
        for secret in {password, *self.passwords.values()}:
            keep_secret(secret)
        self.dir = None
        self.proc = None
        self.paused = False

    def __enter__(self):
        register(self)
        try:
            self.dir = temp_dir("outbox-redis-")
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def refusals(self):
        """What Redis refused the documented users (ACL LOG), as text lines."""
        with contextlib.closing(self.client(socket_timeout=5)) as c:
            entries = c.execute_command("ACL", "LOG", "128")
        out = []
        for entry in entries:
            e = dict(zip(entry[::2], entry[1::2]))
            user = e.get(b"username", b"").decode()
            # CLIENT SETINFO (Redis 7.2, Valkey): client libraries such as
            # ioredis send it at connect and go on when it is refused.
            if user in ACL_USERS and e.get(b"object") != b"client|setinfo":
                out.append(f"{user}: {e.get(b'reason', b'').decode()} "
                           f"{e.get(b'object', b'').decode()} (context {e.get(b'context', b'').decode()})")
        return out

    def close(self):
        unregister(self)
        if self.dir is None:
            return
        refused = []
        try:
            if self.acl_users and self.proc and self.proc.poll() is None and not self.paused:
                try:
                    refused = self.refusals()
                except redis_py.exceptions.RedisError:
                    pass
            if self.proc and self.proc.poll() is None:
                self.resume()
                self.stop()
        finally:
            if self.proc and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            keep_log(os.path.join(self.dir, "redis.log"), "redis")
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if refused:
            raise AssertionError("Redis refused commands of the users docs/OPERATIONS.md "
                                 "documents (fix the rules there):\n" + "\n".join(refused))

    def command(self):
        """The server's command line."""
        argv = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.dir, "--save", "", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync,
                "--logfile", os.path.join(self.dir, "redis.log")]
        if self.password:
            argv += ["--requirepass", self.password, "--masterauth", self.password]
        # The users exist from the first connection on, also after a restart.
        for user, rules in ACL_USERS.items():
            argv += ["--user", user, *[">" + self.passwords[user] if r == ">CHANGE-ME" else r
                                       for r in rules]]
        return argv + self.extra_args

    def start(self):
        """Starts the server and waits until it answers PING. An append-only
        server's AOF is first repaired as docs/GUARANTEES.md tells operators to
        (systemd/redis-aof-repair.conf): a restart after kill() may find its last
        write torn."""
        assert self.proc is None or self.proc.poll() is not None, "redis is already running"
        if self.appendonly:
            self.repair_aof()
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=self.dir)
        self.paused = False

        def answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{REDIS_SERVER} exited with {self.proc.returncode}\n"
                                   + tail(self.log()))
            try:
                with contextlib.closing(self.client(socket_timeout=1)) as c:
                    return c.ping()
            except redis_py.exceptions.RedisError:
                return False
        wait_until(answers, timeout=20, message=f"{REDIS_SERVER} to answer PING")

    def repair_aof(self):
        """Runs systemd/redis-aof-repair.conf's command on this server's directory."""
        done = subprocess.run(aof_repair_argv(self.dir), stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError("the AOF repair of systemd/redis-aof-repair.conf failed:\n"
                               + done.stderr.decode(errors="replace"))

    def aof_tail_file(self):
        """The AOF file Redis appends to now (the manifest's last incr file)."""
        manifest = os.path.join(self.dir, "appendonlydir", "appendonly.aof.manifest")
        with open(manifest, encoding="utf-8") as f:
            names = [line.split()[1] for line in f if " type i" in line]
        return os.path.join(self.dir, "appendonlydir", names[-1])

    def stop(self):
        """A clean shutdown (SIGTERM: no RDB is written, the AOF is flushed)."""
        if self.proc and self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self):
        """Dies as in a crash: SIGKILL."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.paused = False

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        if self.paused and self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def url(self, user="outbox-relay"):
        """The URL for one of the documented users; user=None: the default user."""
        if user is None:
            auth = f":{self.password}@" if self.password else ""
        else:
            auth = f"{user}:{self.passwords[user]}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, socket_timeout=30):
        return redis_py.Redis(host="127.0.0.1", port=self.port, db=0, password=self.password,
                              decode_responses=False, socket_timeout=socket_timeout,
                              socket_connect_timeout=5)

    def log(self):
        try:
            with open(os.path.join(self.dir, "redis.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def wait_replica_synced(replica, timeout=30):
    """Waits until the replica's link to its primary is up (its full sync done)."""
    def up():
        with contextlib.closing(replica.client(socket_timeout=2)) as c:
            return c.info("replication").get("master_link_status") == "up"
    wait_until(up, timeout=timeout, message="the replica's link to its primary")


class RedisCluster:
    """A throwaway Redis Cluster on 127.0.0.1: `primaries` primaries, each with
    `replicas` replicas, every node append-only, made with redis-cli --cluster
    create and stopped and removed at the end.

        with RedisCluster(3, 1) as cluster:
            cluster.url()            # "redis://127.0.0.1:p1,127.0.0.1:p2,..."
            cluster.reader()         # scan_iter/xrange over every primary (Verifier)
            cluster.primaries()      # {port: Redis} of the primaries now
    """

    def __init__(self, primaries=3, replicas=1, node_timeout_ms=2000, tls=None):
        self.count = primaries * (1 + replicas)
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        # ((certificate, key), CA certificate): each node also listens on a
        # TLS port of its own (node.tls_port), its bus and replication speak
        # TLS, and clients must show a certificate there; the plain ports stay
        # for the tests' own clients.
        self.tls = tls
        self.nodes = []

    def _tls_args(self):
        if self.tls is None:
            return [], None
        (crt, key), ca = self.tls
        port = free_port()
        return ["--tls-port", str(port), "--tls-cert-file", crt, "--tls-key-file", key,
                "--tls-ca-cert-file", ca, "--tls-cluster", "yes", "--tls-replication", "yes",
                "--tls-auth-clients", "yes"], port

    def __enter__(self):
        try:
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--repl-diskless-sync-delay", "0"]
            for _ in range(self.count):
                # The bus port is its own (cluster-port): port + 10000, the
                # default, may be taken or past 65535.
                tls_args, tls_port = self._tls_args()
                node = Redis(appendonly=True,
                             extra_args=args + ["--cluster-port", str(free_port())] + tls_args)
                node.tls_port = tls_port
                node.__enter__()
                self.nodes.append(node)
            cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
            run_command([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                         "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                        "redis-cli --cluster create", timeout=120)
            self.wait_ok()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        for node in self.nodes:
            node.close()
        self.nodes = []

    def node(self, port):
        return next(n for n in self.nodes if n.port == port)

    def wait_ok(self, timeout=60):
        """Waits until every running node says cluster_state:ok and agrees on
        the primaries of all 16384 slots."""
        def ok():
            maps = []
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                try:
                    with contextlib.closing(n.client(socket_timeout=2)) as c:
                        if c.execute_command("CLUSTER", "INFO").decode().find(
                                "cluster_state:ok") < 0:
                            return False
                        maps.append(sorted((s[0], s[1], s[2][1])
                                           for s in c.execute_command("CLUSTER", "SLOTS")))
                except redis_py.exceptions.RedisError:
                    return False
            return bool(maps) and all(m == maps[0] for m in maps) and \
                sum(s[1] - s[0] + 1 for s in maps[0]) == 16384
        wait_until(ok, timeout=timeout, interval=0.2, message="the cluster to be ok")

    def slots(self):
        """[(first, last, primary port)] as a running node sees them."""
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                with contextlib.closing(n.client(socket_timeout=5)) as c:
                    return sorted((s[0], s[1], s[2][1])
                                  for s in c.execute_command("CLUSTER", "SLOTS"))
        raise RuntimeError("no cluster node is running")

    def primaries(self):
        return {port: self.node(port) for port in sorted({s[2] for s in self.slots()})}

    def primary_of(self, key):
        slot = self.keyslot(key)
        return self.node(next(p for lo, hi, p in self.slots() if lo <= slot <= hi))

    def keyslot(self, key):
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                with contextlib.closing(n.client(socket_timeout=5)) as c:
                    return int(c.execute_command("CLUSTER", "KEYSLOT", key))
        raise RuntimeError("no cluster node is running")

    def node_id(self, node):
        with contextlib.closing(node.client(socket_timeout=5)) as c:
            return c.execute_command("CLUSTER", "MYID").decode()

    def add_primary(self):
        """A new empty primary joined to the cluster (redis-cli --cluster
        add-node), holding no slot until one is migrated to it."""
        node = Redis(appendonly=True,
                     extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                 "--cluster-node-timeout", str(self.node_timeout_ms),
                                 "--repl-diskless-sync-delay", "0",
                                 "--cluster-port", str(free_port())])
        node.__enter__()
        self.nodes.append(node)
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        run_command([cli, "--cluster", "add-node", f"127.0.0.1:{node.port}",
                     f"127.0.0.1:{self.nodes[0].port}"], "redis-cli --cluster add-node",
                    timeout=60)
        new_id = self.node_id(node)

        def known():
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                with contextlib.closing(n.client(socket_timeout=2)) as c:
                    if new_id not in c.execute_command("CLUSTER", "NODES").decode():
                        return False
            return True
        wait_until(known, timeout=30, interval=0.2, message="every node to know the new one")
        self.wait_ok()
        return node

    def migrate_slot(self, slot, source, target, pause=0.1):
        """Moves a slot's keys from source to target, 10 at a time with a
        pause between (the MIGRATING/IMPORTING states, then SETSLOT NODE on
        every primary): (keys moved, seconds it took)."""
        started = time.monotonic()
        src_id, dst_id = self.node_id(source), self.node_id(target)
        moved = 0
        with contextlib.closing(source.client()) as src, contextlib.closing(target.client()) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while True:
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10)
                if not keys:
                    break
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                                    "KEYS", *keys)
                moved += len(keys)
                time.sleep(pause)  # the migration lasts, and publishes meet it
        owners = {source.port, target.port, *self.primaries()}
        for port in owners:
            with contextlib.closing(self.node(port).client()) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return moved, time.monotonic() - started

    def url(self):
        return "redis://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def tls_url(self, query):
        """rediss:// to every node's TLS port, the TLS options (query) on the first."""
        ports = [n.tls_port for n in self.nodes]
        return (f"rediss://127.0.0.1:{ports[0]}?{query}"
                + "".join(f",127.0.0.1:{p}" for p in ports[1:]))

    def reader(self):
        return ClusterReader(self)


class ClusterReader:
    """What Verifier and stream_names need of a client, over every primary of a
    cluster: scan_iter yields each key once (from the primary that holds it),
    and xrange reads a stream from that primary."""

    def __init__(self, cluster):
        self.clients = {port: node.client() for port, node in cluster.primaries().items()}
        self.owner = {}

    def scan_iter(self, **kwargs):
        for port, c in self.clients.items():
            for key in c.scan_iter(**kwargs):
                self.owner[key] = c
                yield key

    def owner_xlen(self, stream):
        """XLEN on the primary of the stream's slot (0 when it does not exist)."""
        key = stream if isinstance(stream, bytes) else stream.encode()
        if key not in self.owner:
            for c in self.clients.values():
                try:
                    n = c.xlen(key)
                except redis_py.exceptions.ResponseError:  # MOVED: another primary's
                    continue
                self.owner[key] = c
                return n
            return 0
        return self.owner[key].xlen(key)

    def xrange(self, stream, **kwargs):
        key = stream if isinstance(stream, bytes) else stream.encode()
        return self.owner[key].xrange(stream, **kwargs)

    def close(self):
        for c in self.clients.values():
            c.close()


class Sentinel(Redis):
    """A throwaway Redis Sentinel on 127.0.0.1 that monitors one primary.

        Sentinel(primary, master="mymaster", quorum=2, down_after_ms=1000)

    It writes its own config file (Sentinel rewrites it) in its directory.
    With password, the Sentinel asks its clients and the other Sentinels for it
    (requirepass, sentinel sentinel-pass). With user, it also has an ACL user
    of that name whose password is user_password.
    """

    acl_users = False

    def __init__(self, primary, master="mymaster", quorum=2, down_after_ms=1000,
                 failover_timeout_ms=10000, password=None, user=None, user_password=None,
                 primary_port=None, extra_conf=()):
        super().__init__(password=password)
        self.extra_conf = list(extra_conf)  # more lines of sentinel.conf (TLS, say)
        self.user = user
        self.user_password = user_password
        if user_password:
            keep_secret(user_password)
        self.primary_port = primary_port or primary.port  # another port of it: its TLS port
        self.master = master
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def command(self):
        conf = os.path.join(self.dir, "sentinel.conf")
        if not os.path.exists(conf):  # Sentinel rewrites it: written once
            with open(conf, "w") as f:
                f.write(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
                        f"logfile {os.path.join(self.dir, 'redis.log')}\n"
                        f"sentinel monitor {self.master} 127.0.0.1 {self.primary_port}"
                        f" {self.quorum}\n"
                        f"sentinel down-after-milliseconds {self.master} {self.down_after_ms}\n"
                        f"sentinel failover-timeout {self.master} {self.failover_timeout_ms}\n"
                        f"sentinel parallel-syncs {self.master} 1\n")
                if self.password:
                    f.write(f"requirepass {self.password}\n"
                            f"sentinel sentinel-pass {self.password}\n")
                if self.user:
                    f.write(f"user {self.user} on >{self.user_password} ~* &* +@all\n")
                for line in self.extra_conf:
                    f.write(line + "\n")
        return [redis_server_binary(), conf, "--sentinel"]

    def primary(self):
        """The primary's port as this Sentinel names it now."""
        with contextlib.closing(self.client(socket_timeout=2)) as c:
            host, port = c.execute_command("SENTINEL", "get-master-addr-by-name", self.master)
        return int(port)

    def address(self):
        return f"127.0.0.1:{self.port}"
