"""The gate on a task mixture with a chat template and a user environment: it rebuilds the templated prompt
from the task id and compares the ids, and a user environment that raises, hangs or returns a non-number
is a rejection with its reason (forgiven: no ban), never the gate's death."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

from rlfleet.config import parse_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.fleet.reputation import is_banned
from rlfleet.models.builtin import CHAT_TEMPLATE
from rlfleet.models.policy import load_tokenizer
from rlfleet.proofs.toploc import build_proofs
from rlfleet.services.shardcast.origin import make_app
from rlfleet.tasks import make_run_task
from rlfleet.tasks.chat import encode_prompt
from rlfleet.tasks.python_env import EnvironmentFailure
from rlfleet.tasks.turns import completion_text
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RolloutGroup, RunKeys, Sample, SamplingParams, decode_json, encode_json
from tests.runs import bundle_yaml, rlrun
from tests.support import redis_from_url, serving, tiny_policy_dir
from tests.toploc.test_gate import rejections, run_gate, verified_ids

MIXTURE = {
    "type": "mixture",
    "mixture": [
        {"name": "arith", "weight": 1, "task": {"type": "arithmetic", "maxOperand": 20, "chatTemplate": True,
                                                 "systemPrompt": "1"}},
        {"name": "user", "weight": 1, "task": {"type": "python", "entrypoint": "tests.core.user_envs:Moody",
                                                "timeoutSeconds": 2, "chatTemplate": True}},
    ],
}  # fmt: skip


@contextmanager
def mixture_gate(tmp_path, redis_url):
    """Version 0 of a tiny policy whose tokenizer has the builtin chat template, published and served."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    tokenizer = load_tokenizer(policy)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(policy)
    text = bundle_yaml(
        rlrun("gate", model=policy, task=MIXTURE, sampling={"groupSize": 4, "maxTokens": 4},
              trainer={"batchSize": 1, "maxAsyncLevel": 1}, store=tmp_path / "store")
    )  # fmt: skip
    with published_gate(tmp_path, redis_url, policy, text) as (ctx, origin_url):
        yield ctx, policy, origin_url


@contextmanager
def published_gate(tmp_path, redis_url, policy, text: str, run: str = "gate"):
    """(Context, origin URL) of run `run` of the bundle `text`: `policy` published as its signed version 0 to its
    store, announced, and served by an origin (the signing key in the environment while it lasts)."""
    bundle = parse_bundle(text)
    store = open_store(bundle.run.spec.store.uri)
    key_file, public = generate_keypair(tmp_path / "keys")
    saved = {k: os.environ.get(k) for k in (env.SIGNING_KEY_FILE, env.PUBLIC_KEY)}
    os.environ.update({env.SIGNING_KEY_FILE: str(key_file), env.PUBLIC_KEY: public})
    publish_version(store, run, 0, policy, signer=make_signer(load_private_key(key_file)))
    client = redis_from_url(redis_url)
    keys = RunKeys(run)
    client.xadd(keys.policy, encode_json({"version": 0}))
    ctx = Context(bundle=bundle, redis=client, keys=keys, stop=threading.Event())
    try:
        with serving(make_app(store, run)) as origin_url:
            yield ctx, origin_url
    finally:
        ctx.stop.set()
        client.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def worker_group(engine, ctx, task, task_id: str, seed: int, templated: bool = True) -> RolloutGroup:
    """A group as the worker makes it (rollout/main.py: encode_prompt, scores); a reward the environment cannot
    give is claimed as 0 (an honest worker drops such a group; this one sends it to see the gate's answer)."""
    spec = ctx.bundle.run.spec
    s, t = spec.sampling, spec.verifier.toploc
    problem = task.problem(task_id)
    prompt_ids = (
        encode_prompt(engine.tokenizer, problem) if templated else engine.tokenizer(problem.prompt)["input_ids"]
    )
    params = SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=seed)
    gens = engine.generate(prompt_ids, params, s.group_size)
    texts = [completion_text(engine.tokenizer, g.completion_ids, engine.stop_ids) for g in gens]
    try:
        rewards = task.scores(problem, texts, [len(g.completion_ids) for g in gens])
    except EnvironmentFailure:
        rewards = [0.0] * len(gens)
    samples = [
        Sample(g.completion_ids, g.logprobs, build_proofs(g.hidden, len(prompt_ids), t.decode_batching_size, t.topk), r,
               g.finish_reason)
        for g, r in zip(gens, rewards)
    ]  # fmt: skip
    return RolloutGroup(task_id=task_id, worker_id="w-1", policy_version=0, prompt_ids=prompt_ids, sampling=params,
                        samples=samples)  # fmt: skip


def test_templated_prompts_are_checked_and_a_failing_environment_never_kills_the_gate(tmp_path, redis_url):
    with mixture_gate(tmp_path, redis_url) as (ctx, policy, origin_url):
        engine = TorchEngine(policy, 0)
        task = make_run_task(ctx.bundle.run.spec)
        honest = [worker_group(engine, ctx, task, "arith/arith-0-1", 1),
                  worker_group(engine, ctx, task, "user/mood-ok-4", 2)]  # fmt: skip
        untemplated = worker_group(engine, ctx, task, "arith/arith-0-2", 3, templated=False)
        failing = {kind: worker_group(engine, ctx, task, f"user/mood-{kind}-5", 4 + i)
                   for i, kind in enumerate(("raise", "hang", "str", "nan"))}  # fmt: skip
        assert engine.tokenizer.convert_ids_to_tokens(honest[0].prompt_ids)[:3] == ["<bos>", "1", "<bos>"]
        groups = [*honest, untemplated, *failing.values()]
        for group in groups:
            ctx.redis.xadd(ctx.keys.rollouts, group.encode())
        run_gate(ctx, origin_url, tmp_path / "cache", expected=len(groups), timeout=120)
        assert sorted(verified_ids(ctx)) == sorted(g.rollout_id for g in honest)
        reasons = rejections(ctx)
        assert reasons[untemplated.rollout_id] == "prompt_mismatch", "the template is part of the prompt checked"
        assert {reasons[g.rollout_id] for g in failing.values()} == {"environment"}
        details = [decode_json(f)["detail"] for _, f in ctx.redis.xrange(ctx.keys.rejected)]
        for fragment in (
            "rewards raised RuntimeError: the reward model is down",
            "no answer within timeoutSeconds 2",
            "reward returned 'high' (str), not a number",
            "reward returned nan, not a finite number",
        ):
            assert any(fragment in d for d in details), (fragment, details)  # fmt: skip
        assert not is_banned(ctx.redis, ctx.keys, "w-1"), "environment is forgiven: an honest worker gets it too"
