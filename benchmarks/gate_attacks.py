"""Gate security benchmark (issue 16): how close honest rollouts come to the gate's thresholds, and how
many groups of each attack get through, 12 groups per attack by default.

Model and settings: the arithmetic example (`builtin://tiny-arithmetic`, warm-started; groupSize 8,
maxTokens 6, temperature 1), fp32 on CPU; the top-p attack uses topP 0.9. Each attack is built as a
cheating worker would (tests/toploc/attacks.py: logprobs and proofs recomputed by a real prefill
where the attack needs them) and judged by the gate's own `Checker.check` against a real Redis.

Table 1, honest margins: over groups drawn with other batch shapes (1, 2, 4, 8 rows) and 1 or 2
threads, the worst per-chunk TOPLOC errors, the largest |claimed - recomputed| logprob and the
largest replay miss (how far outside its CDF interval a replayed draw fell; 0 = exact), for an fp32
and a bf16 run, next to the calibrated defaults (rlfleet/services/toploc/calibration.py).
Table 2, detection: groups rejected of those submitted, per attack and engine, by the gate as it is
now (calibrated fp32 defaults, seed replay of every group whatever its engine, stop checks, content
digests), in a run admitting both engines. (The pre-issue-16 column of docs/security.md is an earlier
measurement: it relabelled groups vllm to skip replay, which the gate no longer allows.)
With `--engine vllm` every group, honest or attacked, is drawn by the real vLLM engine (the CPU build;
a random Qwen2 with head size 32, which vLLM's CPU attention supports, and the arithmetic task's
tokenizer), drawing by rlfleet's seeded rule in vLLM's worker; the gate's model is the same weights in
torch, and the attacker proves tampered tokens with them (tests/toploc/attacks.Attacker). The numeric
attacks there: bf16 compute is a vLLM engine in bf16, fp16 compute the torch engine in fp16 labelled
vllm (vLLM's CPU build computes in fp32 or bf16 only), drafts come from a noised torch copy (any
cheaper model).
Table 3, multi-turn transcripts (rlfleet/tasks/turns.py; attacks of tests/toploc/turn_attacks.py, re-proved by a
real prefill): torch on the calculator example (examples/calculator: its warm-started model, which calls the
calculator and then answers), vLLM on the same random head-32 Qwen2 with the tests' Counter environment
(tests/core/turn_envs.py: it answers every turn, so every episode has turns to tamper with); the honest row is
12 groups of episodes per engine. Rows are named `turns: ATTACK`.
`--json PATH` writes one row per attack and engine: {engine, attack, groups, rejected, passed, reasons,
unchanged: groups the attack left token for token as honest sampling made them, e.g. a draft that is
the seed's draw under the real weights or an EOS drop on a group without EOS: honest by construction}.
Usage: .venv/bin/python benchmarks/gate_attacks.py [--groups 12] [--engine torch|vllm|both] [--json out.json]
       [--turns-only]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import _paths  # noqa: F401  (the root first: the attack builders the gate tests use, tests.toploc.attacks)
import redis
import torch

from rlfleet.config import parse_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.models.policy import load_policy, score
from rlfleet.models.sampling import keep_mask, sample_seed, sample_uniforms
from rlfleet.models.sources import resolve_model_path
from rlfleet.proofs.toploc import verify_proofs
from rlfleet.services.toploc.calibration import DEFAULTS
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.wire.streams import RunKeys, encode_json
from tests.toploc import attacks, turn_attacks

RUN = """
apiVersion: rlfleet.io/v1alpha1
kind: RLRun
metadata: {{name: bench}}
spec:
  model: {{path: "{model}", dtype: {dtype}}}
  task: {{type: arithmetic, seed: 0, maxOperand: 20, operations: ["+"]}}
  sampling: {{groupSize: 8, maxTokens: 6, temperature: 1.0, topP: {top_p}}}
  trainer: {{batchSize: 16, learningRate: 1.0e-3, maxAsyncLevel: 2}}
  verifier: {verifier}
"""


def spec_of(dtype: str = "float32", top_p: float = 1.0, verifier: str = "{}", model: str = "builtin://tiny-arithmetic"):
    return parse_bundle(RUN.format(dtype=dtype, top_p=top_p, verifier=verifier, model=model)).run.spec


def margins(group, model, tokenizer, spec) -> dict[str, float]:
    """Worst TOPLOC chunk errors, |logprob diff| and replay miss of one honest group under `model`."""
    t, p, sp = spec.verifier.toploc, len(group.prompt_ids), group.sampling
    rows = [group.prompt_ids + s.completion_ids for s in group.samples]
    with torch.inference_mode():
        scored = score(model, rows, sp.temperature, tokenizer.pad_token_id, want_hidden=True)
    out = {"exp": 0.0, "mean": 0.0, "median": 0.0, "logprob": 0.0, "replay": 0.0}
    for i, s in enumerate(group.samples):
        for r in verify_proofs(scored.hidden[i], s.proofs, p, t.decode_batching_size, t.topk):
            out["exp"] = max(out["exp"], r.exp_mismatches)
            out["mean"] = max(out["mean"], r.mant_err_mean)
            out["median"] = max(out["median"], r.mant_err_median)
        lp = scored.logprobs[i][p - 1 :]
        out["logprob"] = max(out["logprob"], float((lp - torch.tensor(s.logprobs)).abs().max()))
        with torch.inference_mode():
            logits = model.lm_head(scored.hidden[i][p - 1 : -1]).float() / sp.temperature  # (T, V)
        keep = keep_mask(logits, sp.top_p, sp.top_k)
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1).double()
        cdf = probs.cumsum(-1)
        tok = torch.tensor(s.completion_ids)[:, None]
        hi, lo = cdf.gather(-1, tok)[:, 0], (cdf.gather(-1, tok) - probs.gather(-1, tok))[:, 0]
        target = torch.from_numpy(sample_uniforms(sample_seed(sp.seed, i), len(s.completion_ids))) * cdf[:, -1]
        miss = torch.clamp(torch.maximum(lo - target, target - hi), min=0.0)
        out["replay"] = max(out["replay"], float(miss.max()))
    return out


def honest_margins(policy: Path, dtype: str, groups: int) -> dict[str, float]:
    spec = spec_of(dtype)
    engine = TorchEngine(policy, 0, dtype)
    model, tokenizer = load_policy(policy, dtype)
    worst: dict[str, float] = {}
    threads = torch.get_num_threads()
    try:
        for i in range(groups):
            torch.set_num_threads(1 + i % 2)
            g = attacks.honest(engine, spec, 5000 + i, per_batch=(8, 4, 2, 1)[i % 4])
            for k, v in margins(g, model, tokenizer, spec).items():
                worst[k] = max(worst.get(k, 0.0), v)
    finally:
        torch.set_num_threads(threads)
    return worst


class Judge:
    """Checker.check against a real Redis, each attack class on a clean database (version 0 and 1 announced)."""

    def __init__(self, client: redis.Redis, spec, models: dict[int, tuple]):
        self.client, self.keys = client, RunKeys("bench")
        self.checker = Checker(spec, client, self.keys, policy=lambda v: models[v])
        self.n, self.last = 0, ""

    def reset(self) -> None:
        self.client.flushdb()
        for v in (0, 1):
            self.client.xadd(self.keys.policy, encode_json({"version": v}))

    def verdict(self, group) -> str | None:
        self.n += 1
        try:
            self.checker.check(group, f"{self.n}-0".encode(), prefill=True)
        except Rejection as exc:
            self.last = exc.detail
            return exc.reason
        return None


def vllm_policy(tmp: Path) -> Path:
    """The vLLM benchmark's model: a random Qwen2 of head size 32 (vLLM's CPU attention has no smaller)."""
    from tests.support import tiny_policy_dir

    return tiny_policy_dir(tmp / "vllm-policy", seed=0, num_attention_heads=2, num_key_value_heads=1)


def attack_groups(kind: str, policy: Path, tmp: Path, n: int, spec, top_p_spec, closers: list):
    """(honest base groups, {attack: (class, groups)}, models by version, the honest reference groups) for
    one engine; `closers` collects what must be closed (vLLM engines)."""
    from rlfleet.engines import make_engine

    model, tokenizer = load_policy(policy)
    # the weights one GRPO step later, stepped before any vLLM engine starts: vLLM runs in this process and
    # its parallel state does not survive the trainer's update here (any honest groups make the step)
    first = [attacks.honest(TorchEngine(policy, 0), spec, i) for i in range(min(n, 4))]
    stepped = attacks.one_step_later(policy, tmp / f"{kind}-v1", spec, first)
    if kind == "torch":
        engine = TorchEngine(policy, 0)
        model, tokenizer = engine.model, engine.tokenizer
    else:
        raw = make_engine("vllm", policy, 0)
        closers.append(raw)
        engine = attacks.Attacker(raw, model, tokenizer)
    base = [attacks.honest(engine, spec, i) for i in range(n)]
    models = {0: (model, tokenizer), 1: load_policy(stepped)}
    cheap = TorchEngine(policy, 0)
    with torch.no_grad():  # a cheaper draft model: the policy with its weights rounded to fp8 and noise added
        for p in cheap.model.parameters():
            p.copy_(p.to(torch.float8_e4m3fn).float() + 0.02 * torch.randn_like(p))

    def stale(i: int):
        g = copy.deepcopy(base[i])
        g.policy_version = 1  # drawn with version 0, claimed as version 1 (not stale by the version)
        return g

    classes = {
        "replay: new rollout_id": ("replay", lambda g: attacks.replay_new_rollout_id(g)),
        "replay: new worker_id": ("replay", lambda g: attacks.replay_new_worker(g)),
        "replay: new seed": ("replay", lambda g: attacks.replay_new_seed(g)),
        "replay: task id with the same prompt": ("replay", lambda g: attacks.replay_same_prompt_task(g, spec)),
        "replay: samples reordered": ("replay", lambda g: attacks.replay_reordered(g)),
        "dropped final EOS": ("new", lambda g: attacks.dropped_eos(g, model, tokenizer, spec)),
        "<eos> answer <eos>": ("new", lambda g: attacks.answer_after_eos(g, model, tokenizer, spec)),
        "temperature 0.5, logprobs recomputed": ("numeric", lambda g: attacks.temperature_lie(engine, g, spec)),
        "greedy decoding": ("numeric", lambda g: attacks.greedy(engine, g, spec)),
        "cherry-picked (best 8 of 24)": ("numeric", lambda g: attacks.cherry_picked(engine, g, spec)),
        "forced answers": ("numeric", lambda g: attacks.forced(g, model, tokenizer, spec)),
        "cheap-model drafts, one real prefill": ("numeric", lambda g: attacks.draft(cheap, g, model, tokenizer, spec)),
        "duplicated sample": ("numeric", lambda g: attacks.duplicated(g)),
    }
    made = {name: (kind_, [build(g) for g in base]) for name, (kind_, build) in classes.items()}
    made["weights one step stale"] = ("numeric", [stale(i) for i in range(n)])
    made["tokens outside top-p 0.9"] = (
        "numeric",
        [attacks.outside_nucleus(engine, top_p_spec, 20_000 + 1000 * i) for i in range(n)],
    )
    honest_groups = [attacks.honest(engine, spec, 300 + i) for i in range(n)]
    fp16 = [attacks.honest(attacks.half_engine(policy), spec, 200 + i) for i in range(n)]
    if kind == "torch":
        bf16 = [attacks.honest(TorchEngine(policy, 0, "bfloat16"), spec, 100 + i) for i in range(n)]
    else:  # in-process vLLM engines share one parallel state: the fp32 one is closed before the bf16 one starts
        closers.pop().close()
        low = make_engine("vllm", policy, 0, "bfloat16")
        closers.append(low)
        bf16 = [attacks.honest(attacks.Attacker(low, model, tokenizer), spec, 100 + i) for i in range(n)]
        for g in fp16:
            g.engine = "vllm"
    made["bf16 compute"] = ("numeric", bf16)
    made["fp16 compute"] = ("numeric", fp16)
    unchanged = {  # attacks that left a group token for token as honest sampling made it (honest by construction)
        name: sum(attacks.tokens(g) == attacks.tokens(b) for g, b in zip(groups, base))
        for name, (cls, groups) in made.items()
        if cls != "replay" and name in classes
    }
    return base, made, models, honest_groups, unchanged


def detection(kind: str, policy: Path, tmp: Path, n: int, client, model_path: str) -> list[dict]:
    """One row per attack (and the honest groups) for one engine, judged by the gate as it is now; the torch
    rows are judged by the gate as it is now."""
    both = "{engines: [torch, vllm]}"  # a run admitting both engines: the label must not lower the bar
    spec, top_p_spec = spec_of(model=model_path, verifier=both), spec_of(top_p=0.9, model=model_path, verifier=both)
    closers: list = []
    try:
        base, made, models, honest_groups, unchanged = attack_groups(kind, policy, tmp, n, spec, top_p_spec, closers)
    finally:
        for c in closers:
            c.close()
    rows = []
    for name, (cls, groups) in made.items():
        s = top_p_spec if name.startswith("tokens outside") else spec
        judge = Judge(client, s, models)
        row: dict = {"engine": kind, "attack": name, "groups": len(groups), "unchanged": unchanged.get(name, 0)}
        judge.reset()
        if cls == "replay":
            for g in base:
                assert judge.verdict(g) is None, f"an honest original was rejected: {judge.last}"
        reasons = [judge.verdict(copy.deepcopy(g)) for g in groups]
        rejected = sum(r is not None for r in reasons)
        row["rejected"], row["passed"] = rejected, len(groups) - rejected
        row["reasons"] = sorted({r for r in reasons if r})
        rows.append(row)
    now = Judge(client, spec, models)
    now.reset()
    reasons = [now.verdict(g) for g in honest_groups]
    rejected = sum(r is not None for r in reasons)
    honest_row = {"engine": kind, "attack": "(honest)", "groups": len(honest_groups), "rejected": rejected}
    rows.append({**honest_row, "passed": len(honest_groups) - rejected, "reasons": sorted({r for r in reasons if r})})
    return rows


CALCULATOR = """
apiVersion: rlfleet.io/v1alpha1
kind: RLRun
metadata: {{name: bench}}
spec:
  model: {{path: "{model}"}}
  task: {task}
  sampling: {{groupSize: 8, maxTurns: {turns}, maxTokensPerTurn: {per_turn}, maxTokens: 32, temperature: 1.0}}
  trainer: {{batchSize: 16, learningRate: 1.0e-3, maxAsyncLevel: 2}}
  verifier: {{engines: [torch, vllm]}}
"""


def turn_detection(kind: str, tmp: Path, n: int, client) -> list[dict]:
    """One row per transcript attack (and the honest episodes) for one engine (Table 3)."""
    from rlfleet.engines import make_engine

    if kind == "torch":
        example = "{type: arithmetic, seed: 0, maxOperand: 999, operations: ['+', '-'], tools: [calculator]}"
        spec = parse_bundle(CALCULATOR.format(model="builtin://tiny-arithmetic", task=example, turns=2,
                                              per_turn=10)).run.spec  # fmt: skip
        policy, ids = resolve_model_path(spec.model, spec.task, seed=0), "arith-0-{}"
    else:
        (tmp / "turns").mkdir(exist_ok=True)
        policy = vllm_policy(tmp / "turns")
        counter = "{type: python, entrypoint: 'tests.core.turn_envs:Counter', timeoutSeconds: 30}"
        spec = parse_bundle(CALCULATOR.format(model=policy, task=counter, turns=3, per_turn=4)).run.spec
        ids = "turns-ok-{}"
    model, tokenizer = load_policy(policy)
    engine = make_engine(kind, policy, 0)
    try:
        episodes = [turn_attacks.honest_episodes(engine, spec, ids.format(i), seed=i) for i in range(n * 2)]
    finally:
        engine.close()
    judge = Judge(client, spec, {0: (model, tokenizer), 1: (model, tokenizer)})
    rows = []
    for name, (attack, _) in turn_attacks.ATTACKS.items():
        judge.reset()
        made = [attack(g, tokenizer, spec) for g in episodes[n:]]
        groups = [turn_attacks.prove_turns(g, model, tokenizer, spec) for g in made if g is not None][:n]
        reasons = [judge.verdict(g) for g in groups]
        rejected = sum(r is not None for r in reasons)
        rows.append({"engine": kind, "attack": f"turns: {name}", "groups": len(groups), "rejected": rejected,
                     "passed": len(groups) - rejected, "reasons": sorted({r for r in reasons if r})})  # fmt: skip
    judge.reset()
    reasons = [judge.verdict(g) for g in episodes[:n]]
    rejected = sum(r is not None for r in reasons)
    rows.append({"engine": kind, "attack": "turns: (honest episodes)", "groups": n, "rejected": rejected,
                 "passed": n - rejected, "reasons": sorted({r for r in reasons if r})})  # fmt: skip
    rows.append(claimed_rewards(kind, judge, episodes[n:]))
    return rows


def claimed_rewards(kind: str, judge: Judge, episodes: list) -> dict:
    """Honest episodes claiming reward 1 for every sample (turns that solved nothing included): not a rejection,
    as the gate trains on the rewards it recomputes; `trained_as_claimed` counts the groups whose trusted rewards
    are the claimed ones although the episodes did not earn them (0 is the bar)."""
    judge.reset()
    earned = [[s.reward for s in g.samples] for g in episodes]
    claims, trained = 0, 0
    for g, rewards in zip(episodes, earned):
        if all(r == 1.0 for r in rewards):
            continue  # nothing to over-claim
        g = copy.deepcopy(g)
        for sample in g.samples:
            sample.reward = 1.0
        judge.n += 1
        outcome = judge.checker.check(g, f"{judge.n}-0".encode(), prefill=True)
        claims += 1
        trained += outcome.rewards == [1.0] * len(g.samples)
    return {"engine": kind, "attack": "turns: reward claimed for turns that earned none", "groups": claims,
            "rejected": 0, "passed": claims, "trained_as_claimed": trained, "reasons": []}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=12, help="groups per attack")
    ap.add_argument("--honest-groups", type=int, default=48, help="honest groups per dtype for the margins")
    ap.add_argument("--engine", choices=["torch", "vllm", "both"], default="torch", help="the engine drawing groups")
    ap.add_argument("--json", type=Path, default=None, help="write the detection rows here")
    ap.add_argument("--turns-only", action="store_true", help="only Table 3 (multi-turn transcripts)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = spec_of()
    policy = resolve_model_path(spec.model, spec.task, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="rlfleet-gate-bench-"))
    engines = ["torch", "vllm"] if args.engine == "both" else [args.engine]

    if "torch" in engines and args.honest_groups > 0 and not args.turns_only:
        print(f"model {policy.name}; honest groups per dtype: {args.honest_groups}\n")
        print("| dtype | exp mismatches | mantissa mean | mantissa median | abs logprob diff | replay miss |")
        print("|---|---|---|---|---|---|")
        for dtype in ("float32", "bfloat16"):
            w = honest_margins(policy, dtype, args.honest_groups)
            c = DEFAULTS[("torch", "cpu", dtype)]
            print(
                f"| {dtype} honest (worst) | {w['exp']:.0f} | {w['mean']:.3g} | {w['median']:.3g} | "
                f"{w['logprob']:.2g} | {w['replay']:.2g} |"
            )
            print(
                f"| {dtype} default | {c.toploc.max_exp_mismatches} | {c.toploc.max_mant_err_mean} | "
                f"{c.toploc.max_mant_err_median} | {c.logprob_tolerance} | {c.replay_tolerance} |"
            )
        print()

    rows: list[dict] = []
    with EmbeddedRedis(tmp / "redis") as url:
        client = redis.Redis.from_url(url)
        for kind in [] if args.turns_only else engines:
            if kind == "torch":
                rows += detection(kind, policy, tmp, args.groups, client, "builtin://tiny-arithmetic")
            else:
                path = vllm_policy(tmp)
                rows += detection(kind, path, tmp, args.groups, client, str(path))
        for kind in engines:
            rows += turn_detection(kind, tmp, args.groups, client)
    print("| engine | attack | rejected (reasons) |")
    print("|---|---|---|")
    for r in rows:
        why = f" ({','.join(r['reasons'])})" if r["reasons"] else ""
        if r.get("unchanged"):
            why += f"; {r['unchanged']} left token for token honest by the attack"
        if "trained_as_claimed" in r:
            why += f"; trained with the claimed rewards: {r['trained_as_claimed']}"
        print(f"| {r['engine']} | {r['attack']} | {r['rejected']}/{r['groups']}{why} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
