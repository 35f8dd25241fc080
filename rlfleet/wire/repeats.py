"""The run's `repeats` hash: groups workers sampled and did not send, their content being work the trainer already
trained (rlfleet/services/rollout/repeats.py). Per task source (tasks/mixture.py; "" for a single-source run) it
holds `groups|SOURCE`, `samples|SOURCE` and `reward_sum|SOURCE`, only ever incremented by workers; the trainer
takes the increase since its last look at each step and counts it in that step's sampled reward (what the
policy samples, repeats included), so the figure means what it did when the trainer read every repeat itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from rlfleet.wire.streams import RolloutGroup, RunKeys


@dataclass(frozen=True)
class Tally:
    """Groups, their samples and the samples' summed reward (of one task source's repeats, or of what a step read)."""

    groups: int = 0
    samples: int = 0
    reward_sum: float = 0.0


def record_repeats(client: redis.Redis, keys: RunKeys, by_source: dict[str, list[RolloutGroup]]) -> None:
    """Add the repeats a worker holds back, by task source, to the run's tally, one round trip."""
    with client.pipeline(transaction=False) as pipe:
        for source, members in by_source.items():
            pipe.hincrby(keys.repeats, f"groups|{source}", len(members))
            pipe.hincrby(keys.repeats, f"samples|{source}", sum(len(g.samples) for g in members))
            pipe.hincrbyfloat(keys.repeats, f"reward_sum|{source}", sum(s.reward for g in members for s in g.samples))
        pipe.execute()


class RepeatTally:
    """The trainer's view of the tally: `take` returns, per source, what was added since the previous `take`
    (everything since the run began at the first one of a process: a restarted trainer counts the repeats
    of the steps it retrains once more, a figure only)."""

    def __init__(self) -> None:
        self.seen: dict[str, Tally] = {}

    def take(self, raw: dict[bytes, bytes]) -> dict[str, Tally]:
        """The increase per source since the last call, from `raw`: the hash as HGETALL returns it."""
        totals: dict[str, dict[str, float]] = {}
        for field, value in raw.items():
            name, _, source = field.decode().partition("|")
            totals.setdefault(source, {})[name] = float(value)
        increase = {}
        for source, t in totals.items():
            now = Tally(int(t.get("groups", 0)), int(t.get("samples", 0)), t.get("reward_sum", 0.0))
            before = self.seen.get(source, Tally())
            self.seen[source] = now
            if now.groups > before.groups:
                increase[source] = Tally(
                    now.groups - before.groups, now.samples - before.samples, now.reward_sum - before.reward_sum
                )
        return increase

    def total_groups(self) -> int:
        """Every repeat held back so far, as of the last `take`."""
        return sum(r.groups for r in self.seen.values())
