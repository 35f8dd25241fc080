"""An example rlfleet user environment: add up a short list of numbers.

A problem is `a,b,c` (digits and commas only, so the builtin model `builtin://tiny-math` can read it) and
the answer their sum; a completion scores 1 when it is exactly `\\boxed{sum}`, else 0. The task id
`sums-{seed}-{index}` determines the numbers through a hash, so the verifier, in another process on
another machine, rebuilds the same problem from the id alone: the contract of docs/environments.md.
"""

from __future__ import annotations

import hashlib

from rlfleet.tasks import Problem, TaskSource


class SumsEnvironment(TaskSource):
    """`terms` numbers of 0..`max_value` each (the factory's arguments come from spec.task.config, as strings)."""

    def __init__(self, terms: str = "3", max_value: str = "9", seed: str = "0"):
        self.terms, self.max_value = int(terms), int(max_value)
        if not 1 <= self.terms <= 8 or not 0 <= self.max_value <= 999:
            raise ValueError(f"terms {terms} must be 1..8 and max_value {max_value} 0..999")
        self.prefix = f"sums-{int(seed)}-"

    def problem(self, task_id: str) -> Problem:
        index = task_id[len(self.prefix) :]
        if not task_id.startswith(self.prefix) or not index.isdigit():
            raise KeyError(f"task id {task_id!r} is not of the form {self.prefix}<index>")
        digest = hashlib.sha256(task_id.encode()).digest()
        numbers = [digest[i] % (self.max_value + 1) for i in range(self.terms)]
        return Problem(task_id=task_id, prompt=",".join(map(str, numbers)), answer=str(sum(numbers)))

    def sample_id(self, rng) -> str:
        return f"{self.prefix}{int(rng.integers(0, 2**62))}"

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == f"\\boxed{{{problem.answer}}}" else 0.0

    def rewards(self, problem: Problem, completions: list[str]) -> list[float]:
        """The optional batch form: one call scores a whole group (here no faster, but it shows the shape)."""
        want = f"\\boxed{{{problem.answer}}}"
        return [1.0 if c.strip() == want else 0.0 for c in completions]
