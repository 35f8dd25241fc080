"""What the gate keeps is bounded by the async window (issue 16 item 11): its checkpoint cache on disk and
its replay guards in Redis, against a real origin and redis-server."""

from __future__ import annotations

import pytest

from rlfleet.operator.names import VERIFIER
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.services.toploc.main import Gate
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import PRIVATE_KEY_FILE, load_private_key, make_signer
from rlfleet.versions.store import open_store
from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams, encode_json
from tests.toploc.test_gate import as_, gate_system


def group(version: int, n: int, ticket: int | None = None) -> RolloutGroup:
    """A group of policy version `version` whose work (completions) is the `n`-th distinct one."""
    return RolloutGroup(
        task_id="arith-0-1",
        worker_id="w1",
        policy_version=version,
        prompt_ids=[1, 2, 3],
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=4, seed=n),
        samples=[Sample([4, 5, n % 1000, n // 1000], [-0.5] * 4, [b"p"]) for _ in range(4)],
        ticket=ticket,
    )


def test_replay_guards_hold_the_async_window_not_every_rollout(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url) as (ctx, *_):
        r, keys = ctx.redis, ctx.keys
        window = ctx.bundle.run.spec.trainer.max_async_level + 1  # versions whose groups are still accepted
        checker = Checker(ctx.bundle.run.spec, r, keys, policy=None)
        per_version, versions = 4, 12
        for v in range(1, versions):
            r.xadd(keys.policy, encode_json({"version": v}))
            for j in range(per_version):
                checker.once(group(v, v * per_version + j), f"{v}-{j}".encode(), prefill=False)
        # Guards are two keys whatever the run's length, holding the window's work only.
        assert sorted(k.decode() for k in r.keys("*seen*")) == [keys.seen, keys.seen_versions]
        assert r.hlen(keys.seen) == r.zcard(keys.seen_versions) == window * per_version
        # Inside the window the guard holds: the newest version's work under a new entry is a replay,
        # and so is a version's work claimed again under a newer version.
        newest = versions - 1
        with pytest.raises(Rejection, match="already submitted"):
            checker.once(group(newest, newest * per_version), b"other-entry", prefill=False)
        r.xadd(keys.policy, encode_json({"version": newest + 1}))
        with pytest.raises(Rejection, match="already submitted"):
            checker.once(group(newest + 1, newest * per_version + 1), b"later-entry", prefill=False)
        checker.once(group(newest, newest * per_version), f"{newest}-0".encode(), prefill=False)  # a redelivery


def test_work_tickets_used_are_one_hash_for_the_run(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, sampling="{groupSize: 4, maxTokens: 4, assignment: run}") as (ctx, *_):
        r, keys = ctx.redis, ctx.keys
        checker = Checker(ctx.bundle.run.spec, r, keys, policy=None)
        for k in range(20):
            checker.once(group(0, k, ticket=k), f"1-{k}".encode(), prefill=False)
        assert r.hlen(keys.tickets_used) == 20 and not r.keys("*ticket:*")
        with pytest.raises(Rejection, match="ticket 3 of worker 'w1' was already used"):
            checker.once(group(0, 100, ticket=3), b"2-0", prefill=False)


@pytest.mark.parametrize("resident", [2, 3])
def test_the_checkpoint_cache_keeps_the_window_and_what_is_loaded(tmp_path, redis_url, resident):
    verifier = f"{{residentVersions: {resident}}}"
    with gate_system(tmp_path, redis_url, verifier=verifier) as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        signer = make_signer(load_private_key(tmp / "keys" / PRIVATE_KEY_FILE))
        store = open_store(spec.store.uri)
        for v in range(1, 7):
            publish_version(store, "gate", v, policy, signer=signer)
        cache = tmp / "cache"
        gate = Gate(as_(ctx, VERIFIER), "verifier-0", origin_url, cache)
        for v in range(7):
            gate.policy(v)
            held = sorted(int(p.name[1:]) for p in cache.iterdir() if p.name.startswith("v"))
            assert v in held and len(held) <= spec.trainer.max_async_level + 2, (v, held)
        # the window of version 6 (maxAsyncLevel 1: 5 and 6) and what is in memory
        expected = [4, 5, 6] if resident == 3 else [5, 6]
        assert held == expected and gate.resident.versions() == expected
        gate.policy(5)  # a version still in the window is served from memory
        assert sorted(p.name for p in cache.iterdir()) == [f"v{v}" for v in expected]
