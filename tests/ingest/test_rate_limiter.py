"""The ingest's token buckets (rlfleet/services/ingest/limits.py RateLimiter): rates, and memory bounded by the keys
seen within a minute, not by every worker or address ever seen."""

from __future__ import annotations

from rlfleet.services.ingest.limits import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_allows_its_rate_then_says_how_long_to_wait_and_refills():
    clock = Clock()
    limiter = RateLimiter(60, clock=clock)
    assert all(limiter.take("w") == 0.0 for _ in range(60))
    assert limiter.take("w") == 1.0  # 60 a minute: one more token in a second
    clock.now += 1.0
    assert limiter.take("w") == 0.0
    assert limiter.take("slow", rate_per_minute=2) == 0.0 and limiter.take("slow", rate_per_minute=2) == 0.0
    assert limiter.take("slow", rate_per_minute=2) == 30.0


def test_full_buckets_are_dropped_once_the_table_grows_and_the_limits_still_hold():
    clock = Clock()
    limiter = RateLimiter(10, clock=clock, prune_at=100)
    for i in range(99):  # 99 addresses, one join each
        assert limiter.take(f"addr-{i}") == 0.0
    assert len(limiter) == 99
    clock.now += 60.0  # every bucket has refilled: as good as none
    for _ in range(10):  # one busy address empties its bucket; its second call finds 100 keys and prunes
        assert limiter.take("busy") == 0.0
    assert len(limiter) == 1, "the 99 full buckets went; the busy one stayed"
    assert limiter.take("busy") > 0.0, "pruning never forgives a bucket that is not full"
    for i in range(250):  # the mark moved to max(100, 2 x 1): the table never holds the refilled keys for long
        clock.now += 1.0
        limiter.take(f"new-{i}")
        assert len(limiter) <= 200
