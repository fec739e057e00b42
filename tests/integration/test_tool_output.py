"""What the operator tools print when producers and consumers choose hostile names.

Topics and last_error come from producers, stream, group and field names from
whoever can write to Redis; the operator reads them on a terminal. A name such
as "\\x1b]0;pwned\\x07" must not retitle the terminal, "\\x1b[2J" must not clear
it, and a newline must not forge an extra row. Promises tested:

- `failed list`, `status` and `dlq list|show` print no control byte (C0 but the
  line ends, DEL, C1) and no byte that is not UTF-8: each such byte is shown as
  \\xNN, a backslash as \\\\, and each row stays on one line;
- `status --json` stays valid UTF-8 JSON and gives every name that JSON can
  carry exactly (control characters as \\u escapes); a byte that is not UTF-8
  comes out as U+FFFD;
- a stream whose name is no topic the relay could publish (here: not UTF-8)
  neither breaks `status` nor is listed as one of the relay's streams;
- the dlq commands escape the stream and group names they repeat too.
"""

import json
import os
import re
import subprocess
import unittest

from testkit import harness

harness.require_relay()
harness.set_deadline(240)

TITLE = "\x1b]0;pwned\x07"   # OSC 0: sets the terminal's title
CLEAR = "\x1b[2J"            # CSI 2 J: clears the screen
C1_CSI = "\u009b"            # the 8-bit CSI, valid UTF-8 (c2 9b)


def run_tool(args, env):
    """Runs the relay binary as a tool; (returncode, stdout bytes, stderr bytes)."""
    proc = subprocess.run([harness.require_relay(), *args], stdin=subprocess.DEVNULL,
                          capture_output=True, env=env, timeout=60)
    report = harness.sanitizer_report(proc.stderr.decode(errors="replace"))
    if report:
        raise AssertionError(f"sanitizer report from {args}:\n{report}")
    print(f"$ outbox-relay {' '.join(a if isinstance(a, str) else repr(a) for a in args)}"
          f" -> {proc.returncode}\n{proc.stdout!r}\n{proc.stderr!r}", flush=True)
    return proc.returncode, proc.stdout, proc.stderr


def terminal_hazards(data):
    """The bytes of data a terminal could act on: C0 but newline, DEL, C1 in UTF-8
    (c2 80..c2 9f), bidirectional overrides, and anything that is not UTF-8."""
    found = [b for b in re.findall(rb"[\x00-\x09\x0b-\x1f\x7f]", data)]
    text = data.decode("utf-8", errors="surrogateescape")
    found += [c for c in text if 0x80 <= ord(c) <= 0x9f or 0x202a <= ord(c) <= 0x202e
              or 0x2066 <= ord(c) <= 0x2069 or 0xdc80 <= ord(c) <= 0xdcff]
    return found


class ToolOutputTest(harness.ServerTestCase):

    def env(self):
        return harness.relay_env(self.pg, self.redis)

    def assert_safe(self, data):
        self.assertEqual(terminal_hazards(data), [], f"raw control bytes in {data!r}")

    # ---- failed list ---------------------------------------------------

    def quarantine(self, topic, error, key=None):
        return harness.quarantine_row(self.db, topic, b"\x00", error, key=key)

    def test_failed_list_escapes_topics_and_errors(self):
        self.quarantine("orders" + TITLE, "bad topic\nsecond line" + CLEAR + "\\ end")
        self.quarantine(CLEAR, "c1 " + C1_CSI + "31m and DEL \x7f and tab\t", key="k" + TITLE)
        self.quarantine("orders", "plain error, caf\u00e9")
        code, out, err = run_tool(["failed", "list"], self.env())
        self.assertEqual(code, 0, err)
        self.assert_safe(out)
        lines = out.decode().splitlines()
        self.assertEqual(len(lines), 5, "a header, one line per row, a footer")
        self.assertIn("orders\\x1b]0;pwned\\x07", lines[1])
        self.assertIn("bad topic\\x0asecond line\\x1b[2J\\\\ end", lines[1])
        self.assertRegex(lines[2], r"^2\s+\S+\s+\\x1b\[2J\s+k\\x1b\]0;pwned\\x07\s+\S+Z\s")
        self.assertIn("c1 \\xc2\\x9b31m and DEL \\x7f and tab\\x09", lines[2])
        self.assertIn("plain error, caf\u00e9", lines[3], "valid UTF-8 is shown as it is")
        self.assertEqual(lines[4], "3 quarantined")

    def test_failed_list_cuts_a_long_topic_at_a_character(self):
        self.quarantine("\u00e9" * 30 + TITLE * 5, "x")
        code, out, err = run_tool(["failed", "list"], self.env())
        self.assertEqual(code, 0, err)
        self.assert_safe(out)
        row = out.decode().splitlines()[1]
        self.assertIn("\u00e9" * 30 + "\\x1b]0;... ", row, "at most 40 columns with the ...")

    # ---- status ----------------------------------------------------------

    def hostile_groups(self):
        """Groups with hostile names on a relay stream, and a stream that is no topic."""
        self.r.xadd("orders", {"id": "1", "payload": "x"})
        names = ["g" + TITLE, CLEAR, "two\nlines", "back\\slash \"q\"", "c1" + C1_CSI + "2J",
                 "caf\u00e9"]
        for name in names:
            self.r.xgroup_create("orders", name, id="0")
        self.r.xgroup_create("orders", b"not-utf8-\xff\xfe", id="0")
        # Not a topic (not UTF-8, with a control byte): no stream of the relay's.
        self.r.xadd(b"evil\x1b[2J\xff", {"x": "1"})
        self.r.xgroup_create(b"evil\x1b[2J\xff", "g", id="0")
        return names

    def test_status_escapes_stream_and_group_names(self):
        names = self.hostile_groups()
        code, out, err = run_tool(["status"], self.env())
        self.assertEqual(code, 0, err)
        self.assert_safe(out)
        self.assert_safe(err)
        text = out.decode()
        self.assertIn("PostgreSQL  up", text, "a stream that is no topic must not break status")
        rows = [line for line in text.splitlines() if line.startswith("orders ")]
        self.assertEqual(len(rows), len(names) + 1, text)
        shown = "\n".join(rows)
        # The group column has 16; a longer name is cut, between escapes, with "...".
        for escaped in ("g\\x1b]0;pwned...", "\\x1b[2J ", "two\\x0alines ", "back\\\\slash",
                        "c1\\xc2\\x9b2J ", "caf\u00e9 ", "not-utf8-\\xff..."):
            self.assertIn(escaped, shown)
        self.assertNotIn("evil", text, "a stream that is no topic is not the relay's")

    def test_status_json_is_exact_and_valid(self):
        names = self.hostile_groups()
        code, out, err = run_tool(["status", "--json"], self.env())
        self.assertEqual(code, 0, err)
        self.assert_safe(out)
        data = json.loads(out.decode("utf-8"))  # strict: the bytes must be UTF-8
        self.assertTrue(data["postgres"]["up"], data["postgres"])
        groups = sorted(g["group"] for g in data["groups"])
        self.assertEqual(groups, sorted(names + ["not-utf8-\ufffd\ufffd"]))
        self.assertEqual({g["stream"] for g in data["groups"]}, {"orders"})

    # ---- dlq -------------------------------------------------------------

    def test_dlq_escapes_what_it_repeats(self):
        group = "g" + TITLE
        self.r.xadd("orders", {"id": "1", "payload": "x"})
        self.r.xgroup_create("orders", group, id="0")
        self.r.xadd(f"{{orders}}.{group}.dlq", {
            "id": "m1", "payload": CLEAR, "dlq.reason": "exhausted" + CLEAR,
            "dlq.deliveries": "5", "dlq.failed_at": "2026-01-01T00:00:00Z",
            "dlq.error": "line one\nline two" + TITLE, "field" + CLEAR: "v"})
        env = harness.relay_env(redis=self.redis)
        code, out, err = run_tool(["dlq", "list", "orders", group], env)
        self.assertEqual(code, 0, err)
        self.assert_safe(out)
        lines = out.decode().splitlines()
        self.assertEqual(len(lines), 3, "a header, the dead letter, a footer")
        self.assertIn("exhausted\\x1b[2J", lines[1])
        self.assertIn("line one\\x0aline two\\x1b]0;pwned\\x07", lines[1])
        self.assertEqual(lines[2], "1 dead letter(s) in {orders}.g\\x1b]0;pwned\\x07.dlq")
        entry = lines[1].split()[0]
        code, out, err = run_tool(["dlq", "show", "orders", group, entry], env)
        self.assertEqual(code, 0, err)
        self.assert_safe(out)
        self.assertIn("in {orders}.g\\x1b]0;pwned\\x07.dlq", out.decode())
        self.assertIn("field\\x1b[2J", out.decode())
        # Errors repeat the names too.
        code, out, err = run_tool(["dlq", "list", "s" + CLEAR, "g" + TITLE], env)
        self.assertEqual(code, 65, err)
        self.assert_safe(err)
        self.assertIn('stream "s\\x1b[2J" does not exist', err.decode())
        code, out, err = run_tool(["dlq", "purge", "orders", "g" + CLEAR, "--all"], env)
        self.assertEqual(code, 65, err)
        self.assert_safe(err)
        self.assertIn('group "g\\x1b[2J" does not exist on stream "orders"', err.decode())


if __name__ == "__main__":
    unittest.main()
