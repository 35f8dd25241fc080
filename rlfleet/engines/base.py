"""The engine seam: what a rollout worker asks of an inference engine (docs/code.md, "Small interfaces at the seams").

Contract of every engine: tokens are drawn by rlfleet/models/sampling.py's rule (each sample's
uniform stream, top-k then top-p, inverse CDF), so the gate can replay them; token logprobs are
`log_softmax(logits / temperature)` over the full vocabulary (what the trainer and verifier
recompute); top-p/top-k only restrict which tokens may be drawn. `hidden` holds the final
(post-norm) hidden state of every prompt and completion position, the rows TOPLOC proofs are
built from, on the CPU.

Batching: `generate_groups` samples several groups (each its own prompt, seed and sampling
parameters) together, as one batch of the engine; `generate` is one group of it. Sample i of a
request with seed s draws with `sample_seed(s, first + i)` (rlfleet/models/sampling.py), so a
sample's tokens depend on the weights, its prompt and its seed only, never on which batch it was
drawn in (up to the float noise of another batch shape, which the gate's replayTolerance absorbs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.wire.streams import SamplingParams

if TYPE_CHECKING:  # the engines package imports without torch: the launcher checks pools before anything starts
    import torch
    from transformers import PreTrainedTokenizerBase


@dataclass
class Generation:
    completion_ids: list[int]  # (T,) including the end-of-sequence token when one was sampled
    logprobs: list[float]  # (T,)
    hidden: torch.Tensor  # (P + T, H) final hidden states of prompt and completion positions, on the CPU
    finish_reason: str  # "stop" or "length"
    version: int  # the policy version whose weights produced every token and hidden state of it
    spans: list[int] | None = None  # a multi-turn episode's span lengths (wire Sample.spans); None: one completion


@dataclass(frozen=True)
class GroupRequest:
    """Samples first .. first+n-1 of a group of one prompt (the worker asks for whole groups: first 0)."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    first: int = 0
    # Where in each sample's uniform stream the first token draws: a later turn of a multi-turn episode continues
    # its sample's stream (its model tokens so far; rlfleet/tasks/turns.py), a whole completion starts at 0.
    draws_from: int = 0
    # An engine with a KV prefix cache shares cached blocks only between requests of one salt (and between those
    # of none): a multi-turn episode salts every turn with its own, so its later turns read what its earlier ones
    # computed and nothing another request did. Engines without such a cache ignore it.
    cache_salt: str | None = None
    # (K, H) final hidden rows of the first K prompt positions, computed on this version by an earlier call of the
    # same salt (an episode's previous turn: its Generation.hidden). An engine may then read those K positions from
    # its prefix cache instead of recomputing them, and takes their rows from here (vllm_engine.py).
    prefix_rows: torch.Tensor | None = field(default=None, compare=False, repr=False)


class Engine(ABC):
    """Invariant: one `generate_groups` call runs on one weights version, the one each Generation of it
    records; `load_weights` never takes effect in the middle of a call (a swap waits for the batch).
    Liveness (rlfleet/wire/health.py): `heartbeat` is the time.monotonic() of the last completed forward
    step, read in the worker's process; `probe` is the idle check."""

    name: str  # what a group records as its `engine` (the gate chooses its checks and tolerances by it)
    version: int
    tokenizer: PreTrainedTokenizerBase
    stop_ids: frozenset[int]  # rlfleet.models.sampling.stop_token_ids of the model: a completion ends at the first
    context: int  # the model's context window in tokens (prompt + completion + the one position kept for TOPLOC)
    # Groups a worker keeps in flight when its pool sets no maxGroupsInFlight: where this engine's
    # tokens/s stops growing on CPU (benchmarks/rollout.py --in-flight), memory permitting.
    default_groups_in_flight: int = 1
    heartbeat: float = 0.0  # set by the engine after every forward step

    @abstractmethod
    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Generation]]:
        """One list of `request.n` Generations per request, in order, all on one weights version;
        sample i of a request draws with `rlfleet.models.sampling.sample_seed(params.seed, first + i)`, its token t
        with uniform `draws_from + t` of that stream."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int, first: int = 0) -> list[Generation]:
        """Samples first .. first+n-1 of a group of one prompt (generate_groups with one request)."""
        return self.generate_groups([GroupRequest(list(prompt_ids), params, n, first)])[0]

    @abstractmethod
    def load_weights(self, model_dir: Path, version: int) -> None:
        """Swap to the weights of `model_dir` in place; later generations record `version`."""

    def probe(self) -> None:
        """A 1-token generation, the idle liveness check: returns once the engine produced it, raises when
        it cannot. The caller holds the lock its `generate` and `load_weights` calls hold (the worker's
        liveness lock, rlfleet/services/rollout/health.py), so a probe never interleaves with a swap."""
        prompt = [self.tokenizer.eos_token_id or 0]  # not tokenized: the worker's thread may be using the tokenizer
        self.generate(prompt, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=1, seed=0), 1)

    def close(self) -> None:  # noqa: B027 (optional: most engines hold nothing outside the process)
        """Release what the engine holds outside this process's memory (child processes); idempotent."""
