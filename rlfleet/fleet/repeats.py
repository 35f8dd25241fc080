"""The run's `repeats` hash: groups workers sampled and did not send because the trainer would drop them for their
content (rlfleet/services/rollout/repeats.py): repeats of work it already trained and, with
`trainer.skipZeroAdvantageGroups`, groups whose rewards are all equal ("flat"). Per task source
(tasks/mixture.py; "" for a single-source run) it holds `groups|SOURCE`, `samples|SOURCE` and `reward_sum|SOURCE`
of every group held back, and `flat|SOURCE`, how many of those groups were flat. Only workers write it, and only
by increments; the trainer takes the increase since its last look at each step and counts it in that step's
sampled reward (what the policy samples, held-back groups included), so the figure means what it did when the
trainer read every group itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from rlfleet.wire.streams import RolloutGroup, RunKeys


@dataclass(frozen=True)
class Tally:
    """Groups, their samples and the samples' summed reward (of what one task source's workers held back, or of
    what a step read), and how many of the groups were held back as flat rather than as repeats."""

    groups: int = 0
    samples: int = 0
    reward_sum: float = 0.0
    flat: int = 0


def record_held_back(
    client: redis.Redis, keys: RunKeys, by_source: dict[str, list[RolloutGroup]], flat: dict[str, int]
) -> None:
    """Add the groups a worker holds back, by task source, to the run's tally, one round trip; `flat[source]` of
    a source's groups were held back for equal rewards, the rest as repeats."""
    with client.pipeline(transaction=False) as pipe:
        for source, members in by_source.items():
            pipe.hincrby(keys.repeats, f"groups|{source}", len(members))
            pipe.hincrby(keys.repeats, f"samples|{source}", sum(len(g.samples) for g in members))
            pipe.hincrbyfloat(keys.repeats, f"reward_sum|{source}", sum(s.reward for g in members for s in g.samples))
            if flat.get(source):
                pipe.hincrby(keys.repeats, f"flat|{source}", flat[source])
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
            now = Tally(
                int(t.get("groups", 0)), int(t.get("samples", 0)), t.get("reward_sum", 0.0), int(t.get("flat", 0))
            )
            before = self.seen.get(source, Tally())
            self.seen[source] = now
            if now.groups > before.groups:
                increase[source] = Tally(
                    now.groups - before.groups,
                    now.samples - before.samples,
                    now.reward_sum - before.reward_sum,
                    now.flat - before.flat,
                )
        return increase

    def total_repeats(self) -> int:
        """Every group held back as a repeat of trained work so far, as of the last `take`."""
        return sum(r.groups - r.flat for r in self.seen.values())

    def total_flat(self) -> int:
        """Every group held back for equal rewards so far, as of the last `take`."""
        return sum(r.flat for r in self.seen.values())
