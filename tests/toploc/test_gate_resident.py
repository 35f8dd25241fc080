"""The verifier's resident versions (rlfleet/services/toploc/resident.py) against a real origin: at most
`verifier.residentVersions` models in memory whatever the async window, each new version loaded in place into
the least recently used one, with exactly that version's weights; and a version another thread is using is
never overwritten."""

from __future__ import annotations

import threading

import torch

from rlfleet.models.policy import load_policy
from rlfleet.operator.names import VERIFIER
from rlfleet.services.toploc.main import Gate
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import PRIVATE_KEY_FILE, load_private_key, make_signer
from rlfleet.versions.store import open_store
from tests.support import tiny_policy_dir, wait_for
from tests.toploc.test_gate import as_, gate_system


def publish_distinct_versions(ctx, tmp, versions) -> dict[int, dict[str, torch.Tensor]]:
    """Versions `versions` of the gate's run, each with its own random weights (same config and tokenizer);
    their state dicts as a whole load gives them."""
    spec = ctx.bundle.run.spec
    signer = make_signer(load_private_key(tmp / "keys" / PRIVATE_KEY_FILE))
    store = open_store(spec.store.uri)
    weights = {}
    for v in versions:
        local = tiny_policy_dir(tmp / f"policy-{v}", seed=100 + v)
        publish_version(store, "gate", v, local, signer=signer)
        weights[v] = load_policy(local, spec.model.dtype)[0].state_dict()
    return weights


def assert_weights(model, expected: dict[str, torch.Tensor], version: int) -> None:
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), f"version {version}: {name} differs from a whole load"


def test_versions_past_the_bound_are_loaded_in_place_with_their_own_weights(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, verifier="{residentVersions: 2}") as (ctx, policy, origin_url, tmp):
        weights = publish_distinct_versions(ctx, tmp, range(1, 6))
        weights[0] = load_policy(policy, ctx.bundle.run.spec.model.dtype)[0].state_dict()
        gate = Gate(as_(ctx, VERIFIER), "verifier-0", origin_url, tmp / "cache")
        models = set()
        for v in [0, 1, 2, 3, 4, 5, 4, 2]:
            model, _ = gate.policy(v)
            models.add(id(model))
            assert_weights(model, weights[v], v)
            assert len(gate.resident.versions()) <= 2
        assert len(models) == 2, "never more models than residentVersions, and none copied past it"
        assert gate.resident.versions() == [4, 2]
        # 0 and 1 built; 2, 3, 4, 5 and 2 again each into the least recently used model; 4 was resident
        assert gate.resident.loaded_in_place == 5


def test_a_version_in_use_by_another_thread_is_never_loaded_into(tmp_path, redis_url):
    """The HTTP API's thread verifies on version 1 while the gate's loop needs version 2, with room for one:
    the loop waits for the API's release instead of overwriting the model it is prefilling."""
    with gate_system(tmp_path, redis_url, verifier="{residentVersions: 1}") as (ctx, policy, origin_url, tmp):
        weights = publish_distinct_versions(ctx, tmp, [1, 2])
        gate = Gate(as_(ctx, VERIFIER), "verifier-0", origin_url, tmp / "cache")
        api_has_it, api_done = threading.Event(), threading.Event()
        held = {}

        def api_request():
            held["model"], _ = gate.policy(1)
            api_has_it.set()
            api_done.wait(60)
            held["state"] = {k: t.clone() for k, t in held["model"].state_dict().items()}  # as the API saw it
            gate.release()

        api = threading.Thread(target=api_request)
        api.start()
        assert api_has_it.wait(60)
        got = {}
        loop = threading.Thread(target=lambda: got.setdefault("model", gate.policy(2)[0]))
        loop.start()
        loop.join(1.0)
        assert loop.is_alive() and "model" not in got, "the loop waits while the API uses the only model"
        api_done.set()
        api.join(60)
        loop.join(60)
        wait_for("version 2 for the loop", lambda: "model" in got)
        for name, tensor in held["state"].items():
            assert torch.equal(tensor, weights[1][name]), f"{name} changed while the API used version 1"
        assert got["model"] is held["model"], "loaded in place once the API let go"
        assert_weights(got["model"], weights[2], 2)
        assert gate.resident.versions() == [2]


def test_checks_that_read_no_weight_load_no_version(tmp_path, redis_url):
    """The gate's first pass over a batch reads only a version's config and tokenizer (the prefill comes per
    version afterwards): a version of the same signature as a resident one is described without a load, so
    groups of three versions mixed in a batch do not reload two models in turn."""
    with gate_system(tmp_path, redis_url, verifier="{residentVersions: 1}") as (ctx, policy, origin_url, tmp):
        publish_distinct_versions(ctx, tmp, [1, 2])
        gate = Gate(as_(ctx, VERIFIER), "verifier-0", origin_url, tmp / "cache")
        model, tokenizer = gate.policy(1)
        for version in (2, 0, 2):
            assert gate.resident.describe(version) == (model, tokenizer)
        assert gate.resident.versions() == [1] and gate.resident.loaded_in_place == 0
        assert gate.policy(2)[0] is model and gate.resident.loaded_in_place == 1  # weights: loaded in place
