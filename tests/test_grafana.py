"""The Grafana dashboard (docs/grafana/sandfleet.json) and the alert rules (docs/grafana/alerts.yml) use
what the daemon and the gateway actually export: every metric name a PromQL expression names is a real
sample of theirs, and every metric family they export is on some panel (a new metric without a panel
fails here). Per-sandbox series exist only with `metrics_per_sandbox`: only the dashboard's "Per
sandbox" row may use them, and no alert rule."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from sandfleet.cluster.core import GatewayMetrics
from sandfleet.daemon.node.metrics import Metrics, NodeUsage, SandboxSample
from sandfleet.models import Usage
from sandfleet.testing import InProcessNode

pytestmark = pytest.mark.unit

GRAFANA = Path(__file__).resolve().parents[1] / "docs" / "grafana"
DASHBOARD = GRAFANA / "sandfleet.json"
ALERTS = GRAFANA / "alerts.yml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Metric families exported but deliberately on no panel: name -> why. The registries are their own
# (no process_/python_ default collectors), so nothing needs leaving out today.
NOT_CHARTED: dict[str, str] = {}

# Labels Prometheus adds at scrape time, and the series Prometheus makes of each scrape.
TARGET_LABELS = {"instance", "job"}
PROMETHEUS_SERIES = {"up"}
# Grafana's own variables, usable in any expression.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range", "__range_s", "__interval_ms"}
ROWS = ("Overview", "Alerts", "Exec", "Density", "Pools", "Snapshots", "Network", "Cluster gateway", "Per sandbox")
PER_SANDBOX_ROW = "Per sandbox (needs metrics_per_sandbox = true)"
PER_SANDBOX = {  # samples exported only with metrics_per_sandbox
    "sandfleet_sandbox_memory_bytes",
    "sandfleet_sandbox_memory_peak_bytes",
    "sandfleet_sandbox_cpu_seconds_total",
    "sandfleet_sandbox_tasks",
}
SEVERITIES = {"warning", "critical"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
# an identifier that is not a function or aggregation (those are followed by "(")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
_KEYWORDS |= {"offset", "inf", "nan"}
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def parse_promql(expr: str) -> tuple[set[str], set[str]]:
    """The metric names an expression selects and the label names it matches or groups on."""
    e = _STRING.sub('""', expr)
    e = _RANGE.sub(" ", e)
    labels: set[str] = set()
    for m in _MATCHERS.finditer(e):
        labels |= set(_MATCHER_LABEL.findall(m.group(1)))
    e = _MATCHERS.sub(" ", e)
    for m in _GROUPING.finditer(e):
        labels |= {name.strip() for name in m.group(1).split(",") if name.strip()}
    e = _GROUPING.sub(" ", e)
    names = {n for n in _IDENT.findall(e) if n.lower() not in _KEYWORDS}
    return names, labels


def _populate(obj: object) -> None:
    """One child per labelled metric, so each family has samples in the exposition."""
    for metric in vars(obj).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*["x"] * len(metric._labelnames))


def _exported(registry: CollectorRegistry) -> tuple[dict[str, str], dict[str, set[str]]]:
    """sample name -> family name, and family name -> its label names, as the registry collects them;
    every sample name is in the exposition text /metrics serves."""
    sample_family: dict[str, str] = {}
    family_labels: dict[str, set[str]] = {}
    for family in registry.collect():
        assert family.samples, f"{family.name} has no sample: the test did not populate it"
        for sample in family.samples:
            sample_family[sample.name] = family.name
            family_labels.setdefault(family.name, set()).update(sample.labels)
    served = {line.split("{")[0].split(" ")[0] for line in generate_latest(registry).decode().splitlines()}
    assert set(sample_family) <= served
    return sample_family, family_labels


Exported = tuple[dict[str, str], dict[str, set[str]]]


def _usage() -> NodeUsage:
    usage = Usage(memory_bytes=1, memory_peak_bytes=2, cpu_seconds=0.5, pids=1, oom_kills=0, pids_limit_hits=0)
    sample = SandboxSample("sb-1", "running", "latency_sensitive", 1, 1, lambda: usage)
    return NodeUsage([sample], {"latency_sensitive": 0.5, "best_effort": 0.0})


def _registries(per_sandbox: bool) -> Exported:
    daemon = Metrics()
    _populate(daemon)
    daemon.track_sandboxes(_usage, per_sandbox=per_sandbox)
    gateway = GatewayMetrics()
    _populate(gateway)
    samples, labels = _exported(daemon.registry)
    gw_samples, gw_labels = _exported(gateway.registry)
    assert not set(labels) & set(gw_labels), "the daemon and the gateway export a family of the same name"
    return samples | gw_samples, labels | gw_labels


@pytest.fixture(scope="module")
def exported() -> Exported:
    """What a daemon exports by default, and a gateway."""
    return _registries(per_sandbox=False)


@pytest.fixture(scope="module")
def exported_per_sandbox() -> Exported:
    """The same with `metrics_per_sandbox = true`."""
    return _registries(per_sandbox=True)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def alerts() -> dict[str, Any]:
    rules = yaml.safe_load(ALERTS.read_text())
    assert isinstance(rules, dict)
    return rules


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _charts(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in _panels(dashboard) if p["type"] != "row"]


def _per_sandbox_charts(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [p for p in dashboard["panels"] if p["type"] == "row" and p["title"] == PER_SANDBOX_ROW]
    assert len(rows) == 1 and rows[0]["collapsed"], f"one collapsed row {PER_SANDBOX_ROW!r}"
    return list(rows[0]["panels"])


def _exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in _charts(dashboard):
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def _rules(alerts: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for group in alerts["groups"]:
        yield from group["rules"]


def _known_labels(names: set[str], exported: Exported, recorded: dict[str, set[str]]) -> set[str]:
    samples, family_labels = exported
    known = set(TARGET_LABELS)
    for n in names:
        known |= recorded[n] if n in recorded else family_labels.get(samples.get(n, ""), set())
    return known


def _check_expr(where: str, expr: str, exported: Exported, recorded: dict[str, set[str]] | None = None) -> set[str]:
    """The expression names exported metrics (or series recorded by the rules) and their labels only;
    returns the labels its series may carry."""
    samples, _ = exported
    recorded = recorded or {}
    names, labels = parse_promql(expr)
    assert names, f"{where}: no metric in {expr!r}"
    unknown = names - samples.keys() - recorded.keys() - PROMETHEUS_SERIES
    assert not unknown, f"{where}: {sorted(unknown)} not exported (expr {expr!r})"
    known = _known_labels(names, exported, recorded)
    unknown_labels = labels - known
    assert not unknown_labels, f"{where}: labels {sorted(unknown_labels)} not on {sorted(names)}"
    return known


def test_parser() -> None:
    names, labels = parse_promql(
        'histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{instance=~"$instance", x!="}"}[5m])))'
        " / on (job) group_left sum without (y) (b_total offset 5m) or vector(0) > bool 1e-9"
    )
    assert names == {"a_seconds_bucket", "b_total"}
    assert labels == {"le", "instance", "x", "job", "y"}


def test_structure(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"] and dashboard["id"] is None
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    for wanted in ROWS:
        assert any(title.startswith(wanted) for title in rows), f"no {wanted} row"
    cells: set[tuple[int, int]] = set()
    for panel in _panels(dashboard):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']!r} overlaps another panel"
        cells |= mine
    for panel in _charts(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_variables(dashboard: dict[str, Any], exported: Exported) -> None:
    samples, _ = exported
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", v["query"]["query"])
            assert m, v["name"]
            assert m.group(1) in samples, f"variable {v['name']} reads {m.group(1)}, which is not exported"
    assert re.fullmatch(r"label_values\(\w+,\s*instance\)", variables["instance"]["query"]["query"])
    for title, expr in _exprs(dashboard):
        for m in _VARIABLE.finditer(expr):
            name = m.group(1) or m.group(2)
            assert name in variables or name in GRAFANA_VARIABLES, f"{title!r}: ${name} is not defined"


def test_metrics_exist(dashboard: dict[str, Any], exported: Exported, exported_per_sandbox: Exported) -> None:
    per_sandbox = {id(p) for p in _per_sandbox_charts(dashboard)}
    for panel in _charts(dashboard):
        wanted = exported_per_sandbox if id(panel) in per_sandbox else exported
        for target in panel["targets"]:
            known = _check_expr(repr(panel["title"]), target["expr"], wanted)
            legend = set(_LEGEND_LABEL.findall(target.get("legendFormat", "")))
            assert legend <= known, f"{panel['title']!r}: legend labels {sorted(legend - known)} not on its metrics"


def test_every_family_charted(dashboard: dict[str, Any], exported_per_sandbox: Exported) -> None:
    samples, family_labels = exported_per_sandbox
    charted = {samples[n] for _, expr in _exprs(dashboard) for n in parse_promql(expr)[0] if n in samples}
    assert NOT_CHARTED.keys() <= family_labels.keys(), "NOT_CHARTED names a family nobody exports"
    missing = set(family_labels) - charted - NOT_CHARTED.keys()
    assert not missing, f"exported but on no panel of {DASHBOARD.name}: {sorted(missing)}"


def test_per_sandbox_series_only_in_their_row(dashboard: dict[str, Any], exported: Exported) -> None:
    samples, _ = exported
    assert not PER_SANDBOX & samples.keys(), "per-sandbox series by default"
    for panel in _per_sandbox_charts(dashboard):
        names = set().union(*(parse_promql(t["expr"])[0] for t in panel["targets"]))
        assert names - samples.keys(), f"{panel['title']!r} needs no per-sandbox series: not in {PER_SANDBOX_ROW!r}"


def test_alert_rules(alerts: dict[str, Any], exported: Exported) -> None:
    """Rules in Prometheus's format, over what a daemon exports by default or a gateway (or what the
    file's own recording rules make); every alert says how bad (severity) and what (summary)."""
    assert set(alerts) == {"groups"}
    names = [g["name"] for g in alerts["groups"]]
    assert len(names) == len(set(names)), "group names repeat"
    # A recorded series carries the labels its expression groups by.
    recorded = {r["record"]: parse_promql(r["expr"])[1] for r in _rules(alerts) if "record" in r}
    alert_names = []
    for group in alerts["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"], group["name"]
        for rule in group["rules"]:
            where = rule.get("alert") or rule.get("record")
            assert where and ("alert" in rule) != ("record" in rule), rule
            known = _check_expr(where, rule["expr"], exported, recorded)
            if "record" in rule:
                assert set(rule) == {"record", "expr"}, where
                assert re.fullmatch(r"\w+:\w+:\w+", rule["record"]), f"{where}: not level:metric:operations"
                continue
            alert_names.append(rule["alert"])
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, where
            assert re.fullmatch(r"\d+[smh]", rule["for"]), f"{where}: for {rule['for']!r}"
            severity = rule["labels"]["severity"]
            by_label = re.fullmatch(r"\{\{ \$labels\.(\w+) \}\}", severity)
            assert severity in SEVERITIES or (by_label and by_label.group(1) in known), f"{where}: severity"
            annotations = rule["annotations"]
            assert annotations["summary"].strip() and annotations["description"].strip(), where
            for text in annotations.values():
                used = set(re.findall(r"\$labels\.(\w+)", text))
                assert used <= known, f"{where}: its annotations name labels {sorted(used - known)} it has not"
    assert len(alert_names) == len(set(alert_names)), "alert names repeat"


def test_node_alerts_forwarded(alerts: dict[str, Any]) -> None:
    """One rule forwards every alert the node evaluates itself (sandfleet_alerts_firing)."""
    forwarded = [r for r in _rules(alerts) if "sandfleet_alerts_firing" in parse_promql(r["expr"])[0]]
    assert len(forwarded) == 1 and "name" not in parse_promql(forwarded[0]["expr"])[1]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool here")
def test_promtool_checks_the_rules() -> None:
    subprocess.run(["promtool", "check", "rules", str(ALERTS)], check=True)


def _families(registry: CollectorRegistry) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name -> {its labels: value}, as /metrics serves them."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _by_state_and_qos(state: str, qos: str) -> tuple[tuple[str, str], ...]:
    return (("qos", qos), ("state", state))


def test_usage_added_up_by_state_and_qos() -> None:
    """Counts, memory and tasks by (state, QoS) from what the monitor last read: no cgroup read."""

    def unread() -> Usage:
        raise AssertionError("read a cgroup for the aggregates")

    sandboxes = [
        SandboxSample("a", "running", "latency_sensitive", 100, 3, unread),
        SandboxSample("b", "running", "latency_sensitive", 50, 2, unread),
        SandboxSample("c", "running", "best_effort", None, None, unread),  # not read yet
        SandboxSample("d", "paused", "best_effort", 7, 1, unread),
    ]
    cpu = {"latency_sensitive": 10.0, "best_effort": 4.0}
    metrics = Metrics()
    metrics.track_sandboxes(lambda: NodeUsage(sandboxes, cpu))
    got = _families(metrics.registry)
    key = _by_state_and_qos
    assert got["sandfleet_sandboxes"] == {
        key("paused", "best_effort"): 1,
        key("paused", "latency_sensitive"): 0,
        key("running", "best_effort"): 1,
        key("running", "latency_sensitive"): 2,
    }
    memory, tasks = got["sandfleet_sandboxes_memory_bytes"], got["sandfleet_sandboxes_tasks"]
    assert memory[key("running", "latency_sensitive")] == 150 and tasks[key("running", "latency_sensitive")] == 5
    assert memory[key("running", "best_effort")] == 0 and tasks[key("running", "best_effort")] == 0
    assert memory[key("paused", "best_effort")] == 7 and tasks[key("paused", "best_effort")] == 1
    assert not PER_SANDBOX & got.keys()

    # CPU by QoS: counted from the first scrape, and never going down.
    ls, be = (("qos", "latency_sensitive"),), (("qos", "best_effort"),)
    assert got["sandfleet_sandboxes_cpu_seconds_total"] == {ls: 0.0, be: 0.0}
    cpu.update(latency_sensitive=12.5, best_effort=5.0)
    assert _families(metrics.registry)["sandfleet_sandboxes_cpu_seconds_total"] == {ls: 2.5, be: 1.0}
    # the reaper's look moves 1.5 s seen as latency-sensitive over to best-effort: held, not lowered
    cpu.update(latency_sensitive=11.0, best_effort=6.5)
    assert _families(metrics.registry)["sandfleet_sandboxes_cpu_seconds_total"] == {ls: 2.5, be: 2.5}
    cpu.update(latency_sensitive=14.0)
    assert _families(metrics.registry)["sandfleet_sandboxes_cpu_seconds_total"] == {ls: 4.0, be: 2.5}


def test_per_sandbox_series_read_at_scrape() -> None:
    usage = Usage(memory_bytes=5, memory_peak_bytes=9, cpu_seconds=1.5, pids=4, oom_kills=0, pids_limit_hits=0)

    def gone() -> Usage:
        raise FileNotFoundError("stopped meanwhile")

    sandboxes = [
        SandboxSample("a", "running", "latency_sensitive", 1, 1, lambda: usage),
        SandboxSample("b", "paused", "best_effort", 1, 1, gone),
    ]
    metrics = Metrics()
    metrics.track_sandboxes(lambda: NodeUsage(sandboxes, {}), per_sandbox=True)
    got = _families(metrics.registry)
    a = (("qos", "latency_sensitive"), ("sandbox", "a"), ("state", "running"))
    assert got["sandfleet_sandbox_memory_bytes"] == {a: 5}
    assert got["sandfleet_sandbox_memory_peak_bytes"] == {a: 9}
    assert got["sandfleet_sandbox_cpu_seconds_total"] == {a: 1.5}
    assert got["sandfleet_sandbox_tasks"] == {a: 4}
    assert sum(got["sandfleet_sandboxes"].values()) == 2  # the aggregates too


def test_usage_names_are_registered() -> None:
    """The registry knows the usage families' names at registration: a clash fails at start, not
    as a broken scrape."""
    metrics = Metrics()
    metrics.track_sandboxes(lambda: NodeUsage([], {}))
    with pytest.raises(ValueError, match="sandfleet_sandboxes_memory_bytes"):
        metrics.track_sandboxes(lambda: NodeUsage([], {}))


async def test_a_real_daemon_exports_what_the_dashboard_and_rules_use(tmp_path: Path, exported: Exported) -> None:
    """A node service (on the fake tier) registers the same families as the fixtures' registries, so
    the checks above hold for a daemon as it runs; its aggregates count its sandboxes."""
    async with InProcessNode(tmp_path) as node, node.client(timeout=20) as fleet:
        await fleet.create(image="busybox")
        best_effort = await fleet.create(image="busybox", qos="best_effort")
        await best_effort.pause()
        got = _families(node.metrics.registry)
        key = _by_state_and_qos
        assert got["sandfleet_sandboxes"][key("running", "latency_sensitive")] == 1
        assert got["sandfleet_sandboxes"][key("paused", "best_effort")] == 1
        assert not PER_SANDBOX & got.keys()
        _populate(node.metrics)
        samples, family_labels = _exported(node.metrics.registry)
    want_samples, want_labels = exported
    daemon_families = {f for f in want_labels if not f.startswith("sandfleet_gateway_")}
    assert set(family_labels) == daemon_families
    assert {s for s, f in want_samples.items() if f in daemon_families} == set(samples)
