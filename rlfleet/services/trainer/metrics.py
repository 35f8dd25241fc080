"""The trainer's Prometheus metrics: every field of a metrics.jsonl record on /metrics (export_step).

Every labelled series exists from the start (at 0), so a scrape shows it before its first event.
Only rank 0 takes the steps it reports, so under data parallelism the other ranks withdraw these
series (`withdraw`) and serve only process metrics: a dashboard's avg() over the trainer pods is then
rank 0's value, not that value divided by the world size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, get_args

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from rlfleet.config import RejectionReason
from rlfleet.fleet.repeats import Tally
from rlfleet.services.trainer.split import BACKGROUND_PARTS, SPLIT_PARTS
from rlfleet.tasks.mixture import source_of
from rlfleet.wire.streams import RolloutGroup

STEP = Gauge("rlfleet_trainer_step", "Optimizer steps taken")
VERSION = Gauge("rlfleet_trainer_policy_version", "Latest published policy version")
REWARD = Gauge("rlfleet_trainer_reward_mean", "Mean verified reward of the last batch")
SAMPLED_REWARD = Gauge(
    "rlfleet_trainer_sampled_reward_mean",
    "Mean reward of every group the last step read, the ones it dropped too (the policy's reward as sampled)",
)
STALENESS = Gauge("rlfleet_trainer_staleness_mean", "Mean policy lag of the last batch, in versions")
STALENESS_MAX = Gauge("rlfleet_trainer_staleness_max", "Largest policy lag of a group in the last batch, in versions")
ELAPSED = Gauge("rlfleet_trainer_elapsed_seconds", "Seconds from the trainer's start to the end of its last step")
SAMPLES = Counter("rlfleet_trainer_samples_total", "Completions trained on")
REPEATED = Gauge(
    "rlfleet_trainer_repeated_groups", "Groups workers held back as repeats of trained work since the trainer started"
)
FLAT_HELD_BACK = Gauge(
    "rlfleet_trainer_flat_groups_held_back",
    "Groups workers held back for equal rewards (skipZeroAdvantageGroups) since the trainer started",
)
DROPPED = Counter("rlfleet_trainer_dropped_groups_total", "Groups dropped", ["reason"])
STEP_SECONDS = Histogram(
    "rlfleet_trainer_step_seconds", "Step time by phase: the parts of each step's split (split.py)", ["phase"]
)
STEP_WALL = Histogram(
    "rlfleet_trainer_step_wall_seconds", "Wall time of each step (step_seconds; its split adds up to it)"
)
BACKGROUND_SECONDS = Counter(
    "rlfleet_trainer_publish_background_seconds",
    "Seconds the background publish of versions worked, by part, beside the steps (background_split, split.py)",
    ["part"],
)
# Every per-step statistic of metrics.jsonl, by name (loss, grad_norm, accuracy, learning_rate, ...).
BATCH_STATS = (
    "loss",
    "grad_norm",
    "accuracy",
    "learning_rate",
    "clip_fraction",
    "ratio_mean",
    "entropy_mean",
    "kl_mean",
    "completion_tokens_mean",  # the tokens the model sampled (a multi-turn transcript's environment turns excluded)
    "turns_mean",  # model turns per sample: 1 but on a task that takes turns (rlfleet/tasks/turns.py)
    # trainer.offPolicy tis/mis (loss.py): trainer / sampler probability of the tokens, share truncated or masked
    "offpolicy_ratio_mean",
    "offpolicy_ratio_max",
    "offpolicy_truncated_fraction",
    "offpolicy_masked_fraction",
)
STAT = Gauge(
    "rlfleet_trainer_batch_stat", "Statistic of the last optimizer step (the fields of metrics.jsonl)", ["stat"]
)
GROUPS = Gauge(
    "rlfleet_trainer_verifier_groups",
    "Groups the verifier accepted / rejected so far, by reason",
    ["verdict", "reason"],
)
RETIRED = Gauge(
    "rlfleet_trainer_prompts_retired",
    "Prompts the online filter retired so far in this trainer's life, by outcome (spec.sampling.onlineFilter)",
    ["outcome"],
)
EVAL = Gauge(
    "rlfleet_trainer_eval",
    "Held-out evaluation (spec.eval) of the newest evaluated version: score (pass@k), reward_mean, version, "
    "problems, k, seconds",
    ["stat"],
)
EVAL_STATS = ("score", "reward_mean", "version", "problems", "k", "seconds")
SOURCE_REWARD = Gauge(
    "rlfleet_trainer_source_reward_mean",
    "Mean reward per source of a task mixture: of the last trained batch (batch=trained) and of every group the "
    "last step read, dropped ones too (batch=sampled)",
    ["source", "batch"],
)
SOURCE_GROUPS = Counter(
    "rlfleet_trainer_source_groups_total", "Groups per source of a task mixture, trained and read", ["source", "batch"]
)
DROP_REASONS = ("stale", "duplicate", "malformed", "zero_advantage")
# Every labelled series exists from the start (at 0), so a scrape shows it before its first event.
for _reason in DROP_REASONS:
    DROPPED.labels(_reason)
for _phase in SPLIT_PARTS:
    STEP_SECONDS.labels(_phase)
for _part in BACKGROUND_PARTS:
    BACKGROUND_SECONDS.labels(_part)
EXPORTED = (
    STEP,
    VERSION,
    REWARD,
    SAMPLED_REWARD,
    STALENESS,
    STALENESS_MAX,
    ELAPSED,
    SAMPLES,
    REPEATED,
    FLAT_HELD_BACK,
    DROPPED,
    STEP_SECONDS,
    STEP_WALL,
    BACKGROUND_SECONDS,
    STAT,
    GROUPS,
    RETIRED,
    EVAL,
    SOURCE_REWARD,
    SOURCE_GROUPS,
)
AUDIT_TRAIL = {
    "rollout_ids": "the audit trail of trained rollouts: identifiers, not a measurement",
    "worker_ids": "the worker of each trained rollout (rollout_ids' order): identifiers, not a measurement",
    "dropped_rollout_ids": "the audit trail of dropped rollouts by reason (dropped_* counts them)",
}
NOT_EXPORTED = {
    **AUDIT_TRAIL,
    **{
        f"{phase}_seconds": "a sum of split parts (split.py), each on rlfleet_trainer_step_seconds{phase}"
        for phase in ("wait", "compute", "publish")
    },
}


def export_step(record: dict) -> None:
    """Put every field of a metrics.jsonl record (except NOT_EXPORTED) on /metrics.
    Mapping: step, policy_version, reward_mean, sampled_reward_mean, staleness_mean/max -> their gauges; the GRPO
    statistics -> rlfleet_trainer_batch_stat{stat}; samples -> the samples counter; repeated_groups and
    flat_groups_held_back -> their gauges; dropped_* -> the dropped counter by reason; each part of split -> the
    step-time histogram by phase (the part's name); each part of background_split -> the background publish's
    seconds counter by part; step_seconds -> the step wall-time histogram; wall_seconds ->
    elapsed; accepted and rejected_by_reason -> rlfleet_trainer_verifier_groups (rejected is their sum over reasons,
    every known reason present); prompts_retired_* (online filter) -> rlfleet_trainer_prompts_retired{outcome};
    eval/* (held-out evaluation, in the record of the step it finished in) -> rlfleet_trainer_eval{stat}; sources (a
    task mixture's) -> rlfleet_trainer_source_reward_mean and rlfleet_trainer_source_groups_total by source and
    batch."""
    STEP.set(record["step"])
    VERSION.set(record["policy_version"])
    REWARD.set(record["reward_mean"])
    SAMPLED_REWARD.set(record["sampled_reward_mean"])
    STALENESS.set(record["staleness_mean"])
    STALENESS_MAX.set(record["staleness_max"])
    ELAPSED.set(record["wall_seconds"])
    SAMPLES.inc(record["samples"])
    REPEATED.set(record.get("repeated_groups", 0))  # absent from a record an older trainer saved with its state
    FLAT_HELD_BACK.set(record.get("flat_groups_held_back", 0))
    for name in BATCH_STATS:
        if name in record:
            STAT.labels(name).set(record[name])
    for reason in DROP_REASONS:
        if record.get(f"dropped_{reason}"):
            DROPPED.labels(reason).inc(record[f"dropped_{reason}"])
    # A record saved with the resume state by an older trainer may have no split (appended again on resume).
    for phase, seconds in record.get("split", {}).items():
        STEP_SECONDS.labels(phase).observe(seconds)
    if "step_seconds" in record:
        STEP_WALL.observe(record["step_seconds"])
    for part, seconds in record.get("background_split", {}).items():
        BACKGROUND_SECONDS.labels(part).inc(seconds)
    for outcome in ("solved", "failed"):
        if f"prompts_retired_{outcome}" in record:
            RETIRED.labels(outcome).set(record[f"prompts_retired_{outcome}"])
    for stat in EVAL_STATS:
        if f"eval/{stat}" in record:
            EVAL.labels(stat).set(record[f"eval/{stat}"])
    GROUPS.labels("accepted", "").set(record["accepted"])
    for reason in {*get_args(RejectionReason), *record["rejected_by_reason"]}:
        GROUPS.labels("rejected", reason).set(record["rejected_by_reason"].get(reason, 0))
    for name, source in record.get("sources", {}).items():
        for batch, prefix in (("trained", ""), ("sampled", "sampled_")):
            if source[f"{prefix}reward_mean"] is not None:
                SOURCE_REWARD.labels(name, batch).set(source[f"{prefix}reward_mean"])
            SOURCE_GROUPS.labels(name, batch).inc(source[f"{prefix}groups"])


def source_record(
    mixture: bool, trained: list[RolloutGroup], read: list[tuple[str, list[float]]], repeats: dict[str, Tally]
) -> dict:
    """`{"sources": {name: {reward_mean, groups, sampled_reward_mean, sampled_groups}}}` for a task mixture (the
    source named by each task id, tasks/mixture.py), else {}: reward_mean and groups of the trained batch (None
    and 0 when no trained group came from the source), sampled_* of every group the step read and of the
    repeats workers held back meanwhile (`repeats`, rlfleet/fleet/repeats.py)."""
    if not mixture:
        return {}
    trained_by: dict[str, list[float]] = {}
    for g in trained:
        trained_by.setdefault(source_of(g.task_id) or "", []).extend(s.reward for s in g.samples)
    sampled = dict(repeats)  # source -> Tally of what the step read and what workers held back meanwhile
    for task_id, rewards in read:
        name = source_of(task_id) or ""
        t = sampled.get(name, Tally())
        sampled[name] = Tally(t.groups + 1, t.samples + len(rewards), t.reward_sum + sum(rewards))
    sources = {}
    for name in sorted({*trained_by, *sampled}):
        rewards, seen = trained_by.get(name, []), sampled.get(name, Tally())
        sources[name] = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "groups": sum(source_of(g.task_id) == name for g in trained),
            "sampled_reward_mean": seen.reward_sum / seen.samples if seen.samples else None,
            "sampled_groups": seen.groups,
        }
    return {"sources": sources}


def withdraw() -> None:
    """Take the trainer's series off /metrics (ranks other than 0, which never set them)."""
    for metric in EXPORTED:
        REGISTRY.unregister(metric)


class StepTrackers(Protocol):
    """Where records go besides metrics.jsonl: the run's experiment trackers (tracking.py `Trackers`)."""

    def log(self, record: dict) -> None: ...
    def finish(self, metrics_file: Path | None) -> None: ...


class MetricsLog:
    """metrics.jsonl (None: not kept): one record per step, appended once the step is done and exported on
    /metrics and to the run's trackers (tracking.py; rank 0 only); on resume, records of steps trained again are
    removed (state.py)."""

    def __init__(self, path: Path | None, trackers: StepTrackers | None = None):
        self.path = path
        self.trackers = trackers

    def _lines(self) -> list[str]:
        return self.path.read_text().splitlines(keepends=True) if self.path and self.path.exists() else []

    def append(self, record: dict) -> None:
        export_step(record)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.trackers:
            self.trackers.log(record)

    def close(self) -> None:
        """End the trackers' runs, with the summary and reward.png of the records."""
        if self.trackers:
            self.trackers.finish(self.path)
            self.trackers = None

    def last_step(self) -> int:
        """The step of the last record (0 without one)."""
        lines = self._lines()
        return json.loads(lines[-1])["step"] if lines else 0

    def forget_after(self, step: int) -> None:
        """Remove the records of steps after `step`."""
        lines = self._lines()
        kept = [line for line in lines if json.loads(line)["step"] <= step]
        if self.path and len(kept) < len(lines):
            self.path.write_text("".join(kept))
