"""The seed replay's score (replay.py) and its thresholds on crafted inputs: the mismatch share against
the calibrated per-group share, the Token-DiFR-style surprise, and the running-share ban applied by the
gate's commit script in a real Redis."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import redis
import torch

from rlfleet.config import BanPolicySpec
from rlfleet.fleet.reputation import field, one_worker_stats, replay_plan
from rlfleet.models.sampling import draw, keep_mask, sample_seed, sample_uniforms
from rlfleet.services.toploc.commit import COMMIT_SCRIPT
from rlfleet.services.toploc.replay import GroupReplay, ReplayScore, completion_chunks, group_score
from rlfleet.wire.streams import RunKeys

V, T, G = 50, 40, 4


def _group(logits: list[torch.Tensor], seed: int, top_p: float = 1.0, top_k: int = 0, pick=None):
    """A group whose sample i holds the tokens its seed draws from logits[i] (or `pick(logits)`)."""
    samples = []
    for i, rows in enumerate(logits):
        if pick is None:
            u = torch.from_numpy(sample_uniforms(sample_seed(seed, i), rows.shape[0]))
            tokens = draw(rows, keep_mask(rows, top_p, top_k), u).tolist()
        else:
            tokens = pick(rows).tolist()
        samples.append(SimpleNamespace(completion_ids=tokens, spans=None))
    return SimpleNamespace(sampling=SimpleNamespace(seed=seed, top_p=top_p, top_k=top_k), samples=samples)


def test_honest_draws_replay_exactly_and_a_changed_token_is_counted():
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(T, V, generator=gen) * 2 for _ in range(G)]
    group = _group(logits, seed=7, top_p=0.9, top_k=20)
    honest = group_score(logits, group, 1e-3)
    assert (honest.positions, honest.mismatches, honest.first) == (G * T, 0, None)
    assert not honest.rejected(0.0)
    group.samples[2].completion_ids[5] = (group.samples[2].completion_ids[5] + 1) % V  # one token changed
    one = group_score(logits, group, 1e-3)
    assert (one.mismatches, one.first) == (1, (2, 5))
    assert one.rejected(0.0) and not one.rejected(0.05)  # CPU: any mismatch; a GPU share tolerates it
    assert ReplayScore(100, 6).rejected(0.05) and not ReplayScore(100, 5).rejected(0.05)


@pytest.mark.parametrize("rows", [1, 3, 40, 41, 160])
def test_a_replay_by_chunks_of_rows_scores_as_the_whole_group(rows):
    """Chunks that split samples anywhere (3 rows: every sample boundary inside a chunk) give the score of one
    pass, mismatches on either side of a chunk boundary and the first one's place included."""
    gen = torch.Generator().manual_seed(4)
    logits = [torch.randn(T, V, generator=gen) * 2 for _ in range(G)]
    group = _group(logits, seed=9, top_p=0.9, top_k=20)
    for i, t in [(1, 38), (1, 39), (2, 0), (3, 17)]:  # the last rows of a sample, the first of the next
        group.samples[i].completion_ids[t] = (group.samples[i].completion_ids[t] + 1) % V
    whole = group_score(logits, group, 1e-3)
    assert (whole.positions, whole.mismatches, whole.first) == (G * T, 4, (1, 38))
    replay = GroupReplay(group, 1e-3)
    starts = []
    for start, chunk in completion_chunks(logits, rows):
        assert chunk.shape == (min(rows, G * T - start), V)
        starts.append(start)
        replay.add(start, chunk)
    assert starts == list(range(0, G * T, rows))
    assert replay.score() == ReplayScore(G * T, 4, pytest.approx(whole.surprise), (1, 38))


def test_surprise_is_near_zero_for_honest_groups_and_negative_for_greedy():
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(T, V, generator=gen) * 1.5 for _ in range(G)]
    honest = group_score(logits, _group(logits, seed=3), 1e-3)
    greedy = group_score(logits, _group(logits, seed=3, pick=lambda r: r.argmax(-1)), 1e-3)
    entropy = float(-(torch.softmax(logits[0], -1) * torch.log_softmax(logits[0], -1)).sum(-1).mean())
    assert abs(honest.surprise / honest.positions) < 0.5 * entropy
    assert greedy.surprise / greedy.positions < -0.3 * entropy
    assert greedy.mismatches > 0  # and the replay itself rejects it


def test_a_worker_under_the_group_share_is_banned_by_its_running_share(redis_url):
    client, keys = redis.Redis.from_url(redis_url), RunKeys("score")
    commit = client.register_script(COMMIT_SCRIPT)
    policy = BanPolicySpec(min_replay_positions=200)
    client.xgroup_create(keys.rollouts, keys.verifier_group, id="0", mkstream=True)
    answers = []
    for n in range(5):  # 4 % mismatches per group: under a 5 % group share, over a 2 % running share
        entry = client.xadd(keys.rollouts, {"m": "x"})
        client.xreadgroup(keys.verifier_group, "c", {keys.rollouts: ">"}, count=1)
        workers, share_ban = replay_plan(policy, "w", ReplayScore(100, 4, -3.5), 0.02, f"r{n}")
        plan = {"stats": {"accepted": 1}, "workers": workers, "share_ban": share_ban}
        assert share_ban is not None
        answers.append(
            commit(
                keys=[keys.rollouts, keys.verified, keys.stats, keys.workers, keys.banned, keys.attempts],
                args=[keys.verifier_group, entry, 1000, json.dumps(plan), "m", "x"],
            )
        )
    assert answers == [1, 2, 1, 1, 1]  # banned once 200 positions are in, not before
    stats = one_worker_stats(client, keys, "w")
    assert stats["counters"]["replay_positions"] == 500 and stats["counters"]["replay_mismatches"] == 20
    assert stats["counters"]["replay_surprise_milli"] == -17500
    assert stats["banned"]["rule"] == "runningReplayShare" and stats["banned"]["reason"] == "seed_replay"
    assert replay_plan(policy, "w", ReplayScore(1, 0), 0.0, "r")[1] is None  # CPU: no running rule
    assert field("w", "replay_positions") in replay_plan(policy, "w", ReplayScore(1, 0), 0.0, "r")[0]
    assert np.isclose(ReplayScore(100, 4).share, 0.04)


@pytest.mark.parametrize("rows", [None, 1, 7])  # one chunk, a row at a time, chunks across samples
def test_a_tolerated_mismatch_must_still_be_a_possible_token(redis_url, rows):
    """Where the calibration tolerates a share of mismatches (bf16, GPU), a mismatched token inside top-p
    passes with its mismatch counted, and one outside top-p is `impossible_token`."""
    from dataclasses import replace

    from rlfleet.config import parse_bundle
    from rlfleet.services.toploc.calibration import DEFAULTS
    from rlfleet.services.toploc.checks import Checker, Rejection
    from tests.runs import bundle_yaml, rlrun

    spec = parse_bundle(bundle_yaml(rlrun("s", sampling={"groupSize": 4, "topP": 0.9}))).run.spec
    checker = Checker(spec, redis.Redis.from_url(redis_url), RunKeys("s"), policy=lambda v: None)
    cal = replace(DEFAULTS[("vllm", "gpu", "bfloat16")], max_mismatch_share=0.2)
    gen = torch.Generator().manual_seed(2)
    logits = [torch.randn(10, V, generator=gen) for _ in range(G)]
    group = _group(logits, seed=5, top_p=0.9)
    order = logits[0][3].argsort(descending=True)
    drawn = group.samples[0].completion_ids[3]
    group.samples[0].completion_ids[3] = int(order[0] if drawn != order[0] else order[1])  # inside the nucleus
    got = checker.sampling_checks(group, completion_chunks(logits, rows), cal)
    assert (got.mismatches, got.first) == (1, (0, 3))
    group.samples[0].completion_ids[3] = int(order[-1])  # the least likely token: outside top-p 0.9
    with pytest.raises(Rejection) as caught:
        checker.sampling_checks(group, completion_chunks(logits, rows), cal)
    assert caught.value.reason == "impossible_token"
