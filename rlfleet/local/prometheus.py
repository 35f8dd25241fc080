"""A Prometheus beside a local run: the run's scrape targets as a file-based service discovery file, and
`rlfleet run --prometheus`, which starts Debian's (or any) `prometheus` binary on 127.0.0.1 to scrape them.

Every process of a local run serves /metrics on a loopback port (plan.py, endpoints.json `metrics`). `rlfleet run`
writes RUN_DIR/prometheus/targets.json on every launch, in Prometheus's file_sd format: one target group per process,
labelled as the chart's PodMonitors label a pod's series (charts/rlfleet/templates/monitors.yaml), so the Grafana
dashboards' queries (charts/rlfleet/dashboards/) select a local run's series unchanged:
  rlfleet_io_run                the run's name (the dashboards' `run` variable)
  app_kubernetes_io_component   the component (trainer, rollout, verifier, origin, relay)
  rlfleet_io_kind               the document that owns the process: rlrun, inferencepool or relaytier
  pod, job, namespace           the process name with `-` for `/` (rollout-arithmetic-cpu-0), the component, `local`
There is no `cluster` label, as in a one-cluster Prometheus (the dashboards' `All` matches its absence).
A relaunch rewrites the file with the new ports, and Prometheus reads file_sd files again when they change.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rlfleet.local.plan import Process
from rlfleet.wire.components import RELAY, ROLLOUT
from rlfleet.wire.ports import free_port

NAMESPACE = "local"
SCRAPE_INTERVAL_S = 1  # a short run's rates need several samples a minute
BINARY = "prometheus"


def owner_kind(process: Process) -> str:
    """The rlfleet.io/kind label its pod would carry: the kind of the document it belongs to."""
    return {ROLLOUT: "inferencepool", RELAY: "relaytier"}.get(process.kind, "rlrun")


def scrape_targets(run: str, processes: list[Process]) -> list[dict]:
    """file_sd target groups: one per process serving /metrics (module docstring for the labels)."""
    return [
        {
            "targets": [f"127.0.0.1:{p.metrics_port}"],
            "labels": {
                "job": p.kind,
                "pod": p.name.replace("/", "-"),
                "namespace": NAMESPACE,
                "rlfleet_io_run": run,
                "app_kubernetes_io_component": p.kind,
                "rlfleet_io_kind": owner_kind(p),
            },
        }
        for p in processes
        if p.metrics_port
    ]


def write_targets(run_dir: Path, run: str, processes: list[Process]) -> Path:
    """RUN_DIR/prometheus/targets.json, written whole then renamed (Prometheus may read it at any moment)."""
    path = run_dir / "prometheus" / "targets.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(scrape_targets(run, processes), indent=2) + "\n")
    tmp.replace(path)
    return path


def config_text(targets: Path, interval_s: int = SCRAPE_INTERVAL_S) -> str:
    """prometheus.yml: scrape every target of the file_sd file `targets` every `interval_s` seconds."""
    config = {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
        "scrape_configs": [
            {
                "job_name": "rlfleet",
                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "5s"}],
                # Keep the file's job label (the component) instead of the scrape config's name.
                "honor_labels": True,
            }
        ],
    }
    return json.dumps(config, indent=2) + "\n"  # JSON is YAML


@dataclass
class LocalPrometheus:
    """A running prometheus process, its URL and its log."""

    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def binary() -> str | None:
    return shutil.which(BINARY)


def start(run_dir: Path, targets: Path, timeout: float = 30.0) -> LocalPrometheus:
    """Start `prometheus` on a free 127.0.0.1 port, keeping its data in RUN_DIR/prometheus/data, and wait until it
    answers /-/ready. RuntimeError (naming its log) if there is no binary or it does not come up."""
    exe = binary()
    if exe is None:
        raise RuntimeError("no `prometheus` binary on PATH (Debian: apt-get install prometheus)")
    home = run_dir / "prometheus"
    config = home / "prometheus.yml"
    config.write_text(config_text(targets))
    port = free_port()
    log = run_dir / "logs" / "prometheus.log"
    argv = [
        exe,
        f"--config.file={config}",
        f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=30d",
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    running = LocalPrometheus(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with code {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{running.url}/-/ready", timeout=2) as reply:
                if reply.status == 200:
                    return running
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    running.stop()
    raise RuntimeError(f"prometheus did not answer /-/ready within {timeout:.0f}s; see {log}")
