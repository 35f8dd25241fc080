"""The chart's Redis has a password by default (issue 28): generated into a Secret when none is named, required
by the rendered redis-server (run for real), and handed to the operator for the runs that name no Redis."""

from __future__ import annotations

import base64
import json

import kubernetes_validate
import pytest
import redis

from tests.chart.test_chart import CHART, KUBE_VERSIONS, by_kind, render
from tests.support import redis_client, start_rendered_redis

helm = pytest.importorskip("helm_python")

GENERATED = "rl-rlfleet-redis-auth"  # RELEASE-rlfleet-redis-auth, release "rl"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def parts(chart, values: dict) -> tuple[dict, dict, list[dict]]:
    """(the Redis container ({} without redis.enabled), the operator container's env by name, the Secrets),
    each valid for Kubernetes."""
    objects = render(chart, values)
    redis_deploy = next((d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-redis")), {})
    [operator] = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-operator")]
    secrets = by_kind(objects, "Secret")
    for obj in (redis_deploy, operator, *secrets):
        for version in KUBE_VERSIONS:
            if obj:
                kubernetes_validate.validate(obj, version, strict=True)
    [container] = redis_deploy["spec"]["template"]["spec"]["containers"] if redis_deploy else [{}]
    env = {e["name"]: e for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    return container, env, secrets


def test_a_password_is_generated_required_and_given_to_the_operator(chart, tmp_path):
    """Bug: the in-chart Redis had no password unless redis.auth.existingSecret named one."""
    container, env, secrets = parts(chart, {"redis": {"enabled": True}})
    [secret] = [s for s in secrets if s["metadata"]["name"] == GENERATED]
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) == 32 and password.isalnum()
    ref = {"secretKeyRef": {"name": GENERATED, "key": "password"}}
    assert {e["name"]: e.get("valueFrom") for e in container["env"]}["REDIS_PASSWORD"] == ref
    assert env["RLFLEET_DEFAULT_REDIS_PASSWORD"]["valueFrom"] == ref
    assert env["RLFLEET_DEFAULT_REDIS_URL"]["value"] == "redis://rl-rlfleet-redis.rlfleet.svc:6379/0"

    args = [a.replace("$(REDIS_PASSWORD)", password) for a in container["args"]]
    proc, port = start_rendered_redis(args, tmp_path, password=password)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis_client(port).ping()
        assert redis_client(port, password=password).ping()
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_named_secret_is_used_and_auth_can_be_turned_off(chart):
    container, env, secrets = parts(
        chart, {"redis": {"enabled": True, "auth": {"existingSecret": "mine", "passwordKey": "pw"}}}
    )
    assert not secrets, "nothing generated when a Secret is named"
    ref = {"secretKeyRef": {"name": "mine", "key": "pw"}}
    assert env["RLFLEET_DEFAULT_REDIS_PASSWORD"]["valueFrom"] == ref
    assert "--requirepass" in container["args"]

    container, env, secrets = parts(chart, {"redis": {"enabled": True, "auth": {"enabled": False}}})
    assert not secrets and "--requirepass" not in container["args"] and "env" not in container
    assert "RLFLEET_DEFAULT_REDIS_PASSWORD" not in env and "RLFLEET_DEFAULT_REDIS_URL" in env

    _, env, _ = parts(chart, {"redis": {"enabled": True}, "defaults": {"redis": False}})
    assert "RLFLEET_DEFAULT_REDIS_URL" not in env, "defaults.redis: false keeps runs off the in-chart Redis"


def test_upgrades_keep_the_generated_password(chart):
    """`helm upgrade` re-renders the Secret: the template reads the live one back (lookup) before it would make
    a new password. Offline (no cluster to look in) the SDK renders a fresh one each time, so this checks
    the template reads the Secret it renders, by name, before falling back to a random value."""
    template = (CHART / "templates" / "redis.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $secret' in template
    assert "randAlphaNum 32" in template.split("lookup", 1)[1]


def test_store_defaults_reach_the_operator_as_json(chart):
    store = {"uri": "s3://ckpt/runs", "endpointUrl": "http://minio:9000", "credentialsSecret": "s3"}
    _, env, _ = parts(chart, {"defaults": {"store": store}})

    assert json.loads(env["RLFLEET_DEFAULT_STORE"]["value"]) == store
    _, env, _ = parts(chart, {})
    assert "RLFLEET_DEFAULT_STORE" not in env and "RLFLEET_DEFAULT_REDIS_URL" not in env
    with pytest.raises(Exception, match="uri"):
        render(chart, {"defaults": {"store": {"uri": "file:///data"}}})
