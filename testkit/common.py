"""What every part of the harness uses: where the source tree is, free loopback
ports, waiting for a condition, and running a command or a server process."""

import os
import socket
import subprocess
import tempfile
import time

SOURCE_DIR = os.environ.get("OUTBOX_RELAY_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))
SKIP = 77  # CTest SKIP_RETURN_CODE


_ports_given = set()


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on, not handed out before."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports_given:
            _ports_given.add(port)
            return port
    raise RuntimeError("no free port found")


def reserve_port(port):
    """Marks a port that something of ours listens on, so free_port never hands it out."""
    _ports_given.add(port)


def http_get(port, path, timeout=5.0):
    """GET path from 127.0.0.1:port on a fresh connection (the relay's metrics
    endpoint): (status or None when none came, body, seconds taken)."""
    started = time.monotonic()
    data = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        pass  # refused, reset or timed out: no status below
    elapsed = time.monotonic() - started
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    status = int(parts[1]) if len(parts) >= 2 and parts[0].startswith(b"HTTP/") else None
    return status, body, elapsed


def port_open(port, host="127.0.0.1"):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_until(pred, timeout=30.0, interval=0.05, message=None, relay=None):
    """Calls pred until it returns something true and returns that; fails after timeout.

    With relay given (a Daemon: the relay or a consumer), fails at once, with
    its log, if that process exits.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if relay is not None and not relay.alive():
            raise AssertionError(
                f"{message or 'condition'}: the {relay.label} exited with code {relay.returncode}"
                f" while waiting\n{relay.log_tail()}")
        if time.monotonic() >= deadline:
            detail = f"\n{relay.log_tail()}" if relay is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for "
                                 f"{message or getattr(pred, '__name__', 'condition')}{detail}")
        time.sleep(interval)


def tail(text, lines=40):
    return "\n".join(text.splitlines()[-lines:])


def run_command(argv, what, timeout=120, **kwargs):
    """Runs argv to completion and returns its output (stdout and stderr); raises,
    with the output, if it exits non-zero. what names it in the message."""
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed with code {proc.returncode}: {' '.join(argv)}\n"
                           + proc.stdout.decode(errors="replace"))
    return proc.stdout.decode(errors="replace")


def temp_dir(prefix, for_postgres=False):
    """A private temporary directory; owned by the postgres user when we are root."""
    path = tempfile.mkdtemp(prefix=prefix)
    if for_postgres and os.geteuid() == 0:
        # PostgreSQL refuses to run as root: hand the directory over, and make
        # sure the postgres user can reach it through its parents.
        parent = os.path.dirname(path)
        probe = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", parent])
        if probe.returncode != 0:
            os.rmdir(path)
            path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        import pwd
        pw = pwd.getpwnam("postgres")
        os.chown(path, pw.pw_uid, pw.pw_gid)
    os.chmod(path, 0o700)
    return path


def spawn_listening(argv, port, what, log, cwd, timeout=20):
    """Starts a server process (its output in its own log) and waits until it
    listens on port; raises with the end of log() when it exits first."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=cwd)
    wait_until(lambda: port_open(port) or proc.poll() is not None, timeout=timeout,
               message=f"{what} to listen")
    if proc.poll() is not None:
        raise RuntimeError(f"{what} exited with code {proc.returncode}\n" + tail(log()))
    return proc
