"""Batched verification: the prefill checks of several groups from shared forward passes, and the
gate's handling of inbox entries, alone or read together.

`score_groups`: the rows (prompt + completion) of every group, sorted by length and packed into
prefills of at most `batch_limit` padded positions (fewer on a CPU than on a GPU); each group gets
back the `Scored` of its own rows. A row's hidden states and logprobs do not depend on the other
rows of its batch (right padding, causal attention with the padding masked), up to the float
rounding of another matrix shape, which the TOPLOC thresholds and the logprob tolerance are set to
absorb.

`prefill_verdicts`: checks 3 and 4 (TOPLOC, logprobs, seed replay and its score, possible tokens) of
groups of one version, each judged by `Checker.prefill_checks` on its own rows: a group's verdict is
the one it gets alone, and an accepted one leaves with its recomputed logprobs, as alone.

`InboxChecks`: the gate's verdicts on inbox entries, given what it needs (the `Checker`, the policy
versions, a `SpotCheck` that draws which groups get the prefill checks, and the `Committer` of
commit.py). `InboxChecks.handle_batch` handles entries read together in three passes:
  1. in entry order: decode, draw the spot check and run every check but the prefill ones
     (`Checker.check(deferred=True)`: all checks that come before them, the replay guard knowing
     whether the group's seeds will be replayed; the reward check after them never rejects);
  2. the drawn groups that passed: `prefill_verdicts`, one batch per policy version;
  3. in entry order: commit every verdict. The only way one entry's verdict reaches another's is
     a ban, so a group whose worker was banned by a verdict committed earlier in this batch is
     judged again alone (`InboxChecks.judge`: rejected `banned`, as one-by-one handling would
     have it).
So every entry gets the verdict, and the output streams the order, of handling entries one by one.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Callable
from typing import cast

import redis
import torch

from rlfleet.fleet.reputation import on_probation
from rlfleet.models.policy import Scored, score
from rlfleet.services.toploc.checks import Checker, Outcome, Rejection, decode_group
from rlfleet.services.toploc.commit import Committer
from rlfleet.services.toploc.metrics import LAPS
from rlfleet.services.toploc.replay import ReplayScore, logits_chunk_rows
from rlfleet.wire.streams import RolloutGroup, RunKeys

# Padded positions per prefill: bounds its activations (positions x hidden) and logits (positions x
# vocabulary); past a few thousand positions a larger batch no longer runs faster per token on a GPU.
# On a CPU it runs slower: past ~1-2k positions a batch's activations leave the caches (16 groups at
# hidden 256, fp32: prefills of at most 1,024 positions checked them in 0.85 of the time of one prefill
# of 4,544 on one thread, 0.80 on two; 2,048: 0.90 and 0.83; 284, one group each: 0.88 and 0.92).
MAX_BATCH_TOKENS = 8192
MAX_BATCH_TOKENS_CPU = 1024


def batch_limit(model) -> int:
    """Padded positions per prefill for `model`'s device."""
    on_gpu = next(model.parameters()).device.type != "cpu"
    return MAX_BATCH_TOKENS if on_gpu else min(MAX_BATCH_TOKENS, MAX_BATCH_TOKENS_CPU)


def score_groups(model, groups: list[RolloutGroup], temperature: float, pad_id: int) -> list[Scored]:
    """Per group, the `Scored` (hidden states and logprobs) of its rows, from as few prefills as fit."""
    rows = sorted(
        (
            (len(g.prompt_ids) + len(s.completion_ids), gi, si)
            for gi, g in enumerate(groups)
            for si, s in enumerate(g.samples)
        ),
        reverse=True,
    )
    batches: list[list[tuple[int, int, int]]] = []
    limit = batch_limit(model)
    for row in rows:  # longest first, so a batch's first row sets its padded width
        if batches and (len(batches[-1]) + 1) * batches[-1][0][0] <= limit:
            batches[-1].append(row)
        else:
            batches.append([row])
    # Placeholders, every one filled below: each (group, sample) row is in exactly one batch.
    slots = [cast(list[torch.Tensor], [None] * len(g.samples)) for g in groups]
    out = [Scored(hidden=slot, logprobs=list(slot), entropy=[]) for slot in slots]
    for batch in batches:
        ids = [groups[gi].prompt_ids + groups[gi].samples[si].completion_ids for _, gi, si in batch]
        with torch.inference_mode(), LAPS.part("prefill"):
            scored = score(
                model, ids, temperature, pad_id, want_hidden=True, chunk=logits_chunk_rows(model.lm_head.out_features)
            )
        for (_, gi, si), hidden, logprobs in zip(batch, scored.hidden, scored.logprobs):
            out[gi].hidden[si], out[gi].logprobs[si] = hidden, logprobs
    return out


def prefill_verdicts(
    checker: Checker, model, tokenizer, groups: list[RolloutGroup]
) -> list[Rejection | tuple[list[list[float]], ReplayScore]]:
    """Checks 3 and 4 of groups of one policy version (`model`, `tokenizer`) with batched prefills:
    per group its recomputed logprobs (G, T_i) and replay score when it passed, else its Rejection,
    the verdict `checker.prefill_checks` gives it alone."""
    by_temperature: dict[float, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        by_temperature[g.sampling.temperature].append(i)
    verdicts: list[Rejection | tuple[list[list[float]], ReplayScore]] = [([], ReplayScore()) for _ in groups]
    for temperature, members in by_temperature.items():
        scored = score_groups(model, [groups[i] for i in members], temperature, tokenizer.pad_token_id)
        for i, sc in zip(members, scored):
            try:
                verdicts[i] = checker.prefill_checks(groups[i], model, tokenizer, sc)
            except Rejection as exc:
                exc.worker_id = groups[i].worker_id
                verdicts[i] = exc
    return verdicts


class SpotCheck:
    """Whether a group gets the prefill checks: every group of a worker on probation (a joined worker with
    few accepted groups, fleet/reputation.py `on_probation`), else when an unpredictable draw is below
    spotCheckFraction."""

    def __init__(self, client: redis.Redis, keys: RunKeys, probation_groups: int, fraction: float):
        self.client, self.keys, self.probation_groups, self.fraction = client, keys, probation_groups, fraction
        self._draw = random.SystemRandom()  # workers must not predict which groups get the prefill

    def __call__(self, worker_id: str) -> bool:
        probation = on_probation(self.client, self.keys, worker_id, self.probation_groups)
        return probation or self._draw.random() < self.fraction


Verdict = tuple[RolloutGroup | None, Outcome | Rejection]  # the group if it decoded, and what its checks found


class InboxChecks:
    """The gate's verdicts on inbox entries, alone (`judge`, `handle`) or read together (`handle_batch`),
    committed by `committer`. `policy(version)` gives the (model, tokenizer) of a policy version, as
    it gives them to `checker`."""

    def __init__(
        self,
        checker: Checker,
        policy: Callable[[int], tuple],
        spot_check: SpotCheck,
        committer: Committer,
        max_message_bytes: int,
    ):
        self.checker, self.policy, self.spot_check = checker, policy, spot_check
        self.committer, self.max_message_bytes = committer, max_message_bytes

    def judge(self, msg_id: bytes, fields: dict) -> Verdict:
        """The verdict on one inbox entry, nothing committed."""
        group = None
        try:
            group = decode_group(fields, self.max_message_bytes)
            return group, self.checker.check(group, msg_id, self.spot_check(group.worker_id))
        except Rejection as exc:
            return group, exc

    def handle(self, msg_id: bytes, fields: dict) -> int:
        """Check one inbox entry and commit the verdict; the commit script's answer (0 = already committed)."""
        return self.committer.commit(msg_id, fields, *self.judge(msg_id, fields))

    def handle_batch(self, entries: list[tuple[bytes, dict]]) -> list[int]:
        """Check and commit inbox entries read together (module docstring); per entry the commit script's
        answer, as `handle` gives it."""
        verdicts, drawn = self.first_pass(entries)
        for version, members in drawn.items():
            self.prefill_pass(verdicts, version, members)
        return self.commit_pass(entries, verdicts)

    def first_pass(self, entries: list[tuple[bytes, dict]]) -> tuple[list[Verdict], dict[int, list[int]]]:
        """Pass 1, in entry order: decode, draw the spot check and run every check but the prefill ones.
        The verdicts so far, and per policy version the entries drawn for the prefill checks."""
        verdicts: list[Verdict] = []
        drawn: dict[int, list[int]] = defaultdict(list)
        for n, (msg_id, fields) in enumerate(entries):
            group = None
            try:
                group = decode_group(fields, self.max_message_bytes)
                prefill = self.spot_check(group.worker_id)
                verdicts.append((group, self.checker.check(group, msg_id, prefill, deferred=True)))
                if prefill:
                    drawn[group.policy_version].append(n)
            except Rejection as exc:
                verdicts.append((group, exc))
        return verdicts, drawn

    def prefill_pass(self, verdicts: list[Verdict], version: int, members: list[int]) -> None:
        """Pass 2 for one policy version: the prefill checks of its drawn entries (`members`, which passed
        the others) in shared prefills; each entry's verdict in `verdicts` becomes the final one."""
        model, tokenizer = self.policy(version)
        groups = [cast(RolloutGroup, verdicts[n][0]) for n in members]  # drawn only once decoded
        for n, got in zip(members, prefill_verdicts(self.checker, model, tokenizer, groups)):
            group, first = verdicts[n]
            if isinstance(got, Rejection):
                verdicts[n] = (group, got)
            else:
                assert isinstance(first, Outcome)  # drawn only when check() passed
                logprobs, replay = got
                trusted = dataclasses.replace(first, prefill_checked=True, logprobs=logprobs, replay=replay)
                verdicts[n] = (group, trusted)

    def commit_pass(self, entries: list[tuple[bytes, dict]], verdicts: list[Verdict]) -> list[int]:
        """Pass 3, in entry order: commit every verdict; an entry whose worker a verdict committed earlier
        in this batch banned is judged again alone."""
        banned: set[str] = set()
        answers = []
        for (msg_id, fields), (group, result) in zip(entries, verdicts):
            if group is not None and group.worker_id in banned:
                group, result = self.judge(msg_id, fields)
            answer = self.committer.commit(msg_id, fields, group, result)
            if answer == 2 and group is not None:  # a rejection's ban, or an accepted group's running-share ban
                banned.add(group.worker_id)
            answers.append(answer)
        return answers
