"""Which ways of writing a row keep the payload's bytes (docs/GUARANTEES.md, the
stream contract).

The relay publishes the bytes of outbox.messages.payload (bytea) verbatim; what
those bytes are is decided when the row is written. One JSON document, with
unusual spacing, keys out of order, a duplicate key, a number with a trailing
zero and a non-ASCII character, is written through each documented path and
the stream entry's payload compared with the producer's bytes. Promises tested:
- outbox.enqueue(topic, key, text) (a text parameter, and a string literal
  without a cast, which resolves to the text form), outbox.enqueue(topic, key,
  bytea), and an INSERT of a bytea parameter or of convert_to(text, 'UTF8')
  publish exactly the producer's bytes;
- outbox.enqueue(topic, key, jsonb) publishes jsonb's normalised text, the
  bytes of `payload::jsonb::text` (keys reordered, the duplicate dropped,
  spaces changed): not the producer's bytes, so a signature or a hash the
  producer computed over them no longer matches.
"""

import hashlib
import unittest

import psycopg2

from testkit import harness

harness.require_relay()
harness.set_deadline(120)

DOC = '{ "z":1,"a" :[1,2 ,3],  "a":"dup", "n":1.50, "name":"Zo\u00eb" }'
RAW = DOC.encode()
TOPIC = "signed"

INSERT = "INSERT INTO outbox.messages (topic, payload) VALUES (%s, {}) RETURNING message_id"
# name: (SQL, its parameters), each returning the message_id.
KEEP_BYTES = {
    "enqueue(text)": ("SELECT outbox.enqueue(%s, NULL, %s::text)", (TOPIC, DOC)),
    "enqueue(literal)": ("SELECT outbox.enqueue(%s, NULL, %s)", (TOPIC, DOC)),
    "enqueue(bytea)": ("SELECT outbox.enqueue(%s, NULL, %s)", (TOPIC, psycopg2.Binary(RAW))),
    "INSERT bytea": (INSERT.format("%s"), (TOPIC, psycopg2.Binary(RAW))),
    "INSERT convert_to": (INSERT.format("convert_to(%s, 'UTF8')"), (TOPIC, DOC)),
}
NORMALISES = {
    "enqueue(jsonb)": ("SELECT outbox.enqueue(%s, NULL, %s::jsonb)", (TOPIC, DOC)),
}


class PayloadBytesTest(harness.ServerTestCase):

    def test_which_writes_keep_the_payload_bytes(self):
        relay = self.relay(poll_interval="200ms")
        written = {}
        with self.db.cursor() as cur:
            for name, (sql, args) in {**KEEP_BYTES, **NORMALISES}.items():
                cur.execute(sql, args)
                written[name] = str(cur.fetchone()[0])
            cur.execute("SELECT convert_to(%s::jsonb::text, 'UTF8')", (DOC,))
            normalised = bytes(cur.fetchone()[0])
        harness.wait_all_sent(self.db, timeout=30, relay=relay)
        found = harness.entries_by_message_id(self.r)
        got = {}
        for name, mid in written.items():
            self.assertEqual(len(found.get(mid, [])), 1, f"{name}: entries of message {mid}")
            got[name] = found[mid][0][2][b"payload"]
            print(f"{name:18} {got[name]!r}", flush=True)

        for name in KEEP_BYTES:
            self.assertEqual(got[name], RAW, f"{name} did not keep the producer's bytes")
        for name in NORMALISES:
            self.assertEqual(got[name], normalised, f"{name}: not jsonb's normal form")
            self.assertNotEqual(got[name], RAW, f"{name} kept the bytes after all")
            self.assertNotEqual(hashlib.sha256(got[name]).digest(), hashlib.sha256(RAW).digest(),
                                f"{name}: the producer's hash still matches")


if __name__ == "__main__":
    unittest.main()
