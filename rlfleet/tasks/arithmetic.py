"""Synthetic integer arithmetic: `a+b=` -> `c`, exact-match binary reward.

A task id is `arith-{seed}-{index}`; the operands come from a hash of (seed, index), so any
process rebuilds the same problem from the id alone.
"""

from __future__ import annotations

import hashlib

import numpy as np

from rlfleet.tasks.base import Problem, TaskSource

ALPHABET = "0123456789+-="


class ArithmeticTask(TaskSource):
    def __init__(self, seed: int = 0, max_operand: int = 99, operations: tuple[str, ...] = ("+",)):
        self.seed = seed
        self.max_operand = max_operand
        self.operations = operations
        self._prefix = f"arith-{seed}-"

    def problem(self, task_id: str) -> Problem:
        if not task_id.startswith(self._prefix) or not task_id[len(self._prefix) :].isdigit():
            raise KeyError(f"task id {task_id!r} is not of the form {self._prefix}<index>")
        digest = hashlib.sha256(task_id.encode()).digest()
        a = int.from_bytes(digest[0:4], "little") % (self.max_operand + 1)
        b = int.from_bytes(digest[4:8], "little") % (self.max_operand + 1)
        op = self.operations[digest[8] % len(self.operations)]
        answer = a + b if op == "+" else a - b
        return Problem(task_id=task_id, prompt=f"{a}{op}{b}=", answer=str(answer))

    def sample_id(self, rng: np.random.Generator) -> str:
        return f"{self._prefix}{int(rng.integers(0, 2**62))}"

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0
