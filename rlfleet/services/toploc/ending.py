"""Where a completion stops (check 1 of checks.py, every group of every engine, spot-checked or not):
rlfleet/models/sampling.py's contract, which the torch engine and vLLM's worker both keep.

A completion holds no token after its first stop token, and either ends with one or has exactly
`completion_budget` tokens (min(maxTokens, context - prompt - 1)): a completion cut short without a
stop token was truncated (a dropped EOS changes what the reward and the length penalty see), and
tokens after a stop token were never sampled by the policy (`<eos> answer <eos>`). Its finish
reason must say which (`stop` or `length`). The reward then reads exactly the tokens before the
stop token (rlfleet/tasks/turns.py completion_text).

A multi-turn sample (rlfleet/tasks/turns.py) holds each model turn to the same rule with the turn's own
budget (`TurnLimits.turn_budget` of where it starts), and its finish reason is its last turn's; its
environment spans are checked against the environment (turns.check_transcript), not here.
"""

from __future__ import annotations

from rlfleet.models.sampling import completion_budget
from rlfleet.tasks.turns import TurnLimits, span_bounds


def ending_problem(
    group, stop_ids: frozenset[int], context: int, max_turns: int = 1, per_turn: int | None = None
) -> str | None:
    """What is wrong with where a sample of `group` (or a model turn of it) stops, or None. `max_turns`, `per_turn`:
    spec.sampling's maxTurns and maxTokensPerTurn."""
    budget = completion_budget(group.sampling.max_tokens, len(group.prompt_ids), context)
    limits = TurnLimits(budget, max_turns, min(per_turn or budget, budget))
    for i, sample in enumerate(group.samples):
        ids = sample.completion_ids
        if len(ids) > budget:
            return f"samples[{i}] has {len(ids)} tokens, over min(maxTokens, context left) = {budget}"
        reason = "length"
        for k, (start, end, model) in enumerate(span_bounds(sample.spans, len(ids))):
            if not model:
                continue
            where = f"samples[{i}]" if sample.spans is None else f"samples[{i}] model turn {k // 2 + 1}"
            whole = sample.spans is None  # a single completion: the per-turn limit is an episode's only
            turn_budget = budget if whole else limits.turn_budget(start)
            reason, problem = _turn_ending(ids[start:end], stop_ids, turn_budget, whole)
            if problem:
                return f"{where} {problem}"
        if sample.finish_reason != reason:
            return f"samples[{i}] claims finish reason {sample.finish_reason!r}, its tokens say {reason!r}"
    return None


def _turn_ending(ids: list[int], stop_ids: frozenset[int], budget: int, whole: bool) -> tuple[str, str | None]:
    """(finish reason, what is wrong or None) of one model turn of `budget` tokens at most; `whole`: the turn is the
    whole completion (the messages name its budget as the completion's)."""
    first = next((j for j, t in enumerate(ids) if t in stop_ids), None)
    if first is not None and first != len(ids) - 1:
        return "stop", f"has {len(ids) - 1 - first} token(s) after its stop token at position {first}"
    name = "min(maxTokens, context left)" if whole else "its turn budget"
    if len(ids) > budget:
        return "length", f"has {len(ids)} tokens, over {name} = {budget}"
    if first is None and len(ids) != budget:
        return "length", f"ends after {len(ids)} tokens without a stop token; only one of {name} = {budget} tokens may"
    return ("length" if first is None else "stop"), None
