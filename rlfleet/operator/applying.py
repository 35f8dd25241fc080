"""Back-off for children the API server refuses (a 422 for a quantity it cannot parse, an admission
webhook's denial): per child, the first retry after BASE_S, doubling up to MAX_S. While a child backs
off, the reconciler skips applying it and reports its last error; its siblings are applied as usual.
A change of the owner's spec (`forget`) retries its children at once: the user may have fixed them.
Kept in the operator's memory: a restarted operator tries everything again, which is what a fresh
back-off would do anyway."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

BASE_S = 2.0
MAX_S = 300.0

ChildKey = tuple[str, str, str, str]  # (owner uid, kind, namespace, name)


@dataclass
class _Failure:
    tries: int
    retry_at: datetime.datetime
    message: str


@dataclass
class ApplyBackoff:
    base_s: float = BASE_S
    max_s: float = MAX_S
    _failures: dict[ChildKey, _Failure] = field(default_factory=dict)

    def waiting(self, key: ChildKey, now: datetime.datetime) -> str | None:
        """The child's last error while it still backs off, else None (apply it now)."""
        failure = self._failures.get(key)
        return failure.message if failure and now < failure.retry_at else None

    def failed(self, key: ChildKey, now: datetime.datetime, message: str) -> tuple[float, bool]:
        """Record a refusal: the seconds until the next try, and whether it is news (the first refusal of
        this child since it last applied, or a different message), which is worth an Event."""
        old = self._failures.get(key)
        tries = old.tries + 1 if old else 1
        delay = min(self.base_s * 2 ** (tries - 1), self.max_s)
        self._failures[key] = _Failure(tries, now + datetime.timedelta(seconds=delay), message)
        return delay, old is None or old.message != message

    def succeeded(self, key: ChildKey) -> None:
        self._failures.pop(key, None)

    def forget(self, owner_uid: str) -> None:
        """Retry every child of this owner at its next reconcile."""
        for key in [k for k in self._failures if k[0] == owner_uid]:
            del self._failures[key]
