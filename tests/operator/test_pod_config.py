"""What a pod reads, and only that, is in its config and its template's hash: scaling a pool or a tier,
or changing a setting no pod of a component reads, never restarts that component's pods. What a
component reads is its view (rlfleet/wire/views.py): its process reads its config through it and the
operator cuts and hashes its pods' config by it, so these tests change a view and watch what rolls."""

from __future__ import annotations

import pytest
import yaml

from rlfleet.config import Bundle, RLRun, parse_bundle
from rlfleet.operator import builders as b
from rlfleet.operator import names
from rlfleet.operator.pods import ClusterDefaults
from rlfleet.operator.render import render_bundle
from rlfleet.wire.views import VIEWS, View, ViewError, view_bundle
from tests.operator.test_builders import NS, _bundle


def _pool(bundle, **spec):
    pool = bundle.pools[0]
    return pool.model_copy(update={"spec": pool.spec.model_copy(update=spec)})


def _tier(bundle, **spec):
    tier = bundle.relays[0]
    return tier.model_copy(update={"spec": tier.spec.model_copy(update=spec)})


def _templates(bundle, pool=None, tier=None) -> dict[str, dict]:
    """Pod template of every workload, by name."""
    run, pool, tier = bundle.run, pool or bundle.pools[0], tier or bundle.relays[0]
    children = [
        *b.build_run_children(run, NS),
        *b.build_pool_children(run, pool, bundle.relays, NS),
        *b.build_relay_children(run, tier, [tier], NS),
    ]
    return {c["metadata"]["name"]: c["spec"]["template"] for c in children if "template" in c.get("spec", {})}


def _config_maps(bundle, pool=None) -> dict[str, dict]:
    run, pool = bundle.run, pool or bundle.pools[0]
    children = [*b.build_run_children(run, NS), *b.build_pool_children(run, pool, bundle.relays, NS)]
    return {c["metadata"]["name"]: c["data"] for c in children if c["kind"] == "ConfigMap"}


def test_scaling_a_pool_or_a_tier_changes_no_pod_template_and_no_config():
    """Bug: the pool document, replicas included, was in the hashed pod config, so `kubectl scale`, an
    HPA or KEDA restarted every worker of the pool."""
    bundle = _bundle()
    before = _templates(bundle)
    after = _templates(bundle, pool=_pool(bundle, replicas=9), tier=_tier(bundle, replicas=4))
    assert before == after
    assert _config_maps(bundle) == _config_maps(bundle, pool=_pool(bundle, replicas=9))


def test_trainer_steps_and_verifier_replicas_restart_only_who_reads_them():
    """Bug: changing trainer.steps or verifier.replicas restarted every pool."""
    base = _templates(_bundle())
    steps = _templates(_bundle(trainer={"steps": 999}))
    replicas = _templates(_bundle(verifier={"replicas": 3}))
    for name in ("arithmetic-cpu-rollout", "arithmetic-tier0-relay", "arithmetic-verifier", "arithmetic-origin"):
        assert steps[name] == base[name], f"{name} restarts when trainer.steps changes"
        assert replicas[name] == base[name], f"{name} restarts when verifier.replicas changes"
    key = names.CONFIG_HASH_ANNOTATION
    assert (
        steps["arithmetic-trainer"]["metadata"]["annotations"][key]
        != base["arithmetic-trainer"]["metadata"]["annotations"][key]
    ), "the trainer reads trainer.steps: its pods roll"
    lr = _templates(_bundle(trainer={"learningRate": 0.5}))
    assert lr["arithmetic-cpu-rollout"] == base["arithmetic-cpu-rollout"]
    sampling = _templates(_bundle(sampling={"groupSize": 4}))
    readers = {"arithmetic-trainer", "arithmetic-verifier", "arithmetic-cpu-rollout"}
    assert {n for n in base if sampling[n] != base[n]} == readers, "who generates, verifies and trains reads it"


def test_a_sampling_change_rolls_who_reads_it_and_not_the_servers():
    """Bug (found by the cluster in a box): a change of sampling.temperature restarted the relays and the
    origin, which never read it (every pod but the trainer hashed the whole run document), dropping
    their caches mid-run. Each server hashes only the sections it reads."""
    base = _templates(_bundle(ingest={"tokens": "t"}))
    task = {"type": "arithmetic", "seed": 3, "maxOperand": 20, "operations": ["+"]}
    hot = _templates(_bundle(ingest={"tokens": "t"}, sampling={"groupSize": 8, "temperature": 0.7}, task=task))
    # The ingest serves the public run document (sampling, task, model: what a joining worker reads).
    assert {n for n in base if hot[n] != base[n]} == {
        "arithmetic-trainer",
        "arithmetic-verifier",
        "arithmetic-cpu-rollout",
        "arithmetic-ingest",
    }
    keep = {"signingKeySecret": "arithmetic-signing", "keepVersions": 5}
    shardcast = _templates(_bundle(ingest={"tokens": "t"}, shardcast=keep))
    assert {n for n in base if shardcast[n] != base[n]} == {
        "arithmetic-trainer",
        "arithmetic-verifier",
        "arithmetic-cpu-rollout",
        "arithmetic-tier0-relay",
        "arithmetic-ingest",
    }
    ingest = _templates(_bundle(ingest={"tokens": "t", "maxBacklog": 7}))
    assert (
        ingest["arithmetic-ingest"] != base["arithmetic-ingest"]
        and ingest["arithmetic-origin"] == base["arithmetic-origin"]
    )


def test_the_configs_pods_read_still_parse_as_the_components_read_them():
    bundle = _bundle(trainer={"steps": 7, "replicas": 2}, verifier={"replicas": 3})
    run_doc = _config_maps(bundle)["arithmetic-config"][names.CONFIG_FILE]
    parsed = parse_bundle(run_doc)
    assert parsed.run.spec.trainer.steps == 7 and parsed.run.spec.sampling == bundle.run.spec.sampling
    pool_doc = _config_maps(bundle)["arithmetic-cpu-rollout-config"][names.CONFIG_FILE]
    pool = parse_bundle(pool_doc)
    assert pool.pools[0].spec.engine == bundle.pools[0].spec.engine
    assert pool.run.spec.trainer.max_async_level == bundle.run.spec.trainer.max_async_level
    assert "replicas" not in yaml.safe_load_all(pool_doc).__next__()["spec"].get("verifier", {})


def _hashes(bundle, views=VIEWS) -> dict[str, str]:
    """Config hash of every workload the bundle renders to, by name."""
    objects = render_bundle(bundle, NS, ClusterDefaults(views=views))
    return {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION]
        for o in objects
        if "template" in o.get("spec", {})
    }


def _rolled(before: dict, after: dict) -> set[str]:
    return {name for name in before if after[name] != before[name]}


def _set(bundle, path: str, value) -> Bundle:
    """The bundle with one field of its run's spec (camelCase dotted path) set to `value`."""
    doc = bundle.run.model_dump(mode="json", by_alias=True, exclude_none=True)
    *sections, key = path.split(".")
    node = doc["spec"]
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value
    return Bundle(run=RLRun.model_validate(doc), pools=bundle.pools, relays=bundle.relays)


# (component, a path outside its view, a new value of it, the workloads of that component).
ADDED = [
    (names.TRAINER, "trainer.replicas", 2, {"arithmetic-trainer"}),
    (names.VERIFIER, "trainer.steps", 999, {"arithmetic-verifier"}),
    (names.ROLLOUT, "trainer.learningRate", 0.5, {"arithmetic-cpu-rollout"}),
    (names.RELAY, "sampling.groupSize", 4, {"arithmetic-tier0-relay"}),
    (names.ORIGIN, "model.warmStartSteps", 3, {"arithmetic-origin"}),
    (names.INGEST, "trainer.steps", 999, {"arithmetic-ingest"}),
]


@pytest.mark.parametrize(("component", "path", "value", "pods"), ADDED, ids=[a[0] for a in ADDED])
def test_a_field_added_to_a_components_view_rolls_exactly_that_components_pods(component, path, value, pods):
    """The issue's "done when": with the shipped views a change of `path` rolls none of the component's
    pods; with `path` added to that view alone, the same change rolls its pods and nobody else's, and
    leaves every other pod's hash as it was."""
    views = {**VIEWS, component: VIEWS[component].with_paths(run=(path,))}
    base = _bundle(ingest={"tokens": "t"})
    changed = _set(base, path, value)
    shipped = _rolled(_hashes(base), _hashes(changed))
    assert not shipped & pods, f"{path} is outside the shipped {component} view, yet {shipped & pods} rolled"
    assert _rolled(_hashes(base, views), _hashes(changed, views)) == shipped | pods
    unchanged = {n: h for n, h in _hashes(base).items() if n not in pods}
    assert {n: h for n, h in _hashes(base, views).items() if n not in pods} == unchanged, "only its hashes move"


def test_a_pool_field_added_to_the_rollout_view_rolls_the_pool_alone():
    views = {**VIEWS, names.ROLLOUT: VIEWS[names.ROLLOUT].with_paths(pool=("maxUnavailable",))}
    bundle = _bundle()
    changed = _pool(bundle, max_unavailable="50%")

    def hashes(pool, views):
        run, tiers, defaults = bundle.run, bundle.relays, ClusterDefaults(views=views)
        children = [
            *b.build_run_children(run, NS, None, defaults),
            *b.build_pool_children(run, pool, tiers, NS, None, defaults),
            *b.build_relay_children(run, tiers[0], tiers, NS, None, defaults),
        ]
        key = names.CONFIG_HASH_ANNOTATION
        return {c["metadata"]["name"]: c["spec"]["template"]["metadata"]["annotations"][key]
                for c in children if "template" in c.get("spec", {})}  # fmt: skip

    assert _rolled(hashes(bundle.pools[0], VIEWS), hashes(changed, VIEWS)) == set(), "no view reads it: nothing rolls"
    assert _rolled(hashes(bundle.pools[0], views), hashes(changed, views)) == {"arithmetic-cpu-rollout"}


def test_a_field_in_no_view_is_in_no_config_document():
    """Orchestration fields (replicas, gpus, images, Secret names, pod templates) are in no view, so no
    ConfigMap holds them; what the views name is there, camelCase."""
    bundle = _bundle(trainer={"replicas": 2, "steps": 7}, ingest={"tokens": "t"}, image="me/rlfleet:1")
    docs = [d for data in _config_maps(bundle).values() for d in yaml.safe_load_all(data[names.CONFIG_FILE])]
    for doc in docs:
        spec = doc["spec"]
        assert "image" not in spec and "suspend" not in spec and "replicas" not in spec
        assert "replicas" not in spec.get("trainer", {}) and "tokens" not in spec.get("ingest", {})
        assert "signingKeySecret" not in spec.get("shardcast", {})
    run_doc = docs[0]
    assert run_doc["spec"]["trainer"]["steps"] == 7, "the run's ConfigMap holds the widest view (the trainer's)"


def test_a_process_reading_outside_its_view_fails_naming_the_field_and_the_fix():
    bundle = _bundle()
    relay = view_bundle(bundle, VIEWS[names.RELAY])
    assert relay.run.spec.shardcast.keep_versions == bundle.run.spec.shardcast.keep_versions
    with pytest.raises(ViewError, match=r"relay: RLRun spec\.sampling is not in this component's view.*views\.py"):
        _ = relay.run.spec.sampling
    worker = view_bundle(bundle, VIEWS[names.ROLLOUT])
    assert worker.run.spec.trainer.seed == bundle.run.spec.trainer.seed
    with pytest.raises(ViewError, match=r"spec\.trainer\.steps"):
        _ = worker.run.spec.trainer.steps
    assert worker.pool(None)[1].engine == bundle.pools[0].spec.engine
    with pytest.raises(ViewError, match=r"InferencePool spec\.replicas"):
        _ = worker.pool(None)[1].replicas


def test_a_view_naming_a_field_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="TrainerSpec has no field 'stepz'"):
        View(names.TRAINER, ("trainer.stepz",))
    with pytest.raises(ValueError, match="not a section"):
        View(names.TRAINER, ("trainer.steps.x",))
