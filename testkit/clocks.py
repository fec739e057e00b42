"""Servers whose wall clock is off: tests/shim/clockstep.c preloaded into them.

The shim adds the number of milliseconds found in a file (re-read every
20 ms) to CLOCK_REALTIME, gettimeofday and time, and leaves CLOCK_MONOTONIC
alone, as an NTP step or a VM resume does. The file is named relative to the
server's working directory ("clockstep"), so each node of a Redis Cluster
started under stepped_servers() has a clock of its own: set_step(node.dir,
ms) moves it, while the server runs.

    with clocks.stepped_servers():
        redis = test.enterContext(harness.Redis())   # or harness.RedisCluster()
    clocks.set_step(redis.dir, -60_000)              # Redis's TIME 60 s behind
"""

import contextlib
import os
import sys
import time

from .common import SKIP

STEP_FILE = "clockstep"


def clockstep_lib():
    """The built shim (ctest sets OUTBOX_CLOCKSTEP_LIB), or build/tests/clockstep.so."""
    path = os.environ.get("OUTBOX_CLOCKSTEP_LIB", "")
    if not path:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.path.join(here, "build", "tests", "clockstep.so")
    if not os.path.isfile(path):
        print(f"SKIP: clock-step shim {path!r} not built (set OUTBOX_CLOCKSTEP_LIB)",
              file=sys.stderr)
        sys.exit(SKIP)
    return path


@contextlib.contextmanager
def stepped_servers():
    """Every process started within inherits the shim: start the servers
    whose clock a test moves here, and nothing else."""
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "OUTBOX_CLOCKSTEP_FILE")}
    os.environ["LD_PRELOAD"] = clockstep_lib()
    os.environ["OUTBOX_CLOCKSTEP_FILE"] = STEP_FILE
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def set_step(directory, ms):
    """Moves the wall clock of the server running in directory to true time + ms."""
    tmp = os.path.join(directory, STEP_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(int(ms)))
    os.replace(tmp, os.path.join(directory, STEP_FILE))
    time.sleep(0.1)  # the shim rereads the file every 20 ms


def redis_time_ms(client):
    """Redis's own wall clock (TIME), in Unix ms."""
    s, us = client.time()
    return s * 1000 + us // 1000
