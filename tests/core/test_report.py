"""summary.json and the run's last line, from metrics.jsonl records."""

from __future__ import annotations

from rlfleet.local.report import reward_trend, summarize


def record(step: int, reward: float, sampled: float | None) -> dict:
    r = {"step": step, "policy_version": step, "reward_mean": reward, "accuracy": reward, "samples": 8}
    r.update(staleness_mean=0.5, accepted=step, rejected=0)
    if sampled is not None:
        r["sampled_reward_mean"] = sampled
    return r


def test_the_summary_reports_the_trained_and_the_sampled_reward_over_the_first_and_last_tenth():
    records = [record(s, 0.4 if s <= 2 else 0.8, 0.4 if s <= 2 else 0.95) for s in range(1, 21)]
    summary = summarize(records, 10.0)
    assert (summary["reward_first"], summary["reward_last"]) == (0.4, 0.8)
    assert (summary["sampled_reward_first"], summary["sampled_reward_last"]) == (0.4, 0.95)
    assert reward_trend(summary) == "reward 0.400 -> 0.800 (as sampled 0.400 -> 0.950)"


def test_records_of_a_trainer_without_the_sampled_reward_still_summarize():
    summary = summarize([record(s, 0.5, None) for s in range(1, 11)], 1.0)
    assert summary["sampled_reward_last"] is None
    assert reward_trend(summary) == "reward 0.500 -> 0.500"
