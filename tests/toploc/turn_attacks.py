"""Attacks on multi-turn transcripts (rlfleet/tasks/turns.py), built as a cheating worker would: honest episodes
from a real engine, then tampered, and re-proved by one prefill of the claimed weights (`prove_turns`: logprobs,
TOPLOC proofs, finish reasons and rewards made those of the tampered tokens, which a worker holding the weights can
always do), so only what a prover cannot fake is left to catch them. Shared by tests/toploc/test_gate_turns.py and
benchmarks/gate_attacks.py.

Every attack, called with (an honest group, the tokenizer, the run's spec), returns the tampered group, or None when
the honest group gives it nothing to tamper with (e.g. no episode with an environment turn); `ATTACKS` maps each
name to it and the rejection reasons that may answer it.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable

import torch

from rlfleet.engines.base import GroupRequest
from rlfleet.engines.episodes import generate_episodes
from rlfleet.models.policy import score
from rlfleet.models.sampling import stop_token_ids
from rlfleet.proofs.toploc import build_proofs
from rlfleet.tasks import make_run_task
from rlfleet.tasks.chat import encode_prompt
from rlfleet.tasks.turns import drawn_tokens, episode_text, span_bounds
from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams


def honest_episodes(engine, spec, task_id: str, seed: int, worker: str = "w-honest", version: int = 0) -> RolloutGroup:
    """A multi-turn group as an honest worker makes it (rlfleet/services/rollout/main.py)."""
    s, t = spec.sampling, spec.verifier.toploc
    task = make_run_task(spec)
    problem = task.problem(task_id)
    prompt_ids = encode_prompt(engine.tokenizer, problem)
    params = SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=seed)
    (gens,), failures = generate_episodes(engine, task, [GroupRequest(prompt_ids, params, s.group_size)], [problem], s)
    assert not failures and gens is not None, failures
    texts = [episode_text(task, problem, engine.tokenizer, g.completion_ids, g.spans, engine.stop_ids) for g in gens]
    rewards = task.scores(problem, texts, [drawn_tokens(g.spans, len(g.completion_ids)) for g in gens])
    samples = [
        Sample(g.completion_ids, g.logprobs, build_proofs(g.hidden, len(prompt_ids), t.decode_batching_size, t.topk),
               r, g.finish_reason, g.spans)
        for g, r in zip(gens, rewards)
    ]  # fmt: skip
    return RolloutGroup(task_id, worker, version, prompt_ids, params, samples, engine=engine.name)


def prove_turns(group: RolloutGroup, model, tokenizer, spec) -> RolloutGroup:
    """The group's logprobs, proofs, finish reasons and rewards made those of its (tampered) tokens and spans."""
    t, p = spec.verifier.toploc, len(group.prompt_ids)
    rows = [group.prompt_ids + s.completion_ids for s in group.samples]
    with torch.inference_mode():
        scored = score(model, rows, spec.sampling.temperature, tokenizer.pad_token_id, want_hidden=True)
    task = make_run_task(spec)
    problem = task.problem(group.task_id)
    stop_ids = stop_token_ids(model, tokenizer)
    for i, sample in enumerate(group.samples):
        sample.logprobs = scored.logprobs[i][p - 1 :].tolist()
        sample.proofs = build_proofs(scored.hidden[i], p, decode_batching_size=t.decode_batching_size, topk=t.topk)
        start, end, _ = span_bounds(sample.spans, len(sample.completion_ids))[-1]
        sample.finish_reason = "stop" if sample.completion_ids[end - 1] in stop_ids else "length"
        text = episode_text(task, problem, tokenizer, sample.completion_ids, sample.spans, stop_ids)
        sample.reward = task.score(problem, text, drawn_tokens(sample.spans, len(sample.completion_ids)))
    return group


def _copy(group: RolloutGroup) -> RolloutGroup:
    out = copy.deepcopy(group)
    out.rollout_id = uuid.uuid4().hex
    return out


def _with_turns(group: RolloutGroup, turns: int) -> int | None:
    """The first sample with at least `turns` model turns, or None."""
    return next((i for i, s in enumerate(group.samples) if s.spans and len(s.spans) >= 2 * turns - 1), None)


def _digits(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]


def forged_tool_result(group: RolloutGroup, tokenizer, spec) -> RolloutGroup | None:
    """An environment turn's result replaced by another of the same length (the tool said what the worker liked)."""
    i = _with_turns(group, 2)
    if i is None:
        return None
    out = _copy(group)
    sample = out.samples[i]
    start, end, _ = span_bounds(sample.spans, len(sample.completion_ids))[1]
    digits = _digits(tokenizer)
    for at in range(start, end):
        token = sample.completion_ids[at]
        if token in digits:  # `=17=` -> `=28=`: every digit moved by one
            sample.completion_ids[at] = digits[(digits.index(token) + 1) % 10]
            return out
    sample.completion_ids[start] = digits[1]  # no digit to move: the result's first character forged
    return out


def own_tokens_as_environment(group: RolloutGroup, tokenizer, spec) -> RolloutGroup | None:
    """Tokens the worker wrote (the problem's answer) appended to an environment turn, where no proof or replay
    checks a token: the reward then sees the answer."""
    i = _with_turns(group, 2)
    if i is None:
        return None
    out = _copy(group)
    sample = out.samples[i]
    _, end, _ = span_bounds(sample.spans, len(sample.completion_ids))[1]
    answer = tokenizer("99", add_special_tokens=False)["input_ids"]
    sample.completion_ids[end:end] = answer
    sample.spans[1] += len(answer)
    budget = out.sampling.max_tokens
    if len(sample.completion_ids) > budget:  # keep it within maxTokens: drop the tail of the last model turn
        cut = len(sample.completion_ids) - budget
        if sample.spans[-1] <= cut:
            return None
        del sample.completion_ids[-cut:]
        sample.spans[-1] -= cut
    return out


def environment_as_model(group: RolloutGroup, tokenizer, spec) -> RolloutGroup | None:
    """An environment turn's tokens claimed as the model's (merged into the model turn before it): tokens the
    seeds never drew, now in the loss."""
    i = _with_turns(group, 2)
    if i is None:
        return None
    out = _copy(group)
    spans = out.samples[i].spans
    out.samples[i].spans = [spans[0] + spans[1], *spans[2:]]
    merged = out.samples[i].spans
    if len(merged) % 2 == 0:  # [m1 + e1, m2] is even: fold the next model turn in too
        out.samples[i].spans = [merged[0] + merged[1], *merged[2:]]
    return out


def changed_tool_call(group: RolloutGroup, tokenizer, spec) -> RolloutGroup | None:
    """A model turn changed (one digit) while the environment's answer to the original turn is kept: the tool
    would answer the changed call differently."""
    i = _with_turns(group, 2)
    if i is None:
        return None
    out = _copy(group)
    sample = out.samples[i]
    _, end, _ = span_bounds(sample.spans, len(sample.completion_ids))[0]
    digits = _digits(tokenizer)
    for at in range(end):
        if sample.completion_ids[at] in digits:
            sample.completion_ids[at] = digits[(digits.index(sample.completion_ids[at]) + 1) % 10]
            return out
    sample.completion_ids[0] = digits[7]  # a turn with no digit gets one
    return out


def turns_past_the_limit(group: RolloutGroup, tokenizer, spec) -> RolloutGroup | None:
    """One more environment turn and model turn (ending with the stop token, as a finished turn does) appended
    after the episode's end: past maxTurns when the sample already took them all."""
    out = _copy(group)
    sample = max(out.samples, key=lambda s: len(s.spans or [0]))
    extra_env = tokenizer("=1=", add_special_tokens=False)["input_ids"]
    extra_model = [_digits(tokenizer)[2], tokenizer.eos_token_id]
    if len(sample.completion_ids) + len(extra_env) + len(extra_model) > out.sampling.max_tokens:
        return None
    spans = sample.spans or [len(sample.completion_ids)]
    sample.completion_ids += extra_env + extra_model
    sample.spans = [*spans, len(extra_env), len(extra_model)]
    return out


def cut_short(group: RolloutGroup, tokenizer, spec) -> RolloutGroup | None:
    """The transcript ended before its last environment turn and model turn (a failing ending hidden)."""
    i = _with_turns(group, 2)
    if i is None:
        return None
    out = _copy(group)
    sample = out.samples[i]
    keep = sum(sample.spans[:-2])
    sample.completion_ids, sample.spans = sample.completion_ids[:keep], sample.spans[:-2]
    return out


def forged_last_turn(group: RolloutGroup, tokenizer, spec) -> RolloutGroup | None:
    """A token of the last model turn of an episode that took every turn (so no environment reads it) replaced: its
    transcript is the environment's, its proofs and logprobs re-proved, and only the seed replay, which continues
    each sample's draws across its turns, can tell that the model never drew it."""

    def last_turn(sample) -> tuple[int, int]:
        start, end, _ = span_bounds(sample.spans, len(sample.completion_ids))[-1]
        return start, end

    # an episode of every turn whose last turn has a token before its end (its stop token, if any, stays put)
    max_turns = spec.sampling.max_turns
    found = [i for i, s in enumerate(group.samples) if s.spans and len(s.spans) == 2 * max_turns - 1
             and last_turn(s)[1] - last_turn(s)[0] >= 2]  # fmt: skip
    if not found:
        return None
    out = _copy(group)
    sample = out.samples[found[0]]
    start, _ = last_turn(sample)
    digits = _digits(tokenizer)
    token = sample.completion_ids[start]
    sample.completion_ids[start] = digits[(digits.index(token) + 1) % 10] if token in digits else digits[0]
    return out


# name -> (attack, the reasons that may reject it)
ATTACKS: dict[str, tuple[Callable, set[str]]] = {
    "forged tool result": (forged_tool_result, {"transcript"}),
    "own tokens as environment": (own_tokens_as_environment, {"transcript"}),
    "environment span as model": (environment_as_model, {"completion_end", "seed_replay", "transcript"}),
    "changed tool call": (changed_tool_call, {"transcript"}),
    "turns past the limit": (turns_past_the_limit, {"transcript"}),
    "transcript cut short": (cut_short, {"transcript"}),
    "forged last turn": (forged_last_turn, {"seed_replay"}),
}
