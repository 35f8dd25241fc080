"""The trainer's experiment trackers (`spec.tracking`): W&B and MLflow get what metrics.jsonl gets.

Rank 0 alone opens them (`open_trackers`), so only the trainer holds a tracker's credentials. Each step's record is
logged at its step (`step_metrics`: every number of the record, nested mappings such as rejected_by_reason or an
eval section flattened to `parent/key`, the audit lists of rollout ids left out); the run's config once, at the
start (URL passwords redacted); at the end (`Trackers.finish`) the run's summary and reward.png, computed from
metrics.jsonl as `rlfleet run` computes its own.
A tracker's run is resumed, not started again, when the trainer resumes: its id is kept in the store
(`{run}/trainer/tracking.json`) beside the trainer's state. Steps trained again after a crash are logged again;
W&B keeps the first value of a step it has seen, MLflow keeps both.
A tracker that fails while the run trains (its server down) costs a warning in the trainer's log, never the run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import secrets
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rlfleet.config import Bundle, MlflowSpec, TrackingSpec, WandbSpec
from rlfleet.config.tracking import TRACKING_EXTRA
from rlfleet.services.trainer.metrics import AUDIT_TRAIL
from rlfleet.versions.store import CheckpointStore

log = logging.getLogger("rlfleet.trainer.tracking")
# The module each tracker needs, by its field of spec.tracking.
MODULES = {"wandb": "wandb", "mlflow": "mlflow"}
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's log_batch takes at most 100 params
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@/\s]*@", re.IGNORECASE)


def missing_packages(tracking: TrackingSpec) -> list[str]:
    """One `spec.tracking.<tracker>: ...` problem per tracker the spec sets whose package is not installed."""
    return [
        f"spec.tracking.{field}: the {module} package is not installed; install the extra: "
        f"pip install 'rlfleet[{TRACKING_EXTRA}]'"
        for field, module in MODULES.items()
        if getattr(tracking, field) is not None and importlib.util.find_spec(module) is None
    ]


def step_metrics(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics.jsonl record by name; nested mappings as `parent/key`; `step` (the axis), lists and
    strings left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and (key == "step" or key in AUDIT_TRAIL):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(step_metrics(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def redact(value: Any) -> Any:
    """`value` with the password of every URL in its strings replaced by ***."""
    if isinstance(value, str):
        return _URL_PASSWORD.sub(r"\1***@", value)
    if isinstance(value, Mapping):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def run_config(bundle: Bundle) -> dict:
    """The run's configuration as its YAML spells it: the RLRun's spec, its pools and relay tiers by name."""

    def dump(doc) -> dict:
        return doc.spec.model_dump(mode="json", by_alias=True, exclude_none=True)

    config = {"name": bundle.run.metadata.name, **dump(bundle.run)}
    config["pools"] = {p.metadata.name: dump(p) for p in bundle.pools}
    config["relayTiers"] = {r.metadata.name: dump(r) for r in bundle.relays}
    return redact(config)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: `trainer.learningRate` -> its value as text."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list | dict) else str(value)
    return out


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def finish(self, summary: dict, reward_png: Path | None) -> None: ...


class WandbTracker:
    def __init__(self, spec: WandbSpec, run_name: str, config: dict, directory: Path | None, run_id: str):
        import wandb

        directory = directory or Path(tempfile.mkdtemp(prefix="rlfleet-wandb-"))
        settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False, x_disable_stats=True)
        self.run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            name=spec.name or run_name,
            mode=spec.mode,
            dir=str(directory),
            id=run_id,
            resume="allow",
            config=config,
            settings=settings,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict, reward_png: Path | None) -> None:
        import wandb

        self.run.summary.update(summary)
        if reward_png:
            self.run.log({"reward.png": wandb.Image(str(reward_png))})
        self.run.finish()


class MlflowTracker:
    def __init__(self, spec: MlflowSpec, run_name: str, config: dict, run_id: str | None):
        from mlflow.tracking import MlflowClient

        if spec.tracking_uri.startswith("file:"):
            # MLflow 3 refuses its file store unless told; a file:// URI in the spec is that choice.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        name = spec.experiment or run_name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        if run_id and self._exists(run_id):
            self.run_id: str = run_id
            self.client.update_run(run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            self._log_config(config)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def _log_config(self, config: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in flat_params(config).items()]  # 6000: MLflow's longest param value
        for i in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_PARAMS_PER_CALL])
        self.client.log_dict(self.run_id, config, "rlrun.json")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(name, value, now, step) for name, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=rows)

    def finish(self, summary: dict, reward_png: Path | None) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        if reward_png:
            self.client.log_artifact(self.run_id, str(reward_png))
        self.client.set_terminated(self.run_id)


def tracking_key(run: str) -> str:
    return f"{run}/trainer/tracking.json"


class Trackers:
    """The trackers the run's spec names, opened on rank 0 (`open_trackers`)."""

    def __init__(self, trackers: dict[str, Tracker], run: str):
        self.trackers = trackers
        self.run = run
        self.started = time.monotonic()

    def log(self, record: Mapping[str, Any]) -> None:
        metrics = step_metrics(record)
        for name, tracker in self.trackers.items():
            try:
                tracker.log(int(record["step"]), metrics)
            except Exception as exc:  # a tracker's outage must not stop the training
                log.warning("%s: step %s not logged: %s", name, record["step"], exc)

    def finish(self, metrics_file: Path | None) -> None:
        """Log the summary and reward.png of metrics.jsonl (rlfleet/wire/run_summary.py computes both), then end
        every tracker's run."""
        from rlfleet.wire.run_summary import plot, read_metrics, summarize

        records = read_metrics(metrics_file) if metrics_file else []
        wall = records[-1]["wall_seconds"] if records else time.monotonic() - self.started
        summary = summarize(records, wall)
        with tempfile.TemporaryDirectory(prefix="rlfleet-tracking-") as tmp:
            png: Path | None = Path(tmp) / "reward.png" if records else None
            try:
                if png:
                    plot(records, png, f"rlfleet run {self.run}")
            except ImportError as exc:  # matplotlib (in the tracking extra) missing from this image
                log.warning("reward.png not drawn: %s", exc)
                png = None
            for name, tracker in self.trackers.items():
                try:
                    tracker.finish(summary, png)
                except Exception as exc:
                    log.warning("%s: the run's summary was not logged: %s", name, exc)


def open_trackers(bundle: Bundle, store: CheckpointStore, directory: Path | None) -> Trackers | None:
    """The trackers of `bundle`'s spec.tracking (None: none set), each resuming the run it logged to before the
    trainer restarted (ids in the store). `directory`: where W&B keeps its files (RUN_DIR/wandb)."""
    spec, run = bundle.run.spec.tracking, bundle.run.metadata.name
    if not spec.enabled:
        return None
    problems = missing_packages(spec)
    if problems:
        raise SystemExit("; ".join(problems))
    key = tracking_key(run)
    ids = json.loads(store.get_bytes(key)) if store.exists(key) else {}
    config = run_config(bundle)
    trackers: dict[str, Tracker] = {}
    if spec.wandb:
        ids.setdefault("wandb", f"{run[:40]}-{secrets.token_hex(4)}")
        trackers["wandb"] = WandbTracker(spec.wandb, run, config, directory, ids["wandb"])
    if spec.mlflow:
        mlflow = MlflowTracker(spec.mlflow, run, config, ids.get("mlflow"))
        ids["mlflow"], trackers["mlflow"] = mlflow.run_id, mlflow
    store.put_bytes(key, json.dumps(ids).encode())
    log.info("tracking to %s", ", ".join(trackers))
    return Trackers(trackers, run)
