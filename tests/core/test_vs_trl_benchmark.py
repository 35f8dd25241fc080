"""benchmarks/vs_trl.py's pure parts: the figures it reads from per-step series, and the TRL option mapping.

The runs themselves (TRL's GRPOTrainer and `rlfleet run`, minutes each) are the benchmark, not a test;
these check what turns their records into the reported figures, on synthetic records."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfleet.config import parse_bundle
from tests.support import benchmark_module

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "arithmetic" / "rlrun.yaml"


@pytest.fixture
def vs_trl(monkeypatch):
    return benchmark_module(monkeypatch, "vs_trl")


def example_run(**trainer):
    """The arithmetic example's RLRun spec, with `trainer` fields (camelCase) changed."""
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    docs[0]["spec"]["trainer"].update(trainer)
    return parse_bundle(yaml.safe_dump_all(docs)).run.spec


def test_moving_mean_counts_only_full_windows(vs_trl):
    assert vs_trl.moving_mean([1.0, 1.0, 0.0, 0.0], window=3) == [None, None, 2 / 3, 1 / 3]


def test_time_to_threshold_is_the_first_step_whose_window_mean_reaches_it(vs_trl):
    # A single 1.0 early on never lifts a 10-step mean to 0.9; the ramp does, at the step the 10th high value lands.
    rewards = [1.0] + [0.5] * 19 + [0.95] * 20
    times = [0.5 * (i + 1) for i in range(len(rewards))]
    assert vs_trl.time_to_threshold(times, rewards, 0.9) == {"step": 29, "seconds": 14.5}
    assert vs_trl.time_to_threshold(times, rewards, 0.8)["step"] == 27  # 3 x 0.5 + 7 x 0.95 = 8.15 of 10
    assert vs_trl.time_to_threshold(times, rewards, 0.99) == {"step": None, "seconds": None}


def test_steady_rate_leaves_out_the_start(vs_trl):
    # 19 slow start-up steps (2 s each), then 0.25 s a step: the steady rate is 4 steps/s whatever the start cost.
    times = [2.0 * (i + 1) for i in range(19)]
    times += [times[-1] + 0.25 * (i + 1) for i in range(60)]
    assert vs_trl.steady_steps_per_s(times) == pytest.approx(4.0)
    assert vs_trl.steady_steps_per_s(times[:20]) is None  # nothing after the start-up


def test_summary_of_a_synthetic_run(vs_trl):
    steps = 100
    times = [10.0 + 0.5 * i for i in range(steps)]  # first step at 10 s, then 2 steps/s
    sampled = [0.5] * 50 + [1.0] * 50
    trained = [0.5] * 50 + [0.85] * 50
    out = vs_trl.summarize(times, {"sampled": sampled, "trained": trained}, 70.0, 3 * 128 * steps, [128] * steps)
    assert out["steps_per_s_steady"] == pytest.approx(2.0)
    assert out["trained_completions_per_s_steady"] == pytest.approx(256.0)
    assert out["completions_per_s"] == pytest.approx(3 * 128 * steps / times[-1])
    assert out["generated_per_trained"] == pytest.approx(3.0)
    assert out["first_step_seconds"] == 10.0
    assert out["reward_first_tenth_sampled"] == 0.5 and out["reward_last_tenth_sampled"] == 1.0
    assert out["to_0.9_sampled"] == {"step": 58, "seconds": times[57]}  # 2 x 0.5 + 8 x 1.0 = 9 of 10
    assert out["to_0.9_trained"] == {"step": None, "seconds": None}
    assert out["to_0.8_trained"]["step"] == 59  # 0.5 + 9 x 0.85 = 8.15 of 10 (8 x 0.85: 7.8)


def test_split_medians_use_the_split_when_records_have_it(vs_trl):
    with_split = [
        {"step_seconds": s, "split": {"wait": s / 2, "publish": 0.1}, "wait_seconds": 9.0} for s in (1.0, 2.0, 4.0)
    ]
    assert vs_trl.median_split(with_split) == {"publish": 0.1, "wait": 1.0, "step_seconds": 2.0}
    older = [{"wait_seconds": w, "compute_seconds": 0.2, "publish_seconds": 0.1} for w in (0.1, 0.3, 0.9)]
    assert vs_trl.median_split(older) == {"wait_seconds": 0.3, "compute_seconds": 0.2, "publish_seconds": 0.1}
    # A run resumed by a newer trainer: the parts are the medians over the records that have them.
    assert vs_trl.median_split(older + with_split[:1])["wait"] == 0.5


def test_the_example_maps_one_to_one_onto_grpo_config(vs_trl):
    options = vs_trl.trl_options(example_run(), steps=150)
    expected = {
        "num_generations": 8,
        "per_device_train_batch_size": 128,  # 16 prompts x 8: TRL counts completions
        "max_completion_length": 6,
        "temperature": 1.0,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "delta": 4.0,
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "num_iterations": 1,
        "loss_type": "dapo",
        "gradient_accumulation_steps": 1,
        "max_steps": 150,
    }
    assert {k: options[k] for k in expected} == expected
    fields = {option: field for option, _, field in vs_trl.mapping_rows(example_run())}
    assert fields["epsilon_high"] == "trainer.epsHigh" and fields["delta"] == "trainer.delta"
    not_matched = vs_trl.unmatched(example_run())
    assert not_matched == vs_trl.NOT_MATCHED  # the example sets nothing beyond the standing differences
    assert any("maxAsyncLevel" in line for line in not_matched)


def test_a_run_s_own_differences_are_listed_and_converted(vs_trl):
    run = example_run(normalization="sequence", klCoef=0.01, skipZeroAdvantageGroups=True, epochs=2)
    options = vs_trl.trl_options(run, steps=10)
    assert (options["loss_type"], options["beta"], options["num_iterations"]) == ("grpo", 0.01, 2)
    extra = vs_trl.unmatched(run)[len(vs_trl.NOT_MATCHED) :]
    assert len(extra) == 2
    assert "skipZeroAdvantageGroups" in extra[0] and "klCoef" in extra[1]


def test_grpo_config_takes_every_mapped_option(vs_trl, tmp_path):
    trl = pytest.importorskip("trl")
    options = vs_trl.trl_options(example_run(), steps=150)
    config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **options)
    assert {k: getattr(config, k) for k in options} == options


def test_a_trl_seed_offset_moves_only_grpo_config_s_seed(vs_trl):
    run = example_run(seed=7)
    base, shifted = vs_trl.trl_options(run, steps=10), vs_trl.trl_options(run, steps=10, seed_offset=2)
    assert (base["seed"], shifted["seed"]) == (7, 9)
    assert {k: v for k, v in shifted.items() if k != "seed"} == {k: v for k, v in base.items() if k != "seed"}


def test_the_median_over_trl_seeds_counts_a_run_that_never_got_there_as_slowest(vs_trl):
    reached = [{"step": 54, "seconds": 25.0}, {"step": None, "seconds": None}, {"step": 75, "seconds": 34.0}]
    assert vs_trl.median_seconds(reached) == 34.0
    assert vs_trl.median_seconds(reached + [{"step": 52, "seconds": 26.0}]) == 30.0
    assert vs_trl.median_seconds(reached[:2]) is None  # half never got there: no median time


def test_seeds_summary_divides_rlfleet_s_time_by_the_trl_median(vs_trl):
    def trl(to_08, to_09=None):
        return {"to_0.8_logged": {"step": 1, "seconds": to_08}, "to_0.9_logged": {"step": None, "seconds": to_09}}

    fleet = {"to_0.8_sampled": {"step": 60, "seconds": 29.0}, "to_0.9_sampled": {"step": None, "seconds": None}}
    summary = vs_trl.seeds_summary(example_run(seed=3), [trl(25.0), trl(45.0), trl(30.0)], fleet)
    assert [s["seed"] for s in summary["trl_seeds"]] == [3, 4, 5]
    assert summary["trl_median_to_0.8_seconds"] == 30.0
    assert summary["time_to_0_8_ratio_vs_trl_median"] == pytest.approx(29.0 / 30.0)
    assert summary["trl_median_to_0.9_seconds"] is None and summary["time_to_0_9_ratio_vs_trl_median"] is None


LORA = {"rank": 16, "alpha": 32, "targetModules": ["q_proj", "v_proj"]}


def test_a_lora_run_trains_the_same_adapters_on_trl_s_side(vs_trl, tmp_path):
    run = example_run(lora=LORA)
    assert vs_trl.lora_options(run) == {
        "r": 16,
        "lora_alpha": 32.0,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,  # as rlfleet's trainer: it scores exactly what a merged adapter generates
        "bias": "none",
    }
    assert vs_trl.lora_options(example_run()) is None
    assert not any(option.startswith("LoraConfig.") for option in vs_trl.trl_options(run, steps=10))
    assert not any("lora" in line.lower() for line in vs_trl.unmatched(run)), "matched, so not listed as a difference"
    config = vs_trl.peft_config(vs_trl.lora_options(run))
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (16, 32.0, {"q_proj", "v_proj"})
    trl = pytest.importorskip("trl")
    options = vs_trl.trl_options(run, steps=10)
    grpo = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **options)
    assert {k: getattr(grpo, k) for k in options} == options


def test_trl_s_gradient_checkpointing_follows_activation_checkpointing(vs_trl):
    # GRPOConfig turns it on by default; rlfleet's trainer has it off unless the run asks
    assert vs_trl.trl_options(example_run(), steps=10)["gradient_checkpointing"] is False
    assert vs_trl.trl_options(example_run(activationCheckpointing=True), steps=10)["gradient_checkpointing"] is True


def eval_record(step: int, **evaluation) -> dict:
    return {"step": step, "wall_seconds": 10.0 * step} | {f"eval/{k}": v for k, v in evaluation.items()}


def test_rlfleet_s_held_out_curve_puts_each_score_at_its_version_s_publication(vs_trl):
    # evaluations land in later records than the step that published their version (the trainer's background)
    records = [
        eval_record(1, version=0, score=0.2),
        eval_record(2),
        eval_record(3, version=2, score=0.4),
        eval_record(4, version=4, score=0.5),
    ]
    times = [5.0 + r["wall_seconds"] for r in records]  # launch-relative: the trainer started 5 s after launch
    assert vs_trl.rlfleet_held_out(records, times, trainer_start=5.0) == [
        {"version": 0, "score": 0.2, "seconds": 5.0},
        {"version": 2, "score": 0.4, "seconds": 25.0},
        {"version": 4, "score": 0.5, "seconds": 45.0},
    ]


def test_times_to_trl_s_final_held_out_score(vs_trl):
    def curve(*points):
        return [{"version": v, "score": s, "seconds": t} for v, s, t in points]

    trl = curve((0, 0.2, 10.0), (5, 0.5, 100.0), (10, 0.4, 190.0), (15, 0.5, 280.0))
    fleet = curve((0, 0.2, 30.0), (5, 0.3, 150.0), (10, 0.58, 260.0), (15, 0.5, 400.0))
    summary = vs_trl.held_out_summary(trl, fleet)
    assert summary["trl_final_held_out"] == 0.5 and summary["rlfleet_final_held_out"] == 0.5
    # TRL first had its final score at version 5, not at its last; rlfleet first passed it at version 10
    assert summary["trl_to_final_held_out"] == {"version": 5, "seconds": 100.0}
    assert summary["rlfleet_to_trl_final_held_out"] == {"version": 10, "seconds": 260.0}
    assert summary["time_to_trl_final_held_out_ratio"] == pytest.approx(2.6)
    never = vs_trl.held_out_summary(trl, curve((0, 0.2, 30.0), (5, 0.3, 150.0)))
    assert never["rlfleet_to_trl_final_held_out"] == {"version": None, "seconds": None}
    assert never["time_to_trl_final_held_out_ratio"] is None
    assert vs_trl.held_out_summary(trl, []) == {}, "a run without spec.eval has no held-out figures"
