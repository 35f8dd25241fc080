"""`rlfleet report RUN_DIR`: one HTML page and its PNGs from a run directory; the page parses, and every image it
shows exists and is not empty. The slow dashboards test (tests/e2e/test_dashboards_live.py) checks the page of a
real run the same way."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

from rlfleet.cli import main as cli_main
from rlfleet.local.run_report import broadcast_times, eval_series, step_split, write_html_report


class Page(HTMLParser):
    """The images, the section titles and the text of a page; fails on unbalanced tags."""

    def __init__(self):
        super().__init__()
        self.images: list[str] = []
        self.titles: list[str] = []
        self.open: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag not in ("meta", "br"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open.pop() == tag, f"</{tag}> closes nothing open"

    def handle_data(self, data):
        if self.open and self.open[-1] == "h2":
            self.titles.append(data)
        self.text.append(data)


def check_page(path: Path) -> Page:
    """Parse the page: balanced tags, and every <img> a non-empty file beside it."""
    page = Page()
    page.feed(path.read_text())
    page.close()
    assert page.open == [], f"unclosed tags {page.open}"
    assert page.images, "no images"
    for src in page.images:
        image = path.parent / src
        assert image.is_file() and image.stat().st_size > 0, src
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src
    return page


# A step's split as the trainer records it (rlfleet/services/trainer/split.py): step 2 of a run of the arithmetic
# example, its parts in the record's order, the coarse fields their sums.
REAL_SPLIT = {
    "record_write": 0.00147, "demand": 0.00693, "wait": 0.00280, "decode": 0.00162, "dedup": 0.00976,
    "outcomes": 0.0, "broadcast": 0.00001, "prepare": 0.01451, "forward_backward": 0.18367, "optimizer": 0.00811,
    "gather": 0.00678, "stats": 0.00386, "record": 0.00046, "resume_save": 0.0, "ack": 0.0, "publish_save": 0.01640,
    "eval": 0.0, "publish_delta": 0.02415, "publish_hash": 0.00542, "publish_sign": 0.00028, "publish_store": 0.02485,
    "prune": 0.00085, "announce": 0.01025,
}  # fmt: skip
REAL_STEP_SECONDS = 0.32516  # the parts' sum and 0.00058 s no part covers


def write_run_dir(run_dir: Path, steps: int = 6) -> None:
    """A run directory as `rlfleet run` leaves it: metrics.jsonl (with eval scores every other step, a rejection),
    a worker's log with its weight swaps, workers.json, summary.json."""
    (run_dir / "logs").mkdir(parents=True)
    records = []
    for s in range(1, steps + 1):
        record = {
            "step": s,
            "policy_version": s,
            "reward_mean": s / 10,
            "sampled_reward_mean": s / 12,
            "accuracy": s / 10,
            "staleness_mean": 0.5,
            "staleness_max": 1,
            "dropped_stale": s % 2,
            "accepted": 4 * s,
            "rejected": 1 if s > 2 else 0,
            "rejected_by_reason": {"toploc": 1} if s > 2 else {},
            "wait_seconds": 0.5,
            "compute_seconds": 0.25,
            "publish_seconds": 0.125,
            "step_seconds": REAL_STEP_SECONDS * s,
            "split": {part: seconds * s for part, seconds in REAL_SPLIT.items()},
        }
        if s % 2 == 0:
            record["eval/accuracy"] = s / 8
        records.append(record)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "logs" / "rollout-pool-0.log").write_text(
        "2026-01-01 00:00:01,000 rollout INFO rlfleet.rollout: 0.250s after its announcement, now generating with "
        "version 1\n2026-01-01 00:00:02,000 rollout INFO rlfleet.rollout: 0.750s after its announcement, now "
        "generating with version 2\n"
    )
    workers = {
        "pool-0": {"counters": {"accepted": 20, "rejected": 0}, "banned": None},
        "evil-0": {"counters": {"rejected": 4, "rejected:toploc": 4}, "banned": {"reason": "toploc", "detail": "x"}},
    }
    (run_dir / "workers.json").write_text(json.dumps(workers))
    (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "reward_first": 0.1, "reward_last": 0.6}))


def test_the_page_shows_every_section_and_each_image_exists(tmp_path):
    run_dir = tmp_path / "run"
    write_run_dir(run_dir)
    page = check_page(write_html_report(run_dir))
    assert sorted(page.images) == sorted(
        ["reward.png", "eval.png", "verdicts.png", "staleness.png", "step_time.png", "broadcast.png"]
    )
    assert page.titles == [
        "Summary",
        "Reward and evaluation",
        "Accepted and rejected groups",
        "Staleness",
        "Step time by part",
        "Broadcast times",
        "Worker reputation",
    ]
    text = " ".join(page.text)
    assert "rejected: toploc" in text and "evil-0" in text and "toploc: x" in text


def test_its_figures_come_from_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    write_run_dir(run_dir)
    assert broadcast_times(run_dir / "logs") == {"pool-0": [(1, 0.25), (2, 0.75)]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert eval_series(records) == {"eval/accuracy": [(2, 0.25), (4, 0.5), (6, 0.75)]}
    assert eval_series([{"step": 3, "eval": {"reward_mean": 0.5}}]) == {"eval/reward_mean": [(3, 0.5)]}


def test_a_run_without_eval_workers_or_swaps_says_so(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5, "accepted": 1}) + "\n")
    page = check_page(write_html_report(run_dir))
    text = " ".join(page.text)
    assert "No eval scores" in text and "No workers.json" in text and "No worker logged a weight swap" in text


def test_the_command_writes_the_page_and_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_run_dir(run_dir)
    assert cli_main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report" / "index.html")
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_the_step_time_plot_stacks_the_parts_of_the_split_the_records_carry(tmp_path):
    run_dir = tmp_path / "run"
    write_run_dir(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    split = step_split(records)
    assert list(split) == list(REAL_SPLIT), "the parts, named and ordered as in the records"
    assert split["forward_backward"] == [REAL_SPLIT["forward_backward"] * s for s in range(1, 7)]
    cells = check_page(write_html_report(run_dir)).text  # a table cell is one piece of text
    for part, seconds in REAL_SPLIT.items():
        assert (part in cells) == (seconds > 0), part  # a part that never took time is left out of the chart
    assert "not in any part" in cells
    assert "wait for a batch" not in cells and "GRPO update" not in cells, "the coarse phases are gone"
    # A run recorded before steps carried a split still shows the coarse phases.
    old = [{k: v for k, v in r.items() if k not in ("split", "step_seconds")} for r in records]
    assert step_split(old) == {"wait": [0.5] * 6, "compute": [0.25] * 6, "publish": [0.125] * 6}
