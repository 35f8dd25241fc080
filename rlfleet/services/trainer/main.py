"""`rlfleet trainer`: consume verified groups, take GRPO steps, publish policy versions.

One step:
  1. read verified groups (consumer group `trainer`) until `batchSize` fresh groups are held;
     a group is fresh while (current version - its policy version) <= maxAsyncLevel, older ones are
     dropped and acknowledged; work trained before (same content digest, streams.group_digest:
     prompt, sampling, completions, whatever ids the worker gave it) is acknowledged and skipped
     (at-least-once delivery made exactly-once);
  2. group-normalized advantages, GRPO loss with two-sided clipping (loss.py), grad-norm clip, AdamW;
  3. write version v+1's files, then publish them to the store (manifest last; whole or as a delta against v,
     rlfleet/versions/publish.py) and announce it on the `policy` stream in a thread beside the next step
     (publishing.py);
  4. every `checkpointEvery` steps (and at the last step, or when stopped) save the resume state,
     sharded (state.py), then record the digests of the steps since the previous save as trained and
     XACK their messages; until then they stay pending, so a crash redelivers them and they are trained
     again from the weights saved before them, never on top of their own update (state.py has the
     whole protocol).

Each step's record (metrics.jsonl) says where its wall time went, part by part (split.py).
A replica of several ranks is started by ranks.py (`--ranks`); every rank runs this loop, rank 0 alone
reads the streams, publishes and commits (distributed.py).

This module reads in the order of the process's life: `main` starts the ranks and builds the `Trainer`, which
loads the policy, resumes from the saved state (`resume`), then takes its steps (`run`, `take_step`): read
a batch (batches.py), update (update.py), record, save when due, publish.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

from rlfleet.fleet.window import AsyncWindow
from rlfleet.models.policy import configure_torch_threads
from rlfleet.models.sources import ModelSourceError, resolve_model_path
from rlfleet.services.trainer.batches import Batch, BatchReader
from rlfleet.services.trainer.distributed import await_lead, broadcast, init_distributed, lead_at, leave_distributed
from rlfleet.services.trainer.evaluation import Evaluator
from rlfleet.services.trainer.metrics import MetricsLog, withdraw
from rlfleet.services.trainer.models import load_rank_models
from rlfleet.services.trainer.publishing import VersionPublishing
from rlfleet.services.trainer.ranks import become_rank, is_group_parent, run_group
from rlfleet.services.trainer.records import StepRecorder
from rlfleet.services.trainer.sharding import full_model_state, publishable_weights
from rlfleet.services.trainer.split import StepSplit
from rlfleet.services.trainer.state import (
    Commit,
    load_checkpoint,
    load_state,
    resume_version,
    save_checkpoint,
    save_state,
)
from rlfleet.services.trainer.tracking import open_trackers
from rlfleet.services.trainer.update import UpdateSettings, grpo_update
from rlfleet.versions.checkpoint import save_model_dir
from rlfleet.versions.store import open_run_store
from rlfleet.wire import components, env
from rlfleet.wire.runtime import ComponentOptions, Context, component_context, fail_run
from rlfleet.wire.streams import RolloutGroup, group_digest

log = logging.getLogger("rlfleet.trainer")

TRAINED_DIGESTS_KEPT = 200_000


@dataclass(frozen=True, kw_only=True)
class TrainerOptions(ComponentOptions):
    output_dir: Path | None = None  # where metrics.jsonl is written
    steps: int | None = None  # overrides spec.trainer.steps
    hold_when_done: bool = False  # after the last step, wait for SIGTERM instead of exiting (in a pod)
    ranks: int = 1  # rank processes of this replica (ranks.py): with more than 1 this process starts them


def main(options: TrainerOptions) -> int:
    """The trainer process: start the replica's ranks (or become one), build the Trainer, take every step."""
    if is_group_parent(options.ranks):
        return run_group(options.ranks)
    become_rank(options.ranks)
    if env.get_int(env.LOCAL_RANK, 0) > 0:
        options = replace(options, metrics_port=0)  # the replica's /metrics port is local rank 0's

    ctx = component_context(options, components.TRAINER)
    configure_torch_threads()
    if options.output_dir:
        options.output_dir.mkdir(parents=True, exist_ok=True)

    try:
        try:
            trainer = Trainer(ctx, options.output_dir)
        except ModelSourceError as exc:  # the config names a model that cannot be had: no restart fixes it
            return fail_run(ctx, "ModelUnavailable", str(exc), hold=options.hold_when_done)
        try:
            trainer.run(options.steps or ctx.bundle.run.spec.trainer.steps)
        finally:
            trainer.records.close()  # the trackers get the summary and reward.png, and their runs end

        if options.hold_when_done and not ctx.stop.is_set():
            # A StatefulSet restarts a container that exits, even with 0; the operator scales it down instead.
            log.info("every step is done; holding until stopped")
            ctx.stop.wait()
    finally:
        leave_distributed()
    return 0


class Trainer:
    """One rank of the trainer: the policy it trains, its optimizer and schedule, and where the run stands (the
    version it holds, the steps trained since the last save). Rank 0 also holds the batch reader's reads, the
    metrics log and trackers, the publisher and the evaluator."""

    def __init__(self, ctx: Context, output_dir: Path | None):
        self.ctx = ctx
        self.spec = ctx.bundle.run.spec
        self.window = AsyncWindow.of(self.spec)  # what a step trains and what the store keeps (fleet/window.py)
        self.store = open_run_store(ctx)
        # only rank 0 reads streams, publishes and commits
        self.ranks = init_distributed(self.spec.trainer.collective_timeout_seconds)
        if not self.ranks.is_lead:
            withdraw()  # its series would read 0 and halve every average over the trainer pods
        trackers = open_trackers(ctx.bundle, self.store, output_dir) if self.ranks.is_lead else None
        self.records = MetricsLog(output_dir / "metrics.jsonl" if output_dir else None, trackers)

        base = resolve_model_path(
            self.spec.model,
            self.spec.task,
            seed=self.spec.trainer.seed,
            store_endpoint=self.spec.store.endpoint_url,
            caller=components.TRAINER,
        )
        self._load_policy(base)
        self.settings = UpdateSettings.of(
            self.spec.trainer,
            self.spec.sampling.temperature,
            self.tokenizer.pad_token_id,
            None if self.sharded else self.precision.compute_dtype,  # FSDP's own policy casts when sharded
        )

        self.version = 0
        self.saved_step = 0  # the step of the last saved state
        self.step_done = 0  # the step whose weights the model holds (announced with each version)
        self.pending = Commit()  # what the steps since then trained (rank 0), committed at the next save
        self.last_record: dict | None = None
        self.last_reward: float | None = None
        self.split = StepSplit()  # each step's record says where its seconds went (split.py)
        self.laps = self.split.laps
        self.publishing = VersionPublishing(ctx, self.store, self.window, self.split)  # rank 0 alone uses it

        self.reader = BatchReader(ctx, self.window, self.laps, record_outcomes=self.ranks.is_lead)
        self.recorder = StepRecorder(self.spec.task.type == "mixture", self.reader.outcomes)
        self.evaluator = Evaluator(self.spec, base) if self.spec.eval and self.ranks.is_lead else None  # spec.eval

    def _load_policy(self, base: Path) -> None:
        """The policy, its optimizer and schedule, and the KL reference on this rank (models.py)."""
        m = load_rank_models(self.spec, base, self.ranks.world)
        self.precision, self.device, self.sharded = m.precision, m.device, m.sharded
        self.model, self.tokenizer, self.prefill, self.lora = m.model, m.tokenizer, m.prefill, m.lora
        self.optimizer, self.scheduler, self.reference = m.optimizer, m.scheduler, m.reference
        if self.ranks.world > 1:
            log.info(
                "rank %d of %d, %s", self.ranks.rank, self.ranks.world, "FSDP-sharded" if self.sharded else "replicated"
            )

    def resume(self) -> int:
        """Restore the saved state if there is one (see state.py); return the next step to take."""
        state = load_state(self.store, self.ctx.run_name)  # every rank reads it
        if state is not None:
            load_checkpoint(self.store, state["checkpoint"], self.model, self.optimizer)
            self.scheduler.load_state_dict(state["scheduler"])
            self.version = state["version"]
            self.saved_step = self.step_done = state["step"]
        if self.ranks.is_lead:  # versions published after the state came from weights lost with the crash
            self.version = resume_version(self.store, self.ctx.run_name, self.version)
        self.version = broadcast(self.version, self.ranks)

        weights = self.version_state()  # every rank: a collective under FSDP
        if self.ranks.is_lead:
            self.publish(weights)  # idempotent for a version already in the store; announces it again
            self.records.forget_after(self.saved_step)  # those steps are trained again
        if state is None:
            return 1

        if self.ranks.is_lead:
            self.commit(Commit.from_dict(state["commit"]))
            if state.get("record") and self.records.last_step() < state["step"]:
                self.records.append(state["record"])  # the crash came between saving the step and recording it
        log.info("resumed after step %d at version %d", state["step"], self.version)
        return state["step"] + 1

    def run(self, steps: int) -> None:
        """Take the steps after the saved state's up to step `steps` (every rank), or stop early when told to."""
        for step in range(self.resume(), steps + 1):
            if not self.take_step(step, last=step == steps):
                break
        self.publishing.wait()  # a stopped run's last version too

    def take_step(self, step: int, last: bool) -> bool:
        """Step `step` (every rank; `last`: the run's last): read and share the batch, update, then rank 0 records,
        saves when due and publishes. False when stopped before the step (what was trained is saved first)."""
        laps = self.laps
        self.split.begin()
        batch = self.read_batch() if self.ranks.is_lead else Batch.empty()
        # The others wait for that read outside any collective: it may take longer than a collective may.
        lead_at(f"step-{step}", self.ranks, done=f"step-{step - 1}")
        await_lead(f"step-{step}", self.ranks)
        with laps.part("broadcast"):
            stopping = broadcast(self.ctx.stop.is_set(), self.ranks)
        if stopping:
            log.info("stopping before step %d; %d unacknowledged groups will be redelivered", step, len(batch.groups))
            if self.saved_step < step - 1:
                self.save(step - 1)  # what was trained since the last save is kept, not trained again
            return False

        if self.ranks.is_lead:  # the batch is held: the next step trains from one version newer
            held = len(batch.ack) + len(self.pending.message_ids)
            with laps.part("demand"):
                self.reader.set_demand(self.window.oldest(self.version + 1), self.spec.trainer.batch_size, held)
        with laps.part("broadcast"):
            groups = broadcast(batch.groups, self.ranks)

        stats = self.step(groups)
        lags = [self.version - g.policy_version for g in groups]
        self.version += 1
        self.step_done = step
        self.last_reward = stats["reward_mean"]

        # The weights to publish on rank 0; every rank joins (a collective under FSDP).
        with laps.part("gather"):
            model_state = self.version_state()
        if not self.ranks.is_lead:
            if self.save_due(step, last):
                self.save(step)
            return True
        self.finish_step(step, last, batch, stats, lags, model_state)
        return True

    def version_state(self) -> dict:
        """What a version publishes, on rank 0's CPU: the whole weights, or with LoRA the adapters alone (the base
        is frozen and every worker holds it). Every rank calls it."""
        if self.lora is not None:
            return full_model_state(self.model, trainable_only=True)
        return full_model_state(self.model, dtype=self.precision.publish_dtype)  # no fp32 copy of bf16 masters

    def read_batch(self) -> Batch:
        """Rank 0: the batch of the step taken while holding `self.version` (batches.py)."""
        return self.reader.collect(self.version, self.pending)

    def step(self, groups: list[RolloutGroup]) -> dict:
        """One GRPO update on `groups` (on every rank); returns its statistics."""
        stats = grpo_update(self.prefill, self.optimizer, groups, self.settings, self.reference, self.ranks, self.laps)
        with self.laps.part("optimizer"):
            stats["learning_rate"] = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
        return stats

    def finish_step(self, step: int, last: bool, batch: Batch, stats: dict, lags: list[int], model_state: dict) -> None:
        """Rank 0, after the update of step `step` on `batch` (`stats`, the groups' `lags` behind the version
        trained): its record, held as pending; the resume state when due; the new version `model_state`
        published; then the record, complete, appended to metrics.jsonl."""
        laps = self.laps
        with laps.part("stats"), self.ctx.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.ctx.keys.stats)
            pipe.hgetall(self.ctx.keys.repeats)
            run_stats, repeats = cast(list[dict[bytes, bytes]], pipe.execute())
        with laps.part("record"):
            hashes = {"stats": run_stats, "repeats": repeats}
            record = self.recorder.record(step, self.version, stats, batch, lags, hashes)
            self.pending.add(record["rollout_ids"], [group_digest(g) for g in batch.groups], self.version, batch.ack)
            self.last_record = record

        if self.save_due(step, last):
            self.save(step)  # before the version is published: a restart never finds it newer than the state
        self.publish(model_state, final=last)

        record.update(wall_seconds=time.monotonic() - self.recorder.started)
        if self.evaluator:
            with laps.part("eval"):
                record.update(self.evaluator.take(wait=last, stop=self.ctx.stop))
        record.update(self.split.end())  # the step ends here; writing its record is the next one's first part
        with laps.part("record_write"):
            self.records.append(record)
            log.info(
                "step %d version %d reward %.3f staleness %.2f",
                step,
                self.version,
                stats["reward_mean"],
                record["staleness_mean"],
            )

    def save_due(self, step: int, last: bool) -> bool:
        """Whether the resume state is saved after step `step`: every checkpointEvery steps, and at the last."""
        return step % self.spec.trainer.checkpoint_every == 0 or last

    def save(self, step: int) -> None:
        """Save the resume state of `step` (every rank), then commit what the steps since the last save trained."""
        with self.laps.part("resume_save"):
            key = save_checkpoint(self.store, self.ctx.run_name, step, self.model, self.optimizer)
            self.saved_step = step
            if not self.ranks.is_lead:
                return
            save_state(
                self.store,
                self.ctx.run_name,
                step=step,
                version=self.version,
                checkpoint=key,
                scheduler=self.scheduler,
                commit=self.pending,
                record=self.last_record,
            )
        with self.laps.part("ack"):
            self.commit(self.pending)
        self.pending = Commit()

    def commit(self, commit: Commit) -> None:
        """Record `commit`'s groups (content digests) as trained and acknowledge its messages (idempotent)."""
        keys, r = self.ctx.keys, self.ctx.client
        with r.pipeline(transaction=True) as pipe:
            if commit.digests:
                pipe.zadd(keys.trained, commit.digests)
                pipe.zremrangebyrank(keys.trained, 0, -TRAINED_DIGESTS_KEPT - 1)
            if commit.message_ids:
                pipe.xack(keys.verified, keys.trainer_group, *commit.message_ids)
                pipe.xdel(keys.verified, *commit.message_ids)
            pipe.execute()

    def publish(self, model_state: dict, final: bool = False) -> None:
        """Write `model_state` (version_state) as `self.version`'s files: the whole weights, or with LoRA the adapter
        alone (lora.py); hand them to the background publish (publishing.py), and at the run's last version wait
        until it is stored and announced."""
        laps = self.laps
        with laps.part("publish_save"):
            tmp = Path(tempfile.mkdtemp(prefix="rlfleet-publish-"))
        try:
            with laps.part("publish_save"):
                if self.lora:
                    self.lora.save(model_state, tmp)
                else:
                    save_model_dir(
                        self.model,
                        self.tokenizer,
                        tmp,
                        state_dict={
                            k: v.to(self.precision.publish_dtype)  # the run's dtype, whatever the masters are
                            for k, v in publishable_weights(self.model, model_state).items()
                        },
                    )
            if self.evaluator:  # evaluates the version when due, on a copy (publishing moves the files), in a thread
                with laps.part("eval"):
                    self.evaluator.offer(self.version, tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

        announcement: dict[str, float] = {"version": self.version, "step": self.step_done}
        if self.last_reward is not None:  # shown by the operator's status and printer columns
            announcement["reward"] = self.last_reward
        self.publishing.hand_off(self.version, tmp, self.lora.section if self.lora else None, announcement)
        if final:
            with laps.part("publish_wait"):
                self.publishing.wait()
