"""Process-wide cleanup: every server, proxy and daemon is stopped and removed
at the end, also on a failure, an exception, SIGTERM or SIGINT of the test, and
the per-file deadline; and the logs the suite keeps of what it removes."""

import atexit
import contextlib
import os
import shutil
import signal
import sys
import threading

# Where the suite keeps every log it produced (the daemons', the tools', the
# servers'), and the passwords it handed out, for tests/integration/
# test_secrets.py to check that no password reached a log. Unset: nothing kept.
LOG_DIR = os.environ.get("OUTBOX_TEST_LOG_DIR")
_kept = 0


def keep_log(path, kind):
    """Copies a log into LOG_DIR (if set) before its directory goes."""
    global _kept
    if not LOG_DIR or not path or not os.path.exists(path):
        return
    os.makedirs(LOG_DIR, exist_ok=True)
    _kept += 1
    name = f"{kind}-{os.getpid()}-{_kept}-{os.path.basename(path)}"
    with contextlib.suppress(OSError):
        shutil.copyfile(path, os.path.join(LOG_DIR, name))


def keep_text(text, kind):
    """Writes output that never was a file (a tool's) into LOG_DIR."""
    global _kept
    if not LOG_DIR or not text:
        return
    os.makedirs(LOG_DIR, exist_ok=True)
    _kept += 1
    with open(os.path.join(LOG_DIR, f"{kind}-{os.getpid()}-{_kept}.log"), "w",
              encoding="utf-8", errors="replace") as f:
        f.write(text)


def keep_secret(secret):
    """Records a password the suite uses, for the final check of its logs."""
    if not LOG_DIR or not secret:
        return
    os.makedirs(LOG_DIR, exist_ok=True)
    with open(os.path.join(LOG_DIR, "secrets.txt"), "a", encoding="utf-8") as f:
        f.write(secret + "\n")


# --------------------------------------------------------------------------
# Process-wide cleanup: signals, deadline, atexit.

_live = []            # servers and relays still running, newest last
_results = []         # unittest results to stop when a signal arrives
_handlers_installed = False


def register(obj):
    """Has obj.close() called at exit, or on a signal or the deadline, unless
    unregister(obj) comes first (its close() does that)."""
    _install_signal_handlers()
    if not any(o is obj for o in _live):
        _live.append(obj)


def unregister(obj):
    """obj is closed: nothing to do for it at exit."""
    with contextlib.suppress(ValueError):
        _live.remove(obj)


def stop_on_signal(result):
    """A unittest result that a signal or the deadline stops (harness.TestCase)."""
    if result not in _results:
        _results.append(result)


def _cleanup_all():
    while _live:
        obj = _live.pop()
        with contextlib.suppress(BaseException):
            obj.close()


def _on_signal(signum, frame):
    name = signal.Signals(signum).name
    print(f"\nharness: {name} received: stopping the tests and every server",
          file=sys.stderr, flush=True)
    for result in _results:
        result.stop()  # unittest runs no further test, but still the cleanups
    raise SystemExit(128 + signum)


def _install_signal_handlers():
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
        signal.signal(sig, _on_signal)
    atexit.register(_cleanup_all)
    _handlers_installed = True


def set_deadline(seconds):
    """Fails the whole file (cleanly, servers stopped) if it runs longer than this."""
    _install_signal_handlers()
    signal.alarm(int(seconds))
