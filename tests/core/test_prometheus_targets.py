"""The file_sd targets `rlfleet run` writes for a Prometheus: one group per process, labelled as the chart's
PodMonitors label a pod, so the dashboards' selectors match a local run's series (the live test proves it)."""

from __future__ import annotations

import json

import yaml

from rlfleet.config import load_bundle
from rlfleet.local.plan import plan
from rlfleet.local.prometheus import config_text, write_targets
from tests.chart.test_dashboards import POD_TARGET_LABELS
from tests.support import REPO


def test_every_process_is_a_target_with_the_labels_the_dashboards_select_on(tmp_path):
    config = REPO / "examples" / "arithmetic" / "rlrun.yaml"
    processes = plan(load_bundle(config), config, tmp_path)
    path = write_targets(tmp_path, "arithmetic", processes)
    groups = json.loads(path.read_text())
    assert [g["targets"] for g in groups] == [[f"127.0.0.1:{p.metrics_port}"] for p in processes]
    by_pod = {g["labels"]["pod"]: g["labels"] for g in groups}
    assert set(by_pod) == {
        "origin",
        "relay-arithmetic-tier0-0",
        "verifier-0",
        "rollout-arithmetic-cpu-0",
        "rollout-arithmetic-cpu-1",
        "trainer",
    }
    for labels in by_pod.values():
        assert POD_TARGET_LABELS <= labels.keys() and labels["rlfleet_io_run"] == "arithmetic"
        assert labels["namespace"] == "local" and labels["job"] == labels["app_kubernetes_io_component"]
    assert [
        by_pod[p]["rlfleet_io_kind"] for p in ("trainer", "rollout-arithmetic-cpu-0", "relay-arithmetic-tier0-0")
    ] == ["rlrun", "inferencepool", "relaytier"]
    scrape = yaml.safe_load(config_text(path))["scrape_configs"]
    assert scrape[0]["file_sd_configs"][0]["files"] == [str(path)] and scrape[0]["honor_labels"] is True
