"""The chart's Redis with ACL users per role (issue 16 item 6): rendered by the real Helm SDK, valid for
Kubernetes, and the rendered redis-server arguments run on a real redis-server with the same grants as
`rlfleet run`'s (rlfleet/wire/redis_acl.py)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import redis

from rlfleet.wire.redis_acl import role_rules
from rlfleet.wire.streams import RunKeys
from tests.chart.test_chart import KUBE_VERSIONS, by_kind, render
from tests.support import redis_client, start_rendered_redis

helm = pytest.importorskip("helm_python")

USERS = [
    {"name": "arithmetic-worker", "role": "worker", "run": "arithmetic"},
    {"name": "arithmetic-reader", "role": "reader", "run": "arithmetic"},
    {"name": "arithmetic-verifier", "role": "verifier", "run": "arithmetic"},
]
VALUES = {
    "redis": {
        "enabled": True,
        "auth": {"existingSecret": "redis-pw"},
        "acl": {"existingSecret": "redis-users", "users": USERS},
    }
}


def redis_container(chart, values: dict) -> dict:
    objects = render(chart, values)
    [deploy] = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-redis")]
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(deploy, version, strict=True)
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def chart():
    from tests.chart.test_chart import CHART

    with helm.Chart.load(CHART) as loaded:
        yield loaded


def test_each_user_gets_its_roles_rules_and_its_password_from_the_secret(chart):
    c = redis_container(chart, VALUES)
    args = c["args"]
    for i, u in enumerate(USERS):
        start = args.index(u["name"]) - 1
        rules = role_rules(u["role"], RunKeys(u["run"])).split(" ")
        assert args[start : start + 4 + len(rules)] == [
            "--user",
            u["name"],
            "on",
            f">$(RLFLEET_ACL_PASSWORD_{i})",
            *rules,
        ]
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
        assert env[f"RLFLEET_ACL_PASSWORD_{i}"] == {"name": "redis-users", "key": u["name"]}


def test_acl_users_need_a_password_for_the_default_user(chart):
    with pytest.raises(Exception, match="redis.auth.enabled or redis.auth.existingSecret"):
        render(
            chart,
            {"redis": {"enabled": True, "auth": {"enabled": False}, "acl": {"existingSecret": "x", "users": USERS}}},
        )
    # the generated password (the default) is one
    render(chart, {"redis": {"enabled": True, "acl": {"existingSecret": "x", "users": USERS}}})


def test_the_rendered_arguments_give_a_real_redis_the_roles(chart, tmp_path):
    """What the container runs, with the Secret's values substituted as Kubernetes does."""
    c = redis_container(chart, VALUES)
    passwords = {"REDIS_PASSWORD": "admin-pw", **{f"RLFLEET_ACL_PASSWORD_{i}": f"pw{i}" for i in range(len(USERS))}}
    args = list(c["args"])
    for name, value in passwords.items():
        args = [a.replace(f"$({name})", value) for a in args]
    proc, port = start_rendered_redis(args, tmp_path, username="arithmetic-worker", password="pw0")
    try:
        keys = RunKeys("arithmetic")
        worker = redis_client(port, username="arithmetic-worker", password="pw0")
        assert worker.xadd(keys.rollouts, {b"m": b"group"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.xadd(keys.verified, {b"m": b"forged"})
        assert redis_client(port, username="arithmetic-reader", password="pw1").xlen(keys.rollouts) == 1
        assert redis_client(port, password="admin-pw").ping()  # the default user: the operator's
    finally:
        proc.terminate()
        proc.wait(10)
