"""The online prompt filter's record (rlfleet/fleet/prompt_filter.py) on a real Redis and its config errors
(who may read and write the retired prompts: tests/core/test_redis_acl.py)."""

from __future__ import annotations

import pytest

from rlfleet.config import ConfigError, OnlineFilterSpec, parse_bundle
from rlfleet.fleet.prompt_filter import OutcomeRecorder, RetiredPrompts, draw_unretired, prompt_key
from rlfleet.wire.streams import RunKeys
from tests.runs import bundle_yaml, rlrun

SOLVED, FAILED, MIXED = [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]
A, B, C = [5, 6, 7], [5, 6, 8], [9]


def test_a_prompt_is_retired_after_window_groups_all_solved_or_all_failed(redis_client):
    keys = RunKeys("pf")
    recorder = OutcomeRecorder(OnlineFilterSpec(window=2), redis_client, keys)
    assert recorder.observe(A, SOLVED) is None, "one solved group is not yet a window"
    assert recorder.observe(B, SOLVED) is None
    assert recorder.observe(B, MIXED) is None
    assert recorder.observe(B, SOLVED) is None, "solved, mixed, solved: the last two are not all solved"
    assert recorder.observe(A, SOLVED) == "solved"
    assert recorder.observe(C, FAILED) is None and recorder.observe(C, FAILED) == "failed"
    assert recorder.observe(A, SOLVED) is None, "a retired prompt is pushed once"
    assert recorder.retired == {"solved": 1, "failed": 1}
    assert redis_client.lrange(keys.retired_prompts, 0, -1) == [prompt_key(A).encode(), prompt_key(C).encode()]

    retired = RetiredPrompts(redis_client, keys)
    retired.refresh()
    assert prompt_key(A) in retired and prompt_key(C) in retired and prompt_key(B) not in retired
    # A trainer that restarts reloads what was retired and never pushes it again.
    again = OutcomeRecorder(OnlineFilterSpec(window=2), redis_client, keys)
    assert again.observe(A, SOLVED) is None and again.observe(A, SOLVED) is None
    assert again.observe(B, SOLVED) is None and again.observe(B, SOLVED) == "solved"
    retired.refresh()  # incremental: only the new entry is read
    assert retired.read == 3 and prompt_key(B) in retired


def test_thresholds_decide_what_counts_as_solved_and_failed(redis_client):
    spec = OnlineFilterSpec(window=1, solved_at=0.75, failed_at=None)
    recorder = OutcomeRecorder(spec, redis_client, RunKeys("pf2"))
    assert recorder.outcome([1.0, 1.0, 1.0, 0.0]) == "solved"
    assert recorder.outcome([0.0, 0.0]) == "mixed", "failedAt empty: failed prompts are never retired"
    assert recorder.observe(C, FAILED) is None and recorder.observe(A, [0.8, 0.7]) == "solved"


def test_draws_skip_retired_prompts_and_give_up_after_max_draws(redis_client):
    keys = RunKeys("pf3")
    redis_client.rpush(keys.retired_prompts, prompt_key(A), prompt_key(B))
    retired = RetiredPrompts(redis_client, keys)
    retired.refresh()
    draws = iter([A, B, A, C, A])
    assert draw_unretired(lambda: next(draws), prompt_key, retired, 10) == (C, 3)
    only_retired = iter([A, B, A, B])
    assert draw_unretired(lambda: next(only_retired), prompt_key, retired, 3) == (A, 2), "the last draw, taken anyway"
    assert draw_unretired(lambda: None, prompt_key, retired, 3) == (None, 0), "stopped: no more draws"


@pytest.mark.parametrize(
    ("online_filter", "message"),
    [
        ({"window": 0}, "spec.sampling.onlineFilter.window: Input should be greater than or equal to 1"),
        ({"solvedAt": 0.5, "failedAt": 0.5}, "solvedAt (0.5) must be above failedAt (0.5)"),
        ({"solvedAt": None, "failedAt": None}, "solvedAt and failedAt are both empty"),
        ({"maxRedraws": 0}, "spec.sampling.onlineFilter.maxRedraws"),
        ({"windw": 2}, "spec.sampling.onlineFilter.windw: unknown field"),
    ],
)
def test_bad_online_filter_settings_are_errors_naming_the_field(online_filter, message):
    text = bundle_yaml(rlrun(sampling={"onlineFilter": online_filter}))
    with pytest.raises(ConfigError) as err:
        parse_bundle(text)
    assert any(message in p for p in err.value.problems), err.value.problems
    if "onlineFilter." not in message:
        assert any("spec.sampling.onlineFilter" in p for p in err.value.problems), err.value.problems
