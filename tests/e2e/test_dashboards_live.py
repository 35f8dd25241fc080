"""Every panel of every Grafana dashboard shows data on a real Prometheus scraping a local run.

`rlfleet run --prometheus` starts Debian's `prometheus` beside the run, scraping each process from the file_sd file
the run writes (rlfleet/local/prometheus.py). While the run trains, each panel's queries are evaluated through
Prometheus's HTTP API as Grafana would: the dashboard variables `cluster`, `namespace` and `run` take the values their
own label_values queries return (All, `.*`, where none), `$__interval` is the scrape interval, `$__rate_interval`
max($__interval + scrape interval, 4 x scrape interval), `$__range` the queried range; a timeseries or stat panel is
a range query, and it shows data when one of its queries returns a series with a finite value. A panel that may be
empty on a local run is in EMPTY_ON_A_LOCAL_RUN with its reason; any other empty panel fails the test.
Without a `prometheus` binary the test skips, except in CI (CI=true), where .ci/run installs it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from rlfleet.local.prometheus import SCRAPE_INTERVAL_S, binary
from tests.core.test_run_report import check_page
from tests.support import REPO

EXAMPLE = REPO / "examples" / "arithmetic" / "rlrun.yaml"
DASHBOARDS = REPO / "charts" / "rlfleet" / "dashboards"
# (dashboard, panel title) -> why it may show nothing on a local run of the arithmetic example.
EMPTY_ON_A_LOCAL_RUN = {
    ("rlfleet-rollout", "Ingest answers by status"): "no ingest: a local run's workers XADD to the inbox",
    ("rlfleet-rollout", "Ingest accepted bytes"): "no ingest: a local run's workers XADD to the inbox",
    ("rlfleet-verification", "Handling failures by error"): "labelled by the exception's type: none on a healthy run",
    ("rlfleet-rollout", "Ingest joins by outcome (201 joined; 403/409/422/429/503 refused) and banned refusals"): (
        "no ingest: a local run's workers XADD to the inbox"
    ),
    (
        "rlfleet-rollout",
        "Joined workers active (per ingest replica)",
    ): "no ingest: a local run's workers XADD to the inbox",
    ("rlfleet-run", "Held-out score (eval)"): "the example sets no spec.eval: the series start with a first evaluation",
    ("rlfleet-run", "Reward per task source"): "labelled by a mixture's source: the example is one task",
    ("rlfleet-run", "Groups per task source"): "labelled by a mixture's source: the example is one task",
    **{
        ("rlfleet-run", title): "the operator's metrics: a local run has no operator"
        for title in (
            "Operator reconciles by kind and result",
            "Operator errors by kind and reason",
            "Operator reconcile latency by kind (p50 / p95)",
            "Runs by phase, and acting operator replicas",
        )
    },
}


def prometheus_or_skip() -> None:
    if binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run this test: .ci/run installs Debian's prometheus (apt-get install prometheus)")
        pytest.skip("no `prometheus` binary (Debian: apt-get install prometheus)")


def api(url: str, path: str, **params) -> dict:
    query = urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(f"{url}{path}?{query}", timeout=30) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]


def panels(board: dict) -> list[dict]:
    """Every panel with queries, rows' nested panels included."""
    out, stack = [], list(board["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        if panel.get("targets"):
            out.append(panel)
    return out


LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$")


def resolve_variables(url: str, board: dict, start: float, end: float) -> dict[str, str]:
    """Each query variable's value as Grafana would set it: its label_values query's values (a regex of them), or
    the variable's allValue where the query finds none; in the dashboard's order, each seeing the ones before."""
    values: dict[str, str] = {}
    for variable in board["templating"]["list"]:
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = LABEL_VALUES.match(substitute(query, values, 60))
        assert match, f"{board['uid']}: variable {variable['name']}: not a label_values query: {query}"
        selector, label = match.groups()
        found = api(url, f"/api/v1/label/{label}/values", **{"match[]": selector, "start": start, "end": end})
        values[variable["name"]] = "|".join(re.escape(v) for v in found) if found else variable["allValue"]
    return values


def substitute(expr: str, values: dict[str, str], range_s: int) -> str:
    interval = SCRAPE_INTERVAL_S  # $__interval: a short range on a wide panel is the data source's minimum, the scrape
    builtins = {
        "__rate_interval": f"{max(interval + SCRAPE_INTERVAL_S, 4 * SCRAPE_INTERVAL_S)}s",
        "__interval": f"{interval}s",
        "__range": f"{range_s}s",
    }
    for name, value in {**builtins, **values}.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr.replace("$__", ""), f"unsubstituted variable in {expr}"
    return expr


def has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(value)) for series in result for _, value in series["values"])


def scraped_at(target: dict) -> float:
    """A target's last scrape as Unix seconds (Prometheus writes RFC 3339 with nanoseconds; 0 before any)."""
    stamp = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", target["lastScrape"])
    if stamp is None:
        return 0.0
    whole, fraction, zone = stamp.groups()
    seconds = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return seconds + float(fraction or 0)


def launch(run_dir: Path) -> tuple[subprocess.Popen, Path]:
    stderr = run_dir.parent / "run.stderr"
    argv = [sys.executable, "-m", "rlfleet.cli", "run", str(EXAMPLE), "--run-dir", str(run_dir), "--no-progress"]
    with open(stderr, "w") as err:
        proc = subprocess.Popen([*argv, "--steps", "1000", "--prometheus"], cwd=REPO, stdout=err, stderr=err)
    return proc, stderr


def wait_for(what: str, seconds: float, proc: subprocess.Popen, check):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        assert proc.poll() is None, f"the run exited with {proc.returncode} while waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {seconds:.0f}s")


@pytest.mark.slow
def test_every_dashboard_panel_returns_data_from_a_real_prometheus_scraping_a_local_run(tmp_path):
    prometheus_or_skip()
    run_dir = tmp_path / "run"
    proc, stderr = launch(run_dir)
    try:
        url = wait_for(
            "Prometheus URL",
            600,
            proc,
            lambda: (re.findall(r"Prometheus at (http://\S+)", stderr.read_text()) or [None])[0],
        )
        start = time.time()
        metrics = run_dir / "metrics.jsonl"
        wait_for("8 steps", 600, proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 8)
        # Eight steps can take under two scrape intervals: a rate window needs two samples taken after the progress,
        # so wait until every target has been scraped a whole $__rate_interval after the eighth step was seen.
        progressed = time.time() + 4 * SCRAPE_INTERVAL_S
        wait_for(
            "a scrape of every target 4 intervals after the 8th step",
            120,
            proc,
            lambda: all(scraped_at(t) >= progressed for t in api(url, "/api/v1/targets")["activeTargets"]),
        )
        targets = api(url, "/api/v1/targets")["activeTargets"]
        assert {t["labels"]["job"] for t in targets} == {"origin", "relay", "verifier", "rollout", "trainer"}
        assert all(t["health"] == "up" for t in targets), [(t["labels"]["pod"], t["lastError"]) for t in targets]

        end = time.time()
        range_s = int(end - start) + 1
        shown, empty = [], []
        for path in sorted(DASHBOARDS.glob("*.json")):
            board = json.loads(path.read_text())
            values = resolve_variables(url, board, start, end)
            assert values["run"] == "arithmetic" and values["namespace"] == "local", (path.stem, values)
            for panel in panels(board):
                results = [
                    api(
                        url,
                        "/api/v1/query_range",
                        query=substitute(t["expr"], values, range_s),
                        start=start,
                        end=end,
                        step=SCRAPE_INTERVAL_S,
                    )["result"]
                    for t in panel["targets"]
                ]
                (shown if any(map(has_data, results)) else empty).append((path.stem, panel["title"]))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    unexplained = [panel for panel in empty if panel not in EMPTY_ON_A_LOCAL_RUN]
    print(f"{len(shown)} of {len(shown) + len(empty)} panels show data; empty: {empty}")
    assert not unexplained, (
        f"panels without data on a local run (fix the query, or list the panel with why): {unexplained}"
    )
    # The run's report (written as it stopped) shows its broadcast times and its workers' reputation too.
    page = check_page(run_dir / "report" / "index.html")
    assert "broadcast.png" in page.images and "Worker reputation" in page.titles
    assert "arithmetic-cpu-0" in " ".join(page.text)
