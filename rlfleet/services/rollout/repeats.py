"""Groups a worker does not send because the trainer would drop them for their content: repeats of work it already
trained (their content digest, streams.group_digest, in the trained set) and, when the run trains only groups
that teach something (`trainer.skipZeroAdvantageGroups`), groups whose rewards are all equal ("flat").

The trainer would drop either (trainer/batches.py), after the verifier had spent a check on it: late in a run
most groups of solved prompts are repeats (a peaked policy samples the same completions again), and on a
binary reward most groups are flat (all right or all wrong). A worker with Redis asks the trained set first,
one ZMSCORE per batch of groups, and looks at the rewards it computed, before it builds their proofs (the digest
never covers proofs), and counts what it holds back in the run's `repeats` hash (rlfleet/fleet/repeats.py), which
the trainer folds into each step's sampled reward: the reward the policy samples, held-back groups included.

Flat groups are sent all the same when the run has an online prompt filter (`sampling.onlineFilter`): the
filter retires prompts from the outcomes of the groups the trainer reads, with the rewards the gate recomputed,
and a solved or failed prompt's groups are flat. A worker behind an ingest has no Redis to count in: it sends
every group, and the trainer drops what it drops as before. Holding back only withholds a worker's own work;
nothing it holds back is trained, so nothing unverified is.
"""

from __future__ import annotations

import redis
from prometheus_client import Counter

from rlfleet.config import RLRunSpec
from rlfleet.fleet.repeats import record_held_back
from rlfleet.tasks.mixture import source_of
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RolloutGroup, group_digest, rewards_all_equal

REPEATS = Counter(
    "rlfleet_rollout_repeated_groups_total", "Groups not sent: their content is work the trainer already trained"
)
FLAT = Counter(
    "rlfleet_rollout_flat_groups_total",
    "Groups not sent: their rewards are all equal and the trainer skips zero-advantage groups",
)


def holds_flat(spec: RLRunSpec) -> bool:
    """Whether a worker of the run holds back flat groups: the trainer skips them and no online filter needs them."""
    return spec.trainer.skip_zero_advantage_groups and spec.sampling.online_filter is None


def worth_sending(
    reader: redis.Redis | None, ctx: Context, groups: list[RolloutGroup], hold_flat: bool
) -> list[RolloutGroup]:
    """`groups` less the repeats of trained work (read through `reader`, the worker's read user; None behind an
    ingest: all of them are sent) and, when `hold_flat`, less the groups whose rewards are all equal, in order;
    what is held back is counted in `ctx.keys.repeats` (the worker's write user)."""
    if reader is None or not groups:
        return groups
    trained = reader.zmscore(ctx.keys.trained, [group_digest(g) for g in groups])
    fresh: list[RolloutGroup] = []
    held: dict[str, list[RolloutGroup]] = {}
    flat: dict[str, int] = {}
    for group, score in zip(groups, trained, strict=True):
        repeat = score is not None
        if not repeat and not (hold_flat and rewards_all_equal(group)):
            fresh.append(group)
            continue
        source = source_of(group.task_id) or ""
        held.setdefault(source, []).append(group)
        if repeat:
            REPEATS.inc()
        else:
            flat[source] = flat.get(source, 0) + 1
            FLAT.inc()
    if held:
        record_held_back(ctx.client, ctx.keys, held, flat)
    return fresh
