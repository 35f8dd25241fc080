"""rlfleet and Hugging Face TRL side by side: one RLRun's work by TRL's GRPOTrainer and by `rlfleet run`.

Both systems run back to back in one invocation, each as its own process launched from here, on
the same work: the run's model bytes (a builtin is resolved exactly as rlfleet's trainer resolves it
and loaded as a transformers model and tokenizer), prompts from rlfleet's own task generator encoded
as the workers encode them (checked: TRL's tokenization of each prompt must equal
rlfleet/tasks/chat.py encode_prompt), the task's reward, and the hyper-parameters mapped one to one
(the table `mapping` prints; what cannot be matched is listed under it). Per system:

- total wall time from launch (process start) to end;
- steps/s over the steady part (steps 20..N), completions/s (generated, launch to the last step: for
  rlfleet the groups its verifier judged x groupSize) and trained completions/s (steady);
- time from launch to a 10-step mean reward of 0.8 and 0.9 (the mean over the last 10 steps, first
  reached at that step): TRL's logged reward per step (on-policy: the sampled batch is the trained
  one); rlfleet's sampled reward (`sampled_reward_mean`: every group the trainer read, repeats
  included) and trained reward (`reward_mean`: the batch it trained on);
- reward over the last tenth of the steps; the load average before and after the run;
- the median step split: rlfleet's `split` parts of metrics.jsonl where its records have them (else
  wait / compute / publish), TRL's generate-and-score time (timed around GRPOTrainer's own
  `_generate_and_score_completions`) and the rest of its step (forward, backward, optimizer);
- with `spec.eval` set, the held-out score of both sides' versions, evaluated the same way: by rlfleet's
  Evaluator (its torch engine, the run's held-out problems, greedy or pass@k as spec.eval says) in a
  background thread of the training process, offered the weights after steps 0, every, 2 x every, ... and
  the last (TRL's model saved for it; a LoRA run's: the adapter), so both sides' training shares the CPU
  with their evaluations alike. A score is placed at the time its version was made (rlfleet: the step
  record that published it; TRL: the end of that step). Then the time each side first reached TRL's final
  held-out score and their ratio, `time_to_trl_final_held_out_ratio`.

`time_to_0_9_ratio` and `time_to_0_8_ratio` in the JSON: rlfleet's sampled time to the threshold ÷ TRL's.
A seeded TRL run crosses a threshold at one fixed step, a single draw of where a noisy reward curve first
touches it; `--trl-seeds K` runs TRL K times (GRPOConfig seeds trainer.seed, +1, ...; the same model bytes)
and adds each seed's times, their median (a seed that never got there counts as slowest) and
`time_to_0_8_ratio_vs_trl_median` / `time_to_0_9_ratio_vs_trl_median`.

    python benchmarks/vs_trl.py                              # the arithmetic example: tables
    python benchmarks/vs_trl.py --json                       # one JSON object (tables on stderr)
    python benchmarks/vs_trl.py --spot-check-fraction 0.25   # rlfleet verifies a quarter of the groups
    python benchmarks/vs_trl.py --compute-bound              # the math example: larger model, 16 tokens
    python benchmarks/vs_trl.py --compute-bound --trl-seeds 4  # and against TRL's median over 4 seeds
    python benchmarks/vs_trl.py --config my-run.yaml --steps 60
    python benchmarks/vs_trl.py --config examples/smollm2/rlrun.yaml --trl-threads 2   # a released model

TRL is in the `bench` extra (`pip install -e '.[bench]'`). A few minutes on 2 cores for the arithmetic example.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _paths import ROOT

from rlfleet.config import load_bundle

EXAMPLE = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
COMPUTE_BOUND = ROOT / "examples" / "math" / "rlrun.yaml"  # builtin://tiny-math: 1.9x the widths, 16 tokens
THRESHOLDS = (0.8, 0.9)
WINDOW = 10  # steps in the moving mean a threshold is read on
STEADY_FROM = 20  # steps before this one are start-up (model loads, first versions), left out of steps/s

# TRL GRPOConfig option <- rlfleet RLRun spec field, and how the value converts.
NORMALIZATION = {"token": "dapo", "sequence": "grpo"}  # DAPO: token mean over the batch; GRPO: mean of sequence means
MAPPED: list[tuple[str, str, object]] = [
    ("num_generations", "sampling.groupSize", lambda s: s.sampling.group_size),
    (
        "per_device_train_batch_size",
        "trainer.batchSize x sampling.groupSize",
        lambda s: s.trainer.batch_size * s.sampling.group_size,
    ),
    ("max_completion_length", "sampling.maxTokens", lambda s: s.sampling.max_tokens),
    ("temperature", "sampling.temperature", lambda s: s.sampling.temperature),
    ("top_p", "sampling.topP", lambda s: s.sampling.top_p),
    ("top_k", "sampling.topK", lambda s: s.sampling.top_k),
    ("learning_rate", "trainer.learningRate", lambda s: s.trainer.learning_rate),
    ("weight_decay", "trainer.weightDecay", lambda s: s.trainer.weight_decay),
    ("lr_scheduler_type", "trainer.lrSchedule", lambda s: s.trainer.lr_schedule),
    ("warmup_steps", "trainer.warmupSteps", lambda s: s.trainer.warmup_steps),
    ("epsilon", "trainer.epsLow", lambda s: s.trainer.eps_low),
    ("epsilon_high", "trainer.epsHigh", lambda s: s.trainer.eps_high),
    ("delta", "trainer.delta", lambda s: s.trainer.delta),
    ("max_grad_norm", "trainer.maxGradNorm", lambda s: s.trainer.max_grad_norm),
    ("beta", "trainer.klCoef", lambda s: s.trainer.kl_coef),
    ("num_iterations", "trainer.epochs", lambda s: s.trainer.epochs),
    ("loss_type", "trainer.normalization", lambda s: NORMALIZATION[s.trainer.normalization]),
    ("seed", "trainer.seed", lambda s: s.trainer.seed),
    # TRL's GRPOConfig turns it on by default (memory for time); rlfleet's default is off
    ("gradient_checkpointing", "trainer.activationCheckpointing", lambda s: s.trainer.activation_checkpointing),
]
# peft LoraConfig option <- trainer.lora field (a LoRA run: both sides train the same adapters, dropout 0).
LORA_MAPPED: list[tuple[str, str, object]] = [
    ("r", "trainer.lora.rank", lambda lora: lora.rank),
    ("lora_alpha", "trainer.lora.alpha", lambda lora: lora.alpha),
    ("target_modules", "trainer.lora.targetModules", lambda lora: list(lora.target_modules)),
]
LORA_FIXED = {"lora_dropout": 0.0, "bias": "none"}  # what rlfleet's trainer sets (services/trainer/lora.py)
# Set on the TRL side to what rlfleet does with no field for it.
FIXED = {
    "gradient_accumulation_steps": 1,  # one optimizer step per batch of groups
    "scale_rewards": "group",  # advantages normalised within each group
    "importance_sampling_level": "token",  # the ratio is per token
    "mask_truncated_completions": False,  # a completion cut at maxTokens is trained as it is
    "use_vllm": False,  # rlfleet's torch engine (the examples' pools) against transformers' generate
}
NOT_MATCHED = [
    "asynchrony: rlfleet trains groups sampled by a policy up to trainer.maxAsyncLevel versions old while workers "
    "keep sampling; TRL samples, then trains, on-policy, in one process",
    "processes: rlfleet runs workers (InferencePool replicas), a verifier, a relay, the trainer and Redis, each "
    "with one torch thread; TRL one process (--trl-threads)",
    "verification: rlfleet builds TOPLOC proofs for every group and the verifier checks spec.verifier."
    "spotCheckFraction of them with a prefill; TRL verifies nothing",
    "weights: rlfleet publishes a signed version each step through a relay, and workers and verifier load it; TRL "
    "generates with the weights it trains",
    "repeats: rlfleet trains no content twice (workers hold back groups repeating trained content, the trainer "
    "drops the rest), so it samples more than it trains; TRL trains every completion it samples",
    "prompts: the same task generator and distribution, not the same draws (rlfleet's workers draw from their own "
    "seeds, in the order their groups finish)",
    "advantage scale: rlfleet divides by the population std + 1e-6, TRL by the sample std (n-1) + 1e-4",
]


def grpo_rows(run) -> list[tuple[str, object, str]]:
    """(GRPOConfig option, value, rlfleet field) for every mapped option of `run` (an RLRun spec), then the fixed
    ones."""
    rows = [(option, convert(run), field) for option, field, convert in MAPPED]  # type: ignore[operator]
    return rows + [(option, value, "(fixed)") for option, value in FIXED.items()]


def lora_rows(run) -> list[tuple[str, object, str]]:
    """(LoraConfig option, value, rlfleet field) of a LoRA run, then the fixed ones; [] without trainer.lora."""
    lora = run.trainer.lora
    if lora is None:
        return []
    rows = [(option, convert(lora), field) for option, field, convert in LORA_MAPPED]  # type: ignore[operator]
    return rows + [(option, value, "(fixed)") for option, value in LORA_FIXED.items()]


def mapping_rows(run) -> list[tuple[str, object, str]]:
    """The whole mapping as printed: GRPOConfig's rows, then a LoRA run's adapter options as `LoraConfig.<option>`."""
    return grpo_rows(run) + [(f"LoraConfig.{option}", value, field) for option, value, field in lora_rows(run)]


def trl_options(run, steps: int, seed_offset: int = 0) -> dict:
    """GRPOConfig keyword arguments for `run`'s work over `steps` optimizer steps; `seed_offset` is added to
    the seed (TRL's sampling and data order; the model bytes stay the run's)."""
    options = {option: value for option, value, _ in grpo_rows(run)}
    return options | {"max_steps": steps, "seed": options["seed"] + seed_offset}


def lora_options(run) -> dict | None:
    """peft LoraConfig keyword arguments for a LoRA run (None otherwise)."""
    return {option: value for option, value, _ in lora_rows(run)} or None


def unmatched(run) -> list[str]:
    """What of `run` the TRL side does not reproduce: the standing differences and this run's own."""
    t = run.trainer
    own = [
        (
            t.skip_zero_advantage_groups,
            "trainer.skipZeroAdvantageGroups: rlfleet trains only groups whose rewards differ and samples until it has "
            "batchSize of them (its workers hold the others back unverified); TRL trains every group it samples",
        ),
        (t.off_policy.mode != "none", f"trainer.offPolicy.mode {t.off_policy.mode}: TRL's correction is vLLM-only"),
        (t.entropy_coef > 0, "trainer.entropyCoef: not passed to TRL"),
        (t.kl_coef > 0, "trainer.klCoef: rlfleet clamps the per-token k3 estimate to [0, 10], TRL does not"),
        (run.sampling.online_filter is not None, "sampling.onlineFilter: TRL samples solved prompts again"),
        (run.length_penalty is not None, "lengthPenalty: TRL's reward is the task's alone"),
        (run.model.dtype != "float32", f"model.dtype {run.model.dtype}: TRL trains in float32 here"),
    ]
    return NOT_MATCHED + [line for applies, line in own if applies]


# -- figures from per-step series (pure) ------------------------------------------------------------------------


def moving_mean(values: list[float], window: int = WINDOW) -> list[float | None]:
    """Trailing mean over `window` steps; None until `window` steps exist (a mean of fewer is no 10-step mean)."""
    return [None if i + 1 < window else sum(values[i + 1 - window : i + 1]) / window for i in range(len(values))]


def time_to_threshold(times: list[float], values: list[float], threshold: float, window: int = WINDOW) -> dict:
    """The first step (1-based) whose trailing `window`-step mean is >= threshold and its time; None if never."""
    for i, mean in enumerate(moving_mean(values, window)):
        if mean is not None and mean >= threshold:
            return {"step": i + 1, "seconds": times[i]}
    return {"step": None, "seconds": None}


def steady_steps_per_s(times: list[float], first: int = STEADY_FROM) -> float | None:
    """Steps per second from step `first` (1-based) to the last: (last - first) / (t_last - t_first)."""
    if len(times) <= first or times[-1] <= times[first - 1]:
        return None
    return (len(times) - first) / (times[-1] - times[first - 1])


def first_tenth(values: list[float]) -> float | None:
    head = values[: max(1, len(values) // 10)]
    return sum(head) / len(head) if head else None


def last_tenth(values: list[float]) -> float | None:
    tail = values[-max(1, len(values) // 10) :]
    return sum(tail) / len(tail) if tail else None


def median_split(records: list[dict]) -> dict[str, float]:
    """Median seconds of each named part of rlfleet's step: the `split` object and `step_seconds` where the
    records have them, else the trainer's wait / compute / publish seconds."""
    if any("split" in r for r in records):
        parts = {name for r in records for name in r.get("split", {})}
        out = {p: statistics.median(r["split"][p] for r in records if p in r.get("split", {})) for p in sorted(parts)}
        steps = [r["step_seconds"] for r in records if "step_seconds" in r]
        return out | ({"step_seconds": statistics.median(steps)} if steps else {})
    keys = ("wait_seconds", "compute_seconds", "publish_seconds")
    return {k: statistics.median(r[k] for r in records) for k in keys if all(k in r for r in records)}


def median_seconds(reached: list[dict]) -> float | None:
    """The median time to a threshold over several runs, a run that never reached it counted as slower than
    any that did (None when at least half never reached it)."""
    seconds = sorted(r["seconds"] if r["seconds"] is not None else math.inf for r in reached)
    middle = statistics.median(seconds)
    return None if math.isinf(middle) else middle


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def first_reaching(curve: list[dict], target: float) -> dict:
    """The first point of a held-out curve ([{version, score, seconds}], in version order) whose score is at
    least `target`: its version and launch-relative seconds (None, None if none)."""
    for point in curve:
        if point["score"] >= target:
            return {"version": point["version"], "seconds": point["seconds"]}
    return {"version": None, "seconds": None}


def held_out_summary(trl_curve: list[dict], fleet_curve: list[dict]) -> dict:
    """Both sides' times to TRL's final held-out score (the score of TRL's last evaluated version) and rlfleet's
    ÷ TRL's; {} when either side has no held-out curve (a run without spec.eval)."""
    if not trl_curve or not fleet_curve:
        return {}
    target = trl_curve[-1]["score"]
    trl_at, fleet_at = first_reaching(trl_curve, target), first_reaching(fleet_curve, target)
    return {
        "trl_final_held_out": target,
        "rlfleet_final_held_out": fleet_curve[-1]["score"],
        "trl_to_final_held_out": trl_at,
        "rlfleet_to_trl_final_held_out": fleet_at,
        "time_to_trl_final_held_out_ratio": ratio(fleet_at["seconds"], trl_at["seconds"]),
    }


def held_out_curve(scores: list[tuple[int, float]], made: dict[int, float]) -> list[dict]:
    """A side's held-out curve: each (version, score), in version order, at `made[version]`, the launch-relative
    time its weights were made (a version without one is left out)."""
    return sorted(
        ({"version": v, "score": score, "seconds": made[v]} for v, score in scores if v in made),
        key=lambda point: point["version"],
    )


def rlfleet_held_out(records: list[dict], times: list[float], trainer_start: float) -> list[dict]:
    """rlfleet's held-out curve from its step records: each eval/version with its eval/score, at the time the
    trainer published that version (step v publishes version v; version 0, the base, at the trainer's start)."""
    scores = [(r["eval/version"], r["eval/score"]) for r in records if "eval/score" in r]
    return held_out_curve(scores, {0: trainer_start} | {r["step"]: t for r, t in zip(records, times)})


def summarize(times: list[float], rewards: dict[str, list[float]], wall: float, generated: int, trained: list[int]):
    """A system's figures: `times` launch-relative per step, `rewards` per kind, `generated` completions over
    the run, `trained` completions per step."""
    rate = steady_steps_per_s(times)
    steady_trained = sum(trained[STEADY_FROM:]) / (times[-1] - times[STEADY_FROM - 1]) if rate else None
    out = {
        "steps": len(times),
        "wall_seconds": wall,
        "first_step_seconds": times[0] if times else None,
        "steps_per_s_steady": rate,
        "completions_per_s": generated / times[-1] if times else None,
        "trained_completions_per_s_steady": steady_trained,
        "generated_per_trained": generated / sum(trained) if sum(trained) else None,
    }
    for kind, values in rewards.items():
        out[f"reward_first_tenth_{kind}"] = first_tenth(values)
        out[f"reward_last_tenth_{kind}"] = last_tenth(values)
        for threshold in THRESHOLDS:
            out[f"to_{threshold}_{kind}"] = time_to_threshold(times, values, threshold)
    return out


# -- the two runs ---------------------------------------------------------------------------------------------


def failed(name: str, code: int, log: Path) -> SystemExit:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    return SystemExit(f"{name} failed (exit status {code}); the end of its output:\n{tail}")


def run_trl(config: Path, steps: int, threads: int, work: Path, seed_offset: int = 0) -> dict:
    out, log_path = work / f"trl-{seed_offset}.json", work / f"trl-{seed_offset}.log"
    cmd = [sys.executable, __file__, "--trl-child", str(out), "--config", str(config), "--steps", str(steps)]
    cmd += ["--trl-seed-offset", str(seed_offset)]
    load_before = os.getloadavg()
    launched = time.time()
    with open(log_path, "w") as log:  # TRL prints its logs on stdout, which is this benchmark's JSON
        code = subprocess.run(
            [*cmd, "--trl-threads", str(threads)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None,
        ).returncode
    if code:
        raise failed("the TRL side", code, log_path)
    child = json.loads(out.read_text())
    wall = time.time() - launched
    times = [t - launched for t in child["step_times"]]
    # TRL's version 0 is the model it started from; version v the weights after its step v
    made = {0: child["train_started"] - launched} | {step: t for step, t in enumerate(times, start=1)}
    held_out = held_out_curve([(version, score) for version, score in child["held_out"]], made)
    step_walls = [b - a for a, b in zip([child["train_started"], *child["step_times"]], child["step_times"])]
    generate = child["generate_seconds"]
    result = summarize(times, {"logged": child["rewards"]}, wall, sum(child["completions"]), child["completions"])
    result["split"] = {
        "generate_and_score": statistics.median(generate),
        "train": statistics.median(w - g for w, g in zip(step_walls, generate)),
        "step_seconds": statistics.median(step_walls),
    }
    return result | {
        "held_out": held_out,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "trl_version": child["trl_version"],
    }


def run_rlfleet(config: Path, steps: int, spot_check_fraction: float | None, work: Path) -> dict:
    if spot_check_fraction is not None:
        docs = list(yaml.safe_load_all(config.read_text()))
        for doc in docs:
            if doc and doc.get("kind") == "RLRun":
                doc["spec"].setdefault("verifier", {})["spotCheckFraction"] = spot_check_fraction
        config = work / "rlrun.yaml"
        config.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    run_dir = work / "run"
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    load_before = os.getloadavg()
    launched = time.time()
    seen: list[float] = []  # launch-relative time each record was first seen
    with open(work / "rlfleet.log", "w") as log:
        proc = subprocess.Popen([*cmd, "--steps", str(steps)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while True:  # a record's time on this clock: its first sight here (polled every 50 ms)
            done = proc.poll() is not None
            count = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            seen += [time.time() - launched] * (count - len(seen))
            if done:
                break
            time.sleep(0.05)
    wall = time.time() - launched
    if proc.returncode:
        raise failed("rlfleet run", proc.returncode, work / "rlfleet.log")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    # The trainer's start on this clock: a record is seen no earlier than it was written (wall_seconds after the
    # start), so the smallest difference over all records is the start to within the polling interval.
    start = min(s - r["wall_seconds"] for s, r in zip(seen, records))
    times = [start + r["wall_seconds"] for r in records]
    group_size = load_bundle(config).run.spec.sampling.group_size
    # Groups the gate judged, and those workers held back (never sent): repeats of trained work, flat groups.
    last = records[-1]
    held_back = last.get("repeated_groups", 0) + last.get("flat_groups_held_back", 0)
    generated = (last["accepted"] + last["rejected"] + held_back) * group_size
    rewards = {"sampled": [r["sampled_reward_mean"] for r in records], "trained": [r["reward_mean"] for r in records]}
    result = summarize(times, rewards, wall, generated, [r["samples"] for r in records])
    return result | {
        "held_out": rlfleet_held_out(records, times, start),
        "split": median_split(records),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def trl_child(out: Path, config: Path, steps: int, threads: int, seed_offset: int) -> None:
    """The TRL side, in its own process: writes step times (time.time()), rewards, generate seconds and the
    held-out scores ((version, score) pairs) to `out`."""
    import numpy as np
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rlfleet.models.sources import resolve_model_path
    from rlfleet.tasks import make_run_task
    from rlfleet.tasks.chat import encode_prompt, prompt_text

    if threads:
        torch.set_num_threads(threads)
    run = load_bundle(config).run.spec
    model_dir = resolve_model_path(run.model, run.task, run.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    task = make_run_task(run)
    seed = int.from_bytes(hashlib.sha256(f"{run.task.seed}:trl".encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)  # drawn as a worker draws (rollout/work.py), from a seed of its own
    ids = [task.sample_id(rng) for _ in range(steps * run.trainer.batch_size)]
    problems = {i: task.problem(i) for i in ids}
    # TRL is given each prompt as text (a chat template's rendering written out); it must encode to the ids
    # rlfleet's workers sample from.
    prompts = {i: prompt_text(tokenizer, problems[i]) for i in ids}
    for i in ids:
        if tokenizer(text=prompts[i])["input_ids"] != encode_prompt(tokenizer, problems[i]):
            raise SystemExit(f"{i}: TRL would encode the prompt {prompts[i]!r} unlike rlfleet's workers")

    def task_reward(prompts, completions, task_id, **_):
        return [task.rewards(problems[i], [c])[0] for i, c in zip(task_id, completions)]

    generate_seconds: list[float] = []

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, *args, **kwargs):
            t0 = time.perf_counter()
            result = super()._generate_and_score_completions(*args, **kwargs)
            generate_seconds.append(time.perf_counter() - t0)
            return result

    record: dict = {"step_times": [], "rewards": [], "completions": [], "trl_version": trl.__version__}
    held_out = HeldOut(run, model_dir) if run.eval is not None else None
    per_step = run.trainer.batch_size * run.sampling.group_size

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            record["train_started"] = time.time()
            if held_out:
                held_out.offer(model, 0, last=False)  # the base: TRL's LoRA adapters start at B = 0

        def on_step_end(self, args, state, control, model=None, **kwargs):
            record["step_times"].append(time.time())
            record["completions"].append(per_step)
            if held_out:
                held_out.offer(model, state.global_step, last=state.global_step == state.max_steps)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                record["rewards"].append(logs["reward"])

    lora = lora_options(run)
    with tempfile.TemporaryDirectory(prefix="rlfleet-vs-trl-") as tmp:
        args = trl.GRPOConfig(
            output_dir=tmp,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            **trl_options(run, steps, seed_offset),
        )
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=task_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [prompts[i] for i in ids], "task_id": ids}),
            processing_class=tokenizer,
            callbacks=[Steps()],
            peft_config=peft_config(lora) if lora else None,
        )
        trainer.train()
    record["held_out"] = held_out.scores if held_out else []
    out.write_text(json.dumps(record | {"generate_seconds": generate_seconds}))


def peft_config(options: dict):
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **options)


class HeldOut:
    """TRL's held-out evaluation, run as rlfleet's trainer runs its own (rlfleet/services/trainer/evaluation.py):
    rlfleet's Evaluator in a background thread of this process, offered the model after each due step (saved
    for it: a peft model saves its adapter alone), one finished evaluation taken after each step and the last
    awaited after the last step."""

    def __init__(self, run, base: Path):
        from rlfleet.services.trainer.evaluation import Evaluator

        self.evaluator = Evaluator(run, base)
        self.scores: list[tuple[int, float]] = []  # (version: TRL's step, held-out score)

    def offer(self, model, version: int, last: bool) -> None:
        if version % self.evaluator.every == 0 or last:
            with tempfile.TemporaryDirectory(prefix="rlfleet-vs-trl-eval-") as tmp:
                model.save_pretrained(tmp)
                self.evaluator.offer(version, Path(tmp), final=last)  # copies it
        result = self.evaluator.take(wait=last)
        if result:
            self.scores.append((result["eval/version"], result["eval/score"]))
            print(f"held-out score of step {result['eval/version']}: {result['eval/score']:.3f}", flush=True)


# -- report ---------------------------------------------------------------------------------------------------


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return "-" if value["seconds"] is None else f"{value['seconds']:.1f} s (step {value['step']})"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    if isinstance(value, tuple | list):
        return " / ".join(f"{v:.2f}" for v in value)
    return str(value)


def report(result: dict, run, file) -> None:
    print(f"\n{result['config']}: {result['steps']} steps, rlfleet spotCheckFraction {result['spot_check_fraction']}, "
          f"TRL torch threads {result['trl_threads'] or 'default'}", file=file)  # fmt: skip
    print("\n| TRL GRPOConfig | value | rlfleet RLRun field |\n|---|---|---|", file=file)
    for option, value, field in mapping_rows(run):
        print(f"| `{option}` | {value} | {field} |", file=file)
    print("\nNot matched:", file=file)
    for line in unmatched(run):
        print(f"- {line}", file=file)
    trl, fleet = result["trl"], result["rlfleet"]
    rows = [
        ("total wall time, launch to end (s)", trl["wall_seconds"], fleet["wall_seconds"]),
        ("launch to first step (s)", trl["first_step_seconds"], fleet["first_step_seconds"]),
        (f"steps/s, steps {STEADY_FROM}..{result['steps']}", trl["steps_per_s_steady"], fleet["steps_per_s_steady"]),
        ("completions/s generated, launch to last step", trl["completions_per_s"], fleet["completions_per_s"]),
        (
            "trained completions/s, steady",
            trl["trained_completions_per_s_steady"],
            fleet["trained_completions_per_s_steady"],
        ),  # fmt: skip
        ("completions generated per trained", trl["generated_per_trained"], fleet["generated_per_trained"]),
    ]
    for threshold in THRESHOLDS:
        rows += [
            (
                f"to a 10-step mean reward {threshold}: sampled",
                trl[f"to_{threshold}_logged"],
                fleet[f"to_{threshold}_sampled"],
            ),  # fmt: skip
            (
                f"to a 10-step mean reward {threshold}: trained",
                trl[f"to_{threshold}_logged"],
                fleet[f"to_{threshold}_trained"],
            ),  # fmt: skip
        ]
    rows += [
        (
            "reward, first tenth (sampled / trained)",
            trl["reward_first_tenth_logged"],
            f"{fmt(fleet['reward_first_tenth_sampled'])} / {fmt(fleet['reward_first_tenth_trained'])}",
        ),  # fmt: skip
        (
            "reward, last tenth (sampled / trained)",
            trl["reward_last_tenth_logged"],
            f"{fmt(fleet['reward_last_tenth_sampled'])} / {fmt(fleet['reward_last_tenth_trained'])}",
        ),  # fmt: skip
        ("load average before (1/5/15 min)", trl["load_before"], fleet["load_before"]),
        ("load average after", trl["load_after"], fleet["load_after"]),
    ]
    print(f"\n| | TRL GRPOTrainer {trl['trl_version']} | rlfleet run |\n|---|---|---|", file=file)
    for name, a, b in rows:
        print(f"| {name} | {fmt(a)} | {fmt(b)} |", file=file)
    split = " · ".join(f"{k} {v:.3f}" for k, v in trl["split"].items())
    print(f"\nmedian step split, TRL (s): {split}", file=file)
    split = " · ".join(f"{k} {v:.3f}" for k, v in fleet["split"].items())
    print(f"median step split, rlfleet (s): {split}", file=file)
    print(f"time_to_0_9_ratio {fmt(result['time_to_0_9_ratio'])}, time_to_0_8_ratio "
          f"{fmt(result['time_to_0_8_ratio'])} (rlfleet sampled ÷ TRL)", file=file)  # fmt: skip
    if result.get("trl_to_final_held_out"):
        report_held_out(result, file)
    if "trl_seeds" in result:
        for t in THRESHOLDS:
            crossings = ", ".join(
                f"seed {s['seed']}: {fmt(s[f'to_{t}']['seconds'])} s (step {s[f'to_{t}']['step']})"
                for s in result["trl_seeds"]
            )
            key = median_ratio_key(t)
            print(f"TRL to {t}: {crossings}; median {fmt(result[f'trl_median_to_{t}_seconds'])} s; {key} "
                  f"{fmt(result[key])}", file=file)  # fmt: skip


def report_held_out(result: dict, file) -> None:
    """Both held-out curves side by side (version: score at seconds) and the times to TRL's final score."""
    print("\n| version | TRL held-out score (at s) | rlfleet held-out score (at s) |\n|---|---|---|", file=file)
    by_side = [{p["version"]: p for p in result[side]["held_out"]} for side in ("trl", "rlfleet")]
    for version in sorted(set(by_side[0]) | set(by_side[1])):
        cells = [f"{c['score']:.2f} ({c['seconds']:.0f})" if (c := side.get(version)) else "-" for side in by_side]
        print(f"| {version} | {cells[0]} | {cells[1]} |", file=file)
    trl_at, fleet_at = result["trl_to_final_held_out"], result["rlfleet_to_trl_final_held_out"]
    print(f"to TRL's final held-out score {result['trl_final_held_out']:.2f}: TRL {fmt(trl_at['seconds'])} s "
          f"(version {trl_at['version']}), rlfleet {fmt(fleet_at['seconds'])} s (version {fleet_at['version']}); "
          f"time_to_trl_final_held_out_ratio {fmt(result['time_to_trl_final_held_out_ratio'])}", file=file)  # fmt: skip


def median_ratio_key(threshold: float) -> str:
    """The JSON key of rlfleet's time to `threshold` ÷ TRL's median (0.8: time_to_0_8_ratio_vs_trl_median)."""
    return f"time_to_{str(threshold).replace('.', '_')}_ratio_vs_trl_median"


def seeds_summary(run, trls: list[dict], fleet: dict) -> dict:
    """Every TRL seed's times to the thresholds, their medians, and rlfleet's sampled times ÷ those medians."""
    per_seed = [
        {"seed": run.trainer.seed + offset, **{f"to_{t}": r[f"to_{t}_logged"] for t in THRESHOLDS}}
        for offset, r in enumerate(trls)
    ]
    medians = {t: median_seconds([s[f"to_{t}"] for s in per_seed]) for t in THRESHOLDS}
    return {
        "trl_seeds": per_seed,
        **{f"trl_median_to_{t}_seconds": medians[t] for t in THRESHOLDS},
        **{median_ratio_key(t): ratio(fleet[f"to_{t}_sampled"]["seconds"], medians[t]) for t in THRESHOLDS},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=None, help="an RLRun file (default: the arithmetic example)")
    parser.add_argument("--compute-bound", action="store_true", help="the math example (default config then)")
    parser.add_argument("--spot-check-fraction", type=float, default=None, help="rlfleet's verifier.spotCheckFraction")
    parser.add_argument("--steps", type=int, default=None, help="default: the run's trainer.steps")
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=1,
        help="torch threads of the TRL process (default 1, as `rlfleet run` gives each of its processes; 0: torch's "
        "default, one per core, which on a loaded machine runs several times slower)",
    )
    parser.add_argument(
        "--trl-seeds",
        type=int,
        default=1,
        help="run the TRL side this many times, with GRPOConfig seeds trainer.seed, +1, ... (same model bytes), and "
        "report rlfleet's times against their median too (default 1: one TRL run). A seeded TRL run crosses a "
        "threshold at one fixed step, while rlfleet's asynchronous runs vary, so one TRL seed is one draw",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout (the tables on stderr)")
    parser.add_argument("--trl-child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trl-seed-offset", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = (args.config or (COMPUTE_BOUND if args.compute_bound else EXAMPLE)).resolve()
    if args.spot_check_fraction is not None and not 0.0 <= args.spot_check_fraction <= 1.0:
        parser.error("--spot-check-fraction: a fraction between 0 and 1 (spec.verifier.spotCheckFraction)")
    run = load_bundle(config).run.spec
    steps = args.steps or run.trainer.steps
    if args.trl_seeds < 1:
        parser.error("--trl-seeds: at least 1 (the number of TRL runs)")
    if steps <= STEADY_FROM:
        parser.error(f"--steps: more than {STEADY_FROM} (the steps before {STEADY_FROM} are start-up)")
    if importlib.util.find_spec("trl") is None:
        parser.error("TRL is not installed: `pip install -e '.[bench]'` (TRL and its pinned version) first")
    if args.trl_child:
        trl_child(args.trl_child, config, steps, args.trl_threads, args.trl_seed_offset)
        return 0
    with tempfile.TemporaryDirectory(prefix="rlfleet-vs-trl-") as tmp:
        trls = []
        for offset in range(args.trl_seeds):
            trls.append(run_trl(config, steps, args.trl_threads, Path(tmp), offset))
            time.sleep(5)  # let the TRL process's load fade before the next launch
        fleet = run_rlfleet(config, steps, args.spot_check_fraction, Path(tmp))
    trl = trls[0]
    result = {
        "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
        "steps": steps,
        "spot_check_fraction": run.verifier.spot_check_fraction
        if args.spot_check_fraction is None
        else args.spot_check_fraction,
        "trl_threads": args.trl_threads,
        "trl": trl,
        "rlfleet": fleet,
        "time_to_0_9_ratio": ratio(fleet["to_0.9_sampled"]["seconds"], trl["to_0.9_logged"]["seconds"]),
        "time_to_0_8_ratio": ratio(fleet["to_0.8_sampled"]["seconds"], trl["to_0.8_logged"]["seconds"]),
        **held_out_summary(trl["held_out"], fleet["held_out"]),
        **(seeds_summary(run, trls, fleet) if len(trls) > 1 else {}),
        "mapping": [{"trl": o, "value": v, "rlfleet": f} for o, v, f in mapping_rows(run)],
        "not_matched": unmatched(run),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    report(result, run, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
