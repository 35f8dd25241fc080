"""Experiment trackers the trainer logs to: `spec.tracking.wandb` (Weights & Biases) and `spec.tracking.mlflow`.

Only the trainer (rank 0) talks to a tracker, so only its pod gets a tracker's credentials (rlfleet/operator/pods.py
`tracking_env`). Both need the `tracking` extra (`pip install 'rlfleet[tracking]'`); `rlfleet run` and the trainer
refuse a run that sets one without it (rlfleet/services/trainer/tracking.py `missing_packages`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.config.base import NAME_PATTERN, Spec

TRACKING_EXTRA = "tracking"  # the pyproject extra holding wandb and mlflow-skinny
WANDB_API_KEY_KEY = "api-key"  # the key of wandb.apiKeySecret


class WandbSpec(Spec):
    project: str = Field(min_length=1, max_length=128, description="W&B project the run logs to.")
    entity: str | None = Field(default=None, description="W&B entity (user or team). Empty: the API key's default.")
    name: str | None = Field(default=None, description="Display name of the W&B run. Empty: the RLRun's name.")
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="online: stream to the W&B server (needs an API key); offline: write the run's files only "
        "(RUN_DIR/wandb locally, the trainer's cache volume on a cluster), for `wandb sync` later.",
    )
    api_key_secret: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description=f"Cluster only: name of a Secret whose key `{WANDB_API_KEY_KEY}` holds the W&B API key; only the "
        "trainer pod gets it (env WANDB_API_KEY). `rlfleet run` takes WANDB_API_KEY from your environment.",
    )


class MlflowSpec(Spec):
    tracking_uri: str = Field(
        min_length=1,
        description="MLflow tracking URI: a server (`http://mlflow:5000`, `databricks`) or a file store "
        "(`file:///abs/dir`; on a cluster a path on a volume the trainer mounts).",
    )
    experiment: str | None = Field(default=None, description="MLflow experiment name. Empty: the RLRun's name.")
    credentials_secret: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: name of a Secret whose keys (e.g. MLFLOW_TRACKING_TOKEN, or "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD) become environment variables of the trainer pod "
        "only. `rlfleet run` takes them from your environment.",
    )


class TrackingSpec(Spec):
    """Where the trainer logs each step's record (the fields of metrics.jsonl), the run's config, and at the end
    the summary and reward.png."""

    wandb: WandbSpec | None = Field(default=None, description="Log to Weights & Biases.")
    mlflow: MlflowSpec | None = Field(default=None, description="Log to MLflow.")

    @property
    def enabled(self) -> bool:
        return self.wandb is not None or self.mlflow is not None
