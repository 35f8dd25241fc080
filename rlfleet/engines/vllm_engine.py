"""The vLLM engine: every call into vLLM lives here and in vllm_worker.py (what runs inside vLLM's worker),
pinned to vLLM 0.32.0 (docs/code.md).

Generation goes through vLLM's offline `LLM` (continuous batching, paged KV cache, prefix cache).
What rollouts need beyond vLLM's outputs is captured *inside* vLLM's worker by a small worker
extension (`CaptureExtension`, passed as `worker_extension_cls` and called by name through
`LLM.collective_rpc`, so the same code works whether the engine core and its workers run in other
processes, as vLLM does by default on GPU, or in this one, as we run it on CPU):

- Final hidden states (for TOPLOC proofs), token logprobs and rlfleet's seeded draw of each token:
  vllm_worker.py's docstring says how they are captured or drawn and which rows come from which request.

Weights: vllm_worker.py's `rlfleet_reload_weights`, then `reset_prefix_cache` so no KV block computed by
the old weights is reused. Invariant: `generate_groups` and `load_weights` hold one lock, so
every request of every group of a call (and their continuations) runs on one version and each
`Generation` records it; a swap waits for the groups in flight.

Batching: `generate_groups` submits every sample of every group of the call as its own request in ONE
`LLM.generate` (vLLM's continuous batching schedules them together, whatever their prompts and
parameters), then every continuation in one more; the capture is keyed by request id, so each
group's prompt rows come from its own first request and each completion's rows from its own.
A request that brings the rows of a prefix of its prompt (a later turn of a multi-turn episode,
rlfleet/engines/episodes.py) is sent with its cache salt and reads the prefix cache: its prompt
rows are those rows, then whatever vLLM computed after the cached blocks (`prompt_tokens_cached`
counts the positions read from the cache).

Sampling: one request per sample, its sample seed `rlfleet.models.sampling.sample_seed(group seed, index)`
in `SamplingParams.extra_args` (vllm_worker.SEED_ARG), stopping at exactly the gate's stop tokens
(`stop_token_ids`). vLLM's worker draws every token by rlfleet's contract, not by vLLM's sampler
(vllm_worker.py's docstring): the same uniforms, top-k then top-p, inverse CDF as the torch engine,
so on vLLM-CPU fp32 both engines draw identical completions for the same seeds, and the gate can
replay a vLLM group's draws from its prefill logits as a torch group's (on a GPU up to the draws
that bf16 noise moves across a CDF edge). Groups still record `engine: vllm`: the gate chooses
what to check, and with what tolerance, per engine (rlfleet/services/toploc/).
Cost of the capture: every row of every step is copied to host memory and the whole group's rows
cross from the worker process in one `collective_rpc`; for long completions on GPU, building the
proofs (top-k per 32 rows) inside the worker would cut that.

Liveness (base.py's `heartbeat`): `LLM.generate` calls `LLMEngine.step()` once per engine step until its
requests finish, and each return is one scheduler step done, whether the engine core runs in this
process (CPU) or in its own (GPU: `step` returns with the step's outputs); so `step` is wrapped to beat,
in the worker's process, where /healthz reads it. A wedged core process leaves `step` waiting: no beat.

Pinned because these move between vLLM releases: `LLMEngine.step` as `LLM.generate`'s loop,
`worker_extension_cls`, `Worker.reload_weights`, the V1 model runner's `input_batch` /
`query_start_loc` / `requests` / `sampler` bookkeeping (we force `VLLM_USE_V2_MODEL_RUNNER=0`),
`Sampler` called as a module outside any CUDA graph with `SamplerOutput.sampled_token_ids` what the
runner appends, `SamplingParams.skip_reading_prefix_cache` and `extra_args`, internal request ids
`"{external}-{8 chars}"`, and the CPU attention's head sizes (vllm_pin.py, read without importing vLLM).

Settings: a pool's `spec.vllm` (tensor parallelism, GPU memory, max_model_len, eager or CUDA graphs)
becomes `LLM`'s arguments by vllm_pin.engine_args. With tensor parallelism every rank runs the
hooks and holds the same final rows (they are all-reduced), so rank 0's capture is the sequence's.
Hooks fire only where the model's forward runs in Python: eager always does (the CPU default);
with CUDA graphs (the GPU default) a step replayed from a graph of the whole model would skip
them, so graphs are asked for piecewise (`compilation_config.cudagraph_mode`, pinned too; the
sampler hooks that draw the tokens fire either way: vLLM never captures its sampler in a graph). Since
that rests on vLLM's runner, the engine also checks the capture at start when graphs are on
(`_capture_self_check`: a tiny group whose every prompt and completion position must be captured,
the check vllm_capture.assemble makes on every group) and, when a position is missing, restarts
eager with a logged warning: slower, never wrong.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlfleet.config import VLLMSpec
from rlfleet.engines.adapters import MergedDirs
from rlfleet.engines.base import Engine, Generation, GroupRequest
from rlfleet.engines.vllm_capture import CaptureError, assemble, decode_capture
from rlfleet.engines.vllm_pin import (
    INSTALL_HINT,
    VLLM_VERSION,
    check_supported,
    cpu_build,
    engine_args,
    stop_ids,
    tensor_names,
)
from rlfleet.engines.vllm_worker import DRAWS_FROM_ARG, SEED_ARG, CaptureExtension
from rlfleet.models.policy import DTYPES, load_tokenizer
from rlfleet.models.sampling import sample_seed
from rlfleet.wire import env
from rlfleet.wire.streams import SamplingParams

log = logging.getLogger("rlfleet.rollout.vllm")

# CPU defaults for a shared machine: the KV cache is sized explicitly (env.VLLM_KV_CACHE_BYTES; vLLM's
# CPU default asks for a fraction of all RAM), and worker threads are not pinned to cores other
# processes also use. vLLM reads its own variables when it is imported, hence before `import vllm`.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the capture reads V1 runner bookkeeping
# On CPU the engine core and its one worker run in this process (the `uni` executor): on a few cores,
# two more processes that each import vLLM and poll for work cost more than they overlap. Measured on
# 2 busy cores: engine start 124 s -> 29 s, a 1-token group after a weight swap 0.8-2.5 s -> 0.15-0.5 s.
if cpu_build():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
IN_PROCESS = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
# How long `close` lets the engine-core process exit gracefully before it is killed; inside the
# launcher's stop grace period (launcher.STOP_GRACE_S) and a pod's default 30 s.
ENGINE_STOP_TIMEOUT_S = 15.0

try:
    import vllm
except ImportError as exc:  # a clear error for `engine: vllm` without the extra
    raise ImportError(f"spec.engine: vllm needs the vllm package ({exc}); install it with {INSTALL_HINT}") from exc
if vllm.__version__ != VLLM_VERSION:
    raise ImportError(
        f"rlfleet's vLLM adapter is pinned to vllm {VLLM_VERSION}, found {vllm.__version__}; "
        f"reinstall with {INSTALL_HINT}"
    )


class VLLMEngine(Engine):
    name = "vllm"
    # benchmarks/rollout.py on 2 CPU cores, groups of 8: 1 -> 4 -> 8 -> 16 in flight gave 689 -> 1590 -> 2319
    # -> 2710 tokens/s, still growing at 16; vLLM's scheduler bounds what runs at once by its KV cache
    # (env.VLLM_KV_CACHE_BYTES) and queues the rest, so more in flight costs no engine memory
    default_groups_in_flight = 16

    def __init__(
        self,
        model_dir: Path,
        version: int,
        dtype: str = "float32",
        settings: VLLMSpec | None = None,
        device: torch.device | None = None,
    ):
        from vllm.platforms import current_platform

        model_dir = Path(model_dir)
        check_supported(model_dir)
        on_cpu = current_platform.is_cpu()
        if device is not None and (device.type == "cpu") != on_cpu:
            raise ValueError(
                f"this process computes on {device} (rlfleet/models/device.py) but the installed vLLM runs on "
                f"{'the CPU' if on_cpu else 'GPUs'}; set {env.DEVICE} to match, install the other vLLM build "
                f"({INSTALL_HINT}), or use engine: torch"
            )
        # Ours, as every component loads it (prompts are passed to vLLM as token ids, so vLLM's own
        # tokenizer only supplies the end-of-sequence id, which is the same).
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_id = self.tokenizer.eos_token_id
        self.stop_ids = stop_ids(model_dir, self.tokenizer)  # the gate's stop tokens, exactly
        self._names, self._adapters = tensor_names(model_dir), MergedDirs(model_dir)  # adapters.py: LoRA versions
        self.version = version
        self.prompt_tokens_cached = 0  # prompt tokens vLLM read from its prefix cache instead of computing them
        self._lock = threading.Lock()  # one version per group: generate and load_weights never interleave
        args = engine_args(settings, on_cpu)
        self._start(model_dir, dtype, args)
        if not args["enforce_eager"] and not self._capture_self_check():
            log.warning(
                "vLLM with CUDA graphs: the TOPLOC capture missed positions of a test group; restarting eager "
                "(spec.vllm.enforceEager: true skips this check)"
            )
            self.close()
            self._start(model_dir, dtype, {**args, "enforce_eager": True})
        log.info("vLLM engine on %s: %s", "CPU" if on_cpu else "GPU", self.args)

    def _start(self, model_dir: Path, dtype: str, args: dict[str, Any]) -> None:
        kv_bytes = env.get_int(env.VLLM_KV_CACHE_BYTES, env.DEFAULT_VLLM_KV_CACHE_BYTES)
        memory: dict[str, Any] = {"kv_cache_memory_bytes": kv_bytes} if "gpu_memory_utilization" not in args else {}
        backend: dict[str, Any] = {"distributed_executor_backend": "uni"} if IN_PROCESS else {}
        self.args = args
        self.llm = vllm.LLM(
            model=str(model_dir),
            # LLM's annotation names only dtype strings; its ModelConfig takes a torch.dtype as well.
            dtype=DTYPES[dtype],  # type: ignore[arg-type]
            enable_prefix_caching=True,
            worker_extension_cls=f"{CaptureExtension.__module__}.{CaptureExtension.__qualname__}",
            **args,
            **memory,
            **backend,
        )
        self.llm.collective_rpc("rlfleet_install_capture")
        self.llm.llm_engine.step = partial(_beating_step, self, self.llm.llm_engine.step)  # type: ignore[method-assign]
        self.max_model_len = self.context = self.llm.llm_engine.model_config.max_model_len

    def _capture_self_check(self) -> bool:
        """Whether a tiny group (4 samples of up to 8 tokens, batched decode steps) is captured at every
        position; generate raises CaptureError otherwise."""
        prompt = [int(t) for t in range(1, 9) if t not in self.stop_ids][:6]
        try:
            self.generate(prompt, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8, seed=0), 4)
        except CaptureError as exc:
            log.warning("capture self-check: %s", exc)
            return False
        return True

    def load_weights(self, model_dir: Path, version: int) -> None:
        model_dir = self._adapters.resolve(model_dir)
        names = tensor_names(Path(model_dir))
        if names != self._names:
            raise ValueError(
                f"{model_dir}: weights do not match the running model (missing {sorted(self._names - names)[:3]}, "
                f"unexpected {sorted(names - self._names)[:3]})"
            )
        with self._lock:
            self.llm.collective_rpc("rlfleet_reload_weights", args=(str(model_dir),))
            self.llm.reset_prefix_cache()  # KV blocks computed by the old weights must not be reused
            self.version = version

    def close(self) -> None:
        # Stops the engine core now, while logging still works. In another process (GPU), left to
        # vLLM's exit-time finalizer it gets 5 s, and its graceful exit (worker teardown first) took
        # about that long on 2 CPU cores, so it was force-killed.
        self.llm.llm_engine.engine_core.shutdown(timeout=ENGINE_STOP_TIMEOUT_S)

    def _limit(self, prompt_ids: list[int], max_tokens: int) -> int:
        # A completion's last hidden row comes from one more decode step or a 1-token continuation
        # (module docstring), so a completion may fill the context window but for that one position.
        room = self.max_model_len - len(prompt_ids) - 1
        if room < 1:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens leaves no room to generate in the model's "
                f"{self.max_model_len}-token context (one position is kept for the TOPLOC capture); "
                f"shorten spec.task's prompts or serve a model with a longer context"
            )
        return min(max_tokens, room)

    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Generation]]:
        from vllm import SamplingParams as VSamplingParams

        if not requests:
            return []
        limits = [self._limit(r.prompt_ids, r.params.max_tokens) for r in requests]
        rows = [(k, i) for k, r in enumerate(requests) for i in range(r.n)]  # (request, sample) of each vLLM request
        prompts, sampling = self._vllm_requests(requests, rows, limits)
        with self._lock:  # every request of every group, and their continuations, on one version
            outs = self.llm.generate(prompts, sampling, use_tqdm=False)  # one batch: vLLM schedules them together
            sampled_ids = [list(o.outputs[0].token_ids) for o in outs]
            completions = [ids[: limits[k]] for ids, (k, _) in zip(sampled_ids, rows)]
            # at EOS before the extra token: its last row was not fed
            stopped = [j for j, (ids, (k, _)) in enumerate(zip(sampled_ids, rows)) if len(ids) <= limits[k]]
            tails = (
                self.llm.generate(
                    [
                        _tokens_prompt(requests[rows[j][0]], completions[j])  # in its request's salt
                        for j in stopped
                    ],
                    VSamplingParams(n=1, temperature=0.0, max_tokens=1, detokenize=False),
                    use_tqdm=False,
                )
                if stopped
                else []
            )
            captured = self.llm.collective_rpc("rlfleet_drain_capture")[0]  # TP ranks hold identical rows
            version = self.version
            self.prompt_tokens_cached += sum(o.num_cached_tokens or 0 for o in outs)
        decoded = [decode_capture(captured[out.request_id]) for out in outs]
        prompt_rows = {k: _known_rows(requests[k]) | decoded[j][0] for j, (k, i) in enumerate(rows) if i == 0}
        tail_of = {j: tail for j, tail in zip(stopped, tails)}
        result: list[list[Generation]] = [[] for _ in requests]
        for j, ((k, _), completion) in enumerate(zip(rows, completions)):
            got, sampled = decoded[j]
            tail_rows = decode_capture(captured[tail_of[j].request_id])[0] if j in tail_of else {}
            hidden, logprobs = assemble(requests[k].prompt_ids, completion, prompt_rows[k], got, tail_rows, sampled)
            result[k].append(
                Generation(
                    completion_ids=completion,
                    logprobs=logprobs,
                    hidden=hidden,
                    finish_reason="stop" if j in tail_of else "length",
                    version=version,
                )
            )
        return result

    def _vllm_requests(self, requests: list[GroupRequest], rows: list[tuple[int, int]], limits: list[int]):
        """vLLM's prompts and sampling parameters of each (request, sample) in `rows` (module docstring)."""
        from vllm import SamplingParams as VSamplingParams

        for r in requests:
            if r.prefix_rows is not None and r.cache_salt is None:
                raise ValueError("a request with prefix_rows needs a cache_salt (rlfleet/engines/base.py)")
        prompts = [_tokens_prompt(requests[k]) for k, _ in rows]
        sampling = [
            VSamplingParams(
                n=1,
                temperature=requests[k].params.temperature,
                top_p=requests[k].params.top_p,
                top_k=requests[k].params.top_k,
                max_tokens=limits[k] + 1,  # the extra token's decode step feeds the last one (docstring)
                # drawn by rlfleet's rule in the worker (vllm_worker.py); vLLM's own draw is replaced
                extra_args={
                    SEED_ARG: sample_seed(requests[k].params.seed, requests[k].first + i),
                    DRAWS_FROM_ARG: requests[k].draws_from,
                },
                stop_token_ids=sorted(self.stop_ids),
                detokenize=False,
                # a group's first request computes the prompt rows nobody gave us; with prefix_rows it reads
                # the salt's cached blocks, whose rows those are
                skip_reading_prefix_cache=(i == 0 and requests[k].prefix_rows is None),
            )
            for k, i in rows
        ]
        return prompts, sampling


def _tokens_prompt(request: GroupRequest, completion: Sequence[int] = ()):
    """vLLM's prompt of `request` (its prompt ids, then `completion`), in its cache salt's namespace."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=[*request.prompt_ids, *completion])
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def _known_rows(request: GroupRequest) -> dict[int, torch.Tensor]:
    """position -> row of the prompt rows `request` brings (GroupRequest.prefix_rows), none without."""
    return {} if request.prefix_rows is None else dict(enumerate(request.prefix_rows))


def _beating_step(engine: VLLMEngine, step):
    """LLMEngine.step, then the engine's heartbeat (module docstring)."""
    out = step()
    engine.heartbeat = time.monotonic()
    return out
