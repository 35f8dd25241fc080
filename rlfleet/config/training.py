"""How workers sample and how the trainer learns (`spec.sampling`, `spec.trainer`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rlfleet.config.base import Spec
from rlfleet.config.workload import ResourcesSpec, gpu_resource, pod_template, resources

MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class OnlineFilterSpec(Spec):
    """Online prompt filter (rlfleet/fleet/prompt_filter.py): the trainer records each prompt's recent groups and
    retires a prompt once its last `window` groups were all solved or all failed; workers stop drawing it."""

    window: int = Field(
        default=2,
        ge=1,
        le=1000,
        description="Consecutive groups of one prompt (same prompt tokens) that must all be solved, or all failed, "
        "before the prompt is retired for the rest of the run.",
    )
    solved_at: float | None = Field(
        default=1.0,
        description="A group counts as solved when its mean reward is at least this (1.0: every completion right, "
        "with the binary rewards; lower it with a length penalty). Empty: solved prompts are never retired.",
    )
    failed_at: float | None = Field(
        default=0.0,
        description="A group counts as failed when its mean reward is at most this. Empty: failed prompts are never "
        "retired.",
    )
    max_redraws: int = Field(
        default=32,
        ge=1,
        le=100_000,
        description="Draws a worker makes for one group before it takes a retired prompt anyway (so a run whose "
        "every prompt is retired keeps going; the trainer then drops repeats as before).",
    )

    @model_validator(mode="after")
    def _thresholds(self) -> OnlineFilterSpec:
        if self.solved_at is None and self.failed_at is None:
            raise ValueError("solvedAt and failedAt are both empty, so nothing is ever retired; set one or remove "
                             "sampling.onlineFilter")  # fmt: skip
        if self.solved_at is not None and self.failed_at is not None and self.solved_at <= self.failed_at:
            raise ValueError(
                f"solvedAt ({self.solved_at}) must be above failedAt ({self.failed_at}): a group cannot count as both"
            )
        return self


class SamplingSpec(Spec):
    group_size: int = Field(
        default=8,
        ge=2,
        le=256,
        description="G: completions sampled per prompt; advantages are normalized within the group.",
    )
    max_tokens: int = Field(
        default=16,
        ge=1,
        le=32768,
        description="Maximum completion tokens; of a multi-turn episode, every token after the prompt (the model's "
        "turns and the environment's).",
    )
    max_turns: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Model turns of an episode (docs/environments.md, multi-turn): after each turn but the last, an "
        "environment that takes turns answers (tool results, feedback) or ends the episode. 1: single-turn; a "
        "task that takes no turns is single-turn whatever this says.",
    )
    max_tokens_per_turn: int | None = Field(
        default=None,
        ge=1,
        le=32768,
        description="Tokens of one model turn of a multi-turn episode; a turn ends at its stop token or here (and "
        "the environment answers what it has). Empty: maxTokens.",
    )
    temperature: float = Field(
        default=1.0,
        gt=0.0,
        le=10.0,
        description="Sampling temperature; the trainer and verifier score tokens at the same temperature.",
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off).")
    assignment: Literal["worker", "run"] | None = Field(
        default=None,
        description="Who chooses each group's task and seed. `worker`: the worker draws them. `run`: a worker asks "
        "the run for a work ticket (Redis, or the ingest's tickets endpoint) and the ticket fixes task and seed "
        "(rlfleet/fleet/assignment.py); the gate accepts each ticket once and only from the worker it was issued to, "
        "so a worker cannot grind seeds or tasks, and one that drops too many of its tickets is banned "
        "(verifier.ban.maxDroppedTicketShare). Empty: `run` when spec.ingest.admission lets workers join (mode open "
        "or invite), else `worker`.",
    )
    online_filter: OnlineFilterSpec | None = Field(
        default=None,
        description="Stop sampling prompts whose recent groups were all solved or all failed (they teach nothing: "
        "zero advantage); absent: every drawn prompt is sampled. Workers that submit through an ingest are not "
        "filtered (they read no Redis).",
    )


class LoraSpec(Spec):
    """Low-rank adapters (PEFT LoRA): W' = W + (alpha / rank) * B @ A on each targeted linear layer."""

    rank: int = Field(
        default=8, ge=1, le=1024, description="r: the inner dimension of each adapter (A: r x in, B: out x r)."
    )
    alpha: float = Field(
        default=16.0, gt=0.0, le=65_536.0, description="The adapter's output is scaled by alpha / rank."
    )
    target_modules: list[Annotated[str, Field(pattern=MODULE_PATTERN, max_length=200)]] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        min_length=1,
        max_length=64,
        description="Names of the linear layers that get adapters (the last part of a module's name, e.g. q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); every name must match a linear layer of the model.",
    )


class OffPolicySpec(Spec):
    mode: Literal["none", "tis", "mis"] = Field(
        default="none",
        description="Correction for the mismatch between the engine that sampled and the trainer "
        "(rlfleet/services/trainer/loss.py): `none` clips the ratio against the sampling logprobs as they are; `tis` "
        "(truncated importance sampling) clips against the trainer's own recomputed logprobs and weighs each token's "
        "policy-gradient term by min(trainer / sampler probability, cap); `mis` (masked) drops the tokens whose ratio "
        "exceeds cap instead. Both cost one extra forward (no gradient) per step.",
    )
    cap: float = Field(
        default=2.0, ge=1.0, le=1000.0, description="Truncation (tis) or masking (mis) threshold of the ratio."
    )


class TrainerSpec(Spec):
    steps: int = Field(
        default=100, ge=1, le=10_000_000, description="Optimizer steps; each publishes one policy version."
    )
    batch_size: int = Field(default=16, ge=1, le=65_536, description="Groups (prompts) per optimizer step.")
    learning_rate: float = Field(default=1e-4, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    eps_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="Ratio clip lower bound: ratio >= 1 - epsLow.")
    eps_high: float = Field(default=0.28, ge=0.0, description="Ratio clip upper bound: ratio <= 1 + epsHigh.")
    delta: float = Field(
        default=4.0,
        gt=1.0,
        description="INTELLECT-2 two-sided clipping: for negative advantages the ratio is capped at delta.",
    )
    max_grad_norm: float = Field(default=1.0, gt=0.0, description="Gradient-norm clip.")
    epochs: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Optimizer updates per batch (GRPO's mu): each a full pass over the step's groups with the ratio "
        "taken against the sampling logprobs, so passes after the first are off-policy within the clip range. One "
        "policy version is published per step whatever the count.",
    )
    max_async_level: int = Field(
        default=2,
        ge=0,
        description="Groups generated by a policy older than (current - maxAsyncLevel) are dropped; workers pause "
        "past this lag.",
    )
    normalization: Literal["token", "sequence"] = Field(
        default="token",
        description="`token`: the loss is a mean over all completion tokens of the batch (DAPO); `sequence`: a mean "
        "over completions of each completion's token mean (original GRPO).",
    )
    entropy_coef: float = Field(
        default=0.0,
        ge=0.0,
        description="Weight of the entropy bonus (mean token entropy of the policy) subtracted from the loss.",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0.0,
        description="Weight of the KL penalty to the frozen starting policy (k3 estimator, clamped to [0, 10] per "
        "token); 0 keeps no reference model.",
    )
    warmup_steps: int = Field(
        default=0, ge=0, le=10_000_000, description="Linear learning-rate warmup from 0 over this many steps."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="Learning rate after warmup: constant, or decaying to 0 at the last step."
    )
    skip_zero_advantage_groups: bool = Field(
        default=False,
        description="Online filtering: drop groups whose rewards are all equal (zero advantage, no gradient) and keep "
        "reading until the batch is full of groups that teach something. Workers with Redis then hold such groups back "
        "before building their proofs (unless sampling.onlineFilter needs their outcomes) and count them in the "
        "sampled reward.",
    )
    micro_batch_tokens: int = Field(
        default=8192,
        ge=16,
        le=16_777_216,
        description="Padded tokens (rows x longest row) per forward/backward: a step's rows, sorted by length, are "
        "packed into micro-batches of at most this many and their gradients accumulated, the loss normalised as one "
        "batch; a row longer than the budget goes alone. Bounds the step's activation memory.",
    )
    logprob_chunk: int = Field(
        default=1024,
        ge=1,
        le=1_048_576,
        description="Positions whose logits (fp32, positions x vocabulary) exist at once when token logprobs are "
        "taken; the backward recomputes a chunk's logits instead of keeping them.",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Recompute each decoder layer's activations in the backward instead of keeping them (about a "
        "third more compute, activation memory of one layer per micro-batch).",
    )
    master_weights: bool = Field(
        default=True,
        description="For a bfloat16 model: train fp32 weights and optimizer state and compute in bfloat16 (autocast, "
        "or FSDP2's mixed-precision policy with fp32 gradient reduction), so updates smaller than bfloat16's "
        "resolution accumulate instead of rounding away; published versions stay bfloat16. No effect for float32.",
    )
    off_policy: OffPolicySpec = Field(
        default_factory=OffPolicySpec, description="Sampler/trainer mismatch correction (importance sampling)."
    )
    seed: int = Field(default=0, description="Trainer seed.")
    replicas: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Trainer replicas (pods in a cluster), each a group of `ranksPerReplica` rank processes; the "
        "data-parallel world is replicas x ranksPerReplica ranks.",
    )
    sharding: Literal["none", "fsdp"] = Field(
        default="none",
        description="How data-parallel replicas hold the model. `none`: every replica keeps the whole model, its "
        "gradients and optimizer state, and gradients are all-reduced (for models whose training state "
        "fits one device). `fsdp`: PyTorch FSDP2 (`fully_shard`, one unit per decoder layer plus the "
        "root) shards parameters, gradients and optimizer state over the replicas, for models whose "
        "training state does not fit one device; the published checkpoint is still the whole model. Has "
        "no effect with a world of one rank.",
    )
    gpus: int = Field(
        default=0,
        ge=0,
        le=64,
        description="GPUs per trainer replica (asked of the cluster); each GPU runs one rank process "
        "(ranksPerReplica defaults to it).",
    )
    ranks_per_replica: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Rank processes per replica, one per GPU, torchrun-style (LOCAL_RANK, RANK = replica x "
        "ranksPerReplica + LOCAL_RANK, WORLD_SIZE = replicas x ranksPerReplica). Default: gpus, or 1 without "
        "GPUs. Set it without GPUs to run several CPU ranks (gloo) per replica; with gpus > 0 it must equal gpus.",
    )
    collective_timeout_seconds: float = Field(
        default=1800.0,
        ge=1.0,
        le=86_400.0,
        description="How long one collective of the trainer's ranks (a broadcast of the batch, a gradient "
        "all-reduce, a gather of the weights to publish, a save) may take before the rank fails and the replica "
        "restarts whole (NCCL's own default is 10 minutes, too short for a gather or save of a large model). "
        "Waiting for rank 0 to collect verified groups and publish is not a collective: the other ranks wait "
        "outside one, however long it takes.",
    )
    termination_grace_period_seconds: int = Field(
        default=600,
        ge=0,
        le=86_400,
        description="Cluster only: the trainer pods' terminationGracePeriodSeconds, how long a stopped trainer "
        "(a roll-out, a scale-down, a deleted run) may take to save its resume state before it is killed. "
        "Kubernetes' default of 30 s is shorter than saving a real model's weights and optimizer state; a trainer "
        "that has saved exits at once. A podTemplate may still set it.",
    )
    checkpoint_every: int = Field(
        default=1,
        ge=1,
        le=1_000_000,
        description="Steps between saves of the resume state (weights and optimizer sharded with "
        "torch.distributed.checkpoint); a policy version is still published every step. A restart retrains the "
        "groups of the steps after the last save from the weights saved before them (services/trainer/state.py).",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="Train low-rank adapters instead of every weight (absent: full fine-tuning). The base model stays "
        "frozen; each policy version is the adapter alone (a few MiB, shipped whole), which workers and the verifier "
        "merge into the base they hold, refusing an adapter made over another base.",
    )
    gpu_resource: str = gpu_resource()
    resources: ResourcesSpec = resources("1", "4Gi")
    pod_template: dict[str, Any] | None = pod_template()

    @model_validator(mode="after")
    def _lora_unsharded(self) -> TrainerSpec:
        if self.lora is not None and self.sharding == "fsdp" and self.world > 1:
            raise ValueError(
                "trainer.lora: adapters are trained with sharding: none (the frozen base is replicated, the adapter is "
                "small); set trainer.sharding: none or remove trainer.lora"
            )
        return self

    @model_validator(mode="after")
    def _ranks_match_gpus(self) -> TrainerSpec:
        if self.gpus and self.ranks_per_replica is not None and self.ranks_per_replica != self.gpus:
            raise ValueError(
                f"ranksPerReplica: {self.ranks_per_replica} ranks on {self.gpus} GPUs; each rank computes on one GPU "
                f"of its pod, so set ranksPerReplica to gpus ({self.gpus}) or leave it out"
            )
        return self

    @property
    def ranks(self) -> int:
        """Rank processes per replica (ranksPerReplica, else one per GPU, else 1)."""
        return self.ranks_per_replica or max(self.gpus, 1)

    @property
    def world(self) -> int:
        """Ranks of the data-parallel world: replicas x ranks per replica."""
        return self.replicas * self.ranks
