"""Where a rollout worker's seconds go: `rlfleet_rollout_seconds_total{part}` (rlfleet/wire/timing.py `Laps`).

Parts: `generate` (the engine call sampling a batch of groups), `proofs` (building the TOPLOC proofs of
their hidden states), `reward` (scoring the completions with the task's reward), `send` (XADD to the
inbox or POST to the ingest, its hold-backs included), `load` (loading a version's weights into the
engine: the first one, and each swap between batches) and `fetch` (downloading a version through the
relays: hashes, signature, delta rebuild). `fetch` runs in the version follower's thread while the
main loop generates, so the parts may add up to more than the wall time; the seconds paused by
backpressure are `rlfleet_rollout_paused_seconds_total{reason}`. Every part exists at 0 from the start.
"""

from __future__ import annotations

from prometheus_client import Counter

from rlfleet.wire.timing import Laps, lap_counter

PARTS = ("generate", "proofs", "reward", "send", "load", "fetch")
SECONDS = Counter("rlfleet_rollout_seconds_total", "Seconds spent by part of the worker's work", ["part"])
for _part in PARTS:
    SECONDS.labels(_part)
LAPS = Laps(PARTS, on_lap=lap_counter(SECONDS))
