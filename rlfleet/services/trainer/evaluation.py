"""Held-out evaluation (`spec.eval`) on the trusted side: a background thread of the trainer (rank 0).

After publishing version v, the trainer offers the directory it just published (`offer`); when v is
due (v % every == 0, the base model v = 0 included, and the run's last version) the evaluator copies
it (the trainer deletes its own at once) and a background thread loads it into its own rollout
engine (the torch engine, on a second copy of the weights: training never waits for it; a LoRA run's
version, an adapter not yet signed, is merged into its base by TorchEngine.load_own_adapter), samples
the held-out problems (rlfleet/tasks/held_out.py) greedily or k times each, and scores them with the
task's reward (rlfleet/engines/solve.py). One evaluation runs at a time; a due
version offered while one runs waits in a single slot, where a newer one replaces it (the newest
weights are what matters), so evaluations never queue up behind training.

The trainer puts each finished evaluation into the next step record it writes (`take`, oldest first):
eval/score (pass@k: share of problems with a passing completion), eval/reward_mean, eval/version
(the version evaluated), eval/problems, eval/k, eval/seconds. At the last step it waits for the last
version's evaluation, so a run's records end with its final score. An evaluation that fails is
logged and skipped; it never stops training.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path

from rlfleet.engines.solve import greedy, score_problems
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.device import choose_device
from rlfleet.tasks.held_out import held_out_ids, held_out_task
from rlfleet.versions.adapter import is_adapter_dir
from rlfleet.wire.streams import SamplingParams

log = logging.getLogger("rlfleet.trainer.eval")


class Evaluator:
    def __init__(self, run_spec, base: Path):
        ev, s = run_spec.eval, run_spec.sampling
        self.task = held_out_task(run_spec)  # here, not in the thread: a bad eval.dataset stops the start
        self.task_ids = held_out_ids(self.task, ev.max_problems)
        max_tokens = ev.max_tokens or s.max_tokens
        self.params = (
            greedy(max_tokens)
            if ev.mode == "greedy"
            else SamplingParams(ev.temperature or s.temperature, s.top_p, s.top_k, max_tokens, seed=0)
        )
        self.every, self.k, self.pass_reward = ev.every, ev.k, ev.pass_reward
        self.sampling = s  # a task that takes turns is evaluated on whole episodes under the run's turn limits
        self.base, self.dtype = base, run_spec.model.dtype
        self.engine: TorchEngine | None = None  # made by the thread at its first evaluation
        self.cond = threading.Condition()
        self.waiting: tuple[int, Path] | None = None  # the due version not yet started, and its copy
        self.busy = False
        self.finished: list[dict] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="rlfleet-eval-"))
        weakref.finalize(self, shutil.rmtree, self.tmp, True)
        self.thread = threading.Thread(target=self._loop, name="rlfleet-eval", daemon=True)
        self.thread.start()

    def offer(self, version: int, model_dir: Path, final: bool = False) -> None:
        """`model_dir` holds the just-published `version`; evaluate it when due (or `final`)."""
        if version % self.every and not final:
            return
        copy = self.tmp / f"v{version}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(model_dir, copy)
        with self.cond:
            if self.waiting is not None:
                shutil.rmtree(self.waiting[1], ignore_errors=True)  # replaced by a newer version
            self.waiting = (version, copy)
            self.cond.notify_all()

    def take(self, wait: bool = False, stop: threading.Event | None = None) -> dict:
        """The oldest evaluation finished and not yet taken, as eval/* fields ({} if none), so each lands in
        one step record. `wait` (the last step): first wait until every offered version is evaluated
        (unless `stop` is set meanwhile), then the newest, the others dropped."""
        with self.cond:
            while wait and (self.waiting is not None or self.busy) and not (stop and stop.is_set()):
                self.cond.wait(0.5)
            if wait:
                self.finished = self.finished[-1:]
            return self.finished.pop(0) if self.finished else {}

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.waiting is None:
                    self.cond.wait()
                (version, path), self.waiting = self.waiting, None
                self.busy = True
            result = None
            try:
                result = self.evaluate(version, path)
            except Exception:
                log.exception("evaluating version %d failed; training goes on", version)
            finally:
                shutil.rmtree(path, ignore_errors=True)
                with self.cond:
                    if result is not None:
                        self.finished.append(result)
                    self.busy = False
                    self.cond.notify_all()

    def evaluate(self, version: int, path: Path) -> dict:
        t0 = time.monotonic()
        engine = self.engine = self.engine or TorchEngine(self.base, -1, self.dtype, choose_device())
        if is_adapter_dir(path):  # a LoRA run's version: the trainer's adapter over self.base, not yet signed
            engine.load_own_adapter(path, version)
        else:
            engine.load_weights(path, version)
        scores = score_problems(engine, self.task, self.task_ids, self.k, self.params, sampling=self.sampling)
        result = {
            "eval/version": version,
            "eval/score": scores.pass_at_k(self.pass_reward),
            "eval/reward_mean": scores.reward_mean(),
            "eval/problems": len(scores.task_ids),
            "eval/k": self.k,
            "eval/seconds": time.monotonic() - t0,
        }
        log.info("eval of version %d: score %.3f on %d problems", version, result["eval/score"], len(scores.task_ids))
        return result
