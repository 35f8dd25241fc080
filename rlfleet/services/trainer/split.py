"""Every second of a trainer step, by part: `step_seconds` and `split` of each metrics.jsonl record.

A step's interval runs from the end of the previous step's (the moment its record was complete, just
before it was appended) to the moment this step's record is complete; the first step's starts when it
begins waiting for groups. So consecutive steps tile the run: whatever runs between two steps (writing
the previous record, the log line) is in the next one. Its parts are timed at the code's own boundaries
(rlfleet/wire/timing.py `Laps`, exclusive nesting) and are never computed as a remainder: what no part
covers (a few lines of loop and arithmetic) is the gap between step_seconds and the parts' sum.

The three coarse fields older readers use are sums of parts: wait_seconds (getting the batch),
compute_seconds (the GRPO update), publish_seconds (what the step spends after the update to hand its
version off: gathering the weights, the bookkeeping, the resume-state save, writing the version's files,
and waiting for the previous version's publish); `record_write` and `eval` are in none of them.

The rest of a publish (delta, hashes, signature, store writes, prune, announcement) runs in a thread
beside the next step (publishing.py): its parts are `background_split`, the seconds that thread worked
during the step, outside `split` and `step_seconds` (they overlap the step's own parts).
"""

from __future__ import annotations

import time

from rlfleet.wire.timing import Laps

# Part -> what it times, in the order a step runs them.
SPLIT_PARTS = {
    "record_write": "writing the previous step's record (metrics.jsonl, /metrics, trackers) and its log line",
    "demand": "writing the trainer's demand for workers (set_demand, a Redis HSET per read)",
    "wait": "blocked in XREADGROUP on the verified stream, waiting for verified groups",
    "decode": "decoding the messages read into groups (and noting what was read)",
    "dedup": "the drop checks: content digests, trained-set lookups, stale and zero-advantage checks",
    "outcomes": "recording each group's outcome for the online prompt filter (spec.sampling.onlineFilter)",
    "broadcast": "sending the stop flag and the batch to the other ranks (0 with one rank)",
    "prepare": "building the batch's rows, tensors and micro-batches",
    "forward_backward": "the forwards (reference and off-policy ones included), backwards and gradient all-reduce",
    "optimizer": "gradient clipping, the AdamW step and the learning-rate schedule",
    "gather": "the weights to publish, or with LoRA the adapters alone (full_model_state; a collective under FSDP)",
    "stats": "reading the run's verifier counts from Redis (HGETALL)",
    "record": "building the step record and the pending commit (digests, means)",
    "resume_save": "saving the resume state when due (checkpointEvery): weights, optimizer, scheduler, step",
    "ack": "with a save: recording the trained digests and acknowledging the groups (ZADD, XACK)",
    "publish_save": "writing the new version's files (safetensors, tokenizer; with LoRA the adapter)",
    "eval": "spec.eval: copying a due version for the evaluator; at the last step, waiting for its score",
    "publish_wait": (
        "handing the version to the publishing thread, after waiting for the previous version's publish (publishing"
        " slower than a step); at the last step, waiting for this version's"
    ),
}
# Part -> what it times, of the publishes that run beside the steps (publishing.py), in the order one runs them:
# each record's `background_split` holds their seconds during that step, which overlap its `split`.
BACKGROUND_PARTS = {
    "publish_delta": "encoding the version as a delta against the previous one (hashes included)",
    "publish_hash": "the manifest's file entries (sha256 of each file and shard)",
    "publish_sign": "signing the manifest",
    "publish_store": (
        "store I/O of the publish: existence check, uploads, the manifest, keeping the files as base, removing the"
        " publish directory"
    ),
    "prune": "deleting versions no consumer can still ask for from the store",
    "announce": "announcing the version on the policy stream (XADD)",
}
WAIT_PARTS = ("demand", "wait", "decode", "dedup", "outcomes", "broadcast")
COMPUTE_PARTS = ("prepare", "forward_backward", "optimizer")
PUBLISH_PARTS = ("gather", "stats", "record", "resume_save", "ack", "publish_save", "publish_wait")


class StepSplit:
    """The parts of the step in progress (`laps`, shared with whatever the step calls) and its start."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.laps = Laps(tuple(SPLIT_PARTS), clock=clock)
        self.background = Laps(tuple(BACKGROUND_PARTS), clock=clock)  # publishing.py's thread
        self.started: float | None = None

    def begin(self) -> None:
        """At the top of each step: the first one starts now (what ran before it, e.g. resuming, is not a step's)."""
        if self.started is None:
            self.started = self.clock()
            self.laps.take()
            self.background.take()

    def end(self) -> dict:
        """The step's timing fields (its record is complete); the next step starts now."""
        assert self.started is not None, "end() before begin()"
        now = self.clock()
        step_seconds, self.started = now - self.started, now
        split = self.laps.take()
        return {
            "step_seconds": step_seconds,
            "split": split,
            "background_split": self.background.take(),
            "wait_seconds": sum(split[p] for p in WAIT_PARTS),
            "compute_seconds": sum(split[p] for p in COMPUTE_PARTS),
            "publish_seconds": sum(split[p] for p in PUBLISH_PARTS),
        }
