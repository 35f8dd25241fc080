"""Batched verification (rlfleet/services/toploc/batch.py) gives every group the verdict it gets alone:
honest and tampered groups through shared prefills, and a read batch of inbox entries through the gate
against one-by-one handling (same verdicts, same ban, same stream order)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.models.policy import score
from rlfleet.operator.names import VERIFIER
from rlfleet.services.toploc import batch
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.services.toploc.main import Gate
from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams, decode_json
from tests.support import tiny_policy_dir
from tests.toploc.test_gate import as_, gate_system, honest_group, verified_ids
from tests.toploc.test_gate_tamper import STRICT, fp8_rounded, outside_top_k

SAMPLING = "{groupSize: 4, maxTokens: 6, topK: 8}"


def tampered_groups(ctx, policy, tmp) -> tuple[list[RolloutGroup], list[str | None]]:
    """Honest groups of several prompt lengths and one group of each tamper class the prefill catches,
    with the reason each must get."""
    engine = TorchEngine(policy, 0)
    groups = [(honest_group(engine, ctx, i, worker=f"w-honest-{i}"), None) for i in (1, 12, 123)]
    groups.append((honest_group(TorchEngine(tiny_policy_dir(tmp / "other", seed=1), 0), ctx, 2), "toploc"))
    groups.append((honest_group(TorchEngine(policy, 0, dtype="bfloat16"), ctx, 3), "toploc"))
    groups.append((honest_group(fp8_rounded(TorchEngine(policy, 0)), ctx, 4), "toploc"))
    g = honest_group(engine, ctx, 5)
    g.samples[1].completion_ids[-1] = (g.samples[1].completion_ids[-1] + 1) % len(engine.tokenizer)
    groups.append((g, "toploc"))
    g = honest_group(engine, ctx, 6)
    g.samples[2].proofs[0] = b"\x00\x00" + g.samples[2].proofs[0][2:]  # modulus 0: malformed
    groups.append((g, "toploc"))
    g = honest_group(engine, ctx, 8)
    g.samples[3].logprobs = [lp + 0.01 for lp in g.samples[3].logprobs]
    groups.append((g, "logprob_mismatch"))
    groups.append((outside_top_k(engine, ctx, "w-x"), "seed_replay"))  # torch groups are replayed
    return [g for g, _ in groups], [r for _, r in groups]


@pytest.mark.parametrize("max_tokens", [batch.MAX_BATCH_TOKENS, 24])  # one prefill; many (a row or two each)
def test_batched_prefill_checks_give_each_group_its_own_verdict(tmp_path, redis_url, monkeypatch, max_tokens):
    monkeypatch.setattr(batch, "MAX_BATCH_TOKENS", max_tokens)
    with gate_system(tmp_path, redis_url, sampling=SAMPLING, verifier=STRICT) as (ctx, policy, _, tmp):
        groups, expected = tampered_groups(ctx, policy, tmp)
        engine = TorchEngine(policy, 0)
        model, tokenizer = engine.model, engine.tokenizer
        checker = Checker(ctx.bundle.run.spec, ctx.redis, ctx.keys, policy=lambda v: (model, tokenizer))

        alone = []
        for g in groups:
            try:
                alone.append(checker.prefill_checks(g, model, tokenizer))  # the recomputed logprobs
            except Rejection as exc:
                alone.append(exc)
        together = batch.prefill_verdicts(checker, model, tokenizer, groups)

        def rejection(r):
            return r if isinstance(r, Rejection) else None

        assert [rejection(r) and r.reason for r in alone] == expected
        assert [rejection(r) and r.reason for r in together] == expected
        assert [rejection(r) and r.detail for r in together] == [rejection(r) and r.detail for r in alone]
        assert all(r.worker_id == g.worker_id for g, r in zip(groups, together) if rejection(r))
        for a, t in zip(alone, together):  # a passing group leaves with the logprobs and replay score it gets alone
            if not rejection(a):
                torch.testing.assert_close(
                    torch.tensor(sum(t[0], [])), torch.tensor(sum(a[0], [])), rtol=1e-5, atol=1e-5
                )
                assert (t[1].positions, t[1].mismatches) == (a[1].positions, a[1].mismatches)


def test_scored_rows_match_one_prefill_per_group(tmp_path, monkeypatch):
    """Rows packed with other groups' rows (and split over prefills) score as in their group's own prefill."""
    engine = TorchEngine(tiny_policy_dir(tmp_path / "p", seed=0), 0)
    params = SamplingParams(0.7, 1.0, 0, 16, seed=0)

    def group(prompt: list[int], completions: list[list[int]]) -> RolloutGroup:
        return RolloutGroup("t", "w", 0, prompt, params, [Sample(c, [0.0] * len(c), []) for c in completions])

    groups = [group([1, 3], [[4, 5, 6], [7]]), group([1, 3, 3, 3], [[3, 3, 9, 8, 2]]), group([1], [[5]])]
    for max_tokens in (batch.MAX_BATCH_TOKENS, 9):
        monkeypatch.setattr(batch, "MAX_BATCH_TOKENS", max_tokens)
        scored = batch.score_groups(engine.model, groups, 0.7, engine.tokenizer.pad_token_id)
        with torch.inference_mode():
            for g, got in zip(groups, scored):
                rows = [g.prompt_ids + s.completion_ids for s in g.samples]
                alone = score(engine.model, rows, 0.7, engine.tokenizer.pad_token_id, want_hidden=True)
                assert [h.shape[0] for h in got.hidden] == [len(r) for r in rows]
                for h, h1, lp, lp1 in zip(got.hidden, alone.hidden, got.logprobs, alone.logprobs):
                    torch.testing.assert_close(h, h1, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(lp, lp1, rtol=1e-5, atol=1e-5)


def run_entries(ctx, origin_url, cache, entries: list[dict], batched: bool) -> dict:
    """Push `entries` to the inbox, handle them in one read batch or one by one; what the streams hold."""
    for fields in entries:
        ctx.redis.xadd(ctx.keys.rollouts, fields)
    gate = Gate(as_(ctx, VERIFIER), "verifier-0", origin_url, cache)
    read = gate.read(count=len(entries), block_ms=100)
    assert len(read) == len(entries)
    if batched:
        gate.inbox.handle_batch(read)
    else:
        for msg_id, fields in read:
            gate.handle(msg_id, fields)
    rejected = [decode_json(f) for _, f in ctx.redis.xrange(ctx.keys.rejected)]
    return {
        "verified": verified_ids(ctx),
        # Details name inbox entries (a replay's first entry), whose ids differ between the two Redis servers.
        "rejected": [
            (r["rollout_id"], r["worker_id"], r["reason"], re.sub(r"\d+-\d+", "<id>", r["detail"])) for r in rejected
        ],
        "stats": ctx.redis.hgetall(ctx.keys.stats),
        "workers": ctx.redis.hgetall(ctx.keys.workers),
        "banned": sorted(ctx.redis.hkeys(ctx.keys.banned)),
        "inbox": ctx.redis.xlen(ctx.keys.rollouts),
    }


def test_gate_batch_commits_what_one_by_one_handling_commits(tmp_path, redis_url):
    with gate_system(tmp_path / "a", redis_url, sampling=SAMPLING, verifier=STRICT) as (ctx, policy, origin_url, tmp):
        engine = TorchEngine(policy, 0)
        honest = honest_group(engine, ctx, 1, worker="w-a")
        cheat = honest_group(TorchEngine(tiny_policy_dir(tmp / "other", seed=1), 0), ctx, 2, worker="w-cheat")
        after_ban = honest_group(engine, ctx, 3, worker="w-cheat")  # honest, but its worker is banned just before
        replay = copy.deepcopy(honest)
        replay.worker_id = "w-replayer"
        bad_logprobs = honest_group(engine, ctx, 4, worker="w-b")
        bad_logprobs.samples[0].logprobs = [lp + 0.01 for lp in bad_logprobs.samples[0].logprobs]
        last = honest_group(engine, ctx, 5, worker="w-c")
        entries = [g.encode() for g in (honest, cheat, after_ban, replay, bad_logprobs)] + [
            {b"m": b"{not json"},
            last.encode(),
        ]
        together = run_entries(ctx, origin_url, tmp / "cache", entries, batched=True)
    with (
        EmbeddedRedis(tmp_path / "redis-b") as url_b,
        gate_system(tmp_path / "b", url_b, sampling=SAMPLING, verifier=STRICT) as (ctx, _, origin_url, tmp),
    ):
        alone = run_entries(ctx, origin_url, tmp / "cache", entries, batched=False)

    assert together == alone
    assert together["verified"] == [honest.rollout_id, last.rollout_id]
    assert [(r[1], r[2]) for r in together["rejected"]] == [
        ("w-cheat", "toploc"),
        ("w-cheat", "banned"),
        ("w-replayer", "replay"),
        ("w-b", "logprob_mismatch"),
        (None, "malformed"),
    ]
    assert together["banned"] == [b"w-b", b"w-cheat"]
    assert together["inbox"] == 0
