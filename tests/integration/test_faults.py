"""Fault injection under sustained load: nothing lost, nothing doubled, whatever breaks.

Promises tested (docs/DESIGN.md P1 and P2, "The claim cycle"): while 4 producers keep committing
transactions of 1..20 rows (3 topics, payloads of 0..300 bytes, half of them
binary), faults are injected at random moments, one kind per test:

  relay-kill        the relay killed with SIGKILL (>= 20 times) and restarted
  redis-kill        Redis killed with SIGKILL and restarted on the same port
                    (appendonly yes + appendfsync always: acknowledgements are durable),
                    its AOF's torn last write cut first as docs/GUARANTEES.md says
  redis-freeze      Redis stopped with SIGSTOP for ~2.5 s, longer than the relay's
                    1 s publish deadline, then SIGCONT
  pg-restart        PostgreSQL restarted in immediate mode (as in a crash)
  pg-terminate      the relay's sessions ended with pg_terminate_backend()
  proxy-cut         the relay's TCP connection to Redis reset by a proxy, new ones
                    refused for a while
  proxy-blackhole   the relay's TCP connection to Redis silently stalled (nothing
                    forwarded either way) past the publish deadline, then restored:
                    what the stalled connections held is delivered at once or lost
  proxy-blackhole-late  the same, but the connection the relay abandoned delivers
                    its batch late, after the relay's next connection got through
  two-relays        two relays at once on the same database and Redis, one of them
                    killed with SIGKILL now and then

After each: the producers stop, the relay drains (outbox.unsent is empty),
and every row is checked against every stream. One line of figures is printed,
e.g.

  faults: scenario=relay-kill injected=23 committed=41234 lost=0 duplicates=0 sent_but_absent=0 unsent=0

and the test fails unless lost = duplicates = sent_but_absent = unsent = 0
(also no stray entry and no entry whose payload differs from its row), and the
number of faults injected reached the scenario's minimum. Duplicates are
entries beyond the first per message id across all streams.

Environment:
  OUTBOX_RELAY_FAULT_SEED=<n>   replays one random schedule (the seed is printed)
  OUTBOX_RELAY_FAULT_QUICK=1    lighter load and shorter scenarios, e.g. for a
                                sanitizer build; the minimum numbers of faults stay
"""

import collections
import contextlib
import os
import random
import re
import sys
import time
import unittest

import psycopg2

from testkit import faults
from testkit import harness

harness.require_relay()
harness.set_deadline(870)  # CTest kills the file at 900 s

SEED = int(os.environ.get("OUTBOX_RELAY_FAULT_SEED") or random.randrange(1 << 31))
QUICK = os.environ.get("OUTBOX_RELAY_FAULT_QUICK", "") not in ("", "0")

PRODUCERS = 4
RATE = 500 if QUICK else 1500          # rows per second, all producers together
LOAD_SECONDS = 12 if QUICK else 22     # least time under load per scenario
WARM_UP_SECONDS = 1.0                  # load before the first fault
OVERRUN_SECONDS = 120                  # extra time allowed to reach a minimum of faults
DRAIN_SECONDS = 240 if QUICK else 120
RELAY_FLAGS = dict(poll_interval="200ms", reconnect_min="50ms", reconnect_max="1s",
                   publish_timeout="1s", batch_size=200, log_level="info")
FREEZE_SECONDS = (2.3, 2.8)            # longer than the 1 s publish deadline
LATE_SECONDS = 1.5                     # how much later an abandoned connection delivers
DEADLINE_LOGGED = r"within publish_timeout"
RUNNING_LOGGED = r"^\S+ INFO relay: outbox-relay \S+ running\b"
TOPICS = ("orders", "billing.invoices", "mail-out")
PRODUCER_OPTIONS = dict(topics=TOPICS, tx_rows=(1, 20), payload_bytes=(0, 300),
                        text_payloads=True,
                        connect=dict(application_name="fault-producer", connect_timeout=5,
                                     statement_timeout=30000))
TERMINATE_SQL = ("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                 " WHERE application_name LIKE 'outbox-relay%'")


def problem_tail(relay, lines=25):
    """The relay's last WARNING/ERROR lines and the last lines of its log."""
    log = relay.log()
    problems = re.findall(r"^\S+ (?:WARNING|ERROR) .*$", log, re.MULTILINE)
    return (f"--- relay {relay.log_path}: last {lines} WARNING/ERROR lines ---\n"
            + "\n".join(problems[-lines:]) + "\n" + relay.log_tail(lines))


def fault_line(fig, scenario, injected):
    """The one line of figures printed after each scenario."""
    text = (f"faults: scenario={scenario} injected={injected} committed={fig.committed}"
            f" lost={fig.lost} duplicates={fig.duplicates}"
            f" sent_but_absent={fig.sent_but_absent} unsent={fig.unsent}")
    if fig.stray:
        text += f" stray={fig.stray}"
    if fig.corrupt:
        text += f" corrupt={fig.corrupt}"
    return text


class FaultTest(harness.ServerTestCase):
    redis_options = dict(appendonly=True, appendfsync="always")

    @classmethod
    def setUpClass(cls):
        print(f"faults: seed={SEED} quick={int(QUICK)} (replay with OUTBOX_RELAY_FAULT_SEED={SEED})",
              file=sys.stderr, flush=True)
        super().setUpClass()

    def setUp(self):
        harness.TestCase.setUp(self)
        # Fresh connections: the class's own die with a PostgreSQL or Redis restart.
        self.db = self.pg.connect()
        self.addCleanup(self.db.close)
        self.r = self.redis.client()
        self.addCleanup(self.r.close)
        harness.reset(self.db, self.r)
        self.relays = []
        self.started_at = {}   # relay -> its log's length when it was last started
        self.scenario = None

    # -- building blocks
    def random_for(self, scenario):
        """The schedule of one scenario: the same for one seed whichever tests run."""
        self.scenario = scenario
        print(f"faults: scenario={scenario} seed={SEED}", file=sys.stderr, flush=True)
        return random.Random(f"{SEED}:{scenario}")

    def start_relay(self, args=()):
        relay = harness.Relay(self.pg, self.redis, args=args, **RELAY_FLAGS)
        self.started_at[relay] = 0
        self.enterContext(relay)
        self.relays.append(relay)
        return relay

    def kill_and_restart(self, relay, pause=0.0):
        """SIGKILL, then the same relay again (its log goes on in the same file)."""
        relay.kill()
        time.sleep(pause)
        self.started_at[relay] = relay.mark()
        relay.start()

    def wait_running(self, relay):
        """Waits until the relay's latest start logged that it runs: a SIGTERM that comes
        before the daemon installed its handlers would end it with the default action."""
        relay.wait_for_log(RUNNING_LOGGED, since=self.started_at[relay], timeout=60)

    def assert_relays_alive(self, what):
        for relay in self.relays:
            if not relay.alive():
                self.fail(f"{self.scenario}: the relay exited by itself (code {relay.returncode})"
                          f" {what}\n{problem_tail(relay)}")

    def run_load(self, rnd, inject, minimum, pause):
        """Runs the producers and calls inject() after pause(rnd) seconds, again and again,
        until at least LOAD_SECONDS passed and inject() returned true minimum times
        (or OVERRUN_SECONDS more passed). Returns (faults injected, producers)."""
        producers = harness.Producers(self.pg, n=PRODUCERS, rate=RATE,
                                      seed=rnd.randrange(1 << 30), name="fault-producer",
                                      **PRODUCER_OPTIONS)
        self.addCleanup(_quiet_stop, producers)
        producers.start()
        started = time.monotonic()
        time.sleep(WARM_UP_SECONDS)
        injected = 0
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= LOAD_SECONDS and injected >= minimum:
                break
            if elapsed >= LOAD_SECONDS + OVERRUN_SECONDS:
                break  # the assertion on the minimum reports it
            time.sleep(pause(rnd))
            failure = producers.failed()
            if failure:
                self.fail(f"{self.scenario}: {failure}")
            self.assert_relays_alive("under load")
            if inject():
                injected += 1
        producers.stop()
        print(f"faults: scenario={self.scenario} load {time.monotonic() - started:.1f}s,"
              f" producers committed {producers.committed} rows, {producers.unknown} with an"
              f" unknown outcome, {producers.connection_errors} connection errors",
              file=sys.stderr, flush=True)
        return injected, producers

    def connect_when_up(self, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = self.pg.connect()
                self.addCleanup(conn.close)
                return conn
            except psycopg2.OperationalError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def drain(self, conn):
        """Waits until every row is in its stream (or quarantined); fails with the relay logs if
        it never happens."""
        deadline = time.monotonic() + DRAIN_SECONDS
        while True:
            pending = harness.count_unsent(conn)
            if pending == 0:
                return
            self.assert_relays_alive("while draining")
            if time.monotonic() >= deadline:
                failed = harness.scalar(conn, "SELECT count(*) FROM outbox.quarantine")
                self.fail(f"{self.scenario} (seed {SEED}): {pending} rows still unsent"
                          f" ({failed} quarantined) {DRAIN_SECONDS} s after the load stopped\n"
                          + "\n".join(problem_tail(r) for r in self.relays))
            time.sleep(0.2)

    def finish(self, injected, producers, minimum):
        """Drain, stop the relays cleanly, verify, print the figures, assert."""
        conn = self.connect_when_up()
        self.drain(conn)
        logs = []
        for relay in self.relays:
            self.wait_running(relay)
            code = relay.terminate(timeout=30)
            logs.append(relay.log())
            self.assertEqual(code, 0, f"{self.scenario}: the relay's exit code after SIGTERM\n"
                             + problem_tail(relay))
        r = self.redis.client()
        self.addCleanup(r.close)
        fig = harness.Verifier(conn, r, across_streams=True, compare_payloads=True).figures()
        dedup = sum(1 for _ in r.scan_iter(match="*:dedup:*", count=1000))
        print(f"faults: scenario={self.scenario} dedup records left (batches with an unknown"
              f" outcome): {dedup}", file=sys.stderr, flush=True)
        print(fault_line(fig, self.scenario, injected), file=sys.stderr, flush=True)

        detail = (f"seed {SEED}; {fault_line(fig, self.scenario, injected)}\n"
                  f"lost e.g. {fig.lost_ids[:5]}\n"
                  f"duplicated e.g.:\n{harness.duplicate_detail(r, fig.duplicate_ids)}\n"
                  + "\n".join(problem_tail(rl) for rl in self.relays))
        self.assertEqual(fig.sent_but_absent, 0, "rows marked sent but not in Redis: " + detail)
        self.assertEqual(fig.lost, 0, "rows with no entry in their stream: " + detail)
        self.assertEqual(fig.duplicates, 0, "message ids published more than once: " + detail)
        self.assertEqual(fig.unsent, 0, "rows still unsent after the drain: " + detail)
        self.assertEqual(fig.stray, 0, "entries of no row or in another topic's stream: " + detail)
        self.assertEqual(fig.corrupt, 0, "entries that differ from their row: " + detail)
        # What producers saw committed is in the table; nothing else is.
        self.assertGreaterEqual(fig.committed, producers.committed, detail)
        self.assertLessEqual(fig.committed, producers.committed + producers.unknown, detail)
        self.assertGreater(fig.committed, 0, detail)
        self.assertGreaterEqual(injected, minimum,
                                f"{self.scenario}: too few faults injected (seed {SEED})")
        return fig, logs

    # -- the scenarios
    def test_relay_kill(self):
        rnd = self.random_for("relay-kill")
        relay = self.start_relay()

        def kill():
            self.kill_and_restart(relay)
            return True
        injected, producers = self.run_load(rnd, kill, 20, lambda r: r.uniform(0.2, 1.5))
        self.finish(injected, producers, 20)

    def test_redis_kill(self):
        rnd = self.random_for("redis-kill")
        self.start_relay()

        def kill():
            self.redis.kill()
            try:
                time.sleep(rnd.uniform(0.1, 1.0))
            finally:
                self.redis.start()  # same port, same directory: it replays its AOF
            return True
        injected, producers = self.run_load(rnd, kill, 5, lambda r: r.uniform(1.0, 3.5))
        self.finish(injected, producers, 5)

    def test_redis_freeze(self):
        rnd = self.random_for("redis-freeze")
        relay = self.start_relay()
        mark = relay.mark()

        def freeze():
            self.redis.pause()
            try:
                time.sleep(rnd.uniform(*FREEZE_SECONDS))
            finally:
                self.redis.resume()
            return True
        injected, producers = self.run_load(rnd, freeze, 4, lambda r: r.uniform(1.0, 3.0))
        _, logs = self.finish(injected, producers, 4)
        deadlines = len(re.findall(DEADLINE_LOGGED, logs[0][mark:]))
        print(f"faults: scenario=redis-freeze publish deadline logged {deadlines} times",
              file=sys.stderr, flush=True)
        self.assertGreater(deadlines, 0, "Redis was frozen past the publish deadline, but the"
                           " relay never logged that the deadline fired")

    def test_pg_restart(self):
        rnd = self.random_for("pg-restart")
        self.start_relay()

        def restart():
            self.pg.restart(mode="immediate")
            return True
        injected, producers = self.run_load(rnd, restart, 4, lambda r: r.uniform(1.5, 4.0))
        self.finish(injected, producers, 4)

    def test_pg_terminate(self):
        rnd = self.random_for("pg-terminate")
        self.start_relay()
        sessions = []

        def terminate():
            with contextlib.closing(self.pg.connect()) as conn:
                ended = harness.scalar(conn, TERMINATE_SQL)
            sessions.append(ended)
            return ended > 0
        injected, producers = self.run_load(rnd, terminate, 6, lambda r: r.uniform(0.7, 3.0))
        print(f"faults: scenario=pg-terminate sessions ended per injection: {sessions}",
              file=sys.stderr, flush=True)
        self.finish(injected, producers, 6)

    def proxied_relay(self):
        proxy = self.enterContext(faults.TcpProxy(self.redis.port, name="redis-proxy"))
        # The command line wins over OUTBOX_RELAY_REDIS, which the harness sets.
        relay = self.start_relay(args=["--redis", f"redis://127.0.0.1:{proxy.port}/0"])
        self.addCleanup(proxy.check)
        return proxy, relay

    def test_proxy_cut(self):
        rnd = self.random_for("proxy-cut")
        proxy, relay = self.proxied_relay()

        def cut():
            try:
                reset = proxy.cut()
                time.sleep(rnd.uniform(0.2, 1.5))
            finally:
                proxy.restore()
            return reset > 0
        injected, producers = self.run_load(rnd, cut, 6, lambda r: r.uniform(0.5, 2.5))
        print(f"faults: scenario=proxy-cut connections accepted={proxy.accepted}"
              f" reset={proxy.reset} refused={proxy.refused}", file=sys.stderr, flush=True)
        self.finish(injected, producers, 6)

    def blackholes(self, scenario, restore_as):
        """Stalls the relay's Redis connection past the publish deadline, again and again;
        restore_as(rnd) says what becomes of the connections caught (TcpProxy.restore)."""
        rnd = self.random_for(scenario)
        proxy, relay = self.proxied_relay()
        mark = relay.mark()
        how = collections.Counter()

        def blackhole():
            held = restore_as(rnd)
            try:
                proxy.blackhole()
                live = proxy.live()
                time.sleep(rnd.uniform(*FREEZE_SECONDS))
            finally:
                proxy.restore(held=held, late_seconds=LATE_SECONDS)
            how[held] += 1
            return live > 0
        injected, producers = self.run_load(rnd, blackhole, 4, lambda r: r.uniform(1.0, 3.0))
        print(f"faults: scenario={scenario} connections accepted={proxy.accepted},"
              f" restored as {dict(how)}", file=sys.stderr, flush=True)
        _, logs = self.finish(injected, producers, 4)
        deadlines = len(re.findall(DEADLINE_LOGGED, logs[0][mark:]))
        print(f"faults: scenario={scenario} publish deadline logged {deadlines} times",
              file=sys.stderr, flush=True)
        self.assertGreater(deadlines, 0, "the connection was stalled past the publish deadline,"
                           " but the relay never logged that the deadline fired")

    def test_proxy_blackhole(self):
        # As the partition ends, what the connections held is either delivered at once
        # (an abandoned batch then reaches Redis: the dedup function must absorb it) or
        # lost with them (nothing of that batch may count as sent).
        self.blackholes("proxy-blackhole", lambda rnd: rnd.choice(("deliver", "drop")))

    def test_proxy_blackhole_late(self):
        # The connection the relay abandoned at its publish deadline delivers its
        # batch only after the relay's next connection has published and committed
        # those rows: TCP keeps retransmitting what a closed socket had sent, and its
        # backed-off retransmission timer can fire after a fresh connection got
        # through. The late copies must not become second entries (P2).
        self.blackholes("proxy-blackhole-late", lambda rnd: "late")

    def test_two_relays(self):
        rnd = self.random_for("two-relays")
        pair = [self.start_relay(), self.start_relay()]

        def kill_one():
            relay = rnd.choice(pair)
            self.kill_and_restart(relay, pause=rnd.uniform(0.0, 0.5))
            return True
        injected, producers = self.run_load(rnd, kill_one, 8, lambda r: r.uniform(0.5, 2.5))
        self.finish(injected, producers, 8)


def _quiet_stop(producers):
    with contextlib.suppress(Exception):
        producers.stop(timeout=10)


if __name__ == "__main__":
    unittest.main()
