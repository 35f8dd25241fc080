"""What runs inside vLLM's worker process: rlfleet's seeded draw of every token, the capture of final
hidden states and token logprobs, and the in-place weight reload (vllm_engine.py starts vLLM with
`CaptureExtension` as its `worker_extension_cls` and calls its methods by name through
`LLM.collective_rpc`, so the same code works whether the engine core and its workers run in other
processes, as vLLM does by default on GPU, or in the worker's own, as we run it on CPU). Pinned with
vllm_engine.py to vLLM 0.32.0 (vllm_pin.VLLM_VERSION).

- Final hidden states (for TOPLOC proofs): a forward hook on the model module records, for every
  row of every forward, the request (`input_batch.req_ids`, row ranges `query_start_loc`) and the
  row's position (`positions`); the rows are the post-norm states the decode produced anyway, so
  there is no second prefill. vLLM 0.32's own route to hidden states (speculative method
  `extract_hidden_states` with a KV connector writing them to files) is built for distillation and
  ties generation to speculative decoding, so it is not used.
  Coverage: prompt rows come from the group's first request, which skips *reading* the prefix
  cache (`skip_reading_prefix_cache`) so all its prompt rows are computed, unless the request
  brings the rows of a prefix (`GroupRequest.prefix_rows`, a later turn of an episode): it then
  reads its own salt's cached blocks, which cover no position past those rows, and the rows from
  the first uncached position on are computed here; a completion's tokens
  t_0..t_{T-2} are fed by its own decode steps. vLLM never feeds the last token t_{T-1} (it stops
  after sampling it), so each request may sample one token past the group's limit: a completion
  that runs to the limit gets t_{T-1}'s row from the decode step that samples that extra token
  (dropped, with its row and logprob). One that stops at EOS earlier gets a 1-token continuation
  request (prompt + completion, greedy, output discarded) that reads the prefix cache: it
  recomputes only the rows after the last full cached KV block and yields t_{T-1}'s row.
- Sampling, by rlfleet's contract (rlfleet/models/sampling.py), not vLLM's: every request
  vllm_engine.py samples carries its sample seed s in `SamplingParams.extra_args[SEED_ARG]`. At each
  step a pre-hook on vLLM's `Sampler` reads, for each row of the batch, the request's state in the
  runner (`runner.requests`: its sampling params and prompt length P) and the last input position q
  the model hook saw; the token drawn at that step sits at position q + 1, i.e. t = q + 1 - P within
  the completion (t = 0 for the first token, whatever prefix-cache hit or recompute after preemption
  led there). It draws `draw(l, keep_mask_rows(l, (top_p, top_k)), u_t)` with l = float32 logits / T
  and u_t = `UniformStream(s)[d + t]` (d: `extra_args[DRAWS_FROM_ARG]`, 0 but in a later turn of a multi-turn
  episode; each request's stream, read lazily, exactly `sample_uniforms(s, ·)`),
  the functions the torch engine draws with and the gate replays. A post-hook writes those tokens
  over vLLM's in `SamplerOutput.sampled_token_ids`, the tensor the runner then appends to the
  request, feeds to the next step and returns: vLLM's own draw is computed and discarded. Rows
  without a seed (the greedy continuations below) keep vLLM's greedy token; a partial prefill's row
  (t < 0) keeps vLLM's token, which vLLM discards. The hooks read the logits before vLLM's sampler
  divides them in place by the temperature. The sampler runs outside any CUDA graph (vLLM 0.32
  captures only the model's forward, never `Sampler`), so these hooks fire on every step whatever
  `cudagraph_mode`; with tensor parallelism every rank draws the same token from the same logits.
  On a GPU the logits differ from a verifier's by bf16 kernel noise, so a draw whose u_t falls that
  close to a CDF edge may differ from the replay (the gate's tolerance); on vLLM-CPU fp32 the tokens
  are the torch engine's (tests/engines/test_vllm_engine.py).
- Token logprobs: vLLM's own logprobs are `log_softmax(logits)` before temperature
  (`logprobs_mode="raw_logprobs"`) or after temperature *and* top-k/top-p renormalisation
  (`processed_logprobs`); neither is the contract of engine.py (`log_softmax(logits / T)` over the
  full vocabulary, what the trainer and verifier recompute) when top-k/top-p are on. So the
  sampler's pre-hook computes exactly that from the logits it receives and the post-hook picks
  the entry of the token it wrote; vLLM's logprobs are not requested at all.

Weights: `Worker.reload_weights(weights_path=…)` (vLLM's layerwise in-place reload, which re-runs
the kernel-format processing, e.g. the CPU backend's packed GEMM weights; a plain
`model.load_weights` would leave those stale), plus the CPU repack of a tied head that reload
misses (`CaptureExtension.rlfleet_reload_weights`); vllm_engine.py then resets the prefix cache and
holds the lock that keeps a swap out of a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from rlfleet.models.sampling import UniformStream, draw, keep_mask_rows

# The SamplingParams.extra_args key carrying a request's rlfleet sample seed (vllm_engine.py sets it).
SEED_ARG = "rlfleet_sample_seed"
DRAWS_FROM_ARG = "rlfleet_draws_from"  # the stream position of the request's first token (GroupRequest.draws_from)


@dataclass
class _Record:
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> (H,) final hidden state
    sampled: dict[int, tuple[int, float]] = field(default_factory=dict)  # position -> (token, logprob)


@dataclass
class _Capture:
    requests: dict[str, _Record] = field(default_factory=dict)
    step: list[tuple[str, str, int]] = field(default_factory=list)  # (request, vLLM's id, last input position)
    logp: torch.Tensor | None = None  # (B, V) log_softmax(logits / T) of this step
    drawn: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's (rows, tokens) drawn by rlfleet's rule
    streams: dict[str, UniformStream] = field(default_factory=dict)  # vLLM's request id -> its uniforms


def _external_id(internal: str) -> str:
    return internal.rsplit("-", 1)[0]  # vLLM 0.32 appends "-{8 random chars}" to our request id


def _after_model(runner, cap: _Capture, module, args, kwargs, output) -> None:
    hidden = output[0] if isinstance(output, tuple) else output  # (N_padded, H), post final norm
    positions = kwargs["positions"]  # (N_padded,)
    n = runner.input_batch.num_reqs
    starts = runner.query_start_loc.np[: n + 1]
    rows, pos = hidden.detach().to("cpu"), positions.to("cpu").tolist()
    cap.step = []
    for k, rid in enumerate(runner.input_batch.req_ids[:n]):
        a, b = int(starts[k]), int(starts[k + 1])
        rec = cap.requests.setdefault(_external_id(rid), _Record())
        for r in range(a, b):
            rec.rows[pos[r]] = rows[r].clone()  # a recomputed position (preemption) keeps the newest row
        cap.step.append((_external_id(rid), rid, pos[b - 1]))


def _draw_rows(runner, cap: _Capture, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, tokens): rlfleet's draw for every row whose request carries a sample seed (module docstring)."""
    rows, temps, filters, uniforms = [], [], [], []
    for k, (_, rid, last_pos) in enumerate(cap.step):
        state = runner.requests[rid]  # every request of the input batch is one of the runner's
        params = state.sampling_params
        seed = (params.extra_args or {}).get(SEED_ARG) if params is not None else None
        if params is None or seed is None:  # not sampled by rlfleet's rule: the greedy continuations
            continue
        t = last_pos + 1 - state.num_prompt_tokens  # the drawn token's position within its completion
        if t < 0:  # a partial prefill (a chunk of a long prompt): vLLM discards its token
            continue
        if rid not in cap.streams:
            cap.streams[rid] = UniformStream(seed)
        rows.append(k)
        temps.append(params.temperature)
        filters.append((params.top_p, params.top_k))
        uniforms.append(cap.streams[rid][t + params.extra_args.get(DRAWS_FROM_ARG, 0)])
    if not rows:
        return None
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    scaled = logits[idx].float() / torch.tensor(temps, device=dev)[:, None]  # as torch_engine: float32 logits / T
    tokens = draw(scaled, keep_mask_rows(scaled, filters), torch.tensor(uniforms, dtype=torch.float64, device=dev))
    return idx, tokens


def _before_sampler(runner, cap: _Capture, module, args, kwargs) -> None:
    logits = kwargs["logits"] if "logits" in kwargs else args[0]  # (B, V), before vLLM's in-place temperature
    meta = kwargs["sampling_metadata"] if "sampling_metadata" in kwargs else args[1]
    temp = meta.temperature if meta.temperature is not None else torch.ones(logits.shape[0], device=logits.device)
    cap.logp = torch.log_softmax(logits.float() / temp.float()[:, None], dim=-1)
    cap.drawn = _draw_rows(runner, cap, logits) if len(cap.step) == logits.shape[0] else None


def _after_sampler(cap: _Capture, module, args, kwargs, output) -> None:
    if cap.logp is None or len(cap.step) != output.sampled_token_ids.shape[0]:
        return  # a warm-up/dummy sampler run, not one of our requests' steps
    if cap.drawn is not None:  # ours replace vLLM's draws: what vLLM appends to the request and feeds next
        rows, tokens = cap.drawn
        output.sampled_token_ids[rows.to(output.sampled_token_ids.device), 0] = tokens.to(
            output.sampled_token_ids.device, output.sampled_token_ids.dtype
        )
    tokens = output.sampled_token_ids[:, 0].to("cpu")  # (B,)
    picked = cap.logp.gather(-1, output.sampled_token_ids[:, :1].long().to(cap.logp.device))[:, 0].to("cpu")
    for k, (rid, _, last_pos) in enumerate(cap.step):
        cap.requests[rid].sampled[last_pos + 1] = (int(tokens[k]), float(picked[k]))
    cap.logp, cap.drawn, cap.step = None, None, []  # a later sampler run without a forward is not this step


class CaptureExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); methods run in the worker process."""

    # What the vLLM worker this class is mixed into provides (annotations only: nothing set here).
    model_runner: Any
    reload_weights: Any

    def rlfleet_install_capture(self) -> None:
        runner = self.model_runner
        cap = runner._rlfleet_capture = _Capture()
        runner.get_model().register_forward_hook(partial(_after_model, runner, cap), with_kwargs=True)
        runner.sampler.register_forward_pre_hook(partial(_before_sampler, runner, cap), with_kwargs=True)
        runner.sampler.register_forward_hook(partial(_after_sampler, cap), with_kwargs=True)

    def rlfleet_reload_weights(self, weights_path: str) -> None:
        """vLLM's in-place reload, then the CPU GEMM dispatch redone for layers that keep their weight.

        vLLM 0.32's layerwise reload re-processes only layers it loaded tensors into; a tied
        `lm_head` loads none (it shares `embed_tokens.weight`), so on CPU its packed GEMM copy of
        the old weights survived the reload and logits came from the old head (found by
        tests/engines/test_vllm_engine.py). Redoing the dispatch for every layer that still holds its
        weight (`remove_weight=False` layers: embeddings, heads) rebuilds those copies."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            for module in self.model_runner.get_model().modules():
                weight = getattr(module, "weight", None)
                if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def rlfleet_drain_capture(self) -> dict:
        """Everything captured since the last drain, as plain data (msgpack-safe), then forgotten."""
        cap = self.model_runner._rlfleet_capture
        out = {}
        for rid, rec in cap.requests.items():
            positions = sorted(rec.rows)
            hidden = torch.stack([rec.rows[p] for p in positions]) if positions else torch.empty(0)
            out[rid] = {
                "positions": positions,
                "dtype": str(hidden.dtype).removeprefix("torch."),
                "shape": list(hidden.shape),
                "hidden": hidden.contiguous().view(torch.uint8).numpy().tobytes(),
                "sampled": [[p, t, lp] for p, (t, lp) in sorted(rec.sampled.items())],
            }
        cap.requests.clear()
        cap.streams.clear()  # drained after every generate_groups call: its requests are finished
        return out
