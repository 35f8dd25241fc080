"""Multi-turn episodes: the rules a worker samples an episode by and the verifier checks it by (docs/environments.md,
"Multi-turn environments").

An episode starts from the problem's prompt. The model takes a turn: tokens drawn as every completion is
(rlfleet/models/sampling.py), the draws numbered across the episode's model tokens only, so model token k of sample
i draws with the k-th uniform of `sample_seed(seed, i)`. A turn ends at its first stop token, or after `turn_budget`
tokens: min(maxTokensPerTurn, the tokens the episode has left). The environment is then asked for its turn
(`TaskSource.respond(problem, model turns so far)`, each turn decoded without its stop token; for a problem that
offers tools in its chat template's own format, the answers to the last turn's tool calls: tool_calls.py), unless
the episode is over (`environment_turn`): maxTurns model turns taken, or the last turn used the episode's last
token. Its text becomes tokens (`environment_tokens`, `chat_tokens`) that are appended to the transcript as they
are; None (no call) ends the episode, and so does an answer whose tokens would leave the model no token of the
episode's budget (min(maxTokens, context - prompt - 1), what a single completion has). The transcript therefore ends
with a model turn, and `Sample.spans` records its span lengths, model first.

Given the weights, the prompt, the seed and the environment, every token of an episode is therefore determined;
the verifier re-asks the environment on the claimed model turns (`check_transcript`) and replays the model's draws
from one prefill of the whole transcript (rlfleet/services/toploc/checks.py), so neither a forged environment turn
nor a model token presented as the environment's passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.tasks.base import Problem, TaskSource
from rlfleet.tasks.chat import render_chat
from rlfleet.tasks.tool_calls import answer_calls, call_format


@dataclass(frozen=True)
class TurnLimits:
    """An episode's limits: `budget` tokens after the prompt in all (completion_budget of the prompt), `max_turns`
    model turns, `per_turn` tokens a model turn."""

    budget: int
    max_turns: int
    per_turn: int

    @classmethod
    def of(cls, sampling, budget: int) -> TurnLimits:
        """The limits of spec.sampling `sampling` for an episode of `budget` tokens."""
        per_turn = sampling.max_tokens_per_turn or sampling.max_tokens
        return cls(budget=budget, max_turns=sampling.max_turns, per_turn=min(per_turn, budget))

    def turn_budget(self, used: int) -> int:
        """Tokens the next model turn may have once the transcript holds `used` tokens."""
        return min(self.per_turn, self.budget - used)


def environment_tokens(tokenizer, problem: Problem, text: str) -> list[int]:
    """The tokens of the environment's turn `text` after a model turn. A problem prompted through the chat
    template gets the template's own framing of a user message of `text` (`chat_tokens`); any other problem gets
    `text` tokenized as it is (the environment writes its own tags)."""
    if problem.chat_template:
        return chat_tokens(tokenizer, problem, [{"role": "user", "content": text}])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_tokens(tokenizer, problem: Problem, messages: list[dict]) -> list[int]:
    """The tokens the chat template writes between the model's message and its next turn for `messages` (a user
    message, or tool results) followed by the generation prompt, less the model's stop token the template writes
    first (`_chat_continuation`)."""
    return list(tokenizer(_chat_continuation(tokenizer, problem, messages), add_special_tokens=False)["input_ids"])


_MODEL_MARK = "\x00rlfleet-model-turn\x00"  # stands for the model's turn while the template is rendered


def _chat_continuation(tokenizer, problem: Problem, after: list[dict]) -> str:
    """The chat template's text between the model's message and its next turn, with the messages `after`."""
    messages = [{"role": "system", "content": problem.system_prompt}] if problem.system_prompt else []
    messages += [{"role": "user", "content": problem.prompt}, {"role": "assistant", "content": _MODEL_MARK}]
    rendered = render_chat(tokenizer, [*messages, *after], list(problem.tools) or None)
    continuation = rendered.split(_MODEL_MARK, 1)[1]
    eos = tokenizer.eos_token or ""
    # the model sampled its stop token itself
    return continuation[len(eos) :] if eos and continuation.startswith(eos) else continuation


def environment_turn(
    task: TaskSource, problem: Problem, tokenizer, turns: list[str], used: int, limits: TurnLimits
) -> list[int] | None:
    """The tokens the environment inserts after the model's `turns` (the transcript holds `used` tokens), or None
    when the episode ends there (module docstring): the answers to the last turn's tool calls where the problem
    offers tools in its chat template's format (tool_calls.py), else the source's `respond`. EnvironmentFailure
    (python_env.py) when the environment fails."""
    if len(turns) >= limits.max_turns or used >= limits.budget:
        return None
    form = call_format(tokenizer) if problem.tools and problem.chat_template else None
    if form is not None:
        calls = form.calls(turns[-1])
        tokens = chat_tokens(tokenizer, problem, answer_calls(task, problem, calls)) if calls else None
    else:
        tokens = _respond_tokens(task, problem, tokenizer, turns)
    return tokens if tokens is not None and used + len(tokens) < limits.budget else None


def _respond_tokens(task: TaskSource, problem: Problem, tokenizer, turns: list[str]) -> list[int] | None:
    text = task.respond(problem, turns)
    if text is None:
        return None
    if not isinstance(text, str):  # an in-process source's mistake; PythonEnvironment refuses it itself
        from rlfleet.tasks.python_env import EnvironmentFailure

        raise EnvironmentFailure(f"respond returned a {type(text).__name__}, not a str (the turn) or None (the end)")
    return environment_tokens(tokenizer, problem, text)


def span_bounds(spans: list[int] | None, tokens: int) -> list[tuple[int, int, bool]]:
    """(start, end, is_model) of each span of a completion of `tokens` tokens (one model span when `spans` is
    None)."""
    if spans is None:
        return [(0, tokens, True)]
    out, at = [], 0
    for k, n in enumerate(spans):
        out.append((at, at + n, k % 2 == 0))
        at += n
    return out


def model_positions(spans: list[int] | None, tokens: int) -> list[int]:
    """The completion positions the model sampled, in order (all of them when `spans` is None)."""
    return [t for start, end, model in span_bounds(spans, tokens) if model for t in range(start, end)]


def model_token_mask(spans: list[int]) -> list[float]:
    """1.0 at each completion token the model sampled, 0.0 at the environment's (what the trainer's loss reads)."""
    return [1.0 if model else 0.0 for start, end, model in span_bounds(spans, sum(spans)) for _ in range(start, end)]


def episode_text(
    task: TaskSource, problem: Problem, tokenizer, completion_ids: list[int], spans: list[int] | None, stop_ids
) -> str:
    """The text a reward reads: of a single completion, `completion_text`; of a multi-turn transcript, what
    `task.episode_text` makes of its turns (each model turn without its stop token, each environment turn as
    inserted), by default all of them. EnvironmentFailure when a user environment fails."""
    if spans is None:
        return completion_text(tokenizer, completion_ids, stop_ids)
    turns = []
    for start, end, model in span_bounds(spans, len(completion_ids)):
        ids = completion_ids[start:end]
        turns.append(
            completion_text(tokenizer, ids, stop_ids) if model else tokenizer.decode(ids, skip_special_tokens=False)
        )
    return task.episode_text(problem, turns)


def later_turn_prompt_tokens(prompt_tokens: int, spans: list[int] | None) -> int:
    """The prompt tokens of an episode's model turns after its first: each such turn's prompt is the problem's
    prompt and the transcript before it (what an engine with a prefix cache can read from it; 0 for a single
    completion)."""
    bounds = span_bounds(spans, sum(spans) if spans else 0)
    return sum(prompt_tokens + start for start, _, model in bounds[1:] if model)


def drawn_tokens(spans: list[int] | None, tokens: int) -> int:
    """The completion tokens the model sampled (what a length penalty counts)."""
    return tokens if spans is None else sum(spans[::2])


def check_transcript(
    task: TaskSource, problem: Problem, tokenizer, sample, stop_ids: frozenset[int], limits: TurnLimits
) -> str | None:
    """What is wrong with a sample's turns, or None: every environment span must be exactly the environment's
    answer to the model turns before it, and the episode must end where the rules end it (module docstring). The
    model spans' own endings are checked by rlfleet/services/toploc/ending.py. EnvironmentFailure when the
    environment fails."""
    ids = sample.completion_ids
    bounds = span_bounds(sample.spans, len(ids))
    turns: list[str] = []
    for k in range(0, len(bounds), 2):  # the model spans; k + 1 is the environment's span after one
        _, end, _ = bounds[k]
        turns.append(completion_text(tokenizer, ids[bounds[k][0] : end], stop_ids))
        want = environment_turn(task, problem, tokenizer, turns, end, limits) if task.multi_turn else None
        last = k + 1 == len(bounds)
        if last and want is not None:
            return f"the transcript ends after model turn {len(turns)}, where the environment answers"
        if last:
            return None
        if want is None:
            return (
                f"environment turn {len(turns)} is in the transcript, but the episode ends after model turn "
                f"{len(turns)}"
            )
        start, stop, _ = bounds[k + 1]
        if ids[start:stop] != want:
            return (
                f"environment turn {len(turns)} ({stop - start} tokens) is not the environment's answer to the model's "
                f"turns ({len(want)} tokens)"
            )
    return None


def completion_text(tokenizer, completion_ids: list[int], stop_ids: frozenset[int]) -> str:
    """The text a reward reads of one completion (or one model turn): the tokens before the first stop token,
    special tokens written out."""
    end = next((i for i, t in enumerate(completion_ids) if t in stop_ids), len(completion_ids))
    return tokenizer.decode(completion_ids[:end], skip_special_tokens=False)
