"""The workloads as a cluster runs them: resource requests (HPA needs them), workers that post to an
ingest reach the run only through it and the relays, port names, probes, disruption budgets, the
podTemplate overrides of each component, images and pull settings."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from rlfleet.operator import builders as b
from rlfleet.operator import names
from rlfleet.wire import env
from tests.operator.test_builders import K8S_VERSION, KUBE_VERSIONS, NS, _all_children, _bundle, _container


def _workloads(children):
    return [c for c in children if c["kind"] in ("Deployment", "StatefulSet")]


def _env_names(workload) -> set[str]:
    return {e["name"] for e in _container(workload).get("env", [])}


def test_every_workload_requests_cpu_and_memory():
    """Bug: no workload had resource requests (every pod BestEffort), so `kubectl autoscale
    --cpu-percent` (an HPA on CPU utilization) could never compute."""
    for workload in _workloads(_all_children(_bundle(ingest={"tokens": "worker-tokens"}))):
        requests = _container(workload).get("resources", {}).get("requests", {})
        assert requests.get("cpu") and requests.get("memory"), workload["metadata"]["name"]


def test_torch_components_use_as_many_threads_as_cpus_they_request():
    """Bug (found by the cluster in a box): pods did not set RLFLEET_TORCH_THREADS, so torch in every
    trainer, verifier and worker pod took all of the node's cores; five such pods on a 2-core node
    trained 5x slower than the same processes under `rlfleet run` (which sets 1). The thread count now
    follows each container's CPU request through the downward API."""
    for workload in _workloads(_all_children(_bundle(ingest={"tokens": "worker-tokens"}))):
        container = _container(workload)
        threads = [e for e in container.get("env", []) if e["name"] == env.TORCH_THREADS]
        if container["name"] in (names.TRAINER, names.VERIFIER, names.ROLLOUT):
            assert threads == [
                {
                    "name": env.TORCH_THREADS,
                    "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}},
                }
            ], container["name"]
        else:  # no torch in the origin, relays and ingest
            assert threads == [], container["name"]


def _ingest_bundle(**pool_spec):
    bundle = _bundle()
    pool = bundle.pools[0]
    spec = {"ingest_url": "https://ingest.cluster-a.example.com", "worker_tokens": "worker-tokens", **pool_spec}
    return bundle, pool.model_copy(update={"spec": pool.spec.model_copy(update=spec)})


def test_a_pool_that_posts_to_an_ingest_gets_no_redis_and_no_store():
    """Bug: a pool's ingestUrl could not work in a cluster, so the multi-cluster example handed raw
    Redis with one shared password to untrusted workers. Workers of an ingest pool get neither the
    Redis URL (env or config) nor the store, nor the names of the Secrets that hold them."""
    bundle, pool = _ingest_bundle()
    config_map, workload = b.build_pool_children(bundle.run, pool, bundle.relays, NS)[:2]
    assert env.REDIS_URL not in _env_names(workload)
    doc = next(yaml.safe_load_all(config_map["data"][names.CONFIG_FILE]))
    assert "url" not in doc["spec"].get("redis", {}) and "urlSecret" not in doc["spec"].get("redis", {})
    assert "store" not in doc["spec"] and "tokens" not in doc["spec"].get("ingest", {})


def test_trainer_rendezvous_port_is_named_for_what_it_is():
    """Bug: the trainer's torch rendezvous port (29500) was named `http`."""
    service = b.build_trainer_service(_bundle().run, NS)
    [rendezvous] = [p for p in service["spec"]["ports"] if p["port"] == names.TORCH_MASTER_PORT]
    assert rendezvous["name"] == "torch"
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)


def test_an_ingest_pool_is_a_statefulset_whose_pods_read_their_own_token():
    bundle, pool = _ingest_bundle(replicas=3)
    children = b.build_pool_children(bundle.run, pool, bundle.relays, NS)
    [workload] = [c for c in children if c["kind"] in ("Deployment", "StatefulSet")]
    assert workload["kind"] == "StatefulSet" and workload["spec"]["serviceName"] == "arithmetic-cpu-rollout"
    container = _container(workload)
    env_values = {e["name"]: e.get("value") for e in container["env"]}
    assert env_values[env.WORKER_TOKEN_FILE] == f"{names.WORKER_TOKENS_DIR}/$({names.ENV_POD_NAME})"
    assert [e["name"] for e in container["env"]].index(names.ENV_POD_NAME) < [
        e["name"] for e in container["env"]
    ].index(env.WORKER_TOKEN_FILE), "$(POD_NAME) expands only when POD_NAME comes first"
    assert container["args"][container["args"].index("--worker-id") + 1] == f"$({names.ENV_POD_NAME})"
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    assert volumes["worker-tokens"]["secret"]["secretName"] == "worker-tokens"
    for version in KUBE_VERSIONS:
        for child in children:
            kubernetes_validate.validate(child, version, strict=True)


def test_a_remote_runs_relays_get_no_redis_and_its_pools_must_use_an_ingest():
    bundle = _bundle(remote=True, store={})
    tier = bundle.relays[0]
    relay = next(c for c in b.build_relay_children(bundle.run, tier, [tier], NS) if c["kind"] == "Deployment")
    assert env.REDIS_URL not in _env_names(relay)
    with pytest.raises(b.SpecError, match="spec.ingestUrl: required: RLRun arithmetic is trained in another cluster"):
        b.build_pool_children(bundle.run, bundle.pools[0], bundle.relays, NS)


def test_every_long_running_pod_has_probes_security_and_a_disruption_budget_where_it_scales():
    children = _all_children(_bundle(ingest={"tokens": "worker-tokens"}))
    for workload in _workloads(children):
        container, pod = _container(workload), workload["spec"]["template"]["spec"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["path"] in ("/healthz", "/metrics"), (
                workload["metadata"]["name"],
                probe,
            )
        assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["automountServiceAccountToken"] is False
    rollout = next(c for c in children if c["metadata"]["name"] == "arithmetic-cpu-rollout" and "template" in c["spec"])
    assert _container(rollout)["startupProbe"]["failureThreshold"] * 10 >= 900, "vLLM start-up gets 15 minutes"
    verifier = next(c for c in children if c["metadata"]["name"] == "arithmetic-verifier" and "template" in c["spec"])
    for workload in (rollout, verifier):  # their model's liveness (rlfleet/wire/health.py), on the metrics port
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert _container(workload)[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
        liveness = _container(workload)["livenessProbe"]
        assert (liveness["periodSeconds"], liveness["failureThreshold"]) == (20, 3)
    budgets = {c["metadata"]["name"]: c["spec"] for c in children if c["kind"] == "PodDisruptionBudget"}
    assert budgets == {
        "arithmetic-cpu-rollout": {"maxUnavailable": "25%", "selector": rollout["spec"]["selector"]},
        "arithmetic-tier0-relay": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.selector("RelayTier", "arithmetic-tier0", names.RELAY, "arithmetic")},
        },
        "arithmetic-trainer": {
            "maxUnavailable": 0,
            "selector": next(
                c for c in children if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "arithmetic-trainer"
            )["spec"]["selector"],
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def test_the_trainer_budget_holds_a_drain_only_while_the_trainer_trains():
    """Bug: the trainer had no PodDisruptionBudget, so a node drain could evict a rank mid-run (every rank
    stops, the run goes back to its last checkpoint). Now none may go while it trains; once the run is
    suspended or over the budget lets every pod go, and an unready trainer pod never holds a drain."""

    def budget(bundle, active=True):
        [pdb] = [
            c
            for c in b.build_run_children(bundle.run, NS, b.Owner("RLRun", "arithmetic", "uid-1"), active=active)
            if c["kind"] == "PodDisruptionBudget"
        ]
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(pdb, version, strict=True)
        return pdb

    training = budget(_bundle())
    sts = b.build_trainer_statefulset(_bundle().run, NS)
    assert training["metadata"]["name"] == sts["metadata"]["name"] == names.trainer("arithmetic")
    assert training["spec"]["selector"] == sts["spec"]["selector"]
    assert training["metadata"]["ownerReferences"][0]["kind"] == "RLRun"
    assert training["spec"]["maxUnavailable"] == 0
    assert training["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budget(_bundle(suspend=True))["spec"]["maxUnavailable"] == "100%"
    assert budget(_bundle(), active=False)["spec"]["maxUnavailable"] == "100%", "a finished or failed run"


def test_the_trainer_gets_time_to_save_its_resume_state_when_stopped():
    """Bug: trainer pods had Kubernetes' default 30 s grace period; a trainer saving its resume state when stopped
    took 32.7 s in the cluster test on a loaded machine and was killed (a real model's save takes minutes).
    trainer.terminationGracePeriodSeconds sets it (600 s by default); a podTemplate still decides."""

    def grace(**trainer) -> int:
        sts = b.build_trainer_statefulset(_bundle(trainer={**base, **trainer}).run, NS)
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(sts, version, strict=True)
        return sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]

    base = _bundle().run.spec.trainer.model_dump(mode="json", by_alias=True, exclude_none=True)
    del base["terminationGracePeriodSeconds"]
    assert grace() == 600
    assert grace(terminationGracePeriodSeconds=1800) == 1800
    assert grace(podTemplate={"spec": {"terminationGracePeriodSeconds": 45}}) == 45
    others = [w for w in _workloads(_all_children(_bundle())) if w["metadata"]["name"] != names.trainer("arithmetic")]
    assert others and all("terminationGracePeriodSeconds" not in w["spec"]["template"]["spec"] for w in others)


def test_pod_template_overrides_merge_into_the_built_pods():
    """KubeRay / Kubeflow Trainer style: each component takes a podTemplate fragment for scheduling,
    identity and volumes, merged by name into what the operator builds."""
    override = {
        "metadata": {"annotations": {"team": "ml"}},
        "spec": {
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "training",
            "serviceAccountName": "trainer-s3",  # IRSA / workload identity for the store
            "containers": [
                {"name": "trainer", "resources": {"limits": {"memory": "32Gi"}}},
                {"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]},
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        },
    }
    trainer = _bundle().run.spec.trainer.model_dump(mode="json", by_alias=True, exclude_none=True)
    bundle = _bundle(
        trainer={**trainer, "podTemplate": override, "resources": {"requests": {"cpu": 4, "memory": "16Gi"}}}
    )
    sts = b.build_trainer_statefulset(bundle.run, NS)
    pod = sts["spec"]["template"]
    assert (
        pod["metadata"]["annotations"]["team"] == "ml"
        and names.CONFIG_HASH_ANNOTATION in pod["metadata"]["annotations"]
    )
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["serviceAccountName"] == "trainer-s3"
    trainer, sidecar = spec["containers"]
    assert trainer["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}}
    assert trainer["command"] == ["rlfleet", "trainer"] and sidecar["name"] == "sidecar"
    assert {v["name"] for v in spec["volumes"]} == {"config", "cache", "tmp", "signing", "scratch"}
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(sts, version, strict=True)
    # scheduling fields are orchestration: the trainer's config (and so its config hash) does not change
    plain = b.build_trainer_statefulset(_bundle().run, NS)
    key = names.CONFIG_HASH_ANNOTATION
    assert pod["metadata"]["annotations"][key] == plain["spec"]["template"]["metadata"]["annotations"][key]


def test_vllm_pools_get_a_memory_backed_dev_shm_and_gpus_by_their_resource_name():
    bundle = _bundle()
    pool = bundle.pools[0]
    pool = pool.model_copy(
        update={"spec": pool.spec.model_copy(update={"engine": "vllm", "gpus": 2, "gpu_resource": "amd.com/gpu"})}
    )
    workload = b.build_rollout_workload(bundle.run, pool, ["http://r:8080"], NS)
    container = _container(workload)
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    dshm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}  # vLLM's own example's size
    assert dshm in workload["spec"]["template"]["spec"]["volumes"]
    assert container["resources"]["limits"] == {"amd.com/gpu": 2}
    assert container["image"] == names.DEFAULT_GPU_IMAGE


def test_a_pools_dev_shm_has_a_size_limit_its_spec_sets():
    """Bug: the vLLM pools' memory-backed /dev/shm had no sizeLimit: a worker could fill the node's memory
    through it, counted against no bound of its own. Now 2Gi unless the pool's spec.shmSize says otherwise."""
    bundle = _bundle()
    body = bundle.pools[0].model_dump(mode="json", by_alias=True, exclude_none=True)
    body["spec"].update(engine="vllm", shmSize="8Gi")
    pool = b.parse_resource(body)
    workload = b.build_rollout_workload(bundle.run, pool, ["http://r:8080"], NS)
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(workload, version, strict=True)
    body["spec"]["shmSize"] = "lots"
    with pytest.raises(b.SpecError, match="shmSize.*not a Kubernetes quantity"):
        b.parse_resource(body)
    body["spec"].update(engine="torch", shmSize="8Gi")  # torch workers get the runtime's /dev/shm
    torch_pool = b.build_rollout_workload(bundle.run, b.parse_resource(body), ["http://r:8080"], NS)
    assert "dshm" not in {v["name"] for v in torch_pool["spec"]["template"]["spec"]["volumes"]}


def test_cluster_defaults_set_images_pull_policy_and_pull_secrets():
    defaults = b.ClusterDefaults(image="cpu:1", gpu_image="gpu:1", pull_policy="Always", pull_secrets=("regcred",))
    bundle = _bundle()
    for child in _workloads(
        [
            *b.build_run_children(bundle.run, NS, None, defaults),
            *b.build_pool_children(bundle.run, bundle.pools[0], bundle.relays, NS, None, defaults),
        ]
    ):
        pod = child["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["containers"][0]["imagePullPolicy"] == "Always"
        assert pod["containers"][0]["image"] == "cpu:1"
    with_image = _bundle(image="mine:2")
    assert _container(b.build_trainer_statefulset(with_image.run, NS, None, defaults))["image"] == "mine:2"


def _writable(workload, path: str) -> bool:
    """Whether `path` is on one of the container's writable volume mounts (not on its root filesystem)."""
    mounts = [m for m in _container(workload)["volumeMounts"] if not m.get("readOnly")]
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/") for m in mounts)


def test_run_pods_are_hardened_and_write_only_to_their_volumes():
    """Bug: run pods mounted a service account token they never use and wrote to a writable root
    filesystem. Now: no token, a read-only root, and every place the processes write on a volume."""
    children = _all_children(_bundle(ingest={"tokens": "worker-tokens"}))
    components = set()
    for workload in _workloads(children):
        container, pod = _container(workload), workload["spec"]["template"]["spec"]
        components.add(workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])
        assert pod["automountServiceAccountToken"] is False, workload["metadata"]["name"]
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        environment = {e["name"]: e.get("value") for e in container["env"]}
        for path in ("/tmp", environment["HOME"], environment[env.CACHE], f"{names.CACHE_DIR}/xdg"):
            assert _writable(workload, path), (workload["metadata"]["name"], path)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(workload, version, strict=True)
    assert components == {"trainer", "origin", "verifier", "ingest", "rollout", "relay"}


def test_a_cluster_overrides_the_security_contexts_and_a_pod_template_still_wins(monkeypatch):
    from rlfleet.operator.options import OperatorOptions

    monkeypatch.setenv(env.POD_SECURITY_CONTEXT, '{"runAsNonRoot": true, "runAsUser": 2000, "fsGroup": 2000}')
    monkeypatch.setenv(env.CONTAINER_SECURITY_CONTEXT, '{"readOnlyRootFilesystem": false}')
    defaults = OperatorOptions.from_env().defaults
    trainer = _bundle().run.spec.trainer.model_dump(mode="json", by_alias=True, exclude_none=True)
    override = {"spec": {"securityContext": {"runAsUser": 3000}}}
    bundle = _bundle(trainer={**trainer, "podTemplate": override})
    for workload in _workloads(b.build_run_children(bundle.run, NS, defaults=defaults)):
        pod = workload["spec"]["template"]["spec"]
        expected_user = 3000 if workload["metadata"]["name"].endswith("-trainer") else 2000
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": expected_user, "fsGroup": 2000}
        assert _container(workload)["securityContext"] == {"readOnlyRootFilesystem": False}
    assert defaults.pod_security == {"runAsNonRoot": True, "runAsUser": 2000, "fsGroup": 2000}, "merged into a copy"
    for bad, message in (("[1]", "JSON object"), ("{nope", "JSON object")):
        monkeypatch.setenv(env.CONTAINER_SECURITY_CONTEXT, bad)
        with pytest.raises(SystemExit, match=f"{env.CONTAINER_SECURITY_CONTEXT}.*{message}"):
            OperatorOptions.from_env()
