"""What a pod reads, and only that, is in its config and its template's hash: scaling a pool or a tier,
or changing a setting no pod of a component reads, never restarts that component's pods."""

from __future__ import annotations

import ast

import yaml

from rlfleet.config import TrainerSpec, parse_bundle
from rlfleet.operator import builders as b
from rlfleet.operator import names
from rlfleet.operator.podconfig import TRAINER_FIELDS_OTHERS_READ
from tests.operator.test_builders import NS, _bundle
from tests.support import REPO


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
    assert {n for n in base if hot[n] != base[n]} == {
        "arithmetic-trainer",
        "arithmetic-verifier",
        "arithmetic-cpu-rollout",
    }
    keep = {"signingKeySecret": "arithmetic-signing", "keepVersions": 5}
    shardcast = _templates(_bundle(ingest={"tokens": "t"}, shardcast=keep))
    assert {n for n in base if shardcast[n] != base[n]} == {
        "arithmetic-trainer",
        "arithmetic-verifier",
        "arithmetic-cpu-rollout",
        "arithmetic-tier0-relay",
    }
    ingest = _templates(_bundle(ingest={"tokens": "t", "maxBacklog": 7}))
    assert (
        ingest["arithmetic-ingest"] != base["arithmetic-ingest"]
        and ingest["arithmetic-origin"] == base["arithmetic-origin"]
    )


def test_servers_read_only_the_spec_sections_their_config_hash_holds():
    """Keeps the projection honest: the modules of the relay, the origin and the ingest (and what they
    share) read no run spec section outside podconfig.SERVER_READS."""
    from rlfleet.config import RLRunSpec
    from rlfleet.operator.podconfig import SERVER_READS

    allowed = {s for sections in SERVER_READS.values() for s in sections}
    sections = set(RLRunSpec.model_fields)
    modules = [*(REPO / "rlfleet/services/shardcast").glob("*.py"), *(REPO / "rlfleet/services/ingest").glob("*.py")]
    modules += [
        REPO / f"rlfleet/{m}.py"
        for m in ("wire/runtime", "versions/signing", "versions/store", "wire/streams", "versions/checkpoint")
    ]
    found = {}
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "spec"
                and node.attr in sections - allowed
            ):
                found.setdefault(path.name, set()).add(node.attr)
    assert not found, f"run spec sections read by the servers (add them to podconfig.SERVER_READS): {found}"


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


def test_components_other_than_the_trainer_read_only_the_projected_fields_of_spec_trainer():
    """The projection drops spec.trainer (but TRAINER_FIELDS_OTHERS_READ) from every other pod's config
    hash. This keeps it honest: no module outside services/trainer reads another spec.trainer field."""
    allowed = {name for name, field in TrainerSpec.model_fields.items() if field.alias in TRAINER_FIELDS_OTHERS_READ}
    assert len(allowed) == len(TRAINER_FIELDS_OTHERS_READ)
    found = {}
    for path in (REPO / "rlfleet").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("rlfleet/services/trainer/", "rlfleet/operator/", "rlfleet/config/")) or rel in (
            "rlfleet/local/launcher.py",
            "rlfleet/local/plan.py",
        ):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "trainer"
                and node.attr not in allowed
            ):
                found.setdefault(rel, set()).add(node.attr)
    assert not found, f"spec.trainer fields read outside the trainer (add them to the pod projection): {found}"
