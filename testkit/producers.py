"""Load: threads that commit outbox rows at a steady rate and survive restarts."""

import contextlib
import random
import threading
import time

import psycopg2

from .outbox import insert_many

# SQLSTATE classes that mean "the server or the connection went away", not "your SQL is wrong".
_CONNECTION_CLASSES = ("08", "57")
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz0123456789 {}\":,"
_PRINTABLE = bytes(_ALPHABET[i % len(_ALPHABET)] for i in range(256))


def connection_trouble(exc, conn=None):
    """Whether a psycopg2 error means the server or the connection went away."""
    if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
        return True
    if conn is not None and conn.closed:
        return True
    code = getattr(exc, "pgcode", None) or ""
    return code[:2] in _CONNECTION_CLASSES


class Producer(threading.Thread):
    """Commits outbox rows from its own connection until it has committed `rows`
    (None: no limit) or is stopped.

    Each transaction holds a random number of rows in tx_rows (inclusive), each
    with a random topic of topics and a random payload of payload_bytes
    (inclusive) bytes: random binary, or with text_payloads half of them
    printable text. With rate (rows per second) it keeps to that pace, also
    after an outage. connect: keyword arguments for Postgres.connect.

    Connection failures (a PostgreSQL restart, a terminated session) are
    counted and survived: it reconnects and goes on. A COMMIT that failed that
    way has an unknown outcome; its rows are counted in `unknown`, and the
    Verifier reads the table, so it counts what really committed. Any other
    error ends the thread and is reported by check() and stop().
    """

    def __init__(self, pg, rows=None, topics=("orders",), tx_rows=(1, 1), payload_bytes=(0, 300),
                 rate=None, seed=0, name=None, text_payloads=False, connect=None):
        super().__init__(name=name, daemon=True)
        self.pg = pg
        self.rows = rows
        self.topics = list(topics)
        self.tx_rows = tx_rows
        self.payload_bytes = payload_bytes
        self.rate = rate
        self.text_payloads = text_payloads
        self.connect_options = dict(connect or {})
        self.random = random.Random(seed)
        self.committed = 0          # rows whose COMMIT succeeded
        self.unknown = 0            # rows whose COMMIT failed with the outcome unknown
        self.transactions = 0
        self.connection_errors = 0
        self.error = None
        self._stop_event = threading.Event()

    def _payload(self):
        data = self.random.randbytes(self.random.randint(*self.payload_bytes))
        if self.text_payloads and self.random.random() >= 0.5:
            return data.translate(_PRINTABLE)
        return data  # binary: NUL bytes and invalid UTF-8 included

    def _done(self):
        return self._stop_event.is_set() or (self.rows is not None
                                             and self.committed >= self.rows)

    def run(self):
        conn = None
        started = time.monotonic()
        try:
            while not self._done():
                if self.rate:
                    ahead = ((self.committed + self.unknown) / self.rate
                             - (time.monotonic() - started))
                    if ahead > 0:
                        self._stop_event.wait(min(ahead, 0.5))
                        continue
                if conn is None:
                    try:
                        conn = self.pg.connect(autocommit=False, **self.connect_options)
                    except psycopg2.Error:
                        self.connection_errors += 1
                        self._stop_event.wait(0.05)
                        continue
                n = self.random.randint(*self.tx_rows)
                if self.rows is not None:
                    n = min(n, self.rows - self.committed)
                batch = [(self.random.choice(self.topics), self._payload()) for _ in range(n)]
                committing = False
                try:
                    insert_many(conn, batch, commit=False)
                    committing = True
                    conn.commit()
                except psycopg2.Error as e:
                    if not connection_trouble(e, conn):
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
        except BaseException as e:  # reported by check()
            self.error = e
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def signal_stop(self):
        """Asks the thread to stop after its current transaction; see stop()."""
        self._stop_event.set()

    def stop(self, timeout=60):
        self.signal_stop()
        self.join(timeout)
        self.check()

    def check(self):
        if self.error is not None:
            raise AssertionError(f"producer {self.name} failed: {self.error!r}")
        if self.is_alive():
            raise AssertionError(f"producer {self.name} did not stop")


class Producers:
    """n Producers at once, each on its own connection, until stop().

    rate (rows per second) is for all of them together; producer i is seeded
    with seed * 1000 + i; the other options are Producer's.
    """

    def __init__(self, pg, n=4, rate=None, seed=0, name="producer", **options):
        self.threads = [Producer(pg, rate=rate / n if rate else None, seed=seed * 1000 + i,
                                 name=f"{name}-{i}", **options) for i in range(n)]

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def stop(self, timeout=60):
        """Stops every thread; fails if one failed for another reason than the connection."""
        for t in self.threads:
            t.signal_stop()
        for t in self.threads:
            t.join(timeout)
        for t in self.threads:
            t.check()

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
        """The first thread's error as a message, or None."""
        for t in self.threads:
            if t.error is not None:
                return f"producer {t.name} failed: {t.error!r}"
        return None
