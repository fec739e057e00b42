"""The monitoring files (monitoring/), without any server.

Promises tested:
- monitoring/alerts.yml is valid for Prometheus (promtool check rules) and its
  unit tests pass (promtool test rules monitoring/alerts_test.yml);
- every alert the runbook names exists, with a severity label and summary and
  description annotations, and alerts_test.yml has, for each, a case where it
  fires and one where it must not;
- monitoring/grafana-dashboard.json parses, is schemaVersion 36 or later, takes
  its data source from a datasource variable, has the panels operators need,
  and every PromQL expression in it (panels and variables) is valid PromQL
  (promtool) and uses only the metric names the relay exports.

Exits 77 (skipped) when promtool is missing and nothing else failed: install
Debian's prometheus package (scripts/deps.sh does).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

from testkit import harness

harness.set_deadline(120)

MONITORING = os.path.join(harness.SOURCE_DIR, "monitoring")
ALERTS = os.path.join(MONITORING, "alerts.yml")
ALERTS_TEST = os.path.join(MONITORING, "alerts_test.yml")
DASHBOARD = os.path.join(MONITORING, "grafana-dashboard.json")

# What the relay exports at /metrics: these names are fixed.
METRICS = {
    "outbox_relay_up",
    "outbox_relay_ready",
    "outbox_relay_messages_published_total",
    "outbox_relay_batches_total",
    "outbox_relay_batch_duration_seconds",
    "outbox_relay_batch_phase_seconds",
    "outbox_relay_publish_errors_total",
    "outbox_relay_rows_quarantined_total",
    "outbox_relay_outbox_pending_rows",
    "outbox_relay_outbox_oldest_pending_age_seconds",
    "outbox_relay_outbox_quarantined_rows",
    "outbox_relay_outbox_blocked_keys",
    "outbox_relay_stream_paused",
    "outbox_relay_group_lag_entries",
    "outbox_relay_group_pending_entries",
    "outbox_relay_group_oldest_pending_age_seconds",
    "outbox_relay_group_oldest_undelivered_age_seconds",
    "outbox_relay_group_queue_age_seconds",
    "outbox_relay_group_dead_letters",
    "outbox_relay_topic_admitting",
    "outbox_relay_outbox_bytes",
    "outbox_relay_outbox_dead_rows",
    "outbox_relay_outbox_oldest_sent_age_seconds",
    "outbox_relay_sent_retention_seconds",
    "outbox_relay_stream_retention_seconds",
    "outbox_relay_sent_rows_deleted_total",
    "outbox_relay_stream_entries_trimmed_total",
    "outbox_relay_retention_errors_total",
    "outbox_relay_vacuums_total",
    "outbox_relay_redis_used_memory_bytes",
    "outbox_relay_stream_memory_bytes",
    "outbox_relay_stream_trim_held_back_seconds",
    "outbox_relay_relays",
    "outbox_relay_partitions",
    "outbox_relay_partitions_owned",
    "outbox_relay_partition_takeovers_total",
}
HISTOGRAMS = {"outbox_relay_batch_duration_seconds", "outbox_relay_batch_phase_seconds"}
# Series names a query may use: histograms only through their _bucket, _sum
# and _count series.
SERIES = (METRICS - HISTOGRAMS) | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}

ALERT_NAMES = {"OutboxDeadLettersRising", "OutboxQueueAgeAboveSLO", "OutboxRelayNotReady",
               "OutboxQuarantinedRows", "OutboxStreamPaused", "OutboxProducersRefused",
               "OutboxSentRowsPileUp", "OutboxStreamTrimHeldBack", "OutboxPartitionsUnowned"}

PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset",
                   "bool", "and", "or", "unless", "inf", "nan", "atan2", "start", "end"}


def promtool():
    """OUTBOX_RELAY_PROMTOOL names it (empty: act as if missing); else the PATH."""
    env = os.environ.get("OUTBOX_RELAY_PROMTOOL")
    if env is not None:
        return env or None
    return shutil.which("promtool") or (
        "/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None)


def metric_names(expr):
    """The series names a PromQL expression selects (Grafana variables allowed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\$\{[^}]*\}|\$\w+", " ", text)            # Grafana variables
    text = re.sub(r"\{[^{}]*\}", " ", text)                    # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)                  # ranges, subqueries
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", text):
        name = m.group(0)
        if re.match(r"\s*\(", text[m.end():]):
            continue  # a function or an aggregation
        if name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    # {__name__="..."} selects by name too: refuse anything we cannot check.
    if "__name__" in expr:
        names.add("__name__")
    return names


def grafana_to_promql(expr):
    """Replaces Grafana's variables with values Prometheus accepts."""
    for var, value in (("$__rate_interval", "5m"), ("$__interval", "1m"), ("$__range", "1h"),
                       ("${__rate_interval}", "5m"), ("${__interval}", "1m")):
        expr = expr.replace(var, value)
    return re.sub(r"\$\{[^}]*\}|\$\w+", ".*", expr)


def dashboard_panels(dash):
    for p in dash.get("panels", []):
        yield p
        for q in p.get("panels", []) or []:  # panels of collapsed rows
            yield q


def dashboard_queries(dash):
    """(where, PromQL) for every panel target and every query variable."""
    for p in dashboard_panels(dash):
        for t in p.get("targets", []) or []:
            if t.get("expr"):
                yield f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q or "")
        if m:
            yield f"variable {v['name']}", m.group(1)
        elif re.fullmatch(r"\s*label_values\(\s*\w+\s*\)\s*", q or ""):
            continue  # label_values(label): no metric
        else:
            m = re.fullmatch(r"\s*query_result\((.*)\)\s*", q or "")
            yield f"variable {v['name']}", m.group(1) if m else q


class MetricNameParserTest(harness.TestCase):
    """The checker itself sees what it must see."""

    def test_metric_names(self):
        self.assertEqual(metric_names('histogram_quantile(0.99, sum by (le) (rate('
                                      'foo_bucket{a="b", le=~"1|x"}[$__rate_interval])))'),
                         {"foo_bucket"})
        self.assertEqual(metric_names("increase(a_b[10m]) > 0 and on(x) c offset 5m"),
                         {"a_b", "c"})
        self.assertEqual(metric_names('count(min by (topic) (t{s=~"$stream"}) == 0) or vector(0)'),
                         {"t"})
        self.assertEqual(metric_names('x{__name__=~"y"}'), {"x", "__name__"})
        self.assertEqual(metric_names("max_over_time(a[1h:5m]) / 1e3 * 0x10"), {"a"})


class AlertRulesTest(harness.TestCase):

    def run_promtool(self, *args):
        tool = promtool()
        if tool is None:
            self.skipTest("promtool not found: install Debian's prometheus package "
                          "(scripts/deps.sh)")
        proc = subprocess.run([tool, *args], cwd=MONITORING, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=60)
        output = proc.stdout.decode(errors="replace")
        self.assertEqual(proc.returncode, 0, f"promtool {' '.join(args)}:\n{output}")
        return output

    def test_check_rules(self):
        out = self.run_promtool("check", "rules", ALERTS)
        self.assertIn("SUCCESS", out)

    def test_unit_tests(self):
        out = self.run_promtool("test", "rules", ALERTS_TEST)
        self.assertIn("SUCCESS", out)

    def test_rule_expressions_use_only_exported_metrics(self):
        with open(ALERTS) as f:
            exprs = re.findall(r"^\s*expr:\s*(.+?)\s*$", f.read(), re.MULTILINE)
        self.assertGreaterEqual(len(exprs), len(ALERT_NAMES))
        for expr in exprs:
            with self.subTest(expr=expr):
                names = metric_names(expr)
                self.assertTrue(names, "selects some metric")
                self.assertLessEqual(names, SERIES, f"unknown metric names: {names - SERIES}")

    def test_every_alert_is_documented_and_tested_both_ways(self):
        try:
            import yaml
        except ImportError:
            self.skipTest("python3-yaml is missing")
        with open(ALERTS) as f:
            rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
        with open(ALERTS_TEST) as f:
            tests = yaml.safe_load(f)
        names = {r["alert"] for r in rules if "alert" in r}
        self.assertEqual(names, ALERT_NAMES)
        for r in rules:
            with self.subTest(alert=r["alert"], expr=r["expr"]):
                self.assertIn(r.get("labels", {}).get("severity"), ("page", "ticket"))
                for key in ("summary", "description"):
                    self.assertTrue(r.get("annotations", {}).get(key), f"annotation {key}")
                self.assertIn("docs/OPERATIONS.md", r["annotations"]["description"])
        slo = next(r for r in rules if r["alert"] == "OutboxQueueAgeAboveSLO")
        self.assertEqual(slo["labels"].get("slo_queue_age_seconds"), "300")
        self.assertIn("300", slo["expr"])

        fired, quiet = {}, set()
        for case in tests["tests"]:
            for t in case.get("alert_rule_test", []):
                exp = t.get("exp_alerts") or []
                if exp:
                    for a in exp:
                        key = (t["alertname"], a.get("exp_labels", {}).get("cause"))
                        fired[key] = fired.get(key, 0) + 1
                else:
                    quiet.add(t["alertname"])
        for r in rules:
            key = (r["alert"], r.get("labels", {}).get("cause"))
            with self.subTest(rule=key):
                self.assertIn(key, fired, "a test where it fires")
                self.assertIn(r["alert"], quiet, "a test where it does not fire")


def github_anchor(heading):
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


class RunbookTest(harness.TestCase):
    """The alerts point at sections of docs/OPERATIONS.md that exist."""

    def test_links_from_the_alerts_resolve(self):
        with open(os.path.join(harness.SOURCE_DIR, "docs", "OPERATIONS.md")) as f:
            doc = f.read()
        prose = re.sub(r"^\s*```.*?^\s*```", "", doc, flags=re.MULTILINE | re.DOTALL)
        anchors = {github_anchor(h) for h in re.findall(r"^#+\s+(.+?)\s*$", prose, re.MULTILINE)}
        links = set()
        for path in (ALERTS, DASHBOARD):
            with open(path) as f:
                links |= set(re.findall(r"docs/OPERATIONS\.md#([\w-]+)", f.read()))
        links |= set(re.findall(r"\]\(#([\w-]+)\)", doc))
        self.assertTrue(links)
        self.assertEqual(links - anchors, set(), f"anchors in docs/OPERATIONS.md: {sorted(anchors)}")
        for name in ALERT_NAMES:
            self.assertIn(name, doc, "every alert is described")


class DashboardTest(harness.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with open(DASHBOARD) as f:
            cls.dash = json.load(f)  # a parse error fails every test of the class
        cls.queries = list(dashboard_queries(cls.dash))

    def test_shape(self):
        self.assertGreaterEqual(self.dash.get("schemaVersion", 0), 36)
        self.assertTrue(self.dash.get("title"))
        variables = self.dash["templating"]["list"]
        ds = [v for v in variables if v.get("type") == "datasource"]
        self.assertEqual(len(ds), 1, "one datasource variable")
        self.assertEqual(ds[0]["query"], "prometheus")
        name = ds[0]["name"]
        refs = {f"${name}", f"${{{name}}}"}
        for p in dashboard_panels(self.dash):
            if p.get("type") == "row":
                continue
            with self.subTest(panel=p.get("title")):
                self.assertIn(p.get("datasource", {}).get("uid"), refs)
                self.assertTrue(p.get("targets"), "has queries")
                for t in p["targets"]:
                    if "datasource" in t:
                        self.assertIn(t["datasource"].get("uid"), refs)
        ids = [p["id"] for p in dashboard_panels(self.dash)]
        self.assertEqual(len(ids), len(set(ids)), "panel ids are unique")

    def test_queries_use_only_exported_metrics(self):
        self.assertGreater(len(self.queries), 10)
        for where, expr in self.queries:
            with self.subTest(where=where, expr=expr):
                names = metric_names(expr)
                self.assertTrue(names, "selects some metric")
                self.assertLessEqual(names, SERIES, f"unknown metric names: {names - SERIES}")

    def test_the_panels_operators_need(self):
        exprs = [e for _, e in self.queries]

        def some(pattern):
            return any(re.search(pattern, e) for e in exprs)
        needed = {
            "queue age per stream/group": r"outbox_relay_group_queue_age_seconds\b.*\)?",
            "publish throughput per topic (rate)":
                r"sum by \(topic\) \(rate\(outbox_relay_messages_published_total",
            "lag per group": r"outbox_relay_group_lag_entries",
            "pending per group": r"outbox_relay_group_pending_entries",
            "dead letters": r"outbox_relay_group_dead_letters",
            "quarantined rows": r"outbox_relay_outbox_quarantined_rows",
            "batch duration p50": r"histogram_quantile\(0\.5, .*outbox_relay_batch_duration_seconds_bucket",
            "batch duration p99": r"histogram_quantile\(0\.99, .*outbox_relay_batch_duration_seconds_bucket",
            "connection state": r"outbox_relay_up\b",
            "readiness": r"outbox_relay_ready\b",
            "paused streams": r"outbox_relay_stream_paused",
        }
        for what, pattern in needed.items():
            with self.subTest(what=what):
                self.assertTrue(some(pattern), f"no query matches {pattern}")
        used = set().union(*(metric_names(e) for e in exprs))
        self.assertEqual(SERIES - used - {"outbox_relay_batch_duration_seconds_sum",
                                          "outbox_relay_batch_duration_seconds_count"},
                         set(), "every exported metric is on the dashboard")

    def test_queries_are_valid_promql(self):
        tool = promtool()
        if tool is None:
            self.skipTest("promtool not found: install Debian's prometheus package")
        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
            for i, (_, expr) in enumerate(self.queries)]}]}
        with tempfile.NamedTemporaryFile("w", suffix=".yml", prefix="dashboard-") as f:
            json.dump(rules, f)  # JSON is YAML
            f.flush()
            proc = subprocess.run([tool, "check", "rules", f.name], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=60)
        out = proc.stdout.decode(errors="replace")
        listing = "\n".join(f"  {i}: {w}: {e}" for i, (w, e) in enumerate(self.queries))
        self.assertEqual(proc.returncode, 0, f"{out}\nqueries:\n{listing}")


def main():
    program = unittest.main(exit=False)
    result = program.result
    if not result.wasSuccessful():
        sys.exit(1)
    if promtool() is None:
        print("test_monitoring: promtool is missing: skipped (exit 77)", file=sys.stderr)
        sys.exit(harness.SKIP)
    sys.exit(0)


if __name__ == "__main__":
    main()
