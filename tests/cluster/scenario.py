"""What the cluster tests do to a box, as a user of a cluster would: kubectl's side through the official
`kubernetes` client (create, patch, the scale subresource, delete), the run's settings a cluster needs,
an auditor that follows the run's `verified` stream through a port forward to its Redis, and waits."""

from __future__ import annotations

import base64
import collections
import functools
import json
import secrets
import threading
from pathlib import Path

import boto3
import kubernetes
import redis
import yaml

from rlfleet.config import load_bundle
from rlfleet.operator import names
from rlfleet.wire.streams import RolloutGroup, RunKeys
from tests.cluster.inabox import Cluster
from tests.cluster.inabox.images import REPO
from tests.support import wait_for as poll

NS = "rlfleet"
EXAMPLE = REPO / "examples" / "arithmetic" / "rlrun.yaml"
MULTICLUSTER = REPO / "examples" / "multicluster"
BUCKET = "rlfleet-checkpoints"
# support.wait_for, polling once a second: the tests' conditions are API round trips and file reads.
wait_for = functools.partial(poll, every=1.0)
GROUP, VERSION = names.GROUP, names.VERSION


class Kubectl:
    """kubectl against one cluster of the box, through the `kubernetes` client (admin kubeconfig)."""

    def __init__(self, cluster: Cluster, namespace: str = NS):
        self.cluster, self.ns = cluster, namespace
        self.client = cluster.client()
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.apps = kubernetes.client.AppsV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)

    def secret(self, name: str, data: dict[str, str], kind: str = "Opaque") -> None:
        """kubectl create secret generic NAME --from-literal=k=v ... (`kind` kubernetes.io/tls: `create secret tls`)"""
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": kind, "stringData": data}
        self.core.create_namespaced_secret(self.ns, body)

    def read_secret(self, name: str) -> dict[str, str]:
        data = self.core.read_namespaced_secret(name, self.ns).data or {}
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    def apply(self, docs: list[dict]) -> None:
        """kubectl apply -f of rlfleet documents (creates: the client's create call for each)."""
        for doc in docs:
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, names.KINDS[doc["kind"]].plural, doc)

    def get(self, kind: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, names.KINDS[kind].plural, name)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str) -> list[dict]:
        plural = names.KINDS[kind].plural
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, plural).get("items") or []

    def patch(self, kind: str, name: str, body: dict) -> dict:
        """kubectl patch --type=merge"""
        plural = names.KINDS[kind].plural
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, plural, name, body)

    def scale(self, kind: str, name: str, replicas: int) -> None:
        """kubectl scale KIND/NAME --replicas=N (the scale subresource)."""
        plural = names.KINDS[kind].plural
        self.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, self.ns, plural, name, {"spec": {"replicas": replicas}}
        )

    def delete(self, kind: str, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, names.KINDS[kind].plural, name)

    def children(self, run: str) -> list[str]:
        """Every ConfigMap, Service, Deployment, StatefulSet and PodDisruptionBudget labelled with the run."""
        selector = f"{names.RUN_LABEL}={run}"
        found = []
        for kind, items in (
            ("ConfigMap", self.core.list_namespaced_config_map(self.ns, label_selector=selector).items),
            ("Service", self.core.list_namespaced_service(self.ns, label_selector=selector).items),
            ("Deployment", self.apps.list_namespaced_deployment(self.ns, label_selector=selector).items),
            ("StatefulSet", self.apps.list_namespaced_stateful_set(self.ns, label_selector=selector).items),
        ):
            found += [f"{kind}/{o.metadata.name}" for o in items]
        policy = kubernetes.client.PolicyV1Api(self.client)
        found += [
            f"PodDisruptionBudget/{o.metadata.name}"
            for o in policy.list_namespaced_pod_disruption_budget(self.ns, label_selector=selector).items
        ]
        return found

    def close(self) -> None:
        self.client.close()


def condition(obj: dict | None, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def complete(k: Kubectl, run: str) -> dict | None:
    obj = k.get("RLRun", run)
    return obj if condition(obj, "Complete").get("status") == "True" else None


# ---- the run ---------------------------------------------------------------------------------------


def prebuilt_model(example: Path = EXAMPLE) -> Path:
    """The builtin model of `example` (default: the arithmetic one), built on this machine once (the node's
    model cache)."""
    from rlfleet.models.sources import resolve_model_path

    spec = load_bundle(example).run.spec
    return resolve_model_path(spec.model, spec.task, seed=spec.trainer.seed)


def node_model_cache(model: Path) -> dict:
    """A trainer podTemplate that mounts the node's builtin-model cache read-only where the trainer looks
    (RLFLEET_CACHE/builtin): the box's stand-in for a pre-pulled model on a node, so the trainer pod does
    not spend minutes of a 2-core machine building the same model again."""
    return {
        "spec": {
            "volumes": [{"name": "models", "hostPath": {"path": str(model.parent), "type": "Directory"}}],
            "containers": [
                {
                    "name": names.TRAINER,
                    "volumeMounts": [
                        {"name": "models", "mountPath": f"{names.CACHE_DIR}/models/builtin", "readOnly": True}
                    ],
                }
            ],
        }
    }


def make_bucket(box) -> None:
    forward = box.s3_forward()
    s3 = boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{forward.port}", region_name="us-east-1",
        aws_access_key_id="admin", aws_secret_access_key="admin",
    )  # fmt: skip
    s3.create_bucket(Bucket=BUCKET)


def signing_secret(k: Kubectl, directory: Path, private: bool = True) -> str:
    """The run's signing key Secret (both halves; a remote cluster gets the public one only); the public key."""
    from rlfleet.versions.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keypair

    key_dir = directory / "keys"
    if not (key_dir / PUBLIC_KEY_FILE).exists():
        generate_keypair(key_dir)
    public = (key_dir / PUBLIC_KEY_FILE).read_text().strip()
    data = {"public-key": public}
    if private:
        data["signing-key"] = (key_dir / PRIVATE_KEY_FILE).read_text()
    k.secret("arithmetic-signing", data)
    return public


def example_docs(steps: int, s3_url: str, model: Path) -> list[dict]:
    """The arithmetic example with what a cluster needs (docs/kubernetes.md): Redis from a Secret, the
    store in S3 with credentials from a Secret, the signing key Secret; `steps`; the node's model cache."""
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    spec = docs[0]["spec"]
    spec["trainer"].update(steps=steps, podTemplate=node_model_cache(model))
    spec.update(
        redis={"urlSecret": "arithmetic-redis"},
        store={"uri": f"s3://{BUCKET}/runs", "endpointUrl": s3_url, "credentialsSecret": "rlfleet-s3"},
        shardcast={**spec.get("shardcast", {}), "signingKeySecret": "arithmetic-signing"},
    )
    return docs


def cluster_secrets(k: Kubectl, directory: Path, redis_service: str = "rlfleet-redis") -> str:
    """The Secrets of docs/kubernetes.md (and examples/multicluster/cluster-a-values.yaml); the Redis password."""
    password = secrets.token_hex(12)
    k.secret("rlfleet-redis", {"password": password})
    k.secret("arithmetic-redis", {"url": f"redis://:{password}@{redis_service}.{k.ns}.svc:6379/0"})
    k.secret("rlfleet-s3", {"AWS_ACCESS_KEY_ID": "rlfleet", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(8),
                            "AWS_DEFAULT_REGION": "us-east-1"})  # fmt: skip
    signing_secret(k, directory)
    return password


def run_redis(cluster: Cluster, password: str, service: str = "rlfleet-redis") -> redis.Redis:
    """A client of the run's Redis through `kubectl port-forward svc/rlfleet-redis 6379`."""
    forward = cluster.port_forward(NS, service, 6379)
    return redis.Redis(host="127.0.0.1", port=forward.port, password=password, socket_timeout=10)


class Auditor(threading.Thread):
    """Follows the run's `verified` stream from its start (plain XREAD: it takes nothing from the trainer)
    and records every accepted group: rollout id -> worker id, and how many groups each engine drew."""

    def __init__(self, client: redis.Redis, run: str):
        super().__init__(daemon=True, name="auditor")
        self.client, self.keys = client, RunKeys(run)
        self.accepted: dict[str, str] = {}
        self.engines: collections.Counter[str] = collections.Counter()  # the engine each accepted group records
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        last = "0-0"
        while not self._halt.is_set():
            try:
                for _, entries in self.client.xread({self.keys.verified: last}, block=500, count=500) or []:
                    for msg_id, fields in entries:
                        last = msg_id
                        group = RolloutGroup.decode(fields)
                        self.accepted[group.rollout_id] = group.worker_id
                        self.engines[group.engine] += 1
            except redis.RedisError as exc:
                self.errors.append(repr(exc))
                self._halt.wait(0.5)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

    def queued(self) -> set[str]:
        return {RolloutGroup.decode(f).rollout_id for _, f in self.client.xrange(self.keys.verified)}


def trainer_records(cluster: Cluster, run: str) -> list[dict]:
    """metrics.jsonl of every trainer pod the run had, oldest first (each pod's emptyDir)."""
    records = []
    pods = sorted(
        (p for p in cluster.runner.all_pods() if p.owner[:2] == ("StatefulSet", names.trainer(run))),
        key=lambda p: p.created,
    )
    for pod in pods:
        path = pod.volume_dir("cache") / "trainer" / "metrics.jsonl"
        if path.exists():
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def tenths(records: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and the last tenth of the steps (as summary.json has it)."""
    k = max(1, len(records) // 10)
    rewards = [r["reward_mean"] for r in records]
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k
