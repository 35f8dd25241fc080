"""spec.redis.roleUrls (issue 16 item 6): each pod the operator builds gets its Redis ACL role's URL from
the urlSecret (`url-<role>`), so a rollout worker's pod holds no credentials that may write `verified`."""

from __future__ import annotations

import kubernetes_validate
import pytest

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.operator.pools import build_rollout_workload
from rlfleet.wire import env
from tests.operator.test_builders import K8S_VERSION, NS, _all_children, _bundle, _env
from tests.runs import bundle_yaml, rlrun


def key_of(pod: dict, name: str) -> str | None:
    value = _env(pod).get(name)
    return value["secretKeyRef"]["key"] if isinstance(value, dict) else None


def test_each_pod_gets_its_roles_url():
    bundle = _bundle(redis={"urlSecret": "redis-auth", "roleUrls": True})
    children = {(c["kind"], c["metadata"]["name"]): c for c in _all_children(bundle)}
    for child in children.values():
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
    url, read, tickets = env.REDIS_URL, env.REDIS_READ_URL, env.REDIS_TICKETS_URL
    rollout = children[("Deployment", "arithmetic-cpu-rollout")]
    assert (key_of(rollout, url), key_of(rollout, read), key_of(rollout, tickets)) == (
        "url-worker",
        "url-reader",
        "url-tickets",
    )
    assert key_of(children[("StatefulSet", "arithmetic-trainer")], url) == "url-trainer"
    assert key_of(children[("Deployment", "arithmetic-verifier")], url) == "url-verifier"
    assert key_of(children[("Deployment", "arithmetic-tier0-relay")], url) == "url-reader"
    pool = bundle.pools[0]
    remote = pool.model_copy(update={"spec": pool.spec.model_copy(update={"ingest_url": "https://ingest.example.org"})})
    behind_ingest = build_rollout_workload(bundle.run, remote, ["http://r:8080"], NS)
    assert (key_of(behind_ingest, url), key_of(behind_ingest, read)) == (None, None), "it never reaches Redis"
    without = _bundle(redis={"urlSecret": "redis-auth"})
    plain = {(c["kind"], c["metadata"]["name"]): c for c in _all_children(without)}
    assert key_of(plain[("Deployment", "arithmetic-cpu-rollout")], url) == "url"


def test_role_urls_need_the_secret():
    doc = rlrun("r", model="m", redis={"roleUrls": True})
    with pytest.raises(ConfigError, match="roleUrls: needs urlSecret"):
        parse_bundle(bundle_yaml(doc))
