"""Prompt filters against wasted generation: an example with and without a filter, back to back.

Runs `rlfleet run` on examples/arithmetic/rlrun.yaml (or --config) twice, once as it is and once
filtered: with `spec.sampling.onlineFilter` (the filter's defaults unless --window is given), or with
--offline-band MIN MAX, on the dataset's rows rated by `rlfleet filter` (--rated FILE, or rated here:
the first --rate-rows rows, k=8) and the band `spec.task.solveRateMin/Max`, as INTELLECT-2 filtered its
tasks before training. It reports for each run, from its metrics.jsonl:
- wasted share over the whole run: groups generated that taught nothing (the trainer's drops, and the
  repeats and flat groups, all rewards equal, that workers held back unsent) over those and the groups
  trained. A run with `skipZeroAdvantageGroups` holds its flat groups back; they were sampled all the
  same;
- dropped share in the last third of the steps: groups the trainer read and dropped (repeats of
  trained work, stale, zero-advantage, malformed) and the repeats workers held back unsent, over all of
  those and the groups trained then;
- reward over the last tenth of the steps: the trained batches' (reward_mean) and everything read
  (sampled_reward_mean); neither is the policy's reward on the task as a whole once the filter
  changes which prompts are sampled (it skips solved ones), so both runs also evaluate the policy
  (spec.eval, sampled pass@1 at the run's temperature, every 10 versions: arithmetic on the held-out
  problems of seed 1, a dataset task on its own rows) and the comparison uses the mean score over the
  last third of the steps;
- wall seconds, the prompts the filter retired, and the gate's rejections by reason (a run's directory
  is deleted at the end; this keeps why anything of the honest workers was rejected).
Then the ratios of the dropped shares and of the wasted shares (with / without) and whether the reward
is no worse (the filtered run's held-out score at least the other's less --tolerance). A run whose
RLRun sets `spec.eval` (its own held-out problems) is scored by it; otherwise both runs get the
evaluation above. With the offline band, the rating's own completions (rows x k) are reported too:
they are spent once per dataset and model, not per run.

    python benchmarks/online_filter.py            # a table
    python benchmarks/online_filter.py --json     # one JSON object
    python benchmarks/online_filter.py --steps 60
    python benchmarks/online_filter.py --config examples/math/rlrun.yaml   # prompts of varied difficulty
    python benchmarks/online_filter.py --config examples/smollm2/rlrun.yaml --offline-band 0.125 0.875 \
        --rate-rows 480                                                    # a released model, rated rows

Both runs start from the repository root with the same seeds; each takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _paths import ROOT

from rlfleet.tasks.datasets import filter_by_solve_rate, read_rows
from rlfleet.wire.run_summary import read_metrics

EXAMPLE = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
REJECTIONS_KEPT = 10
DROPS = ("dropped_stale", "dropped_duplicate", "dropped_malformed", "dropped_zero_advantage")


def variant(docs: list[dict], eval_spec: dict, online_filter: dict | None = None, band: dict | None = None) -> str:
    """The example's documents with a filter (the online one, or the offline band: `band` holds the rated
    dataset's path and solveRateMin/Max) and the held-out evaluation set on its RLRun."""
    out = []
    for doc in docs:
        doc = json.loads(json.dumps(doc))
        if doc["kind"] == "RLRun":
            if online_filter is not None:
                doc["spec"]["sampling"]["onlineFilter"] = online_filter
            if band is not None:
                task = doc["spec"]["task"]
                task["dataset"] = {**task["dataset"], "path": band["path"]}
                task.update(solveRateMin=band["min"], solveRateMax=band["max"])
            doc["spec"]["eval"] = eval_spec
        out.append(doc)
    return yaml.safe_dump_all(out, sort_keys=False)


def rate(config: Path, rows: int, out: Path) -> dict:
    """`rlfleet filter` on the first `rows` rows of the config's dataset, k=8: its summary and seconds."""
    from rlfleet.services.rollout.difficulty import FilterOptions, rate_rows

    started = time.monotonic()
    summary = rate_rows(FilterOptions(file=str(config), out=out, k=8, max_rows=rows))
    return {**summary, "seconds": time.monotonic() - started, "completions": summary["rows"] * summary["k"]}


def band_rows(rated: Path, low: float, high: float) -> int:
    """Rows of a rated file within the band (the training set the filtered run draws from), as the task counts them."""
    kept, _ = filter_by_solve_rate(read_rows(str(rated)), low, high)
    return len(kept)


def copy_of_rows(path: str, workdir: Path) -> Path:
    """A copy of a JSONL dataset's rows (a builtin:// set or a local file) to evaluate on.

    A dataset task is scored on its own rows: the policy's reward on the task as a whole, which the
    filter (it skips solved rows) does not bias. spec.eval refuses the training path itself (it is meant
    for held-out rows), hence the copy."""
    source = ROOT / "rlfleet" / "tasks" / "samples" / f"{path[len('builtin://') :]}.jsonl"
    if not path.startswith("builtin://"):
        source = (ROOT / path).resolve()
    target = workdir / "eval-rows.jsonl"
    target.write_bytes(source.read_bytes())
    return target


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def measure(records: list[dict]) -> dict:
    """Dropped share over the last third, rewards over the last tenth (see the module docstring)."""
    third = records[len(records) - max(1, len(records) // 3) :]
    tenth = records[len(records) - max(1, len(records) // 10) :]
    last = records[-1]
    # Over the whole run: every drop, and what workers held back (counters since the trainer started).
    wasted = sum(r.get(k, 0) for r in records for k in DROPS)
    wasted += last.get("repeated_groups", 0) + last.get("flat_groups_held_back", 0)
    trained_all = sum(len(r["rollout_ids"]) for r in records)
    # Repeats of trained work are dropped whether the trainer drops them or the workers hold them back unsent
    # (`repeated_groups`, counted since the trainer started).
    before = records[len(records) - len(third) - 1].get("repeated_groups", 0) if len(third) < len(records) else 0
    held_back = third[-1].get("repeated_groups", 0) - before
    dropped = sum(r.get(k, 0) for r in third for k in DROPS) + held_back
    trained = sum(len(r["rollout_ids"]) for r in third)
    evals = [r["eval/score"] for r in third if "eval/score" in r]
    return {
        "steps": len(records),
        "wall_seconds": last["wall_seconds"],
        "dropped_last_third": dropped,
        "trained_last_third": trained,
        "dropped_share_last_third": dropped / (dropped + trained),
        "wasted_groups": wasted,
        "flat_groups_held_back": last.get("flat_groups_held_back", 0),
        "trained_groups": trained_all,
        "wasted_share": wasted / (wasted + trained_all),
        "reward_last_tenth": mean([r["reward_mean"] for r in tenth]),
        "sampled_reward_last_tenth": mean([r["sampled_reward_mean"] for r in tenth]),
        "eval_score_last_third": mean(evals),
        "eval_score_first": next((r["eval/score"] for r in records if "eval/score" in r), None),
        "eval_score_last": next((r["eval/score"] for r in reversed(records) if "eval/score" in r), None),
        "prompts_retired": last.get("prompts_retired_solved", 0) + last.get("prompts_retired_failed", 0),
        "rejected_by_reason": last["rejected_by_reason"],  # honest workers: only load (stale_version)
    }


def run(config_text: str, workdir: Path, name: str, steps: int | None) -> dict:
    """One run's figures (`measure`), and the verifier's log line of each of its first rejections for another
    reason than a ban (the run's directory is deleted at the end: this keeps what an honest worker was refused for)."""
    config, run_dir = workdir / f"{name}.yaml", workdir / name
    config.write_text(config_text)
    cmd = [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    if steps:
        cmd += ["--steps", str(steps)]
    print(f"running {name}: {' '.join(cmd)}", file=sys.stderr)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)
    lines = (line for log in sorted((run_dir / "logs").glob("verifier*.log")) for line in log.read_text().splitlines())
    logged = [line for line in lines if " rejected " in line and ": banned: " not in line]
    return {**measure(read_metrics(run_dir / "metrics.jsonl")), "rejections_logged": logged[:REJECTIONS_KEPT]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=EXAMPLE, help="the RLRun file (default: the arithmetic example)")
    parser.add_argument("--steps", type=int, default=None, help="override spec.trainer.steps (default: the example's)")
    parser.add_argument("--window", type=int, default=None, help="onlineFilter.window (default: the field's default)")
    parser.add_argument("--offline-band", type=float, nargs=2, metavar=("MIN", "MAX"), default=None,
                        help="filter with solveRateMin/Max on rated rows instead of the online filter")  # fmt: skip
    parser.add_argument("--rated", type=Path, default=None, help="rows `rlfleet filter` rated (default: rate them)")
    parser.add_argument("--rate-rows", type=int, default=None, help="rate the dataset's first N rows (default: all)")
    parser.add_argument("--eval-problems", type=int, default=256, help="held-out problems per evaluation")
    parser.add_argument("--tolerance", type=float, default=0.02, help="reward difference still counted as no worse")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config = args.config.resolve()
    docs = list(yaml.safe_load_all(config.read_text()))
    online_filter = {} if args.window is None else {"window": args.window}
    rating = None
    with tempfile.TemporaryDirectory(prefix="rlfleet-online-filter-") as tmp:
        spec = next(doc for doc in docs if doc["kind"] == "RLRun")["spec"]
        eval_spec = spec.get("eval")  # the run's own held-out problems, if it has them
        if eval_spec is None:
            eval_spec = {"every": 10, "maxProblems": args.eval_problems, "mode": "sampled", "k": 1}
            if "dataset" in spec["task"]:
                eval_spec["dataset"] = {"path": str(copy_of_rows(spec["task"]["dataset"]["path"], Path(tmp)))}
            else:
                eval_spec["seed"] = 1
        band = None
        if args.offline_band is not None:
            rated = args.rated
            if rated is None:
                rated = Path(tmp) / "rated.jsonl"
                rating = rate(config, args.rate_rows, rated)
            low, high = args.offline_band
            band = {"path": str(rated.resolve()), "min": low, "max": high, "rows": band_rows(rated, low, high)}
        without = run(variant(docs, eval_spec), Path(tmp), "without", args.steps)
        filtered = variant(docs, eval_spec, online_filter=None if band else online_filter, band=band)
        with_filter = run(filtered, Path(tmp), "with", args.steps)
    ratio = with_filter["dropped_share_last_third"] / max(without["dropped_share_last_third"], 1e-9)
    wasted_ratio = with_filter["wasted_share"] / max(without["wasted_share"], 1e-9)
    key = "eval_score_last_third"
    no_worse = (with_filter[key] or 0.0) >= (without[key] or 0.0) - args.tolerance
    result = {
        "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
        "filter": {"offline_band": band} if band else {"online_filter": online_filter},
        "rating": rating,
        "without_filter": without,
        "with_filter": with_filter,
        "dropped_share_ratio": ratio,
        "wasted_share_ratio": wasted_ratio,
        "reward_compared": key,
        "reward_no_worse": no_worse,
        "done": ratio <= 0.5 and no_worse,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'':28}{'without':>12}{'with':>12}")
    for name in (n for n in without if n != "rejections_logged"):
        a, b = without[name], with_filter[name]
        fmt = lambda v: f"{v:12.3f}" if isinstance(v, float) else f"{v!s:>12}"  # noqa: E731
        print(f"{name:28}{fmt(a)}{fmt(b)}")
    print(f"dropped share with / without: {ratio:.3f} (goal <= 0.5); wasted share with / without: {wasted_ratio:.3f}")
    print(f"{key} no worse: {no_worse}")
    for name, figures in (("without", without), ("with", with_filter)):
        for line in figures["rejections_logged"]:
            print(f"{name}: {line}")
    if rating:
        print(f"rating: {rating['rows']} rows x {rating['k']} completions in {rating['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
