"""Fault-injection helpers for the integration tests: a TCP proxy, producers, a verifier.

    TcpProxy   a controllable loopback TCP proxy: cut(), blackhole(), restore()
    Producers  N threads committing outbox rows as fast as asked, surviving restarts
    FaultVerifier  the harness's Verifier, with duplicates counted across all streams
               and every entry's payload compared with its row

Only the standard library and psycopg2 (through harness.py) are used. Nothing
here listens on anything but 127.0.0.1.
"""

import contextlib
import dataclasses
import errno
import queue
import random
import select
import selectors
import socket
import struct
import sys
import threading
import time

import psycopg2

import harness

# --------------------------------------------------------------------------
# TCP proxy.

OPEN, CUT, BLACKHOLE = "open", "cut", "blackhole"
_BUF_CAP = 4 << 20      # bytes held per direction before we stop reading that side
_CHUNK = 256 << 10


def _reset_and_close(sock):
    """Closes with an RST (SO_LINGER 0), as a network reset would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Pipe:
    """One proxied connection: client <-> upstream, with a buffer per direction."""

    def __init__(self, number, client, upstream):
        self.number = number
        self.sock = {"c": client, "u": upstream}
        self.buf = {"c": bytearray(), "u": bytearray()}   # bytes waiting to be written TO side
        self.eof = {"c": False, "u": False}               # side sent FIN
        self.shut = {"c": False, "u": False}              # we sent FIN to side
        self.closed = False
        self.held = False           # caught in a blackhole, not yet restored
        self.frozen_until = 0.0     # restored late: forwards nothing before this time

    def client_gone(self):
        """Whether the client closed its end (even with bytes still unread)."""
        p = select.poll()
        p.register(self.sock["c"], select.POLLRDHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                   for _, ev in p.poll(0))

    @staticmethod
    def other(side):
        return "u" if side == "c" else "c"


class TcpProxy:
    """A controllable TCP proxy on 127.0.0.1 in front of target_port.

        with TcpProxy(redis.port) as proxy:
            relay = Relay(..., redis=f"redis://127.0.0.1:{proxy.port}/0")
            proxy.cut()        # RST every live connection; accept and close new ones
            proxy.restore()    # forward again
            proxy.blackhole()  # keep every connection open, forward nothing either way
            proxy.restore()    # what was held is delivered, in order

    During a blackhole nothing is read from or written to any socket, so the
    bytes a peer sends wait in the kernel, as in a network partition. New
    connections are accepted and connected upstream during a blackhole, but
    carry nothing until restore. What restore(held=...) does with the
    connections caught in the blackhole, as the partition ends:
      "deliver"  forward what they hold at once, in order, also for a connection
                 the client closed meanwhile (its bytes reach the server, then
                 the FIN): TCP retransmitting as soon as the network is back;
      "drop"     reset them: their bytes are never delivered (the partition
                 outlived the connections);
      "late"     like deliver, but a connection the client has closed stays
                 frozen late_seconds longer while every other one flows: the
                 abandoned connection's retransmission timer had backed off
                 further than the new connection's.

    One thread runs a selectors loop; cut/blackhole/restore take effect before
    they return. Counters: accepted, refused (closed at accept during a cut),
    upstream_failures (target refused), reset (closed by cut()), live().
    """

    def __init__(self, target_port, target_host="127.0.0.1", name="proxy"):
        self.target = (target_host, target_port)
        self.name = name
        self.port = None
        self.mode = OPEN
        self.accepted = 0
        self.refused = 0
        self.upstream_failures = 0
        self.reset = 0
        self._pipes = {}
        self._listener = None
        self._sel = None
        self._masks = {}           # socket -> registered mask (0 = unregistered)
        self._owner = {}           # socket -> (pipe, side)
        self._commands = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = None
        self._running = False
        self._numbers = 0
        self.error = None

    # -- lifecycle
    def __enter__(self):
        harness._register(self)
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self):
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        harness._ports_given.add(self.port)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-{self.port}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self):
        harness._unregister(self)
        if self._thread is not None and self._thread.is_alive():
            self._command("stop")
            self._thread.join(10)
        self._thread = None
        for pipe in list(self._pipes.values()):
            self._close_pipe(pipe, reset=False)
        for s in (self._listener, self._wake_r, self._wake_w):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        self._listener = None
        if self._sel is not None:
            with contextlib.suppress(Exception):
                self._sel.close()
            self._sel = None

    # -- control (from any thread)
    def cut(self):
        """Resets every live connection and refuses new ones (accepts and closes them).
        Returns how many live connections were reset."""
        return self._command("cut")

    def blackhole(self):
        """Keeps every connection open but forwards nothing, either way, until restore()."""
        return self._command("blackhole")

    def restore(self, held="deliver", late_seconds=1.0):
        """Forwards again; see the class comment for held. Returns how many connections
        were caught in the blackhole (dropped ones included)."""
        assert held in ("deliver", "drop", "late"), held
        return self._command("restore", (held, late_seconds))

    def live(self):
        return self._command("live")

    def check(self):
        if self.error is not None:
            raise AssertionError(f"{self.name} on port {self.port} failed: {self.error!r}")

    def _command(self, what, arg=None):
        self.check()
        if self._thread is None or not self._thread.is_alive():
            raise AssertionError(f"{self.name} on port {self.port} is not running")
        done = queue.Queue(1)
        self._commands.put((what, arg, done))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        try:
            return done.get(timeout=10)
        except queue.Empty:
            raise AssertionError(f"{self.name}: '{what}' not done within 10 s") from None

    # -- the loop (proxy thread only)
    def _loop(self):
        try:
            while self._running:
                timeout = self._update_registrations()
                for key, events in self._sel.select(timeout=timeout):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(4096)
                    else:
                        pipe, side = key.data
                        if pipe.closed:
                            continue
                        if events & selectors.EVENT_READ:
                            self._read(pipe, side)
                        if not pipe.closed and events & selectors.EVENT_WRITE:
                            self._write(pipe, side)
                self._run_commands()
        except BaseException as e:  # reported by check() and by the next command
            self.error = e
            print(f"{self.name}: proxy loop failed: {e!r}", file=sys.stderr, flush=True)
        finally:
            self._running = False
            # Answer whoever waits, so no control call hangs.
            while True:
                try:
                    _, _, done = self._commands.get_nowait()
                except queue.Empty:
                    break
                done.put(None)

    def _run_commands(self):
        while True:
            try:
                what, arg, done = self._commands.get_nowait()
            except queue.Empty:
                return
            result = None
            if what == "stop":
                self._running = False
            elif what == "cut":
                self.mode = CUT
                result = 0
                for pipe in list(self._pipes.values()):
                    self._close_pipe(pipe, reset=True)
                    result += 1
                self.reset += result
            elif what == "blackhole":
                self.mode = BLACKHOLE
                for pipe in self._pipes.values():
                    pipe.held = True
            elif what == "restore":
                result = self._restore(*arg)
            elif what == "live":
                result = len(self._pipes)
            done.put(result)

    def _restore(self, held, late_seconds):
        caught = [p for p in self._pipes.values() if p.held]
        for pipe in caught:
            pipe.held = False
            if held == "drop":
                self._close_pipe(pipe, reset=True)
            elif held == "late" and pipe.client_gone():
                pipe.frozen_until = time.monotonic() + late_seconds
        self.mode = OPEN
        return len(caught)

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ECONNABORTED):
                    return
                raise
            if self.mode == CUT:
                self.refused += 1
                _reset_and_close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                self.upstream_failures += 1
                _reset_and_close(client)
                continue
            self.accepted += 1
            self._numbers += 1
            for s in (client, upstream):
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pipe = _Pipe(self._numbers, client, upstream)
            pipe.held = self.mode == BLACKHOLE
            self._pipes[pipe.number] = pipe
            for side in ("c", "u"):
                self._owner[pipe.sock[side]] = (pipe, side)
                self._masks[pipe.sock[side]] = 0

    def _wanted(self, pipe, side, now):
        """The events we want on pipe's side socket now."""
        if self.mode != OPEN or pipe.frozen_until > now:
            return 0
        mask = 0
        other = _Pipe.other(side)
        if not pipe.eof[side] and len(pipe.buf[other]) < _BUF_CAP:
            mask |= selectors.EVENT_READ
        if pipe.buf[side]:
            mask |= selectors.EVENT_WRITE
        return mask

    def _update_registrations(self):
        """Registers what each socket waits for; returns the select timeout."""
        now = time.monotonic()
        timeout = 0.5
        for pipe in list(self._pipes.values()):
            if pipe.frozen_until > now:
                timeout = min(timeout, pipe.frozen_until - now)
            for side in ("c", "u"):
                sock = pipe.sock[side]
                want = self._wanted(pipe, side, now)
                have = self._masks.get(sock, 0)
                if want == have:
                    continue
                if have and want:
                    self._sel.modify(sock, want, (pipe, side))
                elif want:
                    self._sel.register(sock, want, (pipe, side))
                else:
                    self._sel.unregister(sock)
                self._masks[sock] = want
        return timeout

    def _read(self, pipe, side):
        other = _Pipe.other(side)
        try:
            data = pipe.sock[side].recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_pipe(pipe, reset=True)
            return
        if data:
            pipe.buf[other] += data
            self._write(pipe, other)
            return
        pipe.eof[side] = True
        self._maybe_shutdown(pipe, other)

    def _write(self, pipe, side):
        buf = pipe.buf[side]
        if buf:
            try:
                sent = pipe.sock[side].send(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close_pipe(pipe, reset=True)
                return
            del buf[:sent]
        self._maybe_shutdown(pipe, side)

    def _maybe_shutdown(self, pipe, side):
        """Passes the other side's FIN on to side once everything before it was written."""
        if pipe.closed:
            return
        if pipe.eof[_Pipe.other(side)] and not pipe.buf[side] and not pipe.shut[side]:
            with contextlib.suppress(OSError):
                pipe.sock[side].shutdown(socket.SHUT_WR)
            pipe.shut[side] = True
        if pipe.eof["c"] and pipe.eof["u"] and not pipe.buf["c"] and not pipe.buf["u"]:
            self._close_pipe(pipe, reset=False)

    def _close_pipe(self, pipe, reset):
        if pipe.closed:
            return
        pipe.closed = True
        self._pipes.pop(pipe.number, None)
        for sock in pipe.sock.values():
            if self._masks.pop(sock, 0) and self._sel is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(sock)
            self._owner.pop(sock, None)
            if reset:
                _reset_and_close(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.close()


# --------------------------------------------------------------------------
# Producers under sustained load.

TOPICS = ("orders", "billing.invoices", "mail-out")

# SQLSTATE classes that mean "the server or the connection went away", not "your SQL is wrong".
_CONNECTION_CLASSES = ("08", "57")
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz0123456789 {}\":,"
_PRINTABLE = bytes(_ALPHABET[i % len(_ALPHABET)] for i in range(256))


def _connection_trouble(exc, conn):
    if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
        return True
    if conn is not None and conn.closed:
        return True
    code = getattr(exc, "pgcode", None) or ""
    return code[:2] in _CONNECTION_CLASSES


class _ProducerThread(threading.Thread):

    def __init__(self, owner, index, seed):
        super().__init__(name=f"fault-producer-{index}", daemon=True)
        self.owner = owner
        self.random = random.Random(seed)
        self.committed = 0          # rows whose COMMIT succeeded
        self.unknown = 0            # rows whose COMMIT failed with the outcome unknown
        self.transactions = 0
        self.connection_errors = 0
        self.error = None

    def _payload(self):
        n = self.random.randint(*self.owner.payload_bytes)
        data = self.random.randbytes(n)
        if self.random.random() < 0.5:   # binary: NUL bytes and invalid UTF-8 included
            return data
        return data.translate(_PRINTABLE)  # text

    def _connect(self):
        conn = psycopg2.connect(self.owner.pg.dsn(), connect_timeout=5,
                                application_name="fault-producer",
                                options="-c statement_timeout=30000")
        conn.autocommit = False
        return conn

    def run(self):
        conn = None
        owner = self.owner
        started = time.monotonic()
        try:
            while not owner.stopping.is_set():
                if owner.rate_per_thread:
                    ahead = (self.committed + self.unknown) / owner.rate_per_thread \
                        - (time.monotonic() - started)
                    if ahead > 0:
                        owner.stopping.wait(min(ahead, 0.5))
                        continue
                if conn is None:
                    try:
                        conn = self._connect()
                    except psycopg2.Error:
                        self.connection_errors += 1
                        owner.stopping.wait(0.05)
                        continue
                n = self.random.randint(*owner.tx_rows)
                rows = [(self.random.choice(owner.topics), self._payload()) for _ in range(n)]
                committing = False
                try:
                    harness.insert_many(conn, rows, commit=False)
                    committing = True
                    conn.commit()
                except psycopg2.Error as e:
                    if not _connection_trouble(e, conn):
                        raise
                    self.connection_errors += 1
                    if committing:
                        self.unknown += n   # may or may not be in the table
                    with contextlib.suppress(Exception):
                        conn.close()
                    conn = None
                    continue
                self.committed += n
                self.transactions += 1
        except BaseException as e:  # reported by Producers.stop()
            self.error = e
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()


class Producers:
    """n threads, each on its own connection, committing transactions of tx_rows rows
    into outbox.messages (random topic of topics, payload of payload_bytes bytes, half
    of them random binary) until stop(); rate (rows per second, all threads together)
    paces them, None means as fast as they can.

    Connection failures (a PostgreSQL restart) are survived: the thread reconnects
    and carries on. A COMMIT that failed that way has an unknown outcome; such
    rows are counted in `unknown`, and the verifier counts what is in the table.
    """

    def __init__(self, pg, n=4, rate=None, seed=0, topics=TOPICS, tx_rows=(1, 20),
                 payload_bytes=(0, 300)):
        self.pg = pg
        self.topics = list(topics)
        self.tx_rows = tx_rows
        self.payload_bytes = payload_bytes
        self.rate_per_thread = rate / n if rate else None
        self.stopping = threading.Event()
        self.threads = [_ProducerThread(self, i, seed * 1000 + i) for i in range(n)]

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def stop(self, timeout=60):
        """Stops every thread; fails if one failed for another reason than the connection."""
        self.stopping.set()
        for t in self.threads:
            t.join(timeout)
        for t in self.threads:
            if t.error is not None:
                raise AssertionError(f"{t.name} failed: {t.error!r}")
            if t.is_alive():
                raise AssertionError(f"{t.name} did not stop within {timeout} s")

    @property
    def committed(self):
        return sum(t.committed for t in self.threads)

    @property
    def unknown(self):
        return sum(t.unknown for t in self.threads)

    @property
    def connection_errors(self):
        return sum(t.connection_errors for t in self.threads)

    def alive(self):
        return all(t.is_alive() for t in self.threads)

    def failed(self):
        """The first thread error, or None."""
        for t in self.threads:
            if t.error is not None:
                return f"{t.name} failed: {t.error!r}"
        return None


# --------------------------------------------------------------------------
# Verification.

@dataclasses.dataclass
class FaultFigures(harness.Figures):
    corrupt: int = 0     # entries whose payload, topic or outbox_id differ from the row's

    def fault_line(self, scenario, injected):
        text = (f"faults: scenario={scenario} injected={injected} committed={self.committed}"
                f" lost={self.lost} duplicates={self.duplicates}"
                f" sent_but_absent={self.sent_but_absent} unsent={self.unsent}")
        if self.stray:
            text += f" stray={self.stray}"
        if self.corrupt:
            text += f" corrupt={self.corrupt}"
        return text


class FaultVerifier(harness.Verifier):
    """harness.Verifier with two differences:

    - duplicates are entries beyond the first per message id across ALL streams
      (the harness counts them within the row's own stream only);
    - every entry of a row is compared with the row: payload bytes, topic and
      outbox_id (corrupt).
    Reads every row and every stream once.
    """

    def figures(self):
        with self.pg.cursor() as cur:
            cur.execute("SELECT message_id::text, id, topic, payload, sent_at IS NOT NULL"
                        " FROM outbox.messages ORDER BY id")
            rows = cur.fetchall()
        if not self.pg.autocommit:
            self.pg.commit()
        found = harness.entries_by_message_id(self.redis)
        fig = FaultFigures(committed=len(rows))
        known = set()
        for message_id, outbox_id, topic, payload, sent in rows:
            known.add(message_id)
            stream = self.prefix + topic.encode()
            entries = found.get(message_id, [])
            here = [e for e in entries if e[0] == stream]
            fig.stray += len(entries) - len(here)
            if here:
                fig.published += 1
            else:
                fig.lost += 1
                fig.lost_ids.append(message_id)
                if sent:
                    fig.sent_but_absent += 1
            if len(entries) > 1:
                fig.duplicates += len(entries) - 1
                fig.duplicate_ids.append(message_id)
            if not sent:
                fig.unsent += 1
            for _, _, fields in here:
                if (fields.get(b"payload") != bytes(payload)
                        or fields.get(b"topic") != topic.encode()
                        or fields.get(b"outbox_id") != str(outbox_id).encode()):
                    fig.corrupt += 1
        fig.stray += sum(len(v) for k, v in found.items() if k not in known)
        return fig


def duplicate_detail(redis_client, message_ids, limit=3):
    """Where the entries of some duplicated message ids are, for a failure message."""
    found = harness.entries_by_message_id(redis_client)
    lines = []
    for mid in message_ids[:limit]:
        for stream, entry_id, fields in found.get(mid, []):
            lines.append(f"  {mid}: {stream.decode()} {entry_id}"
                         f" outbox_id={fields.get(b'outbox_id', b'?').decode()}")
    return "\n".join(lines)
