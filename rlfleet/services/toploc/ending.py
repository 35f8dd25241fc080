"""Where a completion stops (check 1 of checks.py, every group of every engine, spot-checked or not):
rlfleet/models/sampling.py's contract, which the torch engine and vLLM's worker both keep.

A completion holds no token after its first stop token, and either ends with one or has exactly
`completion_budget` tokens (min(maxTokens, context - prompt - 1)): a completion cut short without a
stop token was truncated (a dropped EOS changes what the reward and the length penalty see), and
tokens after a stop token were never sampled by the policy (`<eos> answer <eos>`). Its finish
reason must say which (`stop` or `length`). The reward then reads exactly the tokens before the
stop token (sampling.completion_text).
"""

from __future__ import annotations

from rlfleet.models.sampling import completion_budget


def ending_problem(group, stop_ids: frozenset[int], context: int) -> str | None:
    """What is wrong with where a sample of `group` stops, or None."""
    budget = completion_budget(group.sampling.max_tokens, len(group.prompt_ids), context)
    for i, sample in enumerate(group.samples):
        ids = sample.completion_ids
        first = next((j for j, t in enumerate(ids) if t in stop_ids), None)
        if first is not None and first != len(ids) - 1:
            return f"samples[{i}] has {len(ids) - 1 - first} token(s) after its stop token at position {first}"
        if len(ids) > budget:
            return f"samples[{i}] has {len(ids)} tokens, over min(maxTokens, context left) = {budget}"
        if first is None and len(ids) != budget:
            return (
                f"samples[{i}] ends after {len(ids)} tokens without a stop token; only a completion of "
                f"min(maxTokens, context left) = {budget} tokens may"
            )
        reason = "length" if first is None else "stop"
        if sample.finish_reason != reason:
            return f"samples[{i}] claims finish reason {sample.finish_reason!r}, its tokens say {reason!r}"
    return None
