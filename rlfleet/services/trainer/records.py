"""Each trainer step's record for metrics.jsonl (rank 0): what the step trained, read, dropped and cost, and what the
workers held back meanwhile. metrics.py exports the finished record on /metrics and to the trackers; split.py fills
in its timing fields when the step ends.
"""

from __future__ import annotations

import time

import numpy as np

from rlfleet.fleet.prompt_filter import OutcomeRecorder
from rlfleet.fleet.repeats import RepeatTally
from rlfleet.services.trainer.batches import Batch
from rlfleet.services.trainer.metrics import DROP_REASONS, source_record


class StepRecorder:
    """Rank 0's step records for metrics.jsonl: what a step trained, read, dropped and cost, and what workers held
    back meanwhile. It owns the run's tally of held-back groups (fleet/repeats.py) and the trainer's start time;
    the online filter's retired counts come from the batch reader's `outcomes` (prompt_filter.py)."""

    def __init__(self, mixture: bool, outcomes: OutcomeRecorder | None):
        self.mixture, self.outcomes = mixture, outcomes
        self.repeats = RepeatTally()  # what workers hold back: repeats of trained work, flat groups
        self.started = time.monotonic()

    def record(
        self, step: int, version: int, stats: dict, batch: Batch, lags: list[int], redis_hashes: dict[str, dict]
    ) -> dict:
        """Step `step`'s record (trained while holding `version`), its timing fields at 0 until the step ends
        (split.py). `redis_hashes`: the run's `stats` and `repeats` hashes as read after the update; the repeats
        counted since the last step are taken from the latter."""
        groups = batch.groups
        counts = {k.decode(): int(v) for k, v in redis_hashes["stats"].items()}
        repeats = self.repeats.take(redis_hashes["repeats"])
        read_rewards = [r for _, rewards in batch.read_groups for r in rewards]
        held_back = sum(r.samples for r in repeats.values())
        return {
            "step": step,
            "policy_version": version,
            **stats,
            # The policy's reward as sampled: the trained batch's reward_mean leaves out what the trainer
            # dropped and what workers held back, late in a run mostly repeats of solved prompts (all correct).
            "sampled_reward_mean": (sum(read_rewards) + sum(r.reward_sum for r in repeats.values()))
            / max(1, len(read_rewards) + held_back),
            "repeated_groups": self.repeats.total_repeats(),
            "flat_groups_held_back": self.repeats.total_flat(),
            **source_record(self.mixture, groups, batch.read_groups, repeats),
            "staleness_mean": float(np.mean(lags)),
            "staleness_max": max(lags),
            **{f"dropped_{reason}": batch.drops[reason] for reason in DROP_REASONS},
            "accepted": counts.get("accepted", 0),
            "rejected": counts.get("rejected", 0),
            "rejected_by_reason": {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("rejected:")},
            "wait_seconds": 0.0,
            "compute_seconds": 0.0,
            "publish_seconds": 0.0,
            "step_seconds": 0.0,
            "split": {},
            "wall_seconds": time.monotonic() - self.started,
            "rollout_ids": [g.rollout_id for g in groups],
            "worker_ids": [g.worker_id for g in groups],  # the worker of each trained rollout, in the same order
            "dropped_rollout_ids": batch.dropped_ids,
            **({f"prompts_retired_{k}": v for k, v in self.outcomes.retired.items()} if self.outcomes else {}),
        }
