"""Fault injection for the integration tests: a controllable loopback TCP proxy.

    TcpProxy      a TCP proxy in front of a server: cut(), blackhole(), restore()
    HoldingProxy  holds each new connection back before connecting it upstream

The load and the checks under faults are the harness's: harness.Producers
(threads that survive restarts and keep a steady rate) and harness.Verifier
(across_streams=True, compare_payloads=True).

Only the standard library (and the harness) is used. Nothing here listens on
anything but 127.0.0.1.
"""

import contextlib
import errno
import queue
import select
import selectors
import socket
import struct
import sys
import threading
import time

from .cleanup import register, unregister
from .common import reserve_port

# --------------------------------------------------------------------------
# TCP proxy.


def forward_both_ways(client, upstream):
    """Copies bytes each way between two connected sockets, a thread per
    direction, passing each end's FIN on to the other."""

    def pipe(a, b):
        with contextlib.suppress(OSError):
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)
    threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
    threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()


class HoldingProxy:
    """A small TCP proxy on 127.0.0.1 that holds each new connection back
    before it connects it to target_port. hold(client) answers how many
    seconds, and the bytes to send upstream first: it may read the start of
    the client's stream (and answer it) to decide. close() ends every hold at
    once. Counter: connections (accepted)."""

    def __init__(self, target_port, hold):
        self.target = ("127.0.0.1", target_port)
        self.hold = hold
        self.connections = 0
        self.socks = []
        self.closing = threading.Event()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closing.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self.socks.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client):
        try:
            delay, first = self.hold(client)
            if self.closing.wait(delay):
                raise OSError("the proxy is closing")
            upstream = socket.create_connection(self.target)
            self.socks.append(upstream)
            upstream.sendall(first)
        except OSError:
            client.close()
            return
        forward_both_ways(client, upstream)

    def close(self):
        self.closing.set()
        for s in [self.listener, *self.socks]:
            with contextlib.suppress(OSError):
                s.close()


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
        register(self)
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
        reserve_port(self.port)
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
        unregister(self)
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
    def retarget(self, port, host="127.0.0.1"):
        """New connections go to host:port from now on (a failover behind
        one address); live ones keep their upstream."""
        self.target = (host, port)

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
