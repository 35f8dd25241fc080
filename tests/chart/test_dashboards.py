"""The Grafana dashboards query only metrics (and labels) that the rlfleet services really export.

Exported names come from prometheus_client's registry after importing the service modules, so a
renamed or removed metric breaks this test instead of silently blanking a panel.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from tests.support import REPO

DASHBOARDS = REPO / "charts" / "rlfleet" / "dashboards"
SERVICE_MODULES = [
    "rlfleet.services.trainer.main",
    "rlfleet.services.trainer.metrics",
    "rlfleet.services.rollout.main",
    "rlfleet.services.rollout.timing",
    "rlfleet.services.toploc.main",
    "rlfleet.services.toploc.metrics",
    "rlfleet.services.shardcast.assemble",
    "rlfleet.services.shardcast.relay",
    "rlfleet.services.shardcast.relay_cache",
    "rlfleet.services.shardcast.origin",
    "rlfleet.services.ingest.main",
    "rlfleet.operator.metrics",
]
# The row whose panels chart the operator: its series carry the operator pod's namespace and no run, so its
# queries filter on the cluster only (a run or namespace chosen above would blank them).
OPERATOR_ROW = "Operator"
# Labels Prometheus attaches when it scrapes a pod (PodMonitor/ServiceMonitor target labels), the pod
# labels the chart's monitors copy (podTargetLabels, sanitized: rlfleet.io/run -> rlfleet_io_run), and
# `cluster`, the external label a multi-cluster Prometheus/Thanos setup gives each cluster's series.
TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "endpoint", "service", "cluster"}
POD_TARGET_LABELS = {"rlfleet_io_run", "app_kubernetes_io_component", "rlfleet_io_kind"}
TARGET_LABELS |= POD_TARGET_LABELS
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
}

METRIC_RE = re.compile(r"\brlfleet_[a-zA-Z0-9_]*")
SELECTOR_RE = re.compile(r"\b(rlfleet_[a-zA-Z0-9_]*)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING_RE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Exported sample name -> label names, for every rlfleet_* metric the services register."""
    from prometheus_client import REGISTRY
    from prometheus_client.metrics import MetricWrapperBase

    modules = [importlib.import_module(m) for m in SERVICE_MODULES]
    labels_by_family = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase):
                labels_by_family[value._name] = set(value._labelnames)
    names: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("rlfleet_"):
            continue
        for suffix in SAMPLE_SUFFIXES[family.type]:
            labels = set(labels_by_family.get(family.name, set()))
            if suffix == "_bucket":
                labels.add("le")
            names[family.name + suffix] = labels
    return names


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def targets(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every query, rows' nested panels included."""
    out = []
    panels = list(board.get("panels", []))
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", ""), target["expr"]))
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if variable.get("type") == "query" and query:
            out.append((f"variable {variable['name']}", query))
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in an expression; label names that start with rlfleet_ (inside selectors, or the label
    argument of label_values) are not metrics."""
    return set(METRIC_RE.findall(re.sub(r"\{[^}]*\}", "{}", expr))) - POD_TARGET_LABELS


def label_names(expr: str) -> set[str]:
    """Label names an expression filters or groups on (string literals stripped first)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    found = set()
    for _, body in SELECTOR_RE.findall(expr):
        found |= set(MATCHER_RE.findall(body))
    for body in GROUPING_RE.findall(expr):
        found |= {part.strip() for part in body.split(",") if part.strip()}
    return found


def test_parser_finds_names_and_labels():
    expr = (
        'histogram_quantile(0.9, sum by (le, phase) (rate(rlfleet_x_seconds_bucket{namespace=~"$ns", '
        'verdict!="a,b"}[5m]))) / max(rlfleet_y)'
    )
    assert metric_names(expr) == {"rlfleet_x_seconds_bucket", "rlfleet_y"}
    assert label_names(expr) == {"le", "phase", "namespace", "verdict"}


def test_the_four_dashboards_exist():
    assert {p.stem for p in dashboard_files()} == {
        "rlfleet-run",
        "rlfleet-rollout",
        "rlfleet-verification",
        "rlfleet-broadcast",
    }


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.stem)
def test_dashboard_queries_only_exported_metrics(path, exported):
    board = load(path)
    queries = targets(board)
    assert queries, f"{path.name} has no queries"
    missing, bad_labels = [], []
    for title, expr in queries:
        used = metric_names(expr)
        assert used, f"{path.name}: panel {title!r} queries no rlfleet_* metric: {expr}"
        missing += [f"{title!r}: {name}" for name in sorted(used - exported.keys())]
        allowed = TARGET_LABELS.union(*(exported.get(name, set()) for name in used))
        bad_labels += [f"{title!r}: label {label}" for label in sorted(label_names(expr) - allowed)]
    assert not missing, f"{path.name} queries metrics no service exports: {missing}; exported: {sorted(exported)}"
    assert not bad_labels, f"{path.name} uses labels its metrics do not have: {bad_labels}"


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.stem)
def test_dashboard_is_well_formed(path):
    board = load(path)
    assert board["uid"] == path.stem and board["title"].startswith("rlfleet / ")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "cluster", "namespace", "run"} <= variables.keys()
    for name in ("cluster", "namespace", "run"):
        # "All" must match series without the label too (one cluster: no `cluster` label)
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*", name
    rows = [p for p in board["panels"] if p["type"] == "row"]
    nested = [(row["title"], p) for row in rows for p in row.get("panels", [])]
    panels = [("", p) for p in board["panels"] if p["type"] != "row"] + nested
    ids = [p["id"] for p in board["panels"]] + [p["id"] for _, p in nested]
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
    for row_title, panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, f"{path.name}: {panel['title']!r} is off the grid"
        assert panel["datasource"]["uid"] == "${datasource}"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            if row_title == OPERATOR_ROW:
                assert 'cluster=~"$cluster"' in target["expr"] and "$run" not in target["expr"], target["expr"]
                continue
            for matcher in ('cluster=~"$cluster"', 'namespace=~"$namespace"', 'rlfleet_io_run=~"$run"'):
                assert matcher in target["expr"], f"{path.name}: {panel['title']!r} ignores {matcher}: {target['expr']}"


def test_the_monitors_give_every_target_the_labels_the_dashboards_filter_on():
    """The `run` variable reads rlfleet_io_run: the monitors must copy the pod label rlfleet.io/run."""
    import yaml

    from rlfleet.operator import names

    text = (REPO / "charts" / "rlfleet" / "templates" / "monitors.yaml").read_text()
    copied = {tuple(yaml.safe_load(line.split(":", 1)[1])) for line in text.splitlines() if "podTargetLabels:" in line}
    [labels] = copied  # the same on both monitors
    sanitized = {label.replace(".", "_").replace("/", "_").replace("-", "_") for label in labels}
    assert sanitized == POD_TARGET_LABELS and names.RUN_LABEL in labels


def test_every_exported_metric_is_on_a_dashboard(exported):
    """Metric families nobody charts are a sign a dashboard fell behind the code."""
    used = set()
    for path in dashboard_files():
        for _, expr in targets(load(path)):
            used |= metric_names(expr)
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in exported}
    charted = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert families - charted == set(), f"not on any dashboard: {sorted(families - charted)}"


def test_the_operator_row_charts_every_operator_metric(exported):
    """A collapsed row "Operator" on the run dashboard: reconciles, errors, latency, runs by phase, leader."""
    board = load(DASHBOARDS / "rlfleet-run.json")
    [row] = [p for p in board["panels"] if p["type"] == "row" and p["title"] == OPERATOR_ROW]
    used = set().union(*(metric_names(t["expr"]) for panel in row["panels"] for t in panel["targets"]))
    operator = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in exported if n.startswith("rlfleet_operator_")}
    assert operator == {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert {"rlfleet_operator_reconciles", "rlfleet_operator_reconcile_errors", "rlfleet_operator_active"} <= operator
