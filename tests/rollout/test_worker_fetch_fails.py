"""A rollout worker whose next version cannot be fetched keeps producing groups with the version it holds, and
the gate accepts them while that version is inside the async window (rlfleet/services/rollout/follower.py):
a real worker loop with a real engine, a relay that answers 503 while "down", a real gate and a real Redis."""

from __future__ import annotations

import threading

from aiohttp import web

from rlfleet.config import load_bundle
from rlfleet.services.rollout import follower as follower_module
from rlfleet.services.rollout.main import RolloutOptions, Worker
from rlfleet.services.shardcast.client import FetchSettings
from rlfleet.services.shardcast.origin import make_app
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer, parse_public_key
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RolloutGroup, RunKeys, encode_json
from rlfleet.wire.views import VIEWS, view_bundle
from tests.runs import pool, rlrun, write_rlrun
from tests.shardcast.test_shardcast_faults import evil_relay
from tests.support import serving, tiny_policy_dir, wait_for
from tests.toploc.test_gate import rejections, run_gate

RUN = "fetchfail"


def inbox_versions(redis_client, keys) -> list[int]:
    return [RolloutGroup.decode(m).policy_version for _, m in redis_client.xrange(keys.rollouts)]


def test_a_worker_whose_fetch_fails_keeps_producing_accepted_groups_inside_the_async_window(
    tmp_path, redis_client, monkeypatch
):
    base = tiny_policy_dir(tmp_path / "v0", seed=0)
    run = rlrun(
        RUN,
        model=base,
        task={"maxOperand": 20},
        sampling={"groupSize": 2, "maxTokens": 4},
        trainer={"batchSize": 2, "maxAsyncLevel": 2},
        store=tmp_path / "store",
    )
    config = write_rlrun(tmp_path / "rlrun.yaml", run, pool("pool", RUN, replicas=1, maxPending=4))
    bundle = load_bundle(config)
    key_file, public = generate_keypair(tmp_path / "keys")
    monkeypatch.setenv(env.PUBLIC_KEY, public)
    monkeypatch.setattr(follower_module, "FETCH_RETRY_FIRST_S", 0.1)
    store = open_store(bundle.run.spec.store.uri)
    signer = make_signer(load_private_key(key_file))
    publish_version(store, RUN, 0, base, signer=signer)
    publish_version(store, RUN, 1, tiny_policy_dir(tmp_path / "v1", seed=1), signer=signer)
    keys = RunKeys(RUN)
    ctx = Context(bundle=view_bundle(bundle, VIEWS["rollout"]), redis=redis_client, keys=keys, stop=threading.Event())
    down = threading.Event()

    async def maybe_down(request, name, body, status, headers):
        if down.is_set():
            return web.Response(status=503, text="relay restarting")
        return web.Response(status=status, body=body, headers=headers)

    redis_client.xadd(keys.policy, encode_json({"version": 0}))
    failures = follower_module.FETCH_FAILURES._value.get()
    with serving(make_app(store, RUN)) as origin_url, serving(evil_relay(origin_url, maybe_down)) as relay:
        options = RolloutOptions(config=config, worker_id="w", cache_dir=tmp_path / "cache", relay_urls=[relay])
        worker = Worker(ctx, options)
        # A short fetch deadline, so that a try against the relay that is down fails within the test.
        worker.follower.fetch = FetchSettings.over(
            [relay], RUN, public_key=parse_public_key(public), timeout=0.5, stop=ctx.stop
        )
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for("the worker's engine on version 0", lambda: worker.engine and worker.engine.version == 0, 60)
            down.set()
            redis_client.xadd(keys.policy, encode_json({"version": 1}))
            wait_for("a failed fetch of version 1", lambda: follower_module.FETCH_FAILURES._value.get() > failures, 60)
            assert thread.is_alive() and worker.follower.is_alive() and worker.follower.error is None

            # The gate (trusted: it fetches from the origin) accepts what the worker made on version 0, one behind
            # the newest; as it empties the inbox the worker makes more, still on version 0, still failing to fetch.
            def gate(expected: int) -> None:
                gate_ctx = Context(bundle=bundle, redis=redis_client, keys=keys, stop=threading.Event())
                run_gate(gate_ctx, origin_url, tmp_path / "gate-cache", expected=expected)

            first = redis_client.xlen(keys.rollouts)
            gate(first)
            fetch_failures = follower_module.FETCH_FAILURES._value.get()
            wait_for("groups made after the gate took the first", lambda: redis_client.xlen(keys.rollouts) >= 2, 60)
            assert follower_module.FETCH_FAILURES._value.get() >= fetch_failures and worker.engine.version == 0
            assert set(inbox_versions(redis_client, keys)) == {0}
            second = redis_client.xlen(keys.rollouts)
            gate(first + second)
            gate_ctx = Context(bundle=bundle, redis=redis_client, keys=keys, stop=threading.Event())
            accepted = [RolloutGroup.decode(m).policy_version for _, m in redis_client.xrange(keys.verified)]
            # (the worker goes on making groups while the gate runs, so the gate may take more than it waited for)
            assert len(accepted) >= first + second and set(accepted) == {0} and rejections(gate_ctx) == {}
            assert worker.follower.is_alive() and worker.follower.error is None

            down.clear()  # the relay is back: the retry gets version 1 and the worker swaps to it
            wait_for("the swap to version 1", lambda: worker.engine.version == 1, 60)
            redis_client.xtrim(keys.rollouts, maxlen=0, approximate=False)  # room for the worker (maxPending 4)
            wait_for("a group of version 1", lambda: 1 in inbox_versions(redis_client, keys), 60)
        finally:
            ctx.stop.set()
            thread.join(30)
    assert not thread.is_alive()
