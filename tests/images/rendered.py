"""Pods as the operator renders them for the examples, with every optional volume and env source on,
for the tests that run them as containers (test_images.py) or lay them out (test_containers.py)."""

from __future__ import annotations

import yaml

from rlfleet.config import parse_bundle
from rlfleet.operator import builders, names
from tests.support import REPO

SECRETS = {
    "redis": {names.REDIS_URL_KEY: "redis://redis.team-a.svc:6379/0"},
    "store-creds": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"},
    "signing": {names.SIGNING_KEY: "-----BEGIN PRIVATE KEY-----\n", names.PUBLIC_KEY: "ed25519:AAAA"},
    "tokens": {names.INGEST_TOKENS_KEY: "worker-1: token-1\n"},
}


def cluster_bundle(example: str):
    """An example with what a cluster needs, every optional volume and env source switched on."""
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / example / "rlrun.yaml").read_text()) if d]
    docs[0]["spec"].update(
        redis={"urlSecret": "redis"},
        store={"uri": "s3://ckpt/runs", "credentialsSecret": "store-creds"},
        shardcast={"signingKeySecret": "signing"},
        ingest={"tokens": "tokens"},
    )
    docs[0]["spec"]["trainer"]["replicas"] = 2
    return parse_bundle(yaml.safe_dump_all(docs))


def rendered_pods(bundle) -> tuple[list[tuple[str, dict]], dict[str, dict[str, str]]]:
    """(workload name, pod template) of every workload the operator builds for the bundle, and its ConfigMaps."""
    run, ns = bundle.run, "team-a"
    children = [
        *builders.build_run_children(run, ns),
        *(c for p in bundle.pools for c in builders.build_pool_children(run, p, bundle.relays, ns)),
        *(c for t in bundle.relays for c in builders.build_relay_children(run, t, bundle.relays, ns)),
    ]
    config_maps = {c["metadata"]["name"]: c["data"] for c in children if c["kind"] == "ConfigMap"}
    pods = [
        (c["metadata"]["name"], c["spec"]["template"]) for c in children if c["kind"] in ("Deployment", "StatefulSet")
    ]
    return pods, config_maps
