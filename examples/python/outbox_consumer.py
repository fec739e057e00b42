#!/usr/bin/env python3
"""A consumer of outbox-relay's streams in Python: each effect once, retries, dead letters.

It follows docs/CONSUMERS.md with redis-py and psycopg2 (Debian's python3-redis and
python3-psycopg2), as examples/email_consumer.c does with the C library:

- the effect runs in one PostgreSQL transaction with outbox_consumer.begin_message(group,
  id): a message seen again commits nothing new and is only acknowledged (section 3);
- a failed effect leaves its entry pending; it is taken back with XCLAIM once the backoff
  for its delivery count has passed (1 s, 10 s, 100 s, 1000 s by default), and dead-lettered
  to {<stream>}.<group>.dlq after max_deliveries, or at once when the effect raises Fail,
  with one FCALL of outbox_consumer_dead_letter_v1 (sections 4 and 5);
- with partitions (--ordered N) the group's consumers share the topic's partition streams
  through the lease functions, and each key's messages are handled in order (section 8);
- a rediss:// URL takes the relay's TLS options (docs/REDIS.md, "TLS to Redis").

    def effect(cur, msg):            # inside the transaction; raise Fail for bad data
        cur.execute("INSERT INTO invoices (order_id) VALUES (%s)", (msg.key,))
    OutboxConsumer("redis://127.0.0.1:6379/0", "dbname=billing", "orders", "billing",
                   effect).run()     # until stop(), e.g. from a signal handler
"""

import argparse
import os
import signal
import socket
import ssl
import sys
import time
import urllib.parse
from datetime import datetime, timezone

import psycopg2
import redis

BACKOFF_MS = (1000, 10000, 100000, 1000000)  # the C library's default schedule
RECLAIM_MS = 250      # how often pending entries are looked at for retries and take-overs
HAND_MAX = 256        # ordered: entries held per partition while all wait behind retries
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "functions",
                       "outbox_consumer.lua")
CONTRACT = (b"id", b"topic", b"payload", b"created_at", b"outbox_id")
LOST = ("lost", "the entry was deleted or trimmed from the stream while pending")


class Fail(Exception):
    """Raised by an effect for a message that can never succeed: dead-lettered at once."""


class LeaseLost(Exception):
    """A lease function answered LEASELOST: the partition is someone else's now."""

    def __init__(self, pt, text):
        super().__init__(text)
        self.pt = pt


class Message:
    """One entry of the stream contract (README.md): payload and key are bytes."""

    def __init__(self, stream, entry_id, fields, deliveries):
        missing = [f.decode() for f in CONTRACT if f not in fields]
        if missing:
            raise ValueError(f'the entry has no "{missing[0]}" field')
        self.stream, self.entry_id, self.deliveries = stream, entry_id, deliveries
        self.id = fields[b"id"].decode()
        self.topic = fields[b"topic"].decode()
        self.key = fields.get(b"key")  # None: the row had no partition key
        self.payload = fields[b"payload"]
        self.created_at = fields[b"created_at"].decode()
        self.outbox_id = int(fields[b"outbox_id"])
        self.headers = {k[2:].decode(): v.decode(errors="replace")
                        for k, v in fields.items() if k.startswith(b"h.")}


class Held:
    """An entry an ordered consumer holds in hand."""

    def __init__(self, stream, entry_id, fields, deliveries, dead=None):
        self.stream, self.entry_id, self.fields = stream, entry_id, fields
        self.deliveries, self.dead = deliveries, dead  # dead: its dead letter's (reason, why)
        self.key = fields.get(b"key") if fields else None
        self.retry_at = 0  # monotonic ms: when its backoff ends


class Partition:
    """One partition stream of an ordered topic, its keys, and what this consumer holds of it."""

    def __init__(self, topic, p, group):
        self.p, self.stream = p, f"{topic}:{p:03d}"  # as the relay names them: orders:003
        s = "{" + self.stream + "}"  # every key of a partition is in its stream's hash slot
        self.replay, self.dlq = f"{s}.{group}.replay", f"{s}.{group}.dlq"
        self.lease, self.tokens = f"{s}:lease:{group}", f"{s}:lease-token:{group}"
        self.token = 0  # 0: not held
        self.reset()

    def reset(self):
        """Forgets the hand: its own pending entries are read again from the start."""
        self.hand, self.ready, self.last = [], False, {}
        self.cursor = {self.stream: "0", self.replay: "0"}  # None: read, new entries next


def now_ms():
    return time.monotonic() * 1000


# -- rediss://: the relay's TLS options (docs/REDIS.md, "TLS to Redis")
TLS_OPTIONS = ("ca_file", "ca_dir", "cert_file", "key_file", "server_name", "verify")


class TlsConnection(redis.connection.Connection):
    """A redis-py connection that speaks TLS with a context made beforehand and checks the
    certificate against server_name, which may differ from the host it connects to
    (redis-py's SSLConnection checks the host only, and only with ssl_check_hostname)."""

    def __init__(self, ssl_context, server_name, **kwargs):
        super().__init__(**kwargs)
        self.ssl_context, self.server_name = ssl_context, server_name

    def _connect(self):
        where = f"Redis at {self.host}:{self.port}"
        try:  # SNI is server_name unless it is an IP address
            return self.ssl_context.wrap_socket(super()._connect(),
                                                server_hostname=self.server_name)
        except ssl.SSLCertVerificationError as e:
            hint = ("it names another server: connect by a name it carries, or set the URL's "
                    "server_name" if "mismatch" in e.verify_message else "check ca_file or "
                    "ca_dir: they must hold the CA that signed the server's certificate")
            raise redis.ConnectionError(f"the certificate of {where} was refused: "
                                        f"{e.verify_message} ({hint})") from None
        except ssl.SSLError as e:
            raise redis.ConnectionError(f"TLS handshake with {where} failed ({e.reason}): is "
                                        "that port TLS, and does the server accept this "
                                        "client's certificate?") from None


def tls_context(opts):
    """An SSLContext for the URL's options, its files loaded now: ValueError names a bad one."""
    for name in ("ca_file", "cert_file", "key_file"):
        try:
            open(opts.get(name, os.devnull), "rb").close()
        except OSError as e:
            raise ValueError(f"TLS option {name} {opts[name]}: {e.strerror}") from None
    if "ca_dir" in opts and not os.path.isdir(opts["ca_dir"]):
        raise ValueError(f"TLS option ca_dir {opts['ca_dir']}: not a directory")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # the chain and the name are checked
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = opts.get("verify", "full") == "full"  # verify=ca: the chain only
    try:
        if "ca_file" in opts or "ca_dir" in opts:
            ctx.load_verify_locations(cafile=opts.get("ca_file"), capath=opts.get("ca_dir"))
        else:
            ctx.load_default_certs()  # the system's trust store
    except ssl.SSLError as e:
        raise ValueError(f"TLS option ca_file {opts.get('ca_file')}: {e.reason or e}: give a "
                         "PEM file of CA certificates") from None
    cert, key = opts.get("cert_file"), opts.get("key_file")
    try:
        if cert:  # password b"": an encrypted key is refused, never asked for at a prompt
            ctx.load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as e:
        raise ValueError(f"TLS option key_file {key} is not the key of cert_file {cert}"
                         if e.reason == "KEY_VALUES_MISMATCH" else
                         f"TLS options cert_file {cert} and key_file {key}: give a PEM "
                         "certificate and its private key, unencrypted") from None
    return ctx


def redis_client(url, **kwargs):
    """redis.Redis for a redis:// URL (as redis-py reads it), or for
    rediss://[user:password@]host[:port][/db]?ca_file=...&verify=full|ca and the other
    TLS_OPTIONS, checked as the relay checks them: ValueError for a URL it refuses."""
    if not url.lower().startswith("rediss://"):
        return redis.Redis.from_url(url, **kwargs)
    u = urllib.parse.urlsplit(url)
    opts = {}
    for item in u.query.split("&") if u.query else ():
        name, _, value = item.partition("=")
        if name not in TLS_OPTIONS:
            raise ValueError(f'unknown option "{name}": the options of a rediss:// URL are '
                             + ", ".join(TLS_OPTIONS))
        if name in opts:
            raise ValueError(f"option {name} is given twice: keep one")
        if not value:
            raise ValueError(f"option {name} has no value: write {name}=value or leave it out")
        opts[name] = urllib.parse.unquote(value)
    if opts.get("verify", "full") not in ("full", "ca"):
        raise ValueError("option verify must be full (the CA and the server's name, the "
                         "default) or ca (the CA only)")
    if ("cert_file" in opts) != ("key_file" in opts):
        raise ValueError("cert_file and key_file go together: give both for a client "
                         "certificate, or neither")
    db = u.path.strip("/") or "0"
    if not u.hostname or not db.isdigit() or u.fragment:
        raise ValueError("use rediss://[user:password@]host[:port][/db][?options]")
    pool = redis.ConnectionPool(
        connection_class=TlsConnection, ssl_context=tls_context(opts),
        server_name=opts.get("server_name", u.hostname), host=u.hostname, port=u.port or 6379,
        db=int(db),
        username=urllib.parse.unquote(u.username) if u.username else None,
        password=urllib.parse.unquote(u.password) if u.password else None, **kwargs)
    return redis.Redis(connection_pool=pool)


def tls_hint(error):
    """What to check when a TLS server closes the connection after the handshake: with
    TLS 1.3 a server that wants a client certificate says so only then, as an alert, as
    an end of file or, when the client was writing, as a reset connection."""
    text = str(error)
    if any(sign in text for sign in ("certificate required", "EOF occurred in violation of "
                                     "protocol", "Connection reset by peer", "Broken pipe")):
        return (" (the server ended the TLS connection: if it asks for client certificates "
                "(tls-auth-clients), give the URL's cert_file and key_file)")
    return ""


def log(level, text):
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:23]
    print(f"{stamp}Z {level} consumer: {text}", file=sys.stderr, flush=True)


class OutboxConsumer:
    """Reads stream as group, applying effect(cursor, message) once per message."""

    def __init__(self, redis_url, postgres, stream, group, effect, consumer=None,
                 max_deliveries=5, backoff_ms=BACKOFF_MS, block_ms=1000, count=16,
                 partitions=0, lease_ms=10000):
        self.r = redis_client(redis_url, socket_timeout=block_ms / 1000 + 10,
                              socket_connect_timeout=5)
        # TLS without a client certificate: a server that asks for one ends it.
        self.anonymous_tls = (redis_url.lower().startswith("rediss://") and "cert_file"
                              not in urllib.parse.parse_qs(urllib.parse.urlsplit(redis_url).query))
        self.postgres, self.stream, self.group, self.effect = postgres, stream, group, effect
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.max_deliveries, self.backoff_ms = max_deliveries, tuple(backoff_ms)
        self.block_ms, self.count, self.lease_ms = block_ms, count, lease_ms
        self.parts = [Partition(stream, p, group) for p in range(partitions)]
        self.db, self.stopping = None, False
        self.stats = dict.fromkeys(("delivered", "done", "retried", "dead_lettered"), 0)

    def stop(self, *_):
        """Ends run() after the message in hand."""
        self.stopping = True

    def backoff(self, deliveries):
        """The wait after a failed delivery (1, 2, ...): its step; the last step repeats."""
        return self.backoff_ms[min(max(deliveries, 1), len(self.backoff_ms)) - 1]

    def run(self):
        while not self.stopping:
            try:
                self._run_ordered() if self.parts else self._run_unordered()
            except redis.RedisError as e:  # connects again, loads the functions, makes groups
                hint = tls_hint(e) if self.anonymous_tls else ""
                log("ERROR", f"Redis: {e}{hint}; retrying in 1 s")
                time.sleep(1)
        print(f"consumer {self.consumer}: " + " ".join(f"{k}={v}" for k, v in self.stats.items()),
              flush=True)

    # -- what both modes share
    def _prepare(self, streams):
        """Loads the function library if Redis has none yet (the relay loads it too; never
        REPLACE, which could swap a newer one for ours), and creates the group on each
        stream from its start."""
        try:
            with open(LIBRARY, "rb") as f:
                self.r.execute_command("FUNCTION", "LOAD", f.read())
        except redis.ResponseError as e:
            if "already exists" not in str(e):
                raise
        except FileNotFoundError:
            pass
        for s in streams:
            try:
                self.r.xgroup_create(s, self.group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def _apply(self, msg):
        """The effect and the processed row in one transaction: None, or (kind, why)."""
        self.stats["delivered"] += 1
        try:
            if self.db is None or self.db.closed:
                self.db = psycopg2.connect(self.postgres, connect_timeout=5,
                                           application_name="outbox-python-consumer",
                                           options="-c statement_timeout=10000")
            with self.db, self.db.cursor() as cur:  # COMMIT, or ROLLBACK on an exception
                cur.execute("SELECT outbox_consumer.begin_message(%s, %s)", (self.group, msg.id))
                if cur.fetchone()[0]:  # new for this group: apply the effect here
                    self.effect(cur, msg)
            return None
        except (Fail, psycopg2.DataError) as e:  # class 22: the data will never do
            return "permanent", " ".join(str(e).split()) or type(e).__name__
        except Exception as e:  # may pass: the database down, a timeout, a dependency
            return "retry", " ".join(str(e).split()) or type(e).__name__

    def _decide(self, stream, entry_id, fields, deliveries):
        """Handles one delivery: ("done" | "retry" | a dead letter's reason, why)."""
        if fields is None:
            return LOST
        try:
            msg = Message(stream, entry_id, fields, deliveries)
        except ValueError as e:  # UnicodeDecodeError is one too
            return "malformed", f"malformed: {e}"
        if deliveries > self.max_deliveries:
            return "exhausted", (f"delivered {deliveries} times (max_deliveries "
                                 f"{self.max_deliveries}): the consumer of the last delivery "
                                 "did not finish it")
        failed = self._apply(msg)
        if failed is None:
            return "done", ""
        if failed[0] == "permanent" or deliveries >= self.max_deliveries:
            return ("permanent" if failed[0] == "permanent" else "exhausted"), failed[1]
        self.stats["retried"] += 1
        log("INFO", f"{stream} {entry_id} (message {msg.id}) will be retried in "
                    f"{self.backoff(deliveries)} ms (delivery {deliveries} of "
                    f"{self.max_deliveries}): {failed[1]}")
        return "retry", failed[1]

    def _dead_letter(self, head, dlq, stream, entry_id, fields, deliveries, reason, why, pt=None):
        """One FCALL adds the dead letter, then acknowledges the entry; or does neither."""
        tail = [x for k, v in (fields or {}).items() if not k.startswith(b"dlq.") for x in (k, v)]
        tail += ["dlq.stream", stream, "dlq.group", self.group, "dlq.consumer", self.consumer,
                 "dlq.entry_id", entry_id, "dlq.deliveries", deliveries, "dlq.reason", reason,
                 "dlq.error", why,
                 "dlq.failed_at", datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")]
        try:
            self.r.execute_command("FCALL", *head, entry_id, *tail)
        except redis.ResponseError as e:
            if str(e).startswith("LEASELOST"):
                raise LeaseLost(pt, str(e)) from None
            if "Function not found" in str(e):  # FUNCTION FLUSH: run() loads it again
                raise
            log("ERROR", f"dead-lettering {stream} {entry_id} failed: {e}; the entry stays "
                         "pending and a later pass tries again")
            return False
        self.stats["dead_lettered"] += 1
        log("WARNING", f"{stream} {entry_id} -> {dlq} ({reason} after {deliveries} "
                       f"deliveries): {why}")
        return True

    # -- unordered: one consumer group, any consumer handles any entry
    def _run_unordered(self):
        dlq = f"{{{self.stream}}}.{self.group}.dlq"
        streams = [self.stream, f"{{{self.stream}}}.{self.group}.replay"]
        self._prepare(streams)
        log("INFO", f"{self.consumer}: reading {streams[0]} and {streams[1]} as group "
                    f"{self.group}, dead letters to {dlq}")
        head = ["outbox_consumer_dead_letter_v1", 2, dlq]
        next_reclaim = 0
        while not self.stopping:
            if now_ms() >= next_reclaim:
                next_reclaim = now_ms() + RECLAIM_MS
                for s in streams:
                    self._reclaim(s, head)
            block = int(max(1, min(self.block_ms, next_reclaim - now_ms())))
            reply = self.r.xreadgroup(self.group, self.consumer, {s: ">" for s in streams},
                                      count=self.count, block=block)
            for stream, entries in reply or []:
                read_at = now_ms()
                for i, (entry_id, fields) in enumerate(entries):
                    if self.stopping:  # the rest stay pending: taken over after the backoff
                        break
                    if now_ms() - read_at > min(self.backoff_ms) / 2:
                        # The rest of the batch ages from the read: keep it ours before
                        # another consumer's reclaim pass counts it as abandoned.
                        self.r.xclaim(stream, self.group, self.consumer, 0,
                                      [e[0] for e in entries[i:]], justid=True)
                        read_at = now_ms()
                    self._one(head, stream.decode(), entry_id.decode(), fields, 1)

    def _one(self, head, stream, entry_id, fields, deliveries):
        what, why = self._decide(stream, entry_id, fields, deliveries)
        if what == "done":
            self.r.xack(stream, self.group, entry_id)  # only after the COMMIT
            self.stats["done"] += 1
        elif what != "retry":  # "retry": no XACK; _reclaim takes it back after its backoff
            self._dead_letter(head + [stream, self.group], head[2], stream, entry_id, fields,
                              deliveries, what, why)

    def _reclaim(self, stream, head):
        """Takes the pending entries whose backoff has passed, of any consumer of the group:
        retries, and the entries of consumers that died. XCLAIM checks the idle time again
        on the server, so two consumers never take the same entry."""
        start = "-"
        for _ in range(16):
            page = self.r.xpending_range(stream, self.group, start, "+", 64,
                                         idle=min(self.backoff_ms))
            for p in page:
                entry_id, deliveries = p["message_id"].decode(), p["times_delivered"]
                due = self.backoff(deliveries)
                if self.stopping or p["time_since_delivered"] < due:
                    continue
                claimed = self.r.xclaim(stream, self.group, self.consumer, due, [entry_id])
                if claimed:
                    self._one(head, stream, entry_id, claimed[0][1], deliveries + 1)
                elif not self.r.xrange(stream, entry_id, entry_id):  # Redis dropped it
                    self._one(head, stream, entry_id, None, deliveries)
            if len(page) < 64:
                return
            start = "(" + page[-1]["message_id"].decode()

    # -- ordered: partitions shared through leases, each key's messages in order
    def _leased(self, pt, function, *keys_and_args):
        """An FCALL under pt's lease: LeaseLost when another consumer holds it now."""
        try:
            return self.r.execute_command("FCALL", function, *keys_and_args)
        except redis.ResponseError as e:
            if str(e).startswith("LEASELOST"):
                raise LeaseLost(pt, str(e)) from None
            raise

    def _run_ordered(self):
        members = f"{{{self.stream}}}:lease-members:{self.group}"
        for pt in self.parts:
            pt.reset()
        self._prepare([s for pt in self.parts for s in (pt.stream, pt.replay)])
        log("INFO", f"{self.consumer}: reading the {len(self.parts)} partitions of "
                    f"{self.stream} as group {self.group}, in order per key (leases of "
                    f"{self.lease_ms} ms)")
        next_upkeep, self.share = 0, None
        while not self.stopping:
            try:
                if now_ms() >= next_upkeep:
                    next_upkeep = now_ms() + self.lease_ms / 3
                    for pt in self._upkeep(members):
                        self._take_over(pt)
                elif not any(self._handle_next(pt) for pt in self.parts) and not self._fill():
                    self._wait(next_upkeep)
            except LeaseLost as e:
                log("WARNING", f"lost the lease of {e.pt.stream} ({e}): its {len(e.pt.hand)} "
                               "entries in hand are left to the next holder")
                e.pt.token = 0
                e.pt.reset()
        for pt in self.parts:  # a clean stop: the others take the partitions at once
            self._release(pt, None)
        self.r.zrem(members, self.consumer)

    def _release(self, pt, why):
        if pt.token:
            self.r.execute_command("FCALL", "outbox_consumer_release_v1", 1, pt.lease, pt.token)
            log("INFO", f"{self.consumer}: released {pt.stream} ({why or 'stopping'})")
        pt.token = 0
        pt.reset()

    def _upkeep(self, members):
        """Beats in the group's member set, keeps the leases of its share of the partitions
        (p % members == its rank by name), gives up the rest; yields those to take over."""
        secs, micros = self.r.time()
        now = secs * 1000 + micros // 1000
        self.r.zadd(members, {self.consumer: now})
        self.r.zremrangebyscore(members, "-inf", f"({now - self.lease_ms}")
        names = {m.decode() for m in self.r.zrange(members, 0, -1)} | {self.consumer}
        rank = sum(1 for m in names if m.encode() < self.consumer.encode())
        if self.share != (rank, len(names)):
            self.share = (rank, len(names))
            log("INFO", f"{self.consumer}: consumer {rank + 1} of {len(names)} of group "
                        f"{self.group} on {self.stream}")
        for pt in self.parts:
            mine = pt.p % len(names) == rank
            renew = pt.token if pt.token and mine else 0
            if pt.token and not mine:
                self._release(pt, "another consumer's share now")
            elif mine:
                token = self.r.execute_command("FCALL", "outbox_consumer_lease_v1", 2, pt.lease,
                                               pt.tokens, self.consumer, self.lease_ms, renew)[0]
                if renew and token != renew:
                    log("WARNING", f"lost the lease of {pt.stream}: it expired before it was "
                                   "renewed")
                    pt.token = 0
                    pt.reset()
                elif token > 0 and not renew:
                    log("INFO", f"{self.consumer}: took {pt.stream} (lease token {token})")
                    pt.token = token
                if pt.token and not pt.ready:
                    yield pt

    def _take_over(self, pt):
        """The entries other consumers left pending become ours (a delivery more each);
        those deleted from the stream meanwhile are dead-lettered as lost."""
        for s in (pt.stream, pt.replay):
            while True:
                ids, entries = self._leased(pt, "outbox_consumer_take_v1", 2, s, pt.lease,
                                            self.group, self.consumer, pt.token, 100)
                present = {e[0] for e in entries}
                for i in ids:
                    if i not in present:
                        self._dead_letter_held(pt, Held(s, i.decode(), None, 1, LOST))
                if len(ids) < 100:
                    break
        pt.ready = True

    def _fill(self):
        """Reads into the hands: own pending entries first (in id order), then new ones."""
        got = 0
        for pt in self.parts:
            if not pt.ready:
                continue
            limit = self.count if self._next(pt, now_ms()) else HAND_MAX
            for s in (pt.stream, pt.replay):
                room, start = min(self.count, limit - len(pt.hand)), pt.cursor[s]
                if room <= 0:
                    break
                counts = {}  # delivery counts of own pending entries
                if start is not None:
                    for p in self.r.xpending_range(s, self.group, "-" if start == "0" else
                                                   "(" + start, "+", room, self.consumer):
                        counts[p["message_id"]] = p["times_delivered"]
                reply = self._leased(pt, "outbox_consumer_read_v1", 2, s, pt.lease, self.group,
                                     self.consumer, pt.token, room, start or ">")
                entries = reply[0][1] if reply else []
                for entry_id, flat in entries:  # flat: [field, value, ...]; None: deleted
                    fields = None if flat is None else dict(zip(flat[::2], flat[1::2]))
                    pt.hand.append(Held(s, entry_id.decode(), fields, counts.get(entry_id, 1)))
                if entries and start is None:
                    pt.last[s] = entries[-1][0]
                elif start is not None:
                    pt.cursor[s] = entries[-1][0].decode() if len(entries) == room else None
                got += len(entries)
        return got

    @staticmethod
    def _next(pt, now):
        """The first entry in hand whose key has no earlier entry in hand, once its backoff
        has passed; entries without a key never wait."""
        seen = set()
        for h in pt.hand:
            if h.key is not None and h.key in seen:
                continue
            if h.key is not None:
                seen.add(h.key)
            if h.retry_at <= now:
                return h
        return None

    def _handle_next(self, pt):
        h = self._next(pt, now_ms()) if pt.ready else None
        if h is None:
            return False
        what, why = h.dead or self._decide(h.stream, h.entry_id, h.fields, h.deliveries)
        if what == "retry":  # its key's later entries wait behind it, in hand
            h.retry_at, h.deliveries = now_ms() + self.backoff(h.deliveries), h.deliveries + 1
        elif what == "done":
            self._leased(pt, "outbox_consumer_ack_v1", 2, h.stream, pt.lease, self.group, pt.token,
                         h.entry_id)
            self.stats["done"] += 1
            pt.hand.remove(h)
        else:
            h.dead = (what, why)
            self._dead_letter_held(pt, h)
        return True

    def _dead_letter_held(self, pt, h):
        head = ["outbox_consumer_dead_letter_leased_v1", 3, pt.dlq, h.stream, pt.lease,
                self.group, pt.token]
        if self._dead_letter(head, pt.dlq, h.stream, h.entry_id, h.fields, h.deliveries,
                             *h.dead, pt=pt):
            if h in pt.hand:
                pt.hand.remove(h)
        else:
            h.retry_at = now_ms() + 1000  # Redis refused it: written again in a second

    def _wait(self, next_upkeep):
        """Blocks on plain XREAD (it changes nothing) until a new entry, the end of a
        backoff or the next upkeep."""
        now = now_ms()
        wake = min([next_upkeep] + [h.retry_at for pt in self.parts for h in pt.hand
                                    if h.retry_at > now])
        ms = int(min(self.block_ms, wake - now))
        streams = {}
        for pt in self.parts:
            for s in (pt.stream, pt.replay):
                if pt.ready and pt.cursor[s] is None and len(pt.hand) < HAND_MAX:
                    if s not in pt.last:  # the group's last delivered entry, once
                        pt.last[s] = next((g["last-delivered-id"] for g in self.r.xinfo_groups(s)
                                           if g["name"].decode() == self.group), "0-0")
                    streams[s] = pt.last[s]
        if ms > 0 and streams:
            self.r.xread(streams, count=1, block=ms)
        elif ms > 0:
            time.sleep(ms / 1000)


# -- the command line: outbox-email-consumer's effect, an e-mail row per order
def parse_ms(text):
    """"250ms", "5s", "2m" or a bare number of milliseconds."""
    for unit, mult in (("ms", 1), ("s", 1000), ("m", 60000)):
        if text.endswith(unit) and text[:-len(unit)].isdigit():
            return int(text[:-len(unit)]) * mult
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"not a duration: {text!r} (say 250ms, 5s or 2m)")


def send_email(group):
    """The effect of examples/email_consumer.c: a row in emails (examples/email_schema.sql).
    A header "fail" asks for a failure: "permanent", "transient" (every delivery) or
    "transient:N" (the first N deliveries)."""
    def effect(cur, msg):
        fail = msg.headers.get("fail", "")
        if fail == "permanent":
            raise Fail("the message asked for a permanent failure")
        if fail == "transient" or (fail.startswith("transient:")
                                   and msg.deliveries <= int(fail[10:])):
            raise RuntimeError("the message asked for a transient failure")
        cur.execute("INSERT INTO emails (message_id, order_id, customer, consumer)"
                    " SELECT %s, (p ->> 'order')::bigint, p ->> 'customer', %s"
                    " FROM (SELECT convert_from(%s, 'UTF8')::jsonb AS p) AS s",
                    (msg.id, group, psycopg2.Binary(msg.payload)))
    return effect


def main():
    a = argparse.ArgumentParser(description="outbox-email-consumer in Python (README.md here)")
    a.add_argument("--redis", required=True, help="redis://[user:password@]host:port/db, or "
                   "rediss://...?ca_file=PATH and the relay's other TLS options")
    a.add_argument("--postgres", required=True, help="libpq connection string")
    a.add_argument("--stream", default="orders")
    a.add_argument("--group", default="email")
    a.add_argument("--consumer", help="this consumer's name (host-pid)")
    a.add_argument("--max-deliveries", type=int, default=5)
    a.add_argument("--backoff", type=lambda t: [parse_ms(x) for x in t.split(",")],
                   default=BACKOFF_MS, help="waits between deliveries (1s,10s,100s,1000s)")
    a.add_argument("--block", type=parse_ms, default=1000, help="longest wait for news (1s)")
    a.add_argument("--ordered", type=int, default=0, metavar="PARTITIONS",
                   help="the topic has PARTITIONS partitions: handle each key in order")
    a.add_argument("--lease", type=parse_ms, default=10000, help="with --ordered (10s)")
    o = a.parse_args()
    try:  # a URL or TLS option it refuses is a usage error: nothing is connected yet
        c = OutboxConsumer(o.redis, o.postgres, o.stream, o.group, send_email(o.group),
                           o.consumer, o.max_deliveries, o.backoff, o.block,
                           partitions=o.ordered, lease_ms=o.lease)
    except ValueError as e:
        a.error(f"--redis: {e}")
    signal.signal(signal.SIGTERM, c.stop)  # finish the message in hand, then return
    signal.signal(signal.SIGINT, c.stop)
    c.run()


if __name__ == "__main__":
    main()
