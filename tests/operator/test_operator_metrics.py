"""The operator's Prometheus metrics (rlfleet/operator/metrics.py) move with what it does: a real reconcile of
each kind counts and times itself, a child the API refuses counts as ApplyFailed, a request the API forbids
as an error of the reconcile, and the runs gauge follows the phase the operator writes. The leader gauge
under peering is checked with two operators in test_operator_ha.py; its rule here."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys

import pytest

from rlfleet.operator import peering
from rlfleet.operator.options import OperatorOptions
from tests.operator.kubectl import apply_example, get, has_condition, redis_db
from tests.support import scrape, wait_for


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def grew(url: str, before: dict, name: str, **labels):
    """The scrape in which sample `name{labels}` is above its value in `before`, else None."""
    now = scrape(url)
    return now if value(now, name, **labels) > value(before, name, **labels) else None


def test_every_series_exists_before_its_first_event(api, operator_metrics):
    samples = scrape(operator_metrics)
    for kind in ("RLRun", "InferencePool", "RelayTier"):
        for result in ("ok", "error"):
            assert ("rlfleet_operator_reconciles_total", frozenset({("kind", kind), ("result", result)})) in samples
        assert ("rlfleet_operator_reconcile_errors_total", frozenset({("kind", kind), ("reason", "ApplyFailed")})) in (
            samples
        )
    assert value(samples, "rlfleet_operator_active") == 1, "a standalone operator always acts"


def test_a_reconcile_of_each_kind_counts_and_times_itself(api, operator_metrics, redis_url):
    ns, url = "t-metrics", redis_db(redis_url, 4)
    before = scrape(operator_metrics)
    apply_example(api, ns, url)
    wait_for("the run's status", lambda: (get(api, "RLRun", ns, "arithmetic").get("status") or {}).get("phase"))
    for kind in ("RLRun", "InferencePool", "RelayTier"):
        after = wait_for(
            f"a {kind} reconcile counted",
            lambda kind=kind: grew(
                operator_metrics, before, "rlfleet_operator_reconciles_total", kind=kind, result="ok"
            ),
        )
        count = "rlfleet_operator_reconcile_seconds_count"
        assert value(after, count, kind=kind) > value(before, count, kind=kind), f"{kind} reconcile not timed"
        assert value(after, "rlfleet_operator_reconcile_seconds_sum", kind=kind) > value(
            before, "rlfleet_operator_reconcile_seconds_sum", kind=kind
        )
    phase = get(api, "RLRun", ns, "arithmetic")["status"]["phase"]
    assert value(scrape(operator_metrics), "rlfleet_operator_runs", phase=phase) >= 1, f"no run counted as {phase}"


def test_a_refused_child_and_a_forbidden_request_count_as_errors(api, emulator, operator_metrics, redis_url):
    ns, url = "t-metrics-errors", redis_db(redis_url, 6)
    before = scrape(operator_metrics)
    emulator.cluster.refused[("statefulsets", ns, "arithmetic-trainer")] = "denied by a test webhook"
    try:
        apply_example(api, ns, url)
        wait_for("ApplyFailed", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "False", "ApplyFailed"))
        refused = ("rlfleet_operator_reconcile_errors_total", {"kind": "RLRun", "reason": "ApplyFailed"})
        wait_for("ApplyFailed counted", lambda: grew(operator_metrics, before, refused[0], **refused[1]))
        # a 403 is the API's refusal of the operator, not of the child: the reconcile raises (kopf retries it)
        emulator.cluster.forbidden.add(("deployments", ns, "arithmetic-verifier"))
        wait_for(
            "the forbidden apply counted",
            lambda: grew(
                operator_metrics, before, "rlfleet_operator_reconcile_errors_total", kind="RLRun", reason="Forbidden"
            ),
        )
        wait_for(
            "the failed reconcile counted",
            lambda: grew(operator_metrics, before, "rlfleet_operator_reconciles_total", kind="RLRun", result="error"),
        )
    finally:
        emulator.cluster.refused.pop(("statefulsets", ns, "arithmetic-trainer"), None)
        emulator.cluster.forbidden.discard(("deployments", ns, "arithmetic-verifier"))


def entry(priority: int, seen: datetime.datetime, lifetime: int = 20) -> dict:
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


def test_the_leader_rule_is_kopfs():
    now = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.UTC)
    fresh, stale = now - datetime.timedelta(seconds=5), now - datetime.timedelta(seconds=30)
    assert peering.leads({"a": entry(10, fresh), "b": entry(5, fresh)}, 10, now), "the higher priority acts"
    assert not peering.leads({"a": entry(10, fresh), "b": entry(5, fresh)}, 5, now), "the lower stands by"
    assert peering.leads({"a": entry(10, stale), "b": entry(5, fresh)}, 5, now), "a dead peer pauses no one"
    assert not peering.leads({"a": entry(5, fresh), "b": entry(5, fresh)}, 5, now), "equal priorities pause both"
    assert not peering.leads({"a": entry(10, fresh)}, 5, now), "not acting before its own entry is written"
    zulu = {"a": {"priority": 3, "lifetime": 20, "lastseen": fresh.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
    assert peering.leads(zulu, 3, now), "kopf's timestamps may end in Z"
    garbled = {"a": entry(3, fresh), "b": {"priority": 9, "lifetime": 20, "lastseen": "yesterday"}}
    assert peering.leads(garbled, 3, now), "an unreadable entry is no live peer (and never stops the gauge)"


def test_a_bad_metrics_port_is_named_not_a_traceback(tmp_path):
    with pytest.raises(SystemExit, match="--metrics-port=70000 must be a TCP port"):
        OperatorOptions.from_env(metrics_port=70000)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
        done = subprocess.run(
            [sys.executable, "-m", "rlfleet.cli", "operator", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert done.returncode != 0 and f"--metrics-port={port}: cannot serve /metrics there" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
