"""A run's summary: `summary.json` and `reward.png` (reward and accuracy against step), both computed from the
trainer's `metrics.jsonl` records (never written in by hand). Pure functions of the records, so the trainer's
trackers log the same figures on a cluster (rlfleet/services/trainer/tracking.py) that `rlfleet run` writes into
the run directory (rlfleet/local/launcher.py) and `rlfleet report` reads (rlfleet/local/run_report.py).

Why it stands on the wire floor and not in the trainer: metrics.jsonl is a contract between the trainer, which
writes it, and the readers that are not the trainer: the launcher reads it every half second while the run
goes on (its progress line) and writes the summary once every component has stopped, the report and the
benchmarks read it after the run. None of them may import the trainer's inside (the import contracts in
pyproject.toml), and a hook of the trainer's registry record would hide that dependency rather than state
it; a contract that both sides import is what rlfleet/wire holds. matplotlib is imported only by `plot`.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: list[dict], wall_seconds: float) -> dict:
    """Means over the first and last tenth of steps (at least one step each)."""
    if not records:
        return {
            "steps": 0,
            "reward_first": None,
            "reward_last": None,
            "accepted": 0,
            "rejected": 0,
            "wall_seconds": wall_seconds,
        }
    tenth = max(1, len(records) // 10)

    def mean(rows: list[dict], key: str) -> float | None:  # None: no row has it (records of an older trainer)
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else None

    first, last = records[:tenth], records[-tenth:]
    evals = [r for r in records if "eval/score" in r]  # held-out evaluations (spec.eval), where they finished
    return {
        "steps": len(records),
        "policy_version": records[-1]["policy_version"],
        "reward_first": mean(first, "reward_mean"),  # of the trained batches
        "reward_last": mean(last, "reward_mean"),
        "accuracy_first": mean(first, "accuracy"),
        "accuracy_last": mean(last, "accuracy"),
        "sampled_reward_first": mean(first, "sampled_reward_mean"),
        "sampled_reward_last": mean(last, "sampled_reward_mean"),
        "samples": sum(r["samples"] for r in records),
        "accepted": records[-1]["accepted"],
        "rejected": records[-1]["rejected"],
        "rejected_by_reason": records[-1].get("rejected_by_reason", {}),
        "staleness_mean": mean(records, "staleness_mean"),
        "eval_score_first": evals[0]["eval/score"] if evals else None,  # of the first version evaluated (0)
        "eval_version_first": evals[0]["eval/version"] if evals else None,
        "eval_score_last": evals[-1]["eval/score"] if evals else None,
        "eval_version_last": evals[-1]["eval/version"] if evals else None,
        "wall_seconds": wall_seconds,
        **source_summary(first, last, records),
    }


def _source_mean(rows: list[dict], name: str, key: str) -> float | None:
    values = [r["sources"][name][key] for r in rows if (r.get("sources") or {}).get(name, {}).get(key) is not None]
    return sum(values) / len(values) if values else None


def source_summary(first: list[dict], last: list[dict], records: list[dict]) -> dict:
    """A task mixture's `sources`: per source, the trained and as-sampled reward over the first and last tenth of
    steps and the groups trained; {} for a single-task run."""
    names = sorted({name for r in records for name in r.get("sources") or {}})
    if not names:
        return {}
    return {
        "sources": {
            name: {
                "reward_first": _source_mean(first, name, "reward_mean"),
                "reward_last": _source_mean(last, name, "reward_mean"),
                "sampled_reward_first": _source_mean(first, name, "sampled_reward_mean"),
                "sampled_reward_last": _source_mean(last, name, "sampled_reward_mean"),
                "groups": sum(r["sources"][name]["groups"] for r in records if name in (r.get("sources") or {})),
            }
            for name in names
        }
    }


def reward_trend(summary: dict) -> str:
    """The run's reward line, `reward A -> B (as sampled C -> D)`: the trained batches' reward over the
    first and last tenth, then the reward of everything the trainer read where the records have it."""
    trend = f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}"
    if summary.get("sampled_reward_last") is not None:
        trend += f" (as sampled {summary['sampled_reward_first']:.3f} -> {summary['sampled_reward_last']:.3f})"
    if summary.get("eval_score_last") is not None:
        trend += f", held-out {summary['eval_score_first']:.3f} -> {summary['eval_score_last']:.3f}"
    return trend


def plot(records: list[dict], dest: Path, title: str) -> None:
    """PNG of reward and accuracy per step, with a 10-step moving average of the reward, the reward
    of everything the trainer read (sampled_reward_mean) where the records have it, the held-out score
    (eval/score, spec.eval) at the step each evaluation finished, marked by the version evaluated, and for a
    task mixture one line per source (the 10-step mean of its reward as sampled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    reward = [r["reward_mean"] for r in records]
    window = 10
    smooth = [
        sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
        for i in range(len(reward))
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, reward, color="tab:blue", alpha=0.35, label="reward (batch mean)")
    ax.plot(steps, smooth, color="tab:blue", label=f"reward ({window}-step mean)")
    ax.plot(steps, [r["accuracy"] for r in records], color="tab:green", alpha=0.6, linestyle=":", label="accuracy")
    sampled = [(r["step"], r["sampled_reward_mean"]) for r in records if "sampled_reward_mean" in r]
    if sampled:
        ax.plot(*zip(*sampled), color="tab:orange", alpha=0.8, label="reward as sampled (dropped groups too)")
    evals = [(r["eval/version"], r["eval/score"]) for r in records if "eval/score" in r]
    if evals:  # version v is the weights after step v: plotted at its step
        ax.plot(*zip(*evals), color="tab:red", marker="o", label="held-out score (eval)")
    colors = ("tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan", "tab:green")
    for i, name in enumerate(sorted({name for r in records for name in r.get("sources") or {}})):
        points = [
            (r["step"], r["sources"][name]["sampled_reward_mean"])
            for r in records
            if (r.get("sources") or {}).get(name, {}).get("sampled_reward_mean") is not None
        ]
        values = [v for _, v in points]
        means = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                 for i in range(len(values))]  # fmt: skip
        ax.plot([step for step, _ in points], means, color=colors[i % len(colors)], linestyle="--",
                label=f"source {name} ({window}-step mean)")  # fmt: skip
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(dest)
    plt.close(fig)


def write_reports(run_dir: Path, wall_seconds: float, title: str) -> dict:
    records = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(records, wall_seconds)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if records:
        plot(records, run_dir / "reward.png", title)
    return summary
