"""Credentials follow the data (rlfleet/operator/credentials.py), checked on what `rlfleet render` makes: every
pod that reads the dataset from s3:// gets credentials for it, the trainer alone fetches the model (S3
credentials, the hub token), and workers get neither the model's credentials nor the signing key."""

from __future__ import annotations

import pytest
import yaml

from rlfleet.config import parse_bundle
from rlfleet.operator import names
from rlfleet.operator.render import render_bundle
from rlfleet.wire import env
from tests.runs import bundle_yaml, pool, relay_tier, rlrun

CLUSTER = {
    "redis": {"urlSecret": "run-redis"},
    "store": {"uri": "s3://ckpt/runs", "credentialsSecret": "store-creds"},
    "shardcast": {"signingKeySecret": "run-signing"},
}
MATH_ON_S3 = {"type": "math", "dataset": {"path": "s3://data/math.jsonl"}, "promptTemplate": "{problem}"}
TRUSTED = pool("inside", "math", replicas=1)
OWN_KEY = pool("outside", "math", replicas=1, ingestUrl="https://ingest.example", workerTokens="tokens",
               dataCredentialsSecret="data-read")  # fmt: skip
NO_KEY = pool("elsewhere", "math", replicas=1, ingestUrl="https://ingest.example", workerTokens="tokens")
HUB_VARS = {env.HF_TOKEN, env.HF_HOME, env.HF_ENDPOINT, env.HF_HUB_CACHE}


def pods(model: str, task: dict | None = None, *pools) -> dict[str, dict]:
    """The main container of each workload of the rendered run, by workload name."""
    run = rlrun("math", model={"path": model, "tokenSecret": "hub-token"}, task=task or MATH_ON_S3)
    run["spec"].update(CLUSTER)
    objects = render_bundle(parse_bundle(bundle_yaml(run, *(pools or (TRUSTED,)), relay_tier("t0", "math"))), "ml")
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }


def secrets_from(container: dict) -> list[str]:
    return [ref["secretRef"]["name"] for ref in container.get("envFrom", [])]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_every_pod_that_reads_an_s3_dataset_gets_credentials_for_it():
    """Bug: a math run on s3:// gave only the trainer and the origin credentials; the verifier and the workers,
    which load the rows themselves, got none."""
    containers = pods("builtin://tiny-math", MATH_ON_S3, TRUSTED, OWN_KEY, NO_KEY)
    readers = {name for name, c in containers.items() if c["name"] in (names.TRAINER, names.VERIFIER, names.ROLLOUT)}
    assert readers == {"math-trainer", "math-verifier", "inside-rollout", "outside-rollout", "elsewhere-rollout"}
    assert secrets_from(containers["math-trainer"]) == ["store-creds"]
    assert secrets_from(containers["math-verifier"]) == ["store-creds"]
    assert secrets_from(containers["inside-rollout"]) == ["store-creds"], "a pool that writes to Redis directly"
    assert secrets_from(containers["outside-rollout"]) == ["data-read"], "its own read key, never the store's"
    assert secrets_from(containers["elsewhere-rollout"]) == [], "an ingest pool is not trusted with the store's"
    assert secrets_from(containers["math-origin"]) == ["store-creds"]
    assert secrets_from(containers["t0-relay"]) == []


def test_no_pod_but_the_trainer_and_origin_gets_store_credentials_for_data_not_on_s3():
    containers = pods("builtin://tiny-math", {**MATH_ON_S3, "dataset": {"path": "builtin://tiny-math"}}, OWN_KEY)
    assert {name: secrets_from(c) for name, c in containers.items() if secrets_from(c)} == {
        "math-trainer": ["store-creds"],
        "math-origin": ["store-creds"],
    }


@pytest.mark.parametrize("model", ["hf://acme/tiny@v1", "s3://models/tiny"])
def test_only_the_trainer_fetches_the_model_and_workers_never_get_its_credentials(model):
    containers = pods(model, {"type": "arithmetic"}, TRUSTED, OWN_KEY)
    trainer = env_of(containers["math-trainer"])
    if model.startswith("hf://"):
        assert trainer[env.HF_TOKEN]["valueFrom"] == {"secretKeyRef": {"name": "hub-token", "key": "token"}}
        assert trainer[env.HF_HOME]["value"] == f"{names.CACHE_DIR}/hf", "the download outlives a container restart"
    assert secrets_from(containers["math-trainer"]) == ["store-creds"]  # an s3:// model: the store's endpoint, keys
    for name, container in containers.items():
        if name == "math-trainer":
            continue
        text = yaml.safe_dump(container)
        assert not HUB_VARS & set(env_of(container)) and "hub-token" not in text, f"{name} gets the hub token"
    for name in ("inside-rollout", "outside-rollout"):
        worker = containers[name]
        assert secrets_from(worker) == [], f"{name}: the model reaches workers through the relays, never its keys"
        assert names.SIGNING_KEY not in yaml.safe_dump(worker), f"{name}: the signing key"
