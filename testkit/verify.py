"""The check of every outbox row against every stream: lost, duplicated,
sent but absent, stray and corrupt entries, as one line of figures."""

import dataclasses
import sys

from .outbox import entries_by_message_id

@dataclasses.dataclass
class Figures:
    committed: int = 0
    published: int = 0
    lost: int = 0
    duplicates: int = 0
    sent_but_absent: int = 0
    unsent: int = 0
    stray: int = 0    # entries whose id is no row's, or in another topic's stream
    corrupt: int = 0  # entries whose payload, topic or outbox_id differ from the row's
    lost_ids: list = dataclasses.field(default_factory=list)
    duplicate_ids: list = dataclasses.field(default_factory=list)

    def line(self):
        text = (f"rows committed={self.committed} published={self.published} lost={self.lost}"
                f" duplicates={self.duplicates} sent_but_absent={self.sent_but_absent}"
                f" unsent={self.unsent}")
        if self.stray:
            text += f" stray={self.stray}"
        if self.corrupt:
            text += f" corrupt={self.corrupt}"
        return text

    def assert_exactly_once(self, test):
        """Every row sent and published once, as written, nothing else in the streams."""
        test.assertEqual((self.lost, self.duplicates, self.sent_but_absent, self.unsent,
                          self.stray, self.corrupt), (0, 0, 0, 0, 0, 0),
                         f"{self.line()}; lost e.g. {self.lost_ids[:5]},"
                         f" duplicated e.g. {self.duplicate_ids[:5]}")


class Verifier:
    """Compares every row of outbox.messages with every stream.

    lost:            rows with no entry in their topic's stream
    duplicates:      entries beyond the first for one message id in the row's
                     stream (across_streams=True: in all streams together)
    sent_but_absent: rows past their stream's recorded position (or
                     quarantined) with no entry
    unsent:          rows in outbox.unsent
    stray:           entries of no row, or in another topic's stream
    corrupt:         with compare_payloads=True, entries in the row's stream
                     whose payload bytes, topic or outbox_id differ from the row's
    Reads every row and every stream once.
    """

    def __init__(self, pg_conn, redis_client, stream_prefix="", across_streams=False,
                 compare_payloads=False):
        self.pg = pg_conn
        self.redis = redis_client
        self.prefix = stream_prefix.encode()
        self.across_streams = across_streams
        self.compare_payloads = compare_payloads

    def figures(self):
        payload = "payload" if self.compare_payloads else "NULL"
        with self.pg.cursor() as cur:
            cur.execute(f"SELECT m.message_id::text, m.id, m.topic, {payload},"
                        " NOT EXISTS (SELECT FROM outbox.unsent AS u WHERE u.id = m.id)"
                        " FROM outbox.messages AS m ORDER BY m.id")
            rows = cur.fetchall()
        if not self.pg.autocommit:
            self.pg.commit()
        found = entries_by_message_id(self.redis)
        fig = Figures(committed=len(rows))
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
            copies = len(entries) if self.across_streams else len(here)
            if copies > 1:
                fig.duplicates += copies - 1
                fig.duplicate_ids.append(message_id)
            if not sent:
                fig.unsent += 1
            if self.compare_payloads:
                for _, _, fields in here:
                    if (fields.get(b"payload") != bytes(payload)
                            or fields.get(b"topic") != topic.encode()
                            or fields.get(b"outbox_id") != str(outbox_id).encode()):
                        fig.corrupt += 1
        fig.stray += sum(len(v) for k, v in found.items() if k not in known)
        return fig

    def report(self, suffix=""):
        """Computes the figures and prints their one line (with suffix)."""
        fig = self.figures()
        print(fig.line() + (f" {suffix}" if suffix else ""), file=sys.stderr, flush=True)
        return fig


def duplicate_detail(redis_client, message_ids, limit=3):
    """Where the entries of some duplicated message ids are, for a failure message."""
    found = entries_by_message_id(redis_client)
    lines = []
    for mid in message_ids[:limit]:
        for stream, entry_id, fields in found.get(mid, []):
            lines.append(f"  {mid}: {stream.decode()} {entry_id}"
                         f" outbox_id={fields.get(b'outbox_id', b'?').decode()}")
    return "\n".join(lines)
