"""Groups a worker does not send: those whose content (streams.group_digest) the trainer already trained.

The trainer would drop such a repeat (trainer/batches.py), after the verifier had spent a check on it; late in
a run most groups of solved prompts are repeats (a peaked policy samples the same completions again). A worker
with Redis asks the trained set first, one ZMSCORE per batch of groups, before it builds their proofs (the
digest never covers proofs), and counts what it holds back in the run's `repeats` hash
(rlfleet/wire/repeats.py), which the trainer folds into each step's sampled reward: the reward the policy
samples, repeats included. A worker behind an ingest has no Redis: it sends every group, and the trainer drops
the repeats as before.
"""

from __future__ import annotations

import redis
from prometheus_client import Counter

from rlfleet.tasks.mixture import source_of
from rlfleet.wire.repeats import record_repeats
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RolloutGroup, group_digest

REPEATS = Counter(
    "rlfleet_rollout_repeated_groups_total", "Groups not sent: their content is work the trainer already trained"
)


def unrepeated(reader: redis.Redis | None, ctx: Context, groups: list[RolloutGroup]) -> list[RolloutGroup]:
    """`groups` less the repeats of trained work (read through `reader`, the worker's read user; None behind an
    ingest: all of them), in order; the repeats are counted in `ctx.keys.repeats` (the worker's write user)."""
    if reader is None or not groups:
        return groups
    trained = reader.zmscore(ctx.keys.trained, [group_digest(g) for g in groups])
    fresh = [g for g, score in zip(groups, trained, strict=True) if score is None]
    repeats = [g for g, score in zip(groups, trained, strict=True) if score is not None]
    if repeats:
        by_source: dict[str, list[RolloutGroup]] = {}
        for g in repeats:
            by_source.setdefault(source_of(g.task_id) or "", []).append(g)
        record_repeats(ctx.client, ctx.keys, by_source)
        REPEATS.inc(len(repeats))
    return fresh
