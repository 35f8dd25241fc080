"""How many groups a rollout worker's next batch may take (`room`, asked before each batch by
rlfleet/services/rollout/main.py's Worker), and the record that tells the pool's other workers what it is
sampling now.

The worker pauses while the inbox holds more than `maxPending` groups (the verifier deletes what it has
handled, so XLEN is the backlog; an ingest worker leaves this to the ingest), while its weights lag the newest
announced version by more than `maxAsyncLevel`, or while the trainer's demand is covered (`batch_full`,
`enough_queued`); it resumes by itself. A batch takes at most the room those checks leave (groups still
wanted, inbox slots), so it never overshoots the queue and goes stale in it.

The pool's sampling record (`keys.sampling`, a hash: worker id -> "groups deadline"). Every worker reads the
same demand, so without it two workers would each sample the groups still wanted, and the second half would
reach the trainer after its step had filled: stale, dropped after the verifier had checked them. Before a
batch a worker writes how many groups it expects to send from it, and deletes its field after its last send;
`room` counts the other workers' records as queued. The expectation is the batch's size times the worker's
running share of the groups it samples that it sends (`sent_share`: late in a run most groups sampled are
repeats of trained work, held back, rollout/repeats.py), and the worker sizes its own batch by the same share:
the groups still wanted divided by it, at most K. A record names a deadline (several batches' time ahead), so
the field of a worker that died mid-batch stops counting by itself; deadlines are in the Redis server's clock
(TIME, read in `room`'s round trip), so the workers' own clocks need not agree.
"""

from __future__ import annotations

import math
import time

import redis
from prometheus_client import Gauge

from rlfleet.fleet.window import AsyncWindow
from rlfleet.services.rollout.follower import VersionFollower
from rlfleet.wire.runtime import Context, announced_version

LAG = Gauge("rlfleet_rollout_version_lag", "Newest announced version minus loaded version")

# The share of sampled groups a worker sends, as an exponential mean over its batches (this weight on the newest),
# never below the floor: a worker whose every group is a repeat still expects some, and samples at most 1/floor
# times what is wanted.
SENT_SHARE_WEIGHT = 0.5
SENT_SHARE_FLOOR = 0.1
# A record's deadline: this many times the worker's last batch ahead of now, and never less than the floor.
RECORD_BATCHES = 4
RECORD_FLOOR_SECONDS = 10.0


def record_value(groups: float, deadline: float) -> str:
    """A worker's field in the sampling record: the groups it expects to send, and until when that holds."""
    return f"{groups:.3f} {deadline:.3f}"


def others_sampling(record: dict[bytes, bytes], worker_id: str, now: float) -> float:
    """The groups the other workers of `record` (HGETALL of `keys.sampling`) expect to send, counting only records
    whose deadline is after `now` (the Redis server's clock). A field that does not parse counts nothing."""
    own = worker_id.encode()
    total = 0.0
    for worker, value in record.items():
        if worker == own:
            continue
        try:
            groups, deadline = (float(x) for x in value.split())
        except ValueError:
            continue
        if deadline > now:
            total += groups
    return total


class Backpressure:
    """A worker's backpressure and its sampling record (the module docstring); main.Worker asks it before each batch.

    A worker behind an ingest (`reader` None) reads no Redis: only its version lag pauses it, from what its
    `follower` saw announced; the ingest bounds its backlog."""

    def __init__(
        self, ctx: Context, worker_id: str, reader: redis.Redis | None, follower: VersionFollower, max_pending: int
    ):
        self.ctx, self.spec, self.worker_id = ctx, ctx.bundle.run.spec, worker_id
        self.reader, self.follower, self.max_pending = reader, follower, max_pending
        self.window = AsyncWindow.of(self.spec)
        self.sent_share = 1.0  # running share of sampled groups sent (SENT_SHARE_*)
        self.batch_seconds = 0.0  # wall time of the last batch, sampling to last send
        self.clock_offset = 0.0  # the Redis server's clock less this machine's, as `room` last read it
        self._batch_started = 0.0

    def room(self, loaded_version: int, in_flight: int) -> tuple[str | None, int]:
        """(why generation should wait now, or None; how many groups the next batch may take, at most K =
        `in_flight`), for a worker whose engine holds `loaded_version`.
        An ingest worker's backlog is the ingest's to refuse. The room is what keeps each reason below
        from arising within one batch, so a batch never overshoots the queue (and goes stale in it).

        - `version_lag`: the engine is more than maxAsyncLevel versions behind the newest announced one;
        - `batch_full`: the trainer already holds the batch of the last step that could train this
          version (its demand's `oldest`), so a group sampled now would arrive stale; at maxAsyncLevel 0
          that is every moment between a batch filling and the next version loading;
        - `enough_queued`: the groups queued for the trainer and not yet taken by it (the inbox and the
          verified stream, less the entries it holds, and what the other workers are sampling) cover its
          current step's `need` and, when this version will still be trained one step later (newer than
          `oldest`), one batch more, both divided by the share `kept` of read groups the trainer keeps
          (trainer/batches.py): what keeps the trainer fed while it trains; anything deeper would only wait
          and go stale;
        - `backlog`: the inbox holds more than the pool's maxPending.
        The room left is what is still wanted divided by `sent_share` (the module docstring), at most K."""
        if self.reader is None:  # behind an ingest
            newest = self.follower.announced or 0
            LAG.set(newest - loaded_version)
            return ("version_lag", 0) if self.window.is_stale(loaded_version, newest) else (None, in_flight)
        keys = self.ctx.keys
        with self.reader.pipeline(transaction=False) as pipe:  # one round trip, every 20 ms while paused
            pipe.xrevrange(keys.policy, count=1)
            pipe.hmget(keys.demand, ["oldest", "need", "held", "kept"])
            pipe.xlen(keys.rollouts)
            pipe.xlen(keys.verified)
            pipe.hgetall(keys.sampling)
            pipe.time()
            newest_entry, (oldest, need, held, kept), queued, verified, record, (seconds, micros) = pipe.execute()
        now = seconds + micros / 1e6
        self.clock_offset = now - time.time()
        newest = announced_version(newest_entry) or 0
        LAG.set(newest - loaded_version)
        if self.window.is_stale(loaded_version, newest):
            return "version_lag", 0
        if oldest is not None and loaded_version < int(oldest):
            return "batch_full", 0
        room = in_flight
        if need is not None:
            ahead = queued + verified - int(held or 0) + others_sampling(record, self.worker_id, now)
            later = loaded_version > int(oldest)  # still trainable once the trainer's step advances
            # In groups read: the trainer keeps a share `kept` of them (repeats of trained work dropped).
            wanted = (int(need) + later * self.spec.trainer.batch_size) / float(kept or 1) - ahead
            if wanted <= 0:
                return "enough_queued", 0
            room = min(room, math.ceil(wanted / self.sent_share))
        if queued > self.max_pending:
            return "backlog", 0
        return None, min(room, self.max_pending + 1 - queued)

    def begin_batch(self, groups: int) -> None:
        """Record in the pool's sampling record that a batch of `groups` is being sampled (no record behind an
        ingest: its workers read no demand)."""
        self._batch_started = time.monotonic()
        if self.reader is None:
            return
        ttl = max(RECORD_FLOOR_SECONDS, RECORD_BATCHES * self.batch_seconds)
        expected = groups * self.sent_share
        value = record_value(expected, time.time() + self.clock_offset + ttl)
        self.ctx.client.hset(self.ctx.keys.sampling, self.worker_id, value)

    def end_batch(self, groups: int, sent: int) -> None:
        """The batch begun with `groups` is over and `sent` of them were sent: the record is deleted, the sent share
        and the batch time updated."""
        self.batch_seconds = time.monotonic() - self._batch_started
        if groups:
            blended = (1 - SENT_SHARE_WEIGHT) * self.sent_share + SENT_SHARE_WEIGHT * sent / groups
            self.sent_share = max(SENT_SHARE_FLOOR, blended)
        if self.reader is not None:
            self.ctx.client.hdel(self.ctx.keys.sampling, self.worker_id)
