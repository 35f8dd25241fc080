"""Reading a step's batch from the verified stream: step 1 of the trainer's loop (main.py's docstring).

Rank 0 alone reads. A group read is acknowledged only when the step that holds it is committed (state.py);
until then it is pending. A group is dropped, and acknowledged with the step, when it is stale (its policy
version older than maxAsyncLevel behind the version being trained), a repeat of trained work (its content
digest in the trained set, in the steps not yet committed or in this batch), undecodable, or, with
skipZeroAdvantageGroups, one whose rewards are all equal. Every dropped rollout id is kept for the step's
audit trail. The demand the trainer writes (`set_demand`) is what lets workers pause rather than sample
groups that would arrive stale, and, through the share of the groups it reads that it keeps (`kept_share`), sample
enough that the groups it will drop as repeats do not leave its step waiting.
"""

from __future__ import annotations

import logging

from rlfleet.config import RLRunSpec
from rlfleet.fleet.prompt_filter import OutcomeRecorder
from rlfleet.fleet.window import AsyncWindow
from rlfleet.services.trainer.state import Commit
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import MessageError, RolloutGroup, group_digest, rewards_all_equal, stream_reply
from rlfleet.wire.timing import Laps

log = logging.getLogger("rlfleet.trainer")

# The share of the groups read that the trainer keeps, as workers see it: an exponential mean over steps
# (this weight on the newest step), counting only drops for content (repeats, equal rewards). Stale
# drops are left out: they come from sampling too far ahead, so counting them would make workers
# sample further ahead still. Never below the floor, so a run of repeats asks at most 1/floor times the need.
KEPT_SHARE_WEIGHT = 0.5
KEPT_SHARE_FLOOR = 0.1


class BatchReader:
    """The verified stream's side of the trainer (a base of main.Trainer, which sets these attributes)."""

    ctx: Context
    spec: RLRunSpec
    consumer: str
    version: int
    pending: Commit
    outcomes: OutcomeRecorder | None
    dropped_ids: dict[str, list[str]]
    read_groups: list[tuple[str, list[float]]]  # (task id, rewards) of every group the step read, dropped ones too
    _pending_cursor: bytes | str | None
    laps: Laps  # the step's parts (split.py): demand, wait, decode, dedup, outcomes
    kept_share: float  # running share of read groups kept (KEPT_SHARE_* below): what workers scale their demand by

    def collect(self) -> tuple[list[RolloutGroup], list[bytes], dict[str, int]]:
        """Block until batchSize fresh groups are held; return them, every message id to ack, and drop counts."""
        keys, r = self.ctx.keys, self.ctx.client
        want, oldest = self.spec.trainer.batch_size, self.oldest_trained(self.version)
        skip_flat = self.spec.trainer.skip_zero_advantage_groups
        batch: list[RolloutGroup] = []
        batch_digests: set[str] = set()
        ack: list[bytes] = []
        drops = {"stale": 0, "duplicate": 0, "malformed": 0, "zero_advantage": 0}
        self.dropped_ids = {"stale": [], "duplicate": [], "zero_advantage": []}  # the audit trail of drops
        self.read_groups = []
        laps = self.laps
        while len(batch) < want and not self.ctx.stop.is_set():
            with laps.part("demand"):
                self.set_demand(oldest, want - len(batch), len(ack) + len(self.pending.message_ids))
            # After a restart, first the messages this consumer read but never acknowledged, walked
            # once by id (reading pending entries from "0" again would return the same ones forever).
            start = self._pending_cursor or ">"
            with laps.part("wait"):
                resp = stream_reply(
                    r.xreadgroup(
                        keys.trainer_group, self.consumer, {keys.verified: start}, count=want - len(batch), block=500
                    )
                )
            if self._pending_cursor is not None:
                pending = [msg_id for _, entries in resp or [] for msg_id, _ in entries]
                self._pending_cursor = pending[-1] if pending else None
            read: list[RolloutGroup] = []
            for _, entries in resp or []:
                for msg_id, fields in entries:
                    with laps.part("decode"):  # and what was read noted
                        ack.append(msg_id)
                        try:
                            group = RolloutGroup.decode(fields)
                        except MessageError as exc:
                            log.error("undecodable verified message %s: %s", msg_id, exc)
                            drops["malformed"] += 1
                            continue
                        self.read_groups.append((group.task_id, [s.reward for s in group.samples]))
                        read.append(group)
                    if self.outcomes:
                        with laps.part("outcomes"):
                            self.outcomes.observe(group.prompt_ids, [s.reward for s in group.samples])
            with laps.part("dedup"):
                # One round trip for the whole read (ZMSCORE), not one per group: late in a run most groups
                # read are repeats, about 24 reads per step of 16.
                digests = [group_digest(g) for g in read]
                trained = r.zmscore(keys.trained, digests) if digests else []
                for group, digest, score in zip(read, digests, trained, strict=True):
                    self._admit(group, digest, score is not None, batch, batch_digests, oldest, skip_flat, drops)
        self.update_kept_share(len(batch), drops["duplicate"] + drops["zero_advantage"])
        return batch, ack, drops

    def update_kept_share(self, kept: int, dropped_for_content: int) -> None:
        """Fold one step's reads into `kept_share` (KEPT_SHARE_WEIGHT, KEPT_SHARE_FLOOR)."""
        if kept + dropped_for_content:
            share = kept / (kept + dropped_for_content)
            blended = (1 - KEPT_SHARE_WEIGHT) * self.kept_share + KEPT_SHARE_WEIGHT * share
            self.kept_share = max(KEPT_SHARE_FLOOR, blended)

    def _admit(
        self,
        group: RolloutGroup,
        digest: str,
        was_trained: bool,
        batch: list[RolloutGroup],
        batch_digests: set[str],
        oldest: int,
        skip_flat: bool,
        drops: dict[str, int],
    ) -> None:
        """Append `group` (content digest `digest`; `was_trained`: in the run's trained set) to `batch`, or count
        and record why it is dropped (the module docstring's reasons). `batch_digests`: the batch's digests."""
        if was_trained or digest in self.pending.digests or digest in batch_digests:
            drops["duplicate"] += 1
            self.dropped_ids["duplicate"].append(group.rollout_id)
        elif group.policy_version < oldest:
            drops["stale"] += 1
            self.dropped_ids["stale"].append(group.rollout_id)
        elif skip_flat and rewards_all_equal(group):
            drops["zero_advantage"] += 1
            self.dropped_ids["zero_advantage"].append(group.rollout_id)
        else:
            batch.append(group)
            batch_digests.add(digest)

    def oldest_trained(self, version: int) -> int:
        """The oldest policy version a step taken while holding `version` trains (maxAsyncLevel back)."""
        return AsyncWindow.of(self.spec).oldest(version)

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
