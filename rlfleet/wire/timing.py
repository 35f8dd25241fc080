"""Named parts of wall time (`Laps`): where a trainer step, a worker or the verifier spends its seconds.

`with laps.part("name"): ...` adds the seconds spent inside the block to `name`, read from a monotonic
clock. Parts nest exclusively: while an inner part runs, the outer one's clock stops, so a second is
counted in at most one part and the parts of an interval add up to at most its length (exactly, when
every instruction of the interval is inside some part). Nesting is per thread: a part opened in one
thread never pauses a part of another. Only the names given at construction are accepted, so a typo
fails at once instead of making a part nobody reads.

Two readers: the trainer `take`s the parts of each step (one dict per step record); the workers and
the verifier pass `on_lap`, called with each closed part's seconds (a Prometheus counter's `inc`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ContextDecorator, nullcontext
from dataclasses import dataclass


@dataclass(slots=True)
class _Open:
    """A part running in this thread: its name, when it started, the seconds of the parts opened inside it."""

    name: str
    started: float
    nested: float = 0.0


class Laps:
    """Seconds per named part since the last `take` (see the module docstring)."""

    def __init__(
        self,
        names: Sequence[str],
        on_lap: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.names = tuple(names)
        self.on_lap, self.clock = on_lap, clock
        self._parts = dict.fromkeys(self.names, 0.0)
        self._lock = threading.Lock()
        self._local = threading.local()  # this thread's open parts (_Open), innermost last

    def part(self, name: str) -> _Part:
        """Count the block's seconds, less those of parts opened inside it, as `name`; as a decorator, each call's."""
        if name not in self._parts:
            raise KeyError(f"unknown part {name!r}; the parts are {', '.join(self.names)}")
        return _Part(self, name)

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` measured elsewhere as `name`."""
        with self._lock:
            self._parts[name] += seconds
        if self.on_lap is not None:
            self.on_lap(name, seconds)

    def take(self) -> dict[str, float]:
        """Every part's seconds since the last take (0.0 for a part that did not run), and start again."""
        with self._lock:
            parts, self._parts = self._parts, dict.fromkeys(self.names, 0.0)
        return parts

    def _stack(self) -> list[_Open]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack


class _Part(ContextDecorator):
    """One timing of a part (`Laps.part`). A class rather than a generator: a step enters hundreds of parts,
    and what the context manager's own machinery costs between its two clock readings is counted nowhere."""

    def __init__(self, laps: Laps, name: str):
        self.laps, self.name = laps, name
        self.stack: list[_Open] = []
        self.frame = _Open(name, 0.0)

    def _recreate_cm(self) -> _Part:  # a decorator's every call times itself (threads, recursion)
        return _Part(self.laps, self.name)

    def __enter__(self) -> None:
        self.stack = self.laps._stack()
        self.frame = _Open(self.name, self.laps.clock())
        self.stack.append(self.frame)

    def __exit__(self, *exc) -> None:
        elapsed = self.laps.clock() - self.frame.started
        self.stack.pop()
        if self.stack:
            self.stack[-1].nested += elapsed  # the enclosing part does not count these seconds
        self.laps.add(self.name, elapsed - self.frame.nested)


def lap_counter(counter) -> Callable[[str, float], None]:
    """An `on_lap` adding each part's seconds to a Prometheus counter labelled by part (`..._seconds_total{part}`)."""
    return lambda name, seconds: counter.labels(name).inc(seconds)


def timed(laps: Laps | None, name: str):
    """`laps.part(name)`, or nothing when there is no `laps` to count into (a caller that does not time)."""
    return laps.part(name) if laps is not None else nullcontext()
