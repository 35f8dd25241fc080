"""`rlfleet report RUN_DIR`: one HTML page of a run, RUN_DIR/report/index.html, with its PNGs beside it.

Everything on it is read from the run directory, never from a live process:
  metrics.jsonl   reward, accuracy and reward as sampled; eval scores (any `eval/...` field, or an `eval` section);
                  verdicts by reason (cumulative counts, the last record's); staleness and dropped groups; each
                  step's time by the parts of its `split` (rlfleet/services/trainer/split.py), stacked, against its
                  `step_seconds` (records of a run from before the split: wait, compute and publish)
  logs/rollout-*  broadcast times: each worker's "S s after its announcement, now generating with version V" line
                  (rlfleet/services/rollout/main.py), the time from the trainer announcing V to the worker using it
  workers.json    per-worker reputation (verdict counters and ban record), which `rlfleet run` snapshots from Redis
                  when the trainer finishes
  summary.json    the run's summary (report.py)
A section whose source is missing says so instead of drawing an empty chart. `rlfleet run` writes the page at the
end of every run and prints its path.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping
from pathlib import Path

from rlfleet.wire.run_summary import read_metrics

BROADCAST_LINE = re.compile(r"([0-9.]+)s after its announcement, now generating with version (\d+)")
# What a record from before the split carried: a step's wait for its batch, its GRPO update and its publish.
COARSE_PHASES = ("wait_seconds", "compute_seconds", "publish_seconds")


def eval_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Every eval score by name (`eval/accuracy`), as (step, value) for the steps that have it."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        scores = {k: v for k, v in record.items() if k.startswith("eval/")}
        if isinstance(record.get("eval"), Mapping):
            scores |= {f"eval/{k}": v for k, v in record["eval"].items()}
        for name, value in scores.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out.setdefault(name, []).append((record["step"], float(value)))
    return out


def broadcast_times(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Per worker (log stem), (version, seconds from its announcement until the worker generated with it)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for log in sorted(log_dir.glob("rollout-*.log")):
        swaps = [(int(v), float(s)) for s, v in BROADCAST_LINE.findall(log.read_text(errors="replace"))]
        if swaps:
            out[log.stem.removeprefix("rollout-")] = swaps
    return out


def _figure(dest: Path, title: str, ylabel: str, draw, legend_beside: bool = False) -> str:
    """Draw a chart into `dest`; `legend_beside`: a wider figure with the legend to the right of the axes (for a
    chart of many series, whose legend would cover it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5) if legend_beside else (8, 4), dpi=100)
    draw(ax)
    ax.set_title(title)
    ax.set_xlabel("trainer step" if "version" not in ylabel else "policy version")
    ax.set_ylabel(ylabel.replace("version:", ""))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        if legend_beside:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small", ncol=2, frameon=False)
        else:
            ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(dest)
    plt.close(fig)
    return dest.name


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _section(title: str, body: str) -> str:
    return f"<h2>{html.escape(title)}</h2>\n{body}\n"


def _image(name: str, alt: str) -> str:
    return f'<p><img src="{html.escape(name)}" alt="{html.escape(alt)}"></p>'


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def reward_section(records: list[dict], out: Path) -> str:
    steps = [r["step"] for r in records]

    def draw(ax):
        ax.plot(steps, [r["reward_mean"] for r in records], label="reward (trained batch)")
        if any("sampled_reward_mean" in r for r in records):
            sampled = [(r["step"], r["sampled_reward_mean"]) for r in records if "sampled_reward_mean" in r]
            ax.plot(*zip(*sampled), label="reward as sampled")
        if any("accuracy" in r for r in records):
            ax.plot(steps, [r.get("accuracy") for r in records], linestyle=":", label="accuracy")

    body = _image(_figure(out / "reward.png", "Reward", "reward / accuracy", draw), "reward against step")
    scores = eval_series(records)
    if scores:

        def draw_eval(ax):
            for name, points in sorted(scores.items()):
                ax.plot(*zip(*points), marker="o", label=name)

        body += _image(_figure(out / "eval.png", "Held-out evaluation", "score", draw_eval), "eval scores")
    else:
        body += _note("No eval scores in metrics.jsonl (no eval/... fields).")
    return _section("Reward and evaluation", body)


def verdict_section(records: list[dict], out: Path) -> str:
    steps = [r["step"] for r in records]
    reasons = sorted({k for r in records for k in r.get("rejected_by_reason", {})})

    def draw(ax):
        ax.plot(steps, [r.get("accepted", 0) for r in records], label="accepted")
        for reason in reasons:
            ax.plot(
                steps, [r.get("rejected_by_reason", {}).get(reason, 0) for r in records], label=f"rejected: {reason}"
            )

    last = records[-1]
    rows = [["accepted", last.get("accepted", 0)], ["rejected", last.get("rejected", 0)]]
    rows += [[f"rejected: {reason}", n] for reason, n in sorted(last.get("rejected_by_reason", {}).items())]
    chart = _figure(out / "verdicts.png", "Verifier verdicts (cumulative)", "groups", draw)
    return _section(
        "Accepted and rejected groups", _image(chart, "verdicts against step") + _table(["", "groups"], rows)
    )


def staleness_section(records: list[dict], out: Path) -> str:
    steps = [r["step"] for r in records]
    dropped = sorted({k for r in records for k in r if k.startswith("dropped_") and isinstance(r[k], int | float)})

    def draw(ax):
        ax.plot(steps, [r.get("staleness_mean") for r in records], label="mean lag of the batch")
        ax.plot(steps, [r.get("staleness_max") for r in records], linestyle="--", label="max lag")
        for name in dropped:
            if any(r.get(name) for r in records):
                ax.bar(steps, [r.get(name, 0) for r in records], alpha=0.3, label=f"groups {name.replace('_', ' ')}")

    chart = _figure(out / "staleness.png", "Staleness (policy versions behind) and drops", "versions / groups", draw)
    return _section("Staleness", _image(chart, "staleness against step"))


def step_split(records: list[dict]) -> dict[str, list[float]]:
    """Each step's seconds by part: the parts of the records' `split`, named and in the order the records give them
    (a part a record lacks counts 0 there); for records without a split, the coarse phases (wait, compute,
    publish)."""
    parts = list(dict.fromkeys(part for r in records for part in r.get("split", {})))
    if parts:
        return {part: [float(r.get("split", {}).get(part, 0.0)) for r in records] for part in parts}
    phases = [key for key in COARSE_PHASES if any(key in r for r in records)]
    return {key.removesuffix("_seconds"): [float(r.get(key, 0.0)) for r in records] for key in phases}


def step_time_section(records: list[dict], out: Path) -> str:
    """A step's time stacked by part (those that took any), its step_seconds over them; a table of each part and
    of the time no part covers (split.py: the loop's own lines, the gap between step_seconds and the parts)."""
    steps = [r["step"] for r in records]
    split = {part: values for part, values in step_split(records).items() if any(values)}
    totals = [float(r["step_seconds"]) for r in records if "step_seconds" in r]  # every record's, or fewer

    def draw(ax):
        if split:
            import matplotlib

            # up to 40 distinct colours: the split has ~23 parts, more than one palette of 10 or 20
            palette = [matplotlib.colormaps[name](i) for name in ("tab20", "tab20b") for i in range(20)]
            colors = [palette[i % len(palette)] for i in range(len(split))]
            ax.stackplot(steps, *split.values(), labels=list(split), colors=colors, step="mid")
        if totals:
            timed = [r["step"] for r in records if "step_seconds" in r]
            ax.plot(timed, totals, color="black", linewidth=0.8, label="step_seconds")

    rows = [[part, sum(v) / len(v), max(v), sum(v)] for part, v in split.items()]
    if len(totals) == len(records):
        covered = [sum(values) for values in zip(*split.values())] if split else [0.0] * len(records)
        rest = [t - c for t, c in zip(totals, covered)]
        rows.append(["not in any part", sum(rest) / len(rest), max(rest), sum(rest)])
    chart = _figure(out / "step_time.png", "Step time by part (stacked)", "seconds", draw, legend_beside=True)
    table = _table(["part", "mean s", "max s", "total s"], rows)
    return _section("Step time by part", _image(chart, "step time by part") + table)


def broadcast_section(run_dir: Path, out: Path) -> str:
    times = broadcast_times(run_dir / "logs")
    if not times:
        return _section("Broadcast", _note("No worker logged a weight swap (logs/rollout-*.log)."))

    def draw(ax):
        for worker, swaps in times.items():
            ax.plot(*zip(*swaps), marker=".", label=worker)

    rows = [
        [worker, len(swaps), sum(s for _, s in swaps) / len(swaps), max(s for _, s in swaps)]
        for worker, swaps in times.items()
    ]
    chart = _figure(out / "broadcast.png", "Announced -> generating with it, per worker", "version:seconds", draw)
    table = _table(["worker", "versions", "mean s", "max s"], rows)
    return _section("Broadcast times", _image(chart, "broadcast time per version") + table)


def reputation_section(run_dir: Path) -> str:
    path = run_dir / "workers.json"
    if not path.exists():
        return _section("Worker reputation", _note("No workers.json (written when the trainer finishes its steps)."))
    stats = json.loads(path.read_text())
    counters = sorted({c for s in stats.values() for c in s.get("counters", {})})
    rows = [
        [worker, *(s.get("counters", {}).get(c, 0) for c in counters), _ban(s.get("banned"))]
        for worker, s in sorted(stats.items())
    ]
    return _section("Worker reputation", _table(["worker", *counters, "banned"], rows))


def _ban(record) -> str:
    if not record:
        return "no"
    return f"{record.get('reason', 'yes')}: {record.get('detail', '')}".strip(": ")


def summary_section(run_dir: Path) -> str:
    path = run_dir / "summary.json"
    if not path.exists():
        return ""
    summary = json.loads(path.read_text())
    rows = [[k, v] for k, v in summary.items() if not isinstance(v, dict | list)]
    return _section("Summary", _table(["", ""], rows))


STYLE = (
    "body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}"
    "td:first-child,th:first-child{text-align:left}.note{color:#666;font-style:italic}img{max-width:100%}"
)


def write_html_report(run_dir: Path) -> Path:
    """RUN_DIR/report/index.html and its PNGs (module docstring); returns the page's path."""
    run_dir = Path(run_dir)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    records = read_metrics(run_dir / "metrics.jsonl")
    title = f"rlfleet run {run_dir.name}"
    parts = [f"<h1>{html.escape(title)}</h1>", summary_section(run_dir)]
    if records:
        parts += [
            reward_section(records, out),
            verdict_section(records, out),
            staleness_section(records, out),
            step_time_section(records, out),
        ]
    else:
        parts.append(_note("No steps in metrics.jsonl yet."))
    parts += [broadcast_section(run_dir, out), reputation_section(run_dir)]
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(parts) + "</body></html>\n"
    )
    path = out / "index.html"
    path.write_text(page)
    return path
