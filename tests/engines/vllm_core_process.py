"""Run by tests/engines/test_vllm_engine.py as `python -m tests.engines.vllm_core_process MODEL_DIR` with
VLLM_ENABLE_V1_MULTIPROCESSING=1: vLLM's engine core in a process of its own, as vLLM runs it on a GPU.
Prints one JSON line: whether the core ran in another process, the heartbeats this process saw while one
group was generated, and the group's completions and logprobs (drawn by rlfleet's rule in the worker, in
the core's process, from the seed the request carried there)."""

from __future__ import annotations

import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path


def main(model_dir: Path) -> None:
    from rlfleet.engines.vllm_engine import IN_PROCESS, VLLMEngine
    from rlfleet.wire.streams import SamplingParams

    engine = VLLMEngine(model_dir, 0)
    children = [p.name for p in multiprocessing.active_children()]
    beats: list[float] = []
    done = threading.Event()

    def watch() -> None:  # what the worker's /healthz reads: the heartbeat, in this process
        last = engine.heartbeat
        while not done.is_set():
            if engine.heartbeat != last:
                last = engine.heartbeat
                beats.append(last)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=12, max_tokens=12, seed=3)
    gens = engine.generate(engine.tokenizer("12+7=")["input_ids"], params, 4)
    done.set()
    watcher.join()
    engine.close()
    lengths = [len(g.completion_ids) for g in gens]
    completions = [g.completion_ids for g in gens]
    logprobs = [g.logprobs for g in gens]
    seen = {"in_process": IN_PROCESS, "children": children, "beats": len(beats), "lengths": lengths}
    print(json.dumps({**seen, "params": params.__dict__, "completions": completions, "logprobs": logprobs}))


if __name__ == "__main__":  # vLLM spawns its engine core: the module must not run again when imported there
    main(Path(sys.argv[1]))
