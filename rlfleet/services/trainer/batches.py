"""Reading a step's batch from the verified stream: step 1 of the trainer's loop (main.py's docstring).

Rank 0 alone reads. A group read is acknowledged only when the step that holds it is committed (state.py);
until then it is pending. A group is dropped, and acknowledged with the step, when it is stale (its policy
version older than maxAsyncLevel behind the version being trained), a repeat of trained work (its content
digest in the trained set, in the steps not yet committed or in this batch), undecodable, or, with
skipZeroAdvantageGroups, one whose rewards are all equal. Every dropped rollout id is kept for the step's
audit trail. The demand the trainer writes (`set_demand`) is what lets workers pause rather than sample
groups that would arrive stale, and, through the share of the groups it reads that it keeps (`kept_share`),
sample enough that the groups it will drop as repeats do not leave its step waiting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rlfleet.fleet.prompt_filter import OutcomeRecorder
from rlfleet.fleet.window import AsyncWindow
from rlfleet.services.trainer.metrics import DROP_REASONS
from rlfleet.services.trainer.state import Commit
from rlfleet.wire.runtime import Context, ensure_group
from rlfleet.wire.streams import MessageError, RolloutGroup, group_digest, rewards_all_equal, stream_reply
from rlfleet.wire.timing import Laps

log = logging.getLogger("rlfleet.trainer")

# The share of the groups read that the trainer keeps, as workers see it: an exponential mean over steps
# (this weight on the newest step), counting only drops for content (repeats, equal rewards). Stale
# drops are left out: they come from sampling too far ahead, so counting them would make workers
# sample further ahead still. Never below the floor, so a run of repeats asks at most 1/floor times the need.
KEPT_SHARE_WEIGHT = 0.5
KEPT_SHARE_FLOOR = 0.1


DROPS_RECORDED = ("stale", "duplicate", "zero_advantage")  # the reasons whose rollout ids the step record lists


@dataclass(frozen=True)
class Batch:
    """One step's read of the verified stream (rank 0's; the other ranks hold `Batch.empty()`)."""

    groups: list[RolloutGroup]  # the batchSize groups to train, in the order read
    ack: list[bytes]  # every message id read, kept or dropped: acknowledged when the step is committed
    drops: dict[str, int]  # how many groups were dropped, by reason (metrics.DROP_REASONS)
    dropped_ids: dict[str, list[str]]  # the rollout ids dropped, by reason (DROPS_RECORDED): the step's audit trail
    read_groups: list[tuple[str, list[float]]]  # (task id, rewards) of every group read, dropped ones too

    @classmethod
    def empty(cls) -> Batch:
        return cls([], [], {}, {}, [])


class BatchReader:
    """The verified stream's side of the trainer: reads a step's batch as consumer `consumer` of the trainer's
    group, drops what the module docstring says, and tells the workers what it still wants (`set_demand`).

    It owns what carries over from one read to the next: the cursor over the messages this consumer held
    unacknowledged when it started, the share of the groups read that it keeps, and the online filter's
    outcome recorder. What the trainer has trained but not yet committed (its `Commit`) is the trainer's,
    read here to drop repeats of it and to count what is held."""

    def __init__(self, ctx: Context, window: AsyncWindow, laps: Laps, record_outcomes: bool = True):
        """A reader for the run of `ctx` that drops what is older than `window` and times its parts in `laps`
        (the step's: demand, wait, decode, dedup, outcomes; split.py). Every rank makes one, so every rank makes
        sure the trainer's consumer group exists; only rank 0 reads, and only it records outcomes
        (`record_outcomes`) for the online prompt filter (spec.sampling.onlineFilter, fleet/prompt_filter.py)."""
        self.ctx = ctx
        self.window = window
        self.laps = laps
        self.consumer = "trainer-0"
        spec = ctx.bundle.run.spec
        self.batch_size = spec.trainer.batch_size
        self.skip_flat = spec.trainer.skip_zero_advantage_groups

        # First the messages this consumer read but never acknowledged (a restart), walked once by id, then new
        # ones (">"); reading pending entries from "0" again would return the same ones forever.
        self.pending_cursor: bytes | str | None = "0"
        self.kept_share = 1.0  # running share of read groups kept (KEPT_SHARE_*): nothing read yet

        ensure_group(ctx.client, ctx.keys.verified, ctx.keys.trainer_group)
        f = spec.sampling.online_filter  # the trainer records outcomes; workers skip what it retires
        self.outcomes = OutcomeRecorder(f, ctx.client, ctx.keys) if f and record_outcomes else None

    def collect(self, version: int, pending: Commit) -> Batch:
        """Block until batchSize fresh groups are held for the step taken while holding `version`, or until stopped.
        `pending`: what the steps since the last save trained, not yet committed (repeats of it are dropped)."""
        want, oldest = self.batch_size, self.window.oldest(version)
        batch = Batch([], [], dict.fromkeys(DROP_REASONS, 0), {reason: [] for reason in DROPS_RECORDED}, [])
        batch_digests: set[str] = set()
        while len(batch.groups) < want and not self.ctx.stop.is_set():
            with self.laps.part("demand"):
                self.set_demand(oldest, want - len(batch.groups), len(batch.ack) + len(pending.message_ids))
            read = self._read(want - len(batch.groups), batch)
            with self.laps.part("dedup"):
                # One round trip for the whole read (ZMSCORE), not one per group: late in a run most groups
                # read are repeats, about 24 reads per step of 16.
                digests = [group_digest(g) for g in read]
                trained = self.ctx.client.zmscore(self.ctx.keys.trained, digests) if digests else []
                for group, digest, score in zip(read, digests, trained, strict=True):
                    repeat = score is not None or digest in pending.digests or digest in batch_digests
                    if self._admit(group, repeat, oldest, batch):
                        batch_digests.add(digest)
        self.update_kept_share(len(batch.groups), batch.drops["duplicate"] + batch.drops["zero_advantage"])
        return batch

    def _read(self, count: int, batch: Batch) -> list[RolloutGroup]:
        """Up to `count` groups from the stream (waiting up to half a second), their message ids added to
        `batch.ack` and what they are to `batch.read_groups`; an undecodable one is counted as malformed."""
        keys, r = self.ctx.keys, self.ctx.client
        start = self.pending_cursor or ">"
        with self.laps.part("wait"):
            resp = stream_reply(
                r.xreadgroup(keys.trainer_group, self.consumer, {keys.verified: start}, count=count, block=500)
            )
        if self.pending_cursor is not None:
            pending = [msg_id for _, entries in resp or [] for msg_id, _ in entries]
            self.pending_cursor = pending[-1] if pending else None
        read: list[RolloutGroup] = []
        for _, entries in resp or []:
            for msg_id, fields in entries:
                with self.laps.part("decode"):  # and what was read noted
                    batch.ack.append(msg_id)
                    try:
                        group = RolloutGroup.decode(fields)
                    except MessageError as exc:
                        log.error("undecodable verified message %s: %s", msg_id, exc)
                        batch.drops["malformed"] += 1
                        continue
                    batch.read_groups.append((group.task_id, [s.reward for s in group.samples]))
                    read.append(group)
                if self.outcomes:
                    with self.laps.part("outcomes"):
                        self.outcomes.observe(group.prompt_ids, [s.reward for s in group.samples])
        return read

    def _admit(self, group: RolloutGroup, repeat: bool, oldest: int, batch: Batch) -> bool:
        """Append `group` to `batch.groups` and return True, or count and record why it is dropped (the module
        docstring's reasons) and return False. `repeat`: its content was trained, is pending or is in the batch."""
        if repeat:
            reason = "duplicate"
        elif group.policy_version < oldest:
            reason = "stale"
        elif self.skip_flat and rewards_all_equal(group):
            reason = "zero_advantage"
        else:
            batch.groups.append(group)
            return True
        batch.drops[reason] += 1
        batch.dropped_ids[reason].append(group.rollout_id)
        return False

    def update_kept_share(self, kept: int, dropped_for_content: int) -> None:
        """Fold one step's reads into `kept_share` (KEPT_SHARE_WEIGHT, KEPT_SHARE_FLOOR)."""
        if kept + dropped_for_content:
            share = kept / (kept + dropped_for_content)
            blended = (1 - KEPT_SHARE_WEIGHT) * self.kept_share + KEPT_SHARE_WEIGHT * share
            self.kept_share = max(KEPT_SHARE_FLOOR, blended)

    def set_demand(self, oldest: int, need: int, held: int) -> None:
        """Tell the workers what this trainer still wants (`keys.demand`): the oldest policy version it
        will still train, how many groups its current step lacks, how many entries of the verified
        stream it holds uncommitted (so a worker can count the groups queued beyond them), and the share
        of what it reads that it keeps (`kept`, so a worker counts the queue and the need in groups it
        will keep). A worker holding an older version, or seeing enough queued for what is wanted, pauses
        instead of sampling groups that would arrive stale (rollout/main.py `Worker.room`). Written at every
        start, so a trainer resumed from an older state never leaves workers waiting for a version it
        will not publish."""
        kept = f"{self.kept_share:.4f}"
        self.ctx.client.hset(self.ctx.keys.demand, mapping={"oldest": oldest, "need": need, "held": held, "kept": kept})
