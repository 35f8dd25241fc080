"""`rlfleet report RUN_DIR`: one HTML page of a run, RUN_DIR/report/index.html, with its PNGs beside it.

Everything on it is read from the run directory, never from a live process:
  metrics.jsonl   reward, accuracy and reward as sampled; eval scores (any `eval/...` field, or an `eval` section);
                  verdicts by reason (cumulative counts, the last record's); staleness and dropped groups; the step
                  time split into wait (for a batch), compute (the GRPO update) and publish (the new version)
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
PHASES = (("wait_seconds", "wait for a batch"), ("compute_seconds", "GRPO update"), ("publish_seconds", "publish"))


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


def _figure(dest: Path, title: str, ylabel: str, draw) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    draw(ax)
    ax.set_title(title)
    ax.set_xlabel("trainer step" if "version" not in ylabel else "policy version")
    ax.set_ylabel(ylabel.replace("version:", ""))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
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


def step_time_section(records: list[dict], out: Path) -> str:
    steps = [r["step"] for r in records]
    phases = [(key, label) for key, label in PHASES if any(key in r for r in records)]

    def draw(ax):
        bottom = [0.0] * len(records)
        for key, label in phases:
            values = [float(r.get(key, 0.0)) for r in records]
            ax.bar(steps, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]

    rows = []
    for key, label in phases:
        values = [float(r.get(key, 0.0)) for r in records]
        rows.append([label, sum(values) / len(values), max(values), sum(values)])
    chart = _figure(out / "step_time.png", "Step time by phase", "seconds", draw)
    table = _table(["phase", "mean s", "max s", "total s"], rows)
    return _section("Step time: wait, train, publish", _image(chart, "step time by phase") + table)


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
