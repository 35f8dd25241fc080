"""The async window (`spec.trainer.maxAsyncLevel`): how far behind the newest policy version a group may be sampled.

With the newest version N and maxAsyncLevel A, the window is the versions N - A .. N:
- the verifier rejects a group of a version older than N - A as `stale_version`, and its one-time guards forget
  work older than that (nothing older can be accepted again);
- the trainer, stepping while it holds version N, trains groups of N - A .. N and drops older ones as stale; it
  tells the workers that oldest version (its demand), so they stop sampling what would arrive stale;
- a worker whose loaded version is more than A behind the newest announced pauses (`version_lag`);
- a consumer of versions (the verifier's loaded models, the store's retention) keeps the window and the one
  being loaded: A + 2 versions.
A = 0 is synchronous RL: a group is trained only by the step of the version that sampled it.

Invariant: this module is the only reader of `maxAsyncLevel`; every process builds its window with
`AsyncWindow.of(spec)`, so the verifier, the trainer and the workers agree on what is stale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlfleet.config import RLRunSpec


@dataclass(frozen=True)
class AsyncWindow:
    """The versions N - A .. N of the module docstring, for A = `max_async_level`."""

    max_async_level: int

    @classmethod
    def of(cls, spec: RLRunSpec) -> AsyncWindow:
        """The run's window (spec.trainer.maxAsyncLevel)."""
        return cls(spec.trainer.max_async_level)

    def oldest(self, newest: int) -> int:
        """The oldest version still inside the window when `newest` is the newest (may be negative early on)."""
        return newest - self.max_async_level

    def is_stale(self, version: int, newest: int) -> bool:
        """Whether work of `version` is outside the window whose newest version is `newest`."""
        return version < self.oldest(newest)

    def versions_to_keep(self) -> int:
        """How many versions a consumer keeps so that it can serve the whole window while loading the next."""
        return self.max_async_level + 2
