"""Pure manifest builders: valid Kubernetes objects, the launcher's entrypoints, labels, owners, suspend."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from rlfleet.config import RelayTier, RLRun, parse_bundle
from rlfleet.operator import builders as b
from rlfleet.operator import conditions, names, podconfig
from rlfleet.operator.secrets import SecretNeed, run_secrets
from rlfleet.wire import env
from tests.support import REPO

ROOT = REPO
EXAMPLE = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
NS = "team-a"
K8S_VERSION = "1.30"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
KUBE_VERSIONS = [
    re.search(r'kubeVersion: ">=([0-9.]+)', (ROOT / "charts" / "rlfleet" / "Chart.yaml").read_text()).group(1),
    kubernetes_validate.latest_version(),
]


def _bundle(**run_spec):
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    docs[0]["spec"].update(
        {
            "redis": {"url": "redis://redis:6379/0"},
            "store": {"uri": "s3://ckpt/runs"},
            "shardcast": {"signingKeySecret": "arithmetic-signing"},
        },
        **run_spec,
    )
    return parse_bundle(yaml.safe_dump_all(docs))


def _all_children(bundle, owner_uid="uid-1"):
    run, pool, tier = bundle.run, bundle.pools[0], bundle.relays[0]
    return [
        *b.build_run_children(run, NS, b.Owner("RLRun", run.metadata.name, owner_uid)),
        *b.build_pool_children(run, pool, bundle.relays, NS, b.Owner("InferencePool", pool.metadata.name, "uid-2")),
        *b.build_relay_children(run, tier, bundle.relays, NS, b.Owner("RelayTier", tier.metadata.name, "uid-3")),
    ]


def _container(obj):
    return obj["spec"]["template"]["spec"]["containers"][0]


def _by_kind_and_name(children) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def _env(obj):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(obj)["env"]}


def test_every_child_is_a_valid_kubernetes_object_with_labels_and_owner():
    children = _all_children(_bundle())
    assert len({(c["kind"], c["metadata"]["name"]) for c in children}) == len(children) == 15
    for child in children:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(child, version, strict=True)
        labels = child["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"):
            assert labels[key]
        assert (
            labels["app.kubernetes.io/part-of"] == "rlfleet"
            and labels["app.kubernetes.io/managed-by"] == names.FIELD_MANAGER
        )
        [ref] = child["metadata"]["ownerReferences"]
        assert ref["controller"] and ref["uid"].startswith("uid-") and ref["apiVersion"] == "rlfleet.io/v1alpha1"
        if child["kind"] in ("Deployment", "StatefulSet"):
            match = child["spec"]["selector"]["matchLabels"]
            assert match.items() <= child["spec"]["template"]["metadata"]["labels"].items()


def test_containers_run_the_launcher_entrypoints():
    by_name = {c["metadata"]["name"]: c for c in _all_children(_bundle()) if "template" in c.get("spec", {})}
    trainer = _container(by_name["arithmetic-trainer"])
    assert trainer["command"] == ["rlfleet", "trainer"] and trainer["args"][:2] == ["--config", names.CONFIG_PATH]
    verifier = _container(by_name["arithmetic-verifier"])
    assert verifier["args"][verifier["args"].index("--origin-url") + 1] == f"http://arithmetic-origin.{NS}.svc:8080"
    assert "$(POD_NAME)" in verifier["args"]
    rollout = _container(by_name["arithmetic-cpu-rollout"])
    args = rollout["args"]
    assert args[args.index("--pool") + 1] == "arithmetic-cpu" and "$(POD_NAME)" in args
    assert args[args.index("--relay-url") + 1] == f"http://arithmetic-tier0-relay.{NS}.svc:8080"
    relay = _container(
        next(
            c
            for c in _all_children(_bundle())
            if c["kind"] == "Deployment" and c["metadata"]["name"] == "arithmetic-tier0-relay"
        )
    )
    assert relay["args"][relay["args"].index("--upstream") + 1] == f"http://arithmetic-origin.{NS}.svc:8080"
    assert relay["args"][relay["args"].index("--keep-versions") + 1] == "3"  # the example's RelayTier keepVersions
    # every subcommand and flag the pods use exists in the CLI
    from rlfleet.cli import build_parser

    for c in (trainer, verifier, rollout, relay):
        build_parser().parse_args([c["command"][1], *[a.replace("$(POD_NAME)", "pod-0") for a in c["args"]]])


def test_configmaps_hold_documents_the_components_parse():
    bundle = _bundle()
    run_cm = b.build_run_config_map(bundle.run, NS)
    parsed = parse_bundle(run_cm["data"][names.CONFIG_FILE]).run
    assert podconfig.document(parsed) == podconfig.document(bundle.run)  # what the components read, all of it
    pool_cm = b.build_pool_config_map(bundle.run, bundle.pools[0], NS)
    parsed = parse_bundle(pool_cm["data"][names.CONFIG_FILE])
    assert [p.metadata.name for p in parsed.pools] == ["arithmetic-cpu"]


def test_trainer_gpus_and_distributed_env():
    single = b.build_trainer_statefulset(_bundle().run, NS)
    assert "limits" not in _container(single)["resources"] and "WORLD_SIZE" not in _env(single)
    multi = b.build_trainer_statefulset(_bundle(trainer={"replicas": 4, "gpus": 8}).run, NS)
    kubernetes_validate.validate(multi, K8S_VERSION, strict=True)
    assert _container(multi)["image"] == names.DEFAULT_GPU_IMAGE, "a trainer with GPUs runs the GPU image"
    assert multi["spec"]["replicas"] == 4
    assert _container(multi)["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = _env(multi)
    assert env["WORLD_SIZE"] == "32", "4 replicas x 8 ranks, one a GPU"
    assert env["MASTER_ADDR"] == f"arithmetic-trainer-0.arithmetic-trainer.{NS}.svc"
    assert "pod-index" in env["GROUP_RANK"]["fieldRef"]["fieldPath"], "each rank's RANK = ordinal x 8 + LOCAL_RANK"
    assert _container(multi)["args"][-2:] == ["--ranks", "8"], "one container starts the pod's 8 rank processes"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_a_trainer_pod_of_several_ranks_gets_shared_memory_and_its_rank_environment(version):
    """ranksPerReplica without GPUs (CPU ranks over gloo): one pod, one container, 2 rank processes."""
    sts = b.build_trainer_statefulset(_bundle(trainer={"ranksPerReplica": 2}).run, NS)
    kubernetes_validate.validate(sts, version, strict=True)
    assert sts["spec"]["replicas"] == 1
    container, pod = _container(sts), sts["spec"]["template"]["spec"]
    assert container["command"] == ["rlfleet", "trainer"] and container["args"][-2:] == ["--ranks", "2"]
    env = _env(sts)
    assert env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == str(names.TORCH_MASTER_PORT)
    assert "pod-index" in env["GROUP_RANK"]["fieldRef"]["fieldPath"] and "RANK" not in env
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert "limits" not in container["resources"], "no GPU asked for"
    one = b.build_trainer_statefulset(_bundle().run, NS)
    assert "--ranks" not in _container(one)["args"] and all(v["name"] != "shm" for v in _pod_volumes(one))


def _pod_volumes(obj) -> list[dict]:
    return obj["spec"]["template"]["spec"].get("volumes", [])


def test_ranks_per_replica_must_match_the_gpus_it_runs_on():
    from rlfleet.config import ConfigError

    with pytest.raises(ConfigError, match="ranksPerReplica: 4 ranks on 8 GPUs"):
        _bundle(trainer={"gpus": 8, "ranksPerReplica": 4})
    assert _bundle(trainer={"gpus": 8, "ranksPerReplica": 8}).run.spec.trainer.world == 8
    assert _bundle(trainer={"replicas": 3, "ranksPerReplica": 2}).run.spec.trainer.world == 6


def test_pool_replicas_engine_and_gpus():
    bundle = _bundle()
    pool = bundle.pools[0].model_copy(
        update={"spec": bundle.pools[0].spec.model_copy(update={"replicas": 7, "gpus": 1, "image": "vllm:x"})}
    )
    dep = b.build_rollout_workload(bundle.run, pool, ["http://r:8080"], NS)
    assert dep["spec"]["replicas"] == 7 and _container(dep)["image"] == "vllm:x"
    assert _container(dep)["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_secrets_are_referenced_not_copied():
    bundle = _bundle(
        redis={"urlSecret": "redis-auth"},
        store={"uri": "s3://b/p", "credentialsSecret": "s3-creds"},
        shardcast={"signingKeySecret": "signer"},
    )
    children = _all_children(bundle)
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
    by_name = _by_kind_and_name(children)
    trainer = by_name[("StatefulSet", "arithmetic-trainer")]
    assert _env(trainer)[env.REDIS_URL] == {"secretKeyRef": {"name": "redis-auth", "key": "url"}}
    assert _container(trainer)["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert {
        "name": "signing",
        "secret": {"secretName": "signer", "items": [{"key": "signing-key", "path": "signing-key"}]},
    } in trainer["spec"]["template"]["spec"]["volumes"]
    assert _env(trainer)[env.SIGNING_KEY_FILE] == f"{names.SIGNING_DIR}/signing-key"
    rollout = by_name[("Deployment", "arithmetic-cpu-rollout")]
    assert "envFrom" not in _container(rollout), "untrusted workers never get store credentials"
    for name in [
        ("Deployment", "arithmetic-cpu-rollout"),
        ("Deployment", "arithmetic-verifier"),
        ("Deployment", "arithmetic-tier0-relay"),
    ]:
        pod = by_name[name]
        assert "signing" not in yaml.safe_dump(pod["spec"]["template"]["spec"].get("volumes")), (
            f"{name}: private key mounted"
        )
        assert _env(pod)[env.PUBLIC_KEY] == {"secretKeyRef": {"name": "signer", "key": "public-key"}}


def test_suspend_scales_every_workload_to_zero():
    children = _all_children(_bundle(suspend=True))
    workloads = [c for c in children if c["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) == 5 and all(w["spec"]["replicas"] == 0 for w in workloads)


def test_config_change_changes_the_pod_template_hash():
    a = b.build_trainer_statefulset(_bundle().run, NS)
    c = b.build_trainer_statefulset(_bundle(sampling={"groupSize": 4}).run, NS)
    key = names.CONFIG_HASH_ANNOTATION
    assert (
        a["spec"]["template"]["metadata"]["annotations"][key] != c["spec"]["template"]["metadata"]["annotations"][key]
    )
    assert b.build_trainer_statefulset(_bundle().run, NS) == a  # pure: same input, same output


def test_relay_tree_resolution():
    bundle = _bundle()
    t0 = bundle.relays[0]
    t1 = t0.model_copy(
        update={
            "metadata": t0.metadata.model_copy(update={"name": "edge"}),
            "spec": t0.spec.model_copy(update={"tier": 1}),
        }
    )
    run = bundle.run
    assert b.resolve_upstream(run, t1, [t0, t1], NS) == f"http://arithmetic-tier0-relay.{NS}.svc:8080"
    assert b.resolve_pool_relays(run, bundle.pools[0], [t0, t1], NS) == [f"http://edge-relay.{NS}.svc:8080"]
    assert b.resolve_pool_relays(run, bundle.pools[0], [], NS) == [f"http://arithmetic-origin.{NS}.svc:8080"]
    with pytest.raises(b.MissingDependency, match="no RelayTier of run 'arithmetic' has tier 0"):
        b.resolve_upstream(run, t1, [t1], NS)


@pytest.mark.parametrize(
    "spec,expected",
    [
        ({"redis": {}}, "spec.redis.url: required on a cluster"),
        ({"store": {}}, "spec.store.uri: required on a cluster"),
        ({"store": {"uri": "file:///data"}}, "spec.store.uri: 'file:///data' is a local directory"),
        ({"shardcast": {}}, "spec.shardcast.signingKeySecret: required on a cluster while requireSignatures is true"),
        # `rlfleet run` announces its own relays; a cluster's public ones only its operator knows
        ({"ingest": {"admission": {"mode": "open"}}}, "spec.ingest.admission.relayUrls: required on a cluster"),
    ],
)
def test_cluster_only_requirements(spec, expected):
    bundle = _bundle(**spec)
    with pytest.raises(b.SpecError, match=expected.replace("(", r"\(")):
        b.build_run_children(bundle.run, NS)


def test_parse_resource_names_the_field():
    body = {
        "apiVersion": "rlfleet.io/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": NS, "uid": "u", "resourceVersion": "7", "generation": 2},
        "spec": {"run": "arithmetic", "replicas": -1, "engin": "torch"},
        "status": {"phase": "Running"},
    }
    with pytest.raises(b.SpecError) as err:
        b.parse_resource(body)
    assert err.value.problems == [
        "spec.replicas: Input should be greater than or equal to 0",
        "spec.engin: unknown field (check the spelling; fields are camelCase)",
    ]


def test_parse_as_refuses_another_kind():
    body = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RelayTier", "metadata": {"name": "t", "namespace": NS},
            "spec": {"run": "arithmetic", "tier": 0}}  # fmt: skip
    assert isinstance(b.parse_as(body, RelayTier), RelayTier)
    with pytest.raises(b.SpecError) as err:
        b.parse_as(body, RLRun)
    assert err.value.problems == ["kind: 'RelayTier' where RLRun is expected"]


def test_conditions_keep_transition_time_while_status_holds():
    c1 = conditions.build_condition("Ready", True, "ChildrenApplied", "ok", 1, "2025-01-01T00:00:00Z")
    c2 = conditions.build_condition("Ready", True, "ChildrenApplied", "ok", 2, "2025-01-02T00:00:00Z", [c1])
    c3 = conditions.build_condition("Ready", False, "InvalidSpec", "bad", 3, "2025-01-03T00:00:00Z", [c2])
    assert c2["lastTransitionTime"] == "2025-01-01T00:00:00Z" and c3["lastTransitionTime"] == "2025-01-03T00:00:00Z"
    assert conditions.merge_conditions([c1, {"type": "Suspended", "status": "False"}], c3) == [
        {"type": "Suspended", "status": "False"},
        c3,
    ]


def test_a_remote_run_gets_only_its_config_and_relays_reach_outside_upstreams():
    bundle = _bundle(remote=True, store={})
    children = b.build_run_children(bundle.run, NS)
    assert [c["kind"] for c in children] == ["ConfigMap"], "no trainer, verifier or origin for a run trained elsewhere"
    tier = bundle.relays[0]
    outside = tier.model_copy(
        update={"spec": tier.spec.model_copy(update={"upstream_url": "http://relay.cluster-a.example.com:8080/"})}
    )
    assert b.resolve_upstream(bundle.run, outside, [outside], NS) == "http://relay.cluster-a.example.com:8080"
    deployment = _by_kind_and_name(b.build_relay_children(bundle.run, outside, [outside], NS))[
        ("Deployment", "arithmetic-tier0-relay")
    ]
    args = _container(deployment)["args"]
    assert args[args.index("--upstream") + 1] == "http://relay.cluster-a.example.com:8080"


def test_the_ingest_is_deployed_with_its_tokens_only_when_configured():
    assert not [c for c in b.build_run_children(_bundle().run, NS) if "ingest" in c["metadata"]["name"]]
    children = b.build_run_children(_bundle(ingest={"tokens": "worker-tokens"}).run, NS)
    service, deployment = [c for c in children if c["metadata"]["name"] == "arithmetic-ingest"]
    assert service["kind"] == "Service" and deployment["kind"] == "Deployment"
    container = _container(deployment)
    args = container["args"]
    assert container["command"] == ["rlfleet", "ingest"]
    assert args[args.index("--tokens-file") + 1] == "/var/run/rlfleet/ingest/tokens.yaml"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "ingest-tokens",
        "secret": {"secretName": "worker-tokens", "items": [{"key": "tokens.yaml", "path": "tokens.yaml"}]},
    } in volumes
    others = [c for c in children if c["kind"] in ("Deployment", "StatefulSet") and c is not deployment]
    assert all("ingest-tokens" not in str(c) for c in others), "only the ingest pod sees the worker tokens"
    for child in (service, deployment):
        kubernetes_validate.validate(child, "1.30", strict=True)


def test_an_ingest_that_admits_joins_is_deployed_with_its_invites_and_without_tokens():
    relays = ["https://relay.example.org"]
    admission = {"mode": "invite", "invites": "invite-codes", "relayUrls": relays}
    run = _bundle(ingest={"admission": admission}).run
    [deployment] = [c for c in b.build_run_children(run, NS) if c["metadata"]["name"] == "arithmetic-ingest"][1:]
    args = _container(deployment)["args"]
    assert "--tokens-file" not in args
    assert args[args.index("--invites-file") + 1] == "/var/run/rlfleet/ingest-invites/invites.yaml"
    assert {
        "name": "ingest-invites",
        "secret": {"secretName": "invite-codes", "items": [{"key": "invites.yaml", "path": "invites.yaml"}]},
    } in deployment["spec"]["template"]["spec"]["volumes"]
    kubernetes_validate.validate(deployment, "1.30", strict=True)
    assert SecretNeed("invite-codes", "spec.ingest.admission.invites", ("invites.yaml",)) in run_secrets(run)
    opened = _bundle(ingest={"admission": {"mode": "open", "relayUrls": relays}}).run
    [deployment] = [c for c in b.build_run_children(opened, NS) if c["metadata"]["name"] == "arithmetic-ingest"][1:]
    assert "ingest-tokens" not in str(deployment) and "ingest-invites" not in str(deployment)
    with pytest.raises(b.SpecError, match="admission.invites"):
        b.build_run_children(_bundle(ingest={"admission": {"mode": "invite", "relayUrls": relays}}).run, NS)
