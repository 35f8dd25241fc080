"""spec.tracking: the trainer's W&B and MLflow runs hold what metrics.jsonl holds, read back from the files W&B's
offline mode and MLflow's file store write; a tracker set without its package is a field error naming the extra;
only the trainer gets a tracker's credentials."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlfleet.config import ConfigError, load_bundle, parse_bundle
from rlfleet.operator.render import render_bundle
from rlfleet.services.trainer import tracking
from rlfleet.services.trainer.tracking import Trackers, open_trackers, redact, step_metrics
from rlfleet.versions.store import FileStore
from tests.runs import bundle_yaml, rlrun, write_rlrun
from tests.support import REPO
from tests.trainer import wandb_files

pytest.importorskip("wandb", reason="the tracking extra: pip install -e '.[tracking]'")
pytest.importorskip("mlflow", reason="the tracking extra: pip install -e '.[tracking]'")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the tests read MLflow's file store back


def records(steps: int) -> list[dict]:
    """metrics.jsonl records as the trainer writes them, with an eval section and rejections by reason."""
    return [
        {
            "step": s,
            "policy_version": s,
            "reward_mean": s / 10,
            "sampled_reward_mean": s / 20,
            "accuracy": s / 10,
            "samples": 32,
            "staleness_mean": 0.5,
            "accepted": 4 * s,
            "rejected": s,
            "rejected_by_reason": {"toploc": s},
            "eval/accuracy": s / 4,
            "eval": {"reward_mean": s / 5},
            "wait_seconds": 0.1,
            "compute_seconds": 0.2,
            "publish_seconds": 0.05,
            "wall_seconds": float(s),
            "rollout_ids": ["a", "b"],
            "dropped_rollout_ids": {"stale": ["c"]},
        }
        for s in range(1, steps + 1)
    ]


def wandb_run_file(directory: Path) -> Path:
    """The one W&B offline run under `directory`."""
    [run_file] = directory.glob("wandb/offline-run-*/run-*.wandb")
    return run_file


def mlflow_run(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def test_a_record_becomes_its_numbers_with_nested_sections_flattened_and_ids_left_out():
    [record] = records(1)
    metrics = step_metrics(record)
    assert metrics["reward_mean"] == 0.1 and metrics["rejected_by_reason/toploc"] == 1.0
    assert metrics["eval/accuracy"] == 0.25 and metrics["eval/reward_mean"] == 0.2
    assert "step" not in metrics and not any("rollout_ids" in name for name in metrics)


def test_url_passwords_are_redacted_from_the_logged_config():
    config = {"redis": {"url": "redis://trainer:s3cret@redis:6379/0"}, "store": {"uri": "s3://b/p"}}
    assert redact(config) == {"redis": {"url": "redis://trainer:***@redis:6379/0"}, "store": {"uri": "s3://b/p"}}


def test_wandb_offline_and_an_mlflow_file_store_hold_every_step_the_config_and_the_summary(tmp_path):
    uri = f"file://{tmp_path / 'mlruns'}"
    tracking_spec = {"wandb": {"project": "rlfleet-test", "mode": "offline"}, "mlflow": {"trackingUri": uri}}
    bundle = parse_bundle(bundle_yaml(rlrun(redis={"url": "redis://u:pw@h:1/0"}, tracking=tracking_spec)))
    store = FileStore(tmp_path / "store")
    trackers = open_trackers(bundle, store, tmp_path)
    assert isinstance(trackers, Trackers)
    metrics_file = tmp_path / "metrics.jsonl"
    for record in records(3):
        metrics_file.open("a").write(json.dumps(record) + "\n")
        trackers.log(record)
    trackers.finish(metrics_file)

    run_file = wandb_run_file(tmp_path)
    history = [row for row in wandb_files.history(run_file) if "reward_mean" in row]
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [row["reward_mean"] for row in history] == [0.1, 0.2, 0.3]
    assert [row["eval/accuracy"] for row in history] == [0.25, 0.5, 0.75]
    assert [row["eval/reward_mean"] for row in history] == [0.2, 0.4, 0.6]
    assert [row["rejected_by_reason/toploc"] for row in history] == [1, 2, 3]
    config = wandb_files.config(run_file)
    assert config["name"] == "arithmetic" and config["model"]["path"] == "builtin://tiny-arithmetic"
    assert config["redis"]["url"] == "redis://u:***@h:1/0"
    summary = wandb_files.summary(run_file)
    assert summary["steps"] == 3 and summary["reward_last"] == 0.3 and summary["reward.png/_type"] == "image-file"
    assert list(run_file.parent.glob("files/media/images/reward.png_*.png"))

    client, run = mlflow_run(uri, "arithmetic")
    assert run.info.status == "FINISHED"
    for name, values in {"reward_mean": [0.1, 0.2, 0.3], "eval/accuracy": [0.25, 0.5, 0.75]}.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)] == list(
            zip([1, 2, 3], values)
        )
    assert run.data.params["model.path"] == "builtin://tiny-arithmetic"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"reward.png", "rlrun.json", "summary.json"}
    summary_json = json.loads(
        Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))).read_text()
    )
    assert summary_json["steps"] == 3 and summary_json["accepted"] == 12

    # A restarted trainer resumes both runs (ids kept in the store) instead of starting new ones.
    ids = json.loads(store.get_bytes(tracking.tracking_key("arithmetic")))
    again = open_trackers(bundle, store, tmp_path)
    assert again is not None and json.loads(store.get_bytes(tracking.tracking_key("arithmetic"))) == ids
    again.log(records(4)[-1])
    again.finish(None)
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "reward_mean")] == [1, 2, 3, 4]
    assert len(client.search_runs([client.get_experiment_by_name("arithmetic").experiment_id])) == 1
    # W&B's offline mode writes a resumed run beside the first, under the same run id (`wandb sync` joins them).
    first, resumed = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert first.name == resumed.name == f"run-{ids['wandb']}.wandb"
    assert [row["_step"] for row in wandb_files.history(resumed) if "reward_mean" in row] == [4]


def test_a_tracker_without_its_package_is_a_field_error_naming_the_extra(tmp_path, monkeypatch):
    """`rlfleet run` refuses it before it builds a model or starts a process (and the trainer would too)."""
    monkeypatch.setitem(tracking.MODULES, "wandb", "rlfleet_no_such_module")
    config = write_rlrun(tmp_path / "run.yaml", rlrun(tracking={"wandb": {"project": "p"}}))
    from rlfleet.local.launcher import run_local

    with pytest.raises(ConfigError) as err:
        run_local(str(config), run_dir=str(tmp_path / "run"))
    assert err.value.problems == [
        "spec.tracking.wandb: the rlfleet_no_such_module package is not installed; install the extra: "
        "pip install 'rlfleet[tracking]'"
    ]
    assert not (tmp_path / "run" / "endpoints.json").exists()
    with pytest.raises(SystemExit, match=r"pip install 'rlfleet\[tracking\]'"):
        open_trackers(load_bundle(config), FileStore(tmp_path / "store"), tmp_path)


def test_only_the_trainer_pod_gets_the_trackers_credentials():
    spec = {
        "redis": {"urlSecret": "run-redis"},
        "store": {"uri": "s3://ckpt/runs", "credentialsSecret": "s3-creds"},
        "shardcast": {"signingKeySecret": "run-signing"},
        "tracking": {
            "wandb": {"project": "p", "apiKeySecret": "wandb-key"},
            "mlflow": {"trackingUri": "https://mlflow.example", "credentialsSecret": "mlflow-creds"},
        },
    }
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / "arithmetic" / "rlrun.yaml").read_text()) if d]
    docs[0]["spec"].update(spec)
    objects = render_bundle(parse_bundle(yaml.safe_dump_all(docs)), "ml")
    containers = {
        c["name"]: c
        for o in objects
        if o["kind"] in ("StatefulSet", "Deployment")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert {"trainer", "verifier", "rollout", "relay", "origin"} <= containers.keys()

    def credentials(container: dict) -> set[str]:
        found = {
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        return found | {s["secretRef"]["name"] for s in container.get("envFrom", [])}

    trainer = containers.pop("trainer")
    assert {"wandb-key", "mlflow-creds", "s3-creds"} <= credentials(trainer)
    assert {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb-key", "key": "api-key"}}} in trainer[
        "env"
    ]
    for name, container in containers.items():
        assert not credentials(container) & {"wandb-key", "mlflow-creds"}, name


@pytest.mark.slow
def test_a_local_run_logs_every_step_to_wandb_offline_and_an_mlflow_file_store(tmp_path):
    uri = f"file://{tmp_path / 'mlruns'}"
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / "arithmetic" / "rlrun.yaml").read_text()) if d]
    docs[0]["spec"]["tracking"] = {
        "wandb": {"project": "rlfleet-test", "mode": "offline"},
        "mlflow": {"trackingUri": uri},
    }
    docs[0]["spec"]["trainer"]["batchSize"] = 4
    config = tmp_path / "rlrun.yaml"
    config.write_text(yaml.safe_dump_all(docs))
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--steps", "3"]
    done = subprocess.run([*argv, "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in expected] == [1, 2, 3]

    history = [row for row in wandb_files.history(wandb_run_file(run_dir)) if "reward_mean" in row]
    assert [row["_step"] for row in history] == [1, 2, 3]
    for row, record in zip(history, expected):
        for name, value in step_metrics(record).items():
            assert row[name] == pytest.approx(value), name

    client, run = mlflow_run(uri, "arithmetic")
    for name, value in step_metrics(expected[0]).items():
        history_of = client.get_metric_history(run.info.run_id, name)
        assert [m.step for m in history_of] == [1, 2, 3], name
        assert history_of[0].value == pytest.approx(value), name
    assert run.info.status == "FINISHED"
