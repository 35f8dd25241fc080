"""Batched verification: the prefill checks of several groups from shared forward passes, and the
gate's handling of a read batch of inbox entries with them.

`score_groups`: the rows (prompt + completion) of every group, sorted by length and packed into
prefills of at most `batch_limit` padded positions (fewer on a CPU than on a GPU); each group gets back
the `Scored` of its own rows. A row's hidden states and logprobs do not depend on the other rows of its batch (right
padding, causal attention with the padding masked), up to the float rounding of another matrix
shape, which the TOPLOC thresholds and the logprob tolerance are set to absorb.

`prefill_verdicts`: checks 3 and 4 (TOPLOC, logprobs, seed replay and its score, possible tokens) of groups of one
version, each judged by `Checker.prefill_checks` on its own rows: a group's verdict is the one it gets
alone, and an accepted one leaves with its recomputed logprobs, as alone.

`handle_batch`: the gate's loop over entries read together, in three passes:
  1. in entry order: decode, draw the spot check and run every check but the prefill ones
     (`Checker.check(deferred=True)`: all checks that come before them, the replay guard knowing
     whether the group's seeds will be replayed; the reward check after them never rejects);
  2. the drawn groups that passed: `prefill_verdicts`, one batch per policy version;
  3. in entry order: commit every verdict. The only way one entry's verdict reaches another's is
     a ban, so a group whose worker was banned by a verdict committed earlier in this batch is
     judged again alone (`Gate.judge`: rejected `banned`, as one-by-one handling would have it).
So every entry gets the verdict, and the output streams the order, of handling entries one by one.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import cast

import torch

from rlfleet.models.policy import Scored, score
from rlfleet.services.toploc.checks import Checker, Outcome, Rejection, decode_group
from rlfleet.services.toploc.metrics import LAPS
from rlfleet.services.toploc.replay import ReplayScore
from rlfleet.wire.streams import RolloutGroup

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
            scored = score(model, ids, temperature, pad_id, want_hidden=True)
        for (_, gi, si), hidden, logprobs in zip(batch, scored.hidden, scored.logprobs):
            out[gi].hidden[si], out[gi].logprobs[si] = hidden, logprobs
    return out


def prefill_verdicts(
    checker: Checker, model, tokenizer, groups: list[RolloutGroup]
) -> list[Rejection | tuple[list[list[float]], ReplayScore]]:
    """Checks 3 and 4 of groups of one policy version (`model`, `tokenizer`) with batched prefills:
    per group its recomputed logprobs (G, T_i) and replay score when it passed, else its Rejection, the verdict
    `checker.prefill_checks` gives it alone."""
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


def handle_batch(gate, entries: list[tuple[bytes, dict]]) -> list[int]:
    """Check and commit inbox entries read together (`gate`: a toploc.gate.Gate); per entry the commit
    script's answer, as `Gate.handle` gives it."""
    v = gate.spec.verifier
    verdicts: list[tuple[RolloutGroup | None, Outcome | Rejection]] = []
    drawn: dict[int, list[int]] = defaultdict(list)  # policy version -> entries that get the prefill checks
    for n, (msg_id, fields) in enumerate(entries):  # pass 1
        group = None
        try:
            group = decode_group(fields, v.max_message_bytes)
            prefill = gate.spot_checked(group.worker_id)
            verdicts.append((group, gate.checker.check(group, msg_id, prefill, deferred=True)))
            if prefill:
                drawn[group.policy_version].append(n)
        except Rejection as exc:
            verdicts.append((group, exc))
    for version, members in drawn.items():  # pass 2
        model, tokenizer = gate.policy(version)
        groups = [cast(RolloutGroup, verdicts[n][0]) for n in members]  # drawn only once decoded
        for n, got in zip(members, prefill_verdicts(gate.checker, model, tokenizer, groups)):
            group, first = verdicts[n]
            if isinstance(got, Rejection):
                verdicts[n] = (group, got)
            else:
                assert isinstance(first, Outcome)  # drawn only when check() passed
                logprobs, replay = got
                trusted = dataclasses.replace(first, prefill_checked=True, logprobs=logprobs, replay=replay)
                verdicts[n] = (group, trusted)
    banned: set[str] = set()
    answers = []
    for (msg_id, fields), (group, result) in zip(entries, verdicts):  # pass 3
        if group is not None and group.worker_id in banned:
            group, result = gate.judge(msg_id, fields)
        answer = gate.commit(msg_id, fields, group, result)
        if answer == 2 and group is not None:  # a rejection's ban, or an accepted group's running-share ban
            banned.add(group.worker_id)
        answers.append(answer)
    return answers
