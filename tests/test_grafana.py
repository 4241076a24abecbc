"""The Grafana dashboard (docs/grafana/sandfleet.json) is importable and charts what the daemon and the
gateway actually export: every metric name a PromQL expression names is a real sample of theirs, and
every metric family they export is on some panel (a new metric without a panel fails here)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from sandfleet.cluster.core import GatewayMetrics
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.models import Usage

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "sandfleet.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Metric families exported but deliberately on no panel: name -> why. The registries are their own
# (no process_/python_ default collectors), so nothing needs leaving out today.
NOT_CHARTED: dict[str, str] = {}

# Labels Prometheus adds at scrape time, and the histogram bucket bound.
TARGET_LABELS = {"instance", "job"}
# Grafana's own variables, usable in any expression.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range", "__range_s", "__interval_ms"}
ROWS = ("Overview", "Exec", "Density", "Pools", "Snapshots", "Network", "Cluster gateway")

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


@pytest.fixture(scope="module")
def exported() -> tuple[dict[str, str], dict[str, set[str]]]:
    daemon = Metrics()
    _populate(daemon)
    usage = Usage(memory_bytes=1, memory_peak_bytes=2, cpu_seconds=0.5, pids=1, oom_kills=0, pids_limit_hits=0)
    daemon.track_sandboxes(lambda: [("sb-1", "running", "latency_sensitive", lambda: usage)])
    gateway = GatewayMetrics()
    _populate(gateway)
    samples, labels = _exported(daemon.registry)
    gw_samples, gw_labels = _exported(gateway.registry)
    assert not set(labels) & set(gw_labels), "the daemon and the gateway export a family of the same name"
    return samples | gw_samples, labels | gw_labels


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _charts(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in _panels(dashboard) if p["type"] != "row"]


def _exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in _charts(dashboard):
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


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


def test_variables(dashboard: dict[str, Any], exported: tuple[dict[str, str], dict[str, set[str]]]) -> None:
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


def test_metrics_exist(dashboard: dict[str, Any], exported: tuple[dict[str, str], dict[str, set[str]]]) -> None:
    samples, family_labels = exported
    for panel in _charts(dashboard):
        for target in panel["targets"]:
            names, labels = parse_promql(target["expr"])
            assert names, f"{panel['title']!r}: no metric in {target['expr']!r}"
            unknown = names - samples.keys()
            assert not unknown, f"{panel['title']!r}: {sorted(unknown)} not exported (expr {target['expr']!r})"
            known = TARGET_LABELS | set().union(*(family_labels[samples[n]] for n in names))
            unknown_labels = labels - known
            assert not unknown_labels, f"{panel['title']!r}: labels {sorted(unknown_labels)} not on {sorted(names)}"
            legend = set(_LEGEND_LABEL.findall(target.get("legendFormat", "")))
            assert legend <= known, f"{panel['title']!r}: legend labels {sorted(legend - known)} not on {names}"


def test_every_family_charted(dashboard: dict[str, Any], exported: tuple[dict[str, str], dict[str, set[str]]]) -> None:
    samples, family_labels = exported
    charted = {samples[n] for _, expr in _exprs(dashboard) for n in parse_promql(expr)[0] if n in samples}
    assert NOT_CHARTED.keys() <= family_labels.keys(), "NOT_CHARTED names a family nobody exports"
    missing = set(family_labels) - charted - NOT_CHARTED.keys()
    assert not missing, f"exported but on no panel of {DASHBOARD.name}: {sorted(missing)}"
