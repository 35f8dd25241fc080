"""Supervised warm start on imperfect demonstrations.

Next-token cross-entropy on `prompt + demonstration + <eos>` (the demonstration writes the answer
the way the task wants it, e.g. `\\boxed{5/6}`, or is the problem's reference completion when its
source has one, e.g. a code row's `solution`), the prompt encoded as the run encodes it (its chat
template included: tasks/chat.py), loss on the demonstration tokens only, AdamW,
fixed seed. A fraction `label_noise` of the demonstrations carry a near-miss answer (the right one
off by 1..9; for a fraction, its numerator), like SFT data with mistakes in it: the warm-started
policy puts most of its mass on the right answer but samples plausible wrong ones at temperature
1, so a group holds both successes and failures and RL has something to sharpen."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rlfleet.tasks.base import Problem, noisy_answer
from rlfleet.tasks.chat import encode_prompt
from rlfleet.tasks.turns import environment_tokens


def encode_pairs(
    tokenizer, pairs: list[tuple[Problem, str | list[str]]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) input ids, attention mask and labels (-100 outside the answer). An answer that is a list
    of turns (a multi-turn demonstration: the model's, then alternating with the environment's) is laid out as an
    episode is (rlfleet/tasks/turns.py): each model turn ends with EOS and is labelled, each environment turn is
    inserted as `environment_tokens` makes it and is not."""
    rows, labels = [], []
    for problem, answer in pairs:
        p = encode_prompt(tokenizer, problem)
        row, label = list(p), [-100] * len(p)
        for k, turn in enumerate([answer] if isinstance(answer, str) else answer):
            if k % 2:
                tokens = environment_tokens(tokenizer, problem, turn)
                row, label = row + tokens, label + [-100] * len(tokens)
            else:
                tokens = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                row, label = row + tokens, label + tokens
        rows.append(row)
        labels.append(label)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, label) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(label)] = torch.tensor(label)
    return ids, mask, lab


def demonstrate(problem: Problem, demonstration: str, rng: np.random.Generator, label_noise: float) -> str:
    """The completion to imitate: the reference completion if the problem has one, else the answer written
    by `demonstration`; with probability `label_noise` a near miss of it."""
    noisy = rng.random() < label_noise
    if problem.reference is not None:
        return noisy_answer(problem.reference, rng) if noisy else problem.reference
    return demonstration.format(answer=noisy_answer(problem.answer, rng) if noisy else problem.answer)


@dataclass(frozen=True)
class WarmStart:
    """A warm start's recipe: `steps` AdamW steps at learning rate `lr` on batches of `batch_size` problems drawn
    with `seed`; `demonstration` writes an answer as the completion to imitate, e.g. `\\boxed{{{answer}}}`, and
    a fraction `label_noise` of the demonstrations is a near miss."""

    steps: int
    seed: int
    label_noise: float = 0.0
    batch_size: int = 64
    lr: float = 3e-3
    demonstration: str = "{answer}"


def supervised_warm_start(
    model, tokenizer, task, recipe: WarmStart, progress: Callable[[int, int], None] | None = None
) -> None:
    """Train `model` on `task`'s demonstrations by `recipe`; `progress(done, total)` is called before the first
    step and after every step."""
    steps, rng = recipe.steps, np.random.default_rng(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    model.train()
    if progress:
        progress(0, steps)
    for step in range(steps):
        problems = [task.problem(task.sample_id(rng)) for _ in range(recipe.batch_size)]
        pairs = [
            (p, task.demonstration_turns(p, rng, recipe.label_noise) or demonstrate(p, recipe.demonstration, rng,
                                                                                   recipe.label_noise))
            for p in problems
        ]  # fmt: skip
        ids, mask, labels = encode_pairs(tokenizer, pairs)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if progress:
            progress(step + 1, steps)
    model.eval()
