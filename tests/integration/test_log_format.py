"""log_format = json: every line the daemon writes is one JSON object.

Promises tested (docs/OPERATIONS.md, "Logs"; docs/CONFIGURATION.md, log_format):
- with log_format = json, every stderr line of a relay that starts, delivers
  rows, meets a Redis outage and stops is one JSON object with the members
  time (RFC 3339 UTC), level, component and message, plus the key=value pairs
  of the message as string members; nothing else is written;
- under the journal ($JOURNAL_STREAM) each object follows its "<N>" priority;
- log_level still filters: at warning no info object is written;
- the default stays the text format, and the operator commands' output does
  not change with log_format.
"""

import json
import re
import unittest

from testkit import harness
from testkit.harness import insert, wait_until

harness.require_relay()
harness.set_deadline(180)

RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
LEVELS = {"debug", "info", "warning", "error"}
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3}


class LogFormatTest(harness.ServerTestCase):

    def objects(self, log, journal=False):
        """Every line of log as a JSON object, checked; fails on the first that is not."""
        events = []
        for number, line in enumerate(log.splitlines(), 1):
            prio = None
            if journal:
                m = re.match(r"^<(\d)>(.*)$", line)
                self.assertIsNotNone(m, f"line {number} has no journal priority: {line!r}")
                prio, line = int(m.group(1)), m.group(2)
            try:
                obj = json.loads(line)
            except ValueError as e:
                self.fail(f"line {number} is not JSON ({e}): {line!r}")
            self.assertIsInstance(obj, dict, f"line {number}")
            for name in ("time", "level", "component", "message"):
                self.assertIsInstance(obj.get(name), str, f"line {number} lacks {name}: {line}")
            self.assertRegex(obj["time"], RFC3339_MS)
            self.assertIn(obj["level"], LEVELS)
            self.assertTrue(all(isinstance(v, str) for v in obj.values()), line)
            if prio is not None:
                self.assertEqual(prio, PRIORITY[obj["level"]], line)
            events.append(obj)
        return events

    def test_every_line_is_json(self):
        rows = [insert(self.db, "logged", b"row %d" % i) for i in range(20)]
        relay = self.relay(log_format="json", poll_interval="200ms", log_level="debug")
        wait_until(lambda: set(rows) <= set(harness.entries_by_message_id(self.r)), timeout=30,
                   relay=relay, message="the rows")
        self.redis.stop()  # a problem to report: connection errors with server text
        relay.wait_for_log(r'"level":"error","component":"redis"', timeout=20)
        self.redis.start()
        relay.wait_for_log(r'"component":"redis".*"message":"[^"]*(?:back|ready|connected)',
                           timeout=30)
        self.assertEqual(relay.terminate(), 0)
        events = self.objects(relay.log())
        self.assertGreater(len(events), 10)
        running = [e for e in events if e["message"].startswith("outbox-relay ")
                   and " running " in e["message"]]
        self.assertEqual(len(running), 1, "the start line")
        self.assertEqual(running[0]["batch_size"], "500")
        self.assertEqual(running[0]["listen"], "on")
        ready = [e for e in events if e["component"] == "pg" and e["message"].endswith(" ready")]
        self.assertTrue(ready, "the connection lines")
        self.assertEqual(ready[0]["port"], str(self.pg.port))
        self.assertEqual(ready[0]["dbname"], self.pg.database)
        self.assertIn("debug", {e["level"] for e in events})
        self.assertIn("error", {e["level"] for e in events})

    def test_journal_priorities_and_level(self):
        relay = self.relay(log_format="json", log_level="warning",
                           env={"JOURNAL_STREAM": "8:12345"})
        self.redis.stop()
        relay.wait_for_log(r'^<3>\{.*"level":"error","component":"redis"', timeout=20)
        self.redis.start()
        self.assertEqual(relay.terminate(), 0)
        events = self.objects(relay.log(), journal=True)
        self.assertTrue(events)
        self.assertFalse([e for e in events if e["level"] in ("info", "debug")],
                         "log_level = warning still drops info")

    def test_text_stays_the_default_and_commands_are_unchanged(self):
        relay = self.relay()
        relay.wait_for_log(r"^\S+Z INFO relay: outbox-relay \S+ running", timeout=20)
        self.assertEqual(relay.terminate(), 0)
        self.assertNotIn('{"time"', relay.log())
        env = harness.relay_env(self.pg, self.redis)
        text = harness.run_relay(["status"], env=env, timeout=60)
        env["OUTBOX_RELAY_LOG_FORMAT"] = "json"
        as_json = harness.run_relay(["status"], env=env, timeout=60)
        self.assertEqual((text.returncode, as_json.returncode), (0, 0), as_json.output)
        strip = lambda out: re.sub(r"\d+(\.\d+)?", "N", out)
        self.assertEqual(strip(as_json.stdout), strip(text.stdout))
        self.assertNotIn('{"time"', as_json.output)


if __name__ == "__main__":
    unittest.main(verbosity=2)
