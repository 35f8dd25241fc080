"""Sample a model on a list of problems and score every completion with the task's own reward: what
`rlfleet filter` records as solve rates (rlfleet/services/rollout/difficulty.py) and what the trainer's
held-out evaluation reports (rlfleet/services/trainer/evaluation.py).

Completions come from a rollout engine (the torch engine, or vLLM), batched `groups_per_call`
problems at a time, `k` completions each. Problem i of the list draws with group seed `seed + i`
(rlfleet/models/sampling.py), so the same call on the same weights gives the same completions, and
two versions are compared on the same random stream. Greedy decoding is top-k 1: every draw takes
the most likely token, whatever the uniforms.
The reward is `TaskSource.reward` of the decoded completion (no length penalty: a solve rate and
a held-out score measure the task, not the length target). Of a task that takes turns, given the run's
spec.sampling, each completion is an episode (rlfleet/engines/episodes.py) and the reward reads its
`episode_text`; a problem whose environment fails a turn scores 0 for each of its k episodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlfleet.engines.base import Engine, Generation, GroupRequest
from rlfleet.engines.episodes import generate_episodes
from rlfleet.tasks.base import TaskSource
from rlfleet.tasks.chat import encode_prompt
from rlfleet.tasks.turns import episode_text
from rlfleet.wire.streams import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    """Sampling parameters of greedy decoding (top-k 1; the seed changes nothing)."""
    return SamplingParams(temperature=1.0, top_p=1.0, top_k=1, max_tokens=max_tokens, seed=0)


@dataclass(frozen=True)
class Scores:
    """Rewards of k completions per problem, in the order of the task ids asked for."""

    task_ids: list[str]
    rewards: list[list[float]]

    def solve_rates(self, pass_reward: float = 1.0) -> list[float]:
        """Per problem: the share of its completions whose reward is at least `pass_reward`."""
        return [sum(r >= pass_reward for r in rs) / len(rs) for rs in self.rewards]

    def pass_at_k(self, pass_reward: float = 1.0) -> float:
        """The share of problems with at least one passing completion (pass@k with k the completions drawn)."""
        return sum(any(r >= pass_reward for r in rs) for rs in self.rewards) / max(1, len(self.rewards))

    def reward_mean(self) -> float:
        flat = [r for rs in self.rewards for r in rs]
        return sum(flat) / max(1, len(flat))


def score_problems(
    engine: Engine,
    task: TaskSource,
    task_ids: list[str],
    k: int,
    params: SamplingParams,
    groups_per_call: int | None = None,
    on_batch=None,
    sampling=None,
) -> Scores:
    """Rewards of `k` completions of each of `task_ids` (module docstring); `on_batch(done, total)` is
    called after each engine call (progress); `sampling`: the run's spec.sampling, whose turn limits a task that
    takes turns is sampled by (None: one completion each)."""
    if k < 1:
        raise ValueError(f"k: {k} completions per problem; draw at least 1")
    per_call = groups_per_call or engine.default_groups_in_flight
    done_ids: list[str] = []
    rewards: list[list[float]] = []
    for start in range(0, len(task_ids), per_call):
        chunk = task_ids[start : start + per_call]
        problems = [task.problem(t) for t in chunk]
        requests = [
            GroupRequest(encode_prompt(engine.tokenizer, p), replace(params, seed=params.seed + start + j), k)
            for j, p in enumerate(problems)
        ]
        generated: list[list[Generation] | None]
        if sampling is not None and task.multi_turn and sampling.max_turns > 1:
            generated, _ = generate_episodes(engine, task, requests, problems, sampling)
        else:
            generated = list(engine.generate_groups(requests))
        for problem, gens in zip(problems, generated):
            if gens is None:  # the environment failed a turn of this problem's episodes
                rewards.append([0.0] * k)
            else:
                texts = [episode_text(task, problem, engine.tokenizer, g.completion_ids, g.spans, engine.stop_ids)
                         for g in gens]  # fmt: skip
                rewards.append([float(r) for r in task.rewards(problem, texts)])  # a batch reward where it has one
            done_ids.append(problem.task_id)
        if on_batch is not None:
            on_batch(len(done_ids), len(task_ids))
    return Scores(done_ids, rewards)
