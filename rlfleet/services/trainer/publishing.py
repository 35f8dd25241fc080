"""Rank 0's publishing of policy versions, beside the next step rather than on its path.

A version is published in two halves:
  on the step's path   its files are written from the gathered weights (`publish_save`: safetensors and
                       tokenizer, or with LoRA the adapter) into a directory of their own, and a due
                       held-out evaluation copies them (`eval`). Once written they no longer depend on the
                       model, so the next optimizer step may change the weights;
  beside the next step a thread publishes that directory (rlfleet/versions/publish.py: the delta against
                       the previous version, every file's and shard's sha256, the signature, the store
                       writes, manifest last), deletes versions no consumer can still ask for, and
                       announces the version on the `policy` stream.
At 7B the second half is tens of seconds to minutes of hashing and uploading that a step would otherwise
wait for (issue "Real sizes I"); its seconds are `background_split` of each step's record (split.py), never
in `split`.

Invariants:
  - versions reach the store and the stream in order, one publish in flight at most: handing off version N
    first waits for N-1's (the step's `publish_wait` part; non-zero only when publishing is slower than a
    step), and the delta base is always the previous version;
  - the resume state is saved before its version is handed off (Trainer.finish_step), so a restart never
    finds a stored version newer than its state; a crash mid-publish leaves no manifest, and the restart
    publishes its state's version again (Trainer.resume);
  - a publish that fails raises PublishFailed in the trainer's thread at the next hand-off or wait, so the
    trainer stops as it did when publishing was synchronous, one step later;
  - the run's last version is stored and announced before the trainer returns (`wait`).
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from pathlib import Path

from rlfleet.fleet.window import AsyncWindow
from rlfleet.services.trainer.metrics import VERSION
from rlfleet.services.trainer.split import StepSplit
from rlfleet.versions.checkpoint import prune_versions
from rlfleet.versions.manifest import AdapterSection
from rlfleet.versions.publish import PolicyPublisher
from rlfleet.versions.signing import run_signer
from rlfleet.versions.store import CheckpointStore
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import encode_json

log = logging.getLogger("rlfleet.trainer")


class PublishFailed(RuntimeError):
    """A version's background publish failed; the cause is chained."""


class VersionPublishing:
    """Publishes handed-off version directories in order, one at a time, in a thread of its own (module docstring)."""

    def __init__(self, ctx: Context, store: CheckpointStore, window: AsyncWindow, split: StepSplit):
        self.ctx, self.store, self.window = ctx, store, window
        self.shardcast = ctx.bundle.run.spec.shardcast
        self.step_laps, self.laps = split.laps, split.background  # the step's parts; the publishes' (split.py)
        self._publisher: PolicyPublisher | None = None  # made at the first publish (a missing key fails that one)
        self._jobs: queue.SimpleQueue[tuple[int, Path, AdapterSection | None, dict]] = queue.SimpleQueue()
        self._idle = threading.Event()  # no publish in flight
        self._idle.set()
        self._thread: threading.Thread | None = None  # started at the first hand-off, lives as long as the process
        self._failure: tuple[int, BaseException] | None = None

    def hand_off(self, version: int, files: Path, adapter: AdapterSection | None, announcement: dict) -> None:
        """Publish `files` (a directory this object now owns and deletes) as `version`, then announce
        `announcement`, in the background once the previous publish is done."""
        with self.step_laps.part("publish_wait"):
            try:
                self.wait()
            except BaseException:
                shutil.rmtree(files, ignore_errors=True)
                raise
            # One thread for every version, not one each: starting a thread waits for it to run, and on a loaded
            # machine that wait is a step's to pay.
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="publish", daemon=True)
                self._thread.start()
            self._idle.clear()
            self._jobs.put((version, files, adapter, announcement))

    def wait(self) -> None:
        """Until the publish in flight is done; PublishFailed if it (or one before it) failed."""
        self._idle.wait()
        if self._failure is not None:
            version, cause = self._failure
            raise PublishFailed(f"publishing version {version} failed: {cause}") from cause

    def _serve(self) -> None:
        while True:
            version, files, adapter, announcement = self._jobs.get()
            try:
                self._publish(version, files, adapter, announcement)
            except BaseException as exc:  # raised in the trainer's thread by the next hand_off or wait
                log.exception("publishing version %d failed", version)
                self._failure = (version, exc)
            finally:
                self._idle.set()

    def _publish(self, version: int, files: Path, adapter: AdapterSection | None, announcement: dict) -> None:
        laps = self.laps
        try:
            self._publisher = self._publisher or PolicyPublisher(
                self.store,
                self.ctx.run_name,
                self.shardcast.deltas,
                run_signer(self.shardcast),
                self.shardcast.shard_size_bytes,
                laps=laps,
            )
            self._publisher.publish(version, files, adapter)
        finally:  # timed: removing what the publisher left took 2-18 ms a step here, 5 % of a short step
            with laps.part("publish_store"):
                shutil.rmtree(files, ignore_errors=True)

        # Versions older than any consumer may still ask for are deleted, so the store stays bounded.
        keep = max(self.shardcast.keep_versions, self.window.versions_to_keep())
        with laps.part("prune"):
            prune_versions(self.store, self.ctx.run_name, keep)
        with laps.part("announce"):  # redis-py asks for Dict[FieldT, EncodableT], invariant (Mapping would pass)
            announced = {**announcement, "time": time.time()}
            self.ctx.client.xadd(self.ctx.keys.policy, encode_json(announced), maxlen=1000, approximate=True)  # type: ignore[arg-type]
        VERSION.set(version)
