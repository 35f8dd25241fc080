"""What `rlfleet run` shows while it works (launcher.py): the builtin model's build, what the run waits
for before its first step, then a bar over trainer steps. On a terminal these are tqdm bars; without
one (a pipe, CI) they are plain lines, so no wait of more than a few seconds passes in silence."""

from __future__ import annotations

import sys
import time
from typing import Any

from rlfleet.wire.streams import RunKeys

HEARTBEAT_S = 5  # without a terminal, an unchanged status is repeated this often


class BuildProgress:
    """`progress(done, total)` of a builtin model's warm start (builtin.resolve_model_path): a tqdm bar on a
    terminal, else a line every HEARTBEAT_S seconds and at the end; silent unless a build actually runs."""

    def __init__(self, what: str, tty: bool):
        self.what, self.tty = what, tty
        self.bar: Any = None  # a tqdm bar (untyped library), made on the first call on a terminal
        self.said: float | None = None  # when the last line was printed

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.said is None:
            print(f"rlfleet: building {self.what}: warm start, {total} steps (cached afterwards)", file=sys.stderr)
            self.said = now
        if self.tty:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", desc="warm start", dynamic_ncols=True, file=sys.stderr)
            self.bar.update(done - self.bar.n)
        elif now - self.said >= HEARTBEAT_S or done == total:
            print(f"rlfleet: warm start {done}/{total} steps", file=sys.stderr, flush=True)
            self.said = now

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def startup_status(client, keys: RunKeys, batch_size: int) -> str:
    """What a run waits for before its first step, read from its streams."""
    if not client.xlen(keys.policy):
        return "starting: the trainer has not published version 0 yet"
    verified, inbox = client.xlen(keys.verified), client.xlen(keys.rollouts)
    if not verified and not inbox:
        return "version 0 published; workers loading it and sampling their first groups"
    if verified < batch_size:
        return f"first batch: {verified}/{batch_size} groups verified, {inbox} waiting for the verifier"
    # Workers outpaced the first step: what is verified beyond its batch is for the steps after it.
    return (
        f"first batch: {batch_size}/{batch_size} groups verified ({verified} so far); the trainer is on its first step"
    )


class Progress:
    """A tqdm bar over trainer steps (or one line per step without a terminal); before the first step,
    what the run is waiting for (`waiting`: in the bar, or a line when it changes)."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr) if enabled else None
        self.seen = 0
        self.status = ""
        self.started = self.said = time.monotonic()

    def waiting(self, status: str) -> None:
        now = time.monotonic()
        if self.bar:
            if status != self.status:
                self.bar.set_postfix_str(status, refresh=False)
            self.bar.refresh()  # the elapsed time moves
        elif status != self.status or now - self.said >= HEARTBEAT_S:
            print(f"rlfleet: {status} ({now - self.started:.0f}s)", file=sys.stderr, flush=True)
            self.said = now
        self.status = status

    def update(self, records: list[dict], queue_depth: int | str) -> None:
        new = records[self.seen :]
        if not new:
            return
        self.seen = len(records)
        r = new[-1]
        fields = {
            "v": r["policy_version"],
            "reward": f"{r['reward_mean']:.2f}",
            "acc": r["accepted"],
            "rej": r["rejected"],
            "queue": queue_depth,
            "lag": f"{r['staleness_mean']:.1f}",
        }
        if self.bar:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(len(new))
        else:
            print(f"step {r['step']} " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
