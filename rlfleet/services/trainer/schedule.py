"""The learning-rate schedule (`trainer.warmupSteps`, `trainer.lrSchedule`, `trainer.steps`).

The base rate (`trainer.learningRate`) is multiplied at step s (0-based) by:
  warmup:    (s + 1) / warmupSteps while s < warmupSteps, a linear ramp that reaches 1 at its last step;
  then, with progress p = (s - warmupSteps) / (steps - warmupSteps), capped at 1:
  constant:  1;
  linear:    1 - p;
  cosine:    (1 + cos(pi * p)) / 2.
The trainer hands the factor to torch's LambdaLR (main.py), whose state is saved with the resume state (state.py),
so a resumed run goes on where the schedule was.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_factor(warmup: int, schedule: str, total: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate at step s (0-based): linear warmup, then the schedule."""

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
