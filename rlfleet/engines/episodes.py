"""Multi-turn episodes on any engine (the rules: rlfleet/tasks/turns.py).

`generate_episodes` samples every sample of several groups turn by turn: each round is ONE `generate_groups` call
holding the next model turn of every episode still going (a request of one sample each: its prompt is the
problem's prompt plus its transcript so far, `first` its index in the group and `draws_from` its model tokens so
far, so its draws continue its own uniform stream), then asks the environment for its answer to each turn and
appends the answer's tokens. A later turn's request brings the hidden rows of its previous turn's call
(`GroupRequest.prefix_rows`: every position but the environment's answer) and the episode's own cache salt, so vLLM
reads those positions' keys and values from its prefix cache and computes only the answer's and the new turn's,
while no other episode's cached blocks can stand in for positions whose rows it would then lack
(rlfleet/engines/vllm_engine.py). The torch engine has no cache across calls and prefills every transcript again
(benchmarks/rollout.py `--turns` measures both).

A sample's Generation holds its whole transcript (`completion_ids`, with `spans`), logprobs of the model's tokens
and 0.0 at the environment's (the gate and the trainer read only the model's), and the final hidden states of
every prompt and transcript position: those of its last turn's call, whose prompt was everything before that turn.
Invariant: every turn of every episode ran on one weights version (the worker swaps only between its calls).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from rlfleet.engines.base import Engine, Generation, GroupRequest
from rlfleet.models.sampling import completion_budget
from rlfleet.tasks.base import Problem, TaskSource
from rlfleet.tasks.python_env import EnvironmentFailure
from rlfleet.tasks.turns import TurnLimits, completion_text, environment_turn

_SALTS = itertools.count()  # episode cache salts: unique in the process, so in each engine's cache


@dataclass
class _Episode:
    group: int
    index: int  # the sample's index in its group
    request: GroupRequest  # its group's request (prompt and sampling parameters)
    limits: TurnLimits
    ids: list[int] = field(default_factory=list)  # the transcript after the prompt
    logprobs: list[float] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)  # the model's turns as the environment reads them
    drawn: int = 0  # model tokens so far: where the next turn's draws start
    last: Generation | None = None  # the newest turn's generation
    salt: str = field(default_factory=lambda: f"episode-{next(_SALTS)}")  # its requests' own prefix-cache namespace

    def next_request(self) -> GroupRequest:
        r = self.request
        params = replace(r.params, max_tokens=self.limits.turn_budget(len(self.ids)))
        return GroupRequest(
            r.prompt_ids + self.ids,
            params,
            1,
            first=r.first + self.index,
            draws_from=self.drawn,
            cache_salt=self.salt,
            prefix_rows=None if self.last is None else self.last.hidden,
        )


def generate_episodes(
    engine: Engine, task: TaskSource, requests: list[GroupRequest], problems: list[Problem], sampling
) -> tuple[list[list[Generation] | None], dict[int, EnvironmentFailure]]:
    """The episodes of every request's samples (module docstring) under spec.sampling `sampling`'s turn limits:
    one list of `request.n` Generations per request, or None for a request whose environment failed, with the
    failure by request index."""
    episodes = []
    for k, r in enumerate(requests):
        limits = TurnLimits.of(sampling, completion_budget(r.params.max_tokens, len(r.prompt_ids), engine.context))
        episodes += [_Episode(k, i, r, limits) for i in range(r.n)]
    failures: dict[int, EnvironmentFailure] = {}
    going = episodes
    while going:
        generations = engine.generate_groups([e.next_request() for e in going])
        for e, (gen,) in zip(going, generations):
            if e.last is not None and gen.version != e.last.version:
                raise RuntimeError(f"an episode's turns ran on versions {e.last.version} and {gen.version}")
            e.ids += gen.completion_ids
            e.logprobs += gen.logprobs
            e.spans.append(len(gen.completion_ids))
            e.drawn += len(gen.completion_ids)
            e.turns.append(completion_text(engine.tokenizer, gen.completion_ids, engine.stop_ids))
            e.last = gen
        still = []
        for e in going:
            if e.group in failures:
                continue
            try:
                answer = environment_turn(task, problems[e.group], engine.tokenizer, e.turns, len(e.ids), e.limits)
            except EnvironmentFailure as exc:
                failures[e.group] = exc
                continue
            if answer is not None:
                e.ids += answer
                e.logprobs += [0.0] * len(answer)
                e.spans.append(len(answer))
                still.append(e)
        going = [e for e in still if e.group not in failures]
    results: list[list[Generation] | None] = [None if k in failures else [] for k in range(len(requests))]
    for e in episodes:
        out = results[e.group]
        if out is not None:
            assert e.last is not None
            out.append(Generation(e.ids, e.logprobs, e.last.hidden, e.last.finish_reason, e.last.version, e.spans))
    return results, failures
