"""Attacks on the gate (issue 16), built as a cheating worker would: honest groups from a real
TorchEngine, then tampered so that every check the attacker can satisfy is satisfied: where an
attack needs it, logprobs and TOPLOC proofs are recomputed by a real prefill of the claimed weights
(`prove`), which a worker holding the weights can always do. Shared by the gate tests and
benchmarks/gate_attacks.py (which measures detection per attack). Only long-standing APIs are used
here (engine.generate, policy.score, proof.build_proofs), so the same attacks also run against the
gate as it was before issue 16.
"""

from __future__ import annotations

import copy
import uuid

import torch

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.policy import score
from rlfleet.proofs.toploc import build_proofs
from rlfleet.tasks import make_run_task
from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams


class Attacker:
    """A worker's engine (torch or vLLM) beside the real weights it proves tampered tokens with: the attacks
    below draw with `generate` and prove with `model` (a vLLM engine holds no torch model of its own)."""

    def __init__(self, engine, model, tokenizer):
        self.engine, self.model, self.tokenizer, self.name = engine, model, tokenizer, engine.name

    def generate(self, prompt_ids, params, n, first=0):
        return self.engine.generate(prompt_ids, params, n, first=first)


def text_of(tokenizer, completion_ids: list[int]) -> str:
    """The reward's text: the tokens before the first EOS."""
    eos = tokenizer.eos_token_id
    end = completion_ids.index(eos) if eos in completion_ids else len(completion_ids)
    return tokenizer.decode(completion_ids[:end], skip_special_tokens=False)


def honest(
    engine: TorchEngine,
    spec,
    index: int,
    worker: str = "w-honest",
    version: int = 0,
    per_batch: int | None = None,
    params: SamplingParams | None = None,
) -> RolloutGroup:
    """A group as an honest worker makes it (task `arith-{task seed}-{index}`, seed `index`), its G samples
    generated `per_batch` rows at a time; `params` overrides what is sampled with (not what is claimed)."""
    s, t = spec.sampling, spec.verifier.toploc
    task = make_run_task(spec)
    problem = task.problem(f"arith-{spec.task.seed}-{index}")
    prompt_ids = engine.tokenizer(problem.prompt)["input_ids"]
    claimed = SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=index)
    drawn = params or claimed
    if per_batch is None:
        gens = engine.generate(prompt_ids, drawn, s.group_size)
    else:
        gens = []
        while len(gens) < s.group_size:
            n = min(per_batch, s.group_size - len(gens))
            gens += engine.generate(prompt_ids, drawn, n, first=len(gens))
    samples = []
    for gen in gens:
        text = text_of(engine.tokenizer, gen.completion_ids)
        proofs = build_proofs(gen.hidden, len(prompt_ids), decode_batching_size=t.decode_batching_size, topk=t.topk)
        samples.append(Sample(gen.completion_ids, gen.logprobs, proofs, task.reward(problem, text), gen.finish_reason))
    group = RolloutGroup(problem.task_id, worker, version, prompt_ids, claimed, samples)
    group.engine = getattr(engine, "name", "torch")
    return group


def prove(group: RolloutGroup, model, tokenizer, spec) -> RolloutGroup:
    """Make the claimed logprobs, proofs, finish reasons and rewards those of the group's tokens under
    `model`, by one prefill (what a worker with the real weights can do for any tokens it likes)."""
    t, p = spec.verifier.toploc, len(group.prompt_ids)
    rows = [group.prompt_ids + s.completion_ids for s in group.samples]
    with torch.inference_mode():
        scored = score(model, rows, spec.sampling.temperature, tokenizer.pad_token_id, want_hidden=True)
    task = make_run_task(spec)
    problem = task.problem(group.task_id)
    for i, sample in enumerate(group.samples):
        sample.logprobs = scored.logprobs[i][p - 1 :].tolist()
        sample.proofs = build_proofs(scored.hidden[i], p, decode_batching_size=t.decode_batching_size, topk=t.topk)
        ended = sample.completion_ids[-1] == tokenizer.eos_token_id
        sample.finish_reason = "stop" if ended else "length"
        sample.reward = task.reward(problem, text_of(tokenizer, sample.completion_ids))
    return group


def _copy(group: RolloutGroup, **changes) -> RolloutGroup:
    out = copy.deepcopy(group)
    out.rollout_id = uuid.uuid4().hex
    for k, v in changes.items():
        setattr(out, k, v)
    return out


# ---- replays of accepted work under a new identity (item 1) ----------------------------------


def replay_new_rollout_id(group: RolloutGroup) -> RolloutGroup:
    return _copy(group)


def replay_new_worker(group: RolloutGroup) -> RolloutGroup:
    return _copy(group, worker_id=group.worker_id + "-sybil")


def replay_new_seed(group: RolloutGroup) -> RolloutGroup:
    out = _copy(group)
    out.sampling.seed += 1
    return out


def same_prompt_task(spec, task_id: str, tries: int = 100_000) -> str:
    """Another task id of the run's source with exactly the same prompt."""
    task, prompt = make_run_task(spec), make_run_task(spec).problem(task_id).prompt
    prefix = task_id.rsplit("-", 1)[0]
    for i in range(tries):
        other = f"{prefix}-{i}"
        if other != task_id and task.problem(other).prompt == prompt:
            return other
    raise AssertionError(f"no other task id with the prompt of {task_id} in {tries} tries")


def replay_same_prompt_task(group: RolloutGroup, spec) -> RolloutGroup:
    return _copy(group, task_id=same_prompt_task(spec, group.task_id))


def replay_reordered(group: RolloutGroup) -> RolloutGroup:
    return _copy(group, samples=list(reversed(copy.deepcopy(group.samples))))


# ---- where a completion stops (item 2) -------------------------------------------------------


def dropped_eos(group: RolloutGroup, model, tokenizer, spec) -> RolloutGroup:
    """Every completion that ends with EOS loses it (the reward text and length change); proofs rebuilt."""
    out = _copy(group)
    for s in out.samples:
        if len(s.completion_ids) > 1 and s.completion_ids[-1] == tokenizer.eos_token_id:
            s.completion_ids = s.completion_ids[:-1]
    return prove(out, model, tokenizer, spec)


def answer_after_eos(group: RolloutGroup, model, tokenizer, spec) -> RolloutGroup:
    """`<eos> answer <eos>` in sample 0: the policy stopped, the worker wrote the answer after it."""
    out = _copy(group)
    answer = make_run_task(spec).problem(group.task_id).answer
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    out.samples[0].completion_ids = [tokenizer.eos_token_id, *ids, tokenizer.eos_token_id][: spec.sampling.max_tokens]
    return prove(out, model, tokenizer, spec)


# ---- sampling that is not the seed's (item 3) ------------------------------------------------


def resampled(engine: TorchEngine, group: RolloutGroup, spec, **sampling) -> RolloutGroup:
    """The group's samples drawn again with other sampling parameters (same seeds), claimed as the run's,
    logprobs and proofs recomputed at the run's temperature."""
    params = SamplingParams(**{**group.sampling.__dict__, **sampling})
    gens = engine.generate(group.prompt_ids, params, len(group.samples))
    out = _copy(group)
    for s, g in zip(out.samples, gens):
        s.completion_ids = g.completion_ids
    return prove(out, engine.model, engine.tokenizer, spec)


def tokens(group: RolloutGroup) -> list[list[int]]:
    return [s.completion_ids for s in group.samples]


def outside_nucleus(engine: TorchEngine, spec, start: int, tries: int = 200) -> RolloutGroup:
    """A group drawn without the run's top-p (claiming it), from the first task index >= `start` whose
    draw differs from the honest one (so some token lies outside the nucleus)."""
    for i in range(start, start + tries):
        group = honest(engine, spec, i)
        free = resampled(engine, group, spec, top_p=1.0)
        if tokens(free) != tokens(group):
            return free
    raise AssertionError(f"no draw without top-p {spec.sampling.top_p} differed in {tries} groups")


def temperature_lie(engine, group, spec, temperature: float = 0.5) -> RolloutGroup:
    return resampled(engine, group, spec, temperature=temperature)


def greedy(engine, group, spec) -> RolloutGroup:
    return resampled(engine, group, spec, top_k=1)


def cherry_picked(engine: TorchEngine, group: RolloutGroup, spec, pool: int = 3) -> RolloutGroup:
    """`pool` x G samples drawn honestly, the G with the highest reward (then the shortest) kept, re-proved."""
    g = len(group.samples)
    gens = engine.generate(group.prompt_ids, group.sampling, pool * g)
    task = make_run_task(spec)
    problem = task.problem(group.task_id)
    scored = sorted(
        gens, key=lambda x: (-task.reward(problem, text_of(engine.tokenizer, x.completion_ids)), len(x.completion_ids))
    )
    out = _copy(group)
    for s, x in zip(out.samples, scored[:g]):
        s.completion_ids = x.completion_ids
    return prove(out, engine.model, engine.tokenizer, spec)


def forced(group: RolloutGroup, model, tokenizer, spec) -> RolloutGroup:
    """Every completion is the right answer and EOS, proven by a real prefill."""
    out = _copy(group)
    answer = make_run_task(spec).problem(group.task_id).answer
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for s in out.samples:
        s.completion_ids = list(ids[: spec.sampling.max_tokens])
    return prove(out, model, tokenizer, spec)


def draft(cheap: TorchEngine, group: RolloutGroup, model, tokenizer, spec) -> RolloutGroup:
    """Samples drawn by a cheaper model (same seeds), proven with one prefill of the real one."""
    gens = cheap.generate(group.prompt_ids, group.sampling, len(group.samples))
    out = _copy(group)
    for s, g in zip(out.samples, gens):
        s.completion_ids = g.completion_ids
    return prove(out, model, tokenizer, spec)


def duplicated(group: RolloutGroup) -> RolloutGroup:
    """Sample 0 sent G times."""
    return _copy(group, samples=[copy.deepcopy(group.samples[0]) for _ in group.samples])


# ---- numerics the thresholds must follow (item 4) --------------------------------------------


def half_engine(policy_dir, version: int = 0) -> TorchEngine:
    """A worker computing in float16 (not a dtype a run can ask for)."""
    engine = TorchEngine(policy_dir, version)
    engine.model.half()
    return engine


def one_step_later(policy_dir, dest, spec, groups: list[RolloutGroup]):
    """The policy after one GRPO step on `groups` (the run's trainer settings), saved as an HF directory."""
    from rlfleet.models.policy import load_policy
    from rlfleet.services.trainer.update import UpdateSettings, grpo_update
    from rlfleet.versions.checkpoint import save_model_dir

    model, tokenizer = load_policy(policy_dir)
    t = spec.trainer
    groups = copy.deepcopy(groups)
    for g in groups:  # a step that moves the weights needs rewards that differ within a group
        if len({s.reward for s in g.samples}) == 1:
            for k, s in enumerate(g.samples):
                s.reward = float(k % 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
    grpo_update(model, optimizer, groups, UpdateSettings.of(t, spec.sampling.temperature, tokenizer.pad_token_id))
    save_model_dir(model, tokenizer, dest)
    return dest
