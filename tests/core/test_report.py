"""summary.json and the run's last line, from metrics.jsonl records."""

from __future__ import annotations

import json

from rlfleet.wire.run_summary import plot, reward_trend, summarize, write_reports


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


def test_the_summary_and_the_picture_carry_the_first_and_last_held_out_score(tmp_path):
    records = [record(s, 0.5, 0.5) for s in range(1, 21)]
    records[0].update({"eval/version": 0, "eval/score": 0.25})
    records[10].update({"eval/version": 10, "eval/score": 0.5})
    records[19].update({"eval/version": 20, "eval/score": 0.75})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_reports(tmp_path, 3.0, "eval")
    assert (summary["eval_score_first"], summary["eval_version_first"]) == (0.25, 0)
    assert (summary["eval_score_last"], summary["eval_version_last"]) == (0.75, 20)
    assert reward_trend(summary).endswith(", held-out 0.250 -> 0.750")
    assert (tmp_path / "reward.png").stat().st_size > 0
    no_eval = summarize([record(s, 0.5, 0.5) for s in range(1, 11)], 1.0)
    assert no_eval["eval_score_first"] is None and "held-out" not in reward_trend(no_eval)


def test_a_mixture_s_sources_get_their_first_and_last_reward_and_a_line_on_the_picture(tmp_path):
    def with_sources(step: int) -> dict:
        r = record(step, 0.5, 0.5)
        r["sources"] = {
            "math": {"reward_mean": 0.2 + step / 100, "groups": 2, "sampled_reward_mean": 0.1 + step / 50,
                     "sampled_groups": 3},
            "code": {"reward_mean": None, "groups": 0, "sampled_reward_mean": 0.3, "sampled_groups": 1},
        }  # fmt: skip
        return r

    records = [with_sources(s) for s in range(1, 21)]
    summary = summarize(records, 1.0)
    math, code = summary["sources"]["math"], summary["sources"]["code"]
    assert (math["sampled_reward_first"], math["sampled_reward_last"]) == (0.1 + 1.5 / 50, 0.1 + 19.5 / 50)
    assert math["groups"] == 40 and code["groups"] == 0
    assert code["reward_first"] is None and code["sampled_reward_last"] == 0.3, "no trained group: no trained mean"
    assert "sources" not in summarize([record(s, 0.5, 0.5) for s in range(1, 11)], 1.0), "single task: no sources"
    plot(records, tmp_path / "reward.png", "mixture")
    plot([record(s, 0.5, 0.5) for s in range(1, 11)], tmp_path / "single.png", "single")
    assert (tmp_path / "reward.png").stat().st_size > (tmp_path / "single.png").stat().st_size, "the source lines"
