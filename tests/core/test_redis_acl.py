"""Redis ACL users per role (issue 16 item 6), against a real redis-server: what `rlfleet run` gives its
embedded Redis and each component. A worker may add to its run's inbox and read the policy stream and
the trainer's demand, nothing else; each role's grants are enough for the component's real code
(tests/toploc/test_gate_acl.py)."""

from __future__ import annotations

import pytest
import redis

from rlfleet.config import parse_bundle
from rlfleet.local.plan import plan, redis_env
from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.wire.redis_acl import ADMIN, ROLES, RunAcl, chart_roles, user_name
from rlfleet.wire.streams import RunKeys
from tests.runs import extended, pool
from tests.support import REPO, redis_from_url


@pytest.fixture
def served(tmp_path):
    acl = RunAcl.generate("r")
    server = EmbeddedRedis(tmp_path / "redis", acl=acl.acl_file(), auth=(user_name(ADMIN, "r"), acl.passwords[ADMIN]))
    with server:
        clients = {role: redis_from_url(acl.url(server.base_url, role)) for role in [ADMIN, *ROLES]}
        yield server, clients
        for c in clients.values():
            c.close()


def denied(call) -> bool:
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_only_the_trainer_retires_prompts_and_a_worker_reads_them(served):
    _, c = served
    keys = RunKeys("r")
    assert c["trainer"].rpush(keys.retired_prompts, "k1") == 1
    assert c["reader"].lrange(keys.retired_prompts, 0, -1) == [b"k1"]
    for role in ("worker", "reader", "tickets", "verifier", "ingest"):
        assert denied(lambda: c[role].rpush(keys.retired_prompts, "forged")), role
    assert denied(lambda: c["reader"].lrange(RunKeys("other").retired_prompts, 0, -1))


def test_a_worker_can_add_to_its_inbox_and_read_the_policy_stream_only(served):
    server, c = served
    keys, other = RunKeys("r"), RunKeys("other")
    w, read, tickets = c["worker"], c["reader"], c["tickets"]  # a worker's three users
    assert w.xadd(keys.rollouts, {b"m": b"group"}) and w.xlen(keys.rollouts) == 1
    c["trainer"].xadd(keys.policy, {b"m": b"{}"})
    assert read.xrevrange(keys.policy, count=1) and read.xread({keys.policy: "0"}) and read.xlen(keys.rollouts) == 1
    assert tickets.hincrby(keys.tickets, "w1", 1) == 1
    c["trainer"].hset(keys.demand, mapping={"oldest": 3, "need": 2})
    assert read.hmget(keys.demand, ["oldest", "need"]) == [b"3", b"2"] and read.xlen(keys.verified) == 0
    for user in (w, read, tickets):
        for forbidden in (
            lambda: user.xadd(keys.verified, {b"m": b"forged"}),  # skip the gate
            lambda: user.xadd(keys.rejected, {b"m": b"x"}),
            lambda: user.xadd(keys.policy, {b"m": b'{"version": 1000000}'}),  # a fake version stalls the run
            lambda: user.hincrby(keys.policy, "x", 1),
            lambda: user.hincrby(keys.workers, "victim|rejected", 5),  # blame a victim
            lambda: user.hset(keys.banned, "victim", "{}"),
            lambda: user.zadd(keys.trained, {"d": 1}),
            lambda: user.hset(keys.demand, "oldest", 10**6),  # every other worker would pause for good
            lambda: user.xrange(keys.verified),
            lambda: user.xreadgroup("verifiers", "w", {keys.rollouts: ">"}),  # take others' groups
            lambda: user.xdel(keys.rollouts, "0-1"),
            lambda: user.hset(keys.seen, "x", "1"),
            lambda: user.xadd(other.rollouts, {b"m": b"group"}),  # another run
            lambda: user.keys("*"),
            lambda: user.flushall(),
        ):
            assert denied(forbidden)
    assert denied(lambda: read.xadd(keys.rollouts, {b"m": b"group"}))  # a pool behind an ingest only reads
    assert denied(lambda: tickets.xadd(keys.tickets, {b"m": b"x"}))
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis_from_url(server.base_url).ping()  # the default user is off


def test_roles_keep_to_their_part_of_the_run(served):
    _, c = served
    keys = RunKeys("r")
    assert denied(lambda: c["trainer"].xadd(keys.rollouts, {b"m": b"x"}))
    assert denied(lambda: c["trainer"].hset(keys.banned, "w", "{}"))
    assert denied(lambda: c["verifier"].zadd(keys.trained, {"d": 1}))
    assert denied(lambda: c["ingest"].xadd(keys.verified, {b"m": b"x"}))
    assert denied(lambda: c["ingest"].hincrby(keys.workers, "w|accepted", 1))
    assert c[ADMIN].delete(*keys.all()) == 0 and denied(lambda: c[ADMIN].get("rlfleet:other:stats"))


def test_rlfleet_run_gives_each_component_its_role(tmp_path):
    remote = pool("remote", "arithmetic", replicas=1, ingestUrl="https://ingest.example.org")
    bundle = parse_bundle(extended((REPO / "examples" / "arithmetic" / "rlrun.yaml").read_text(), remote))
    acl = RunAcl.generate("arithmetic")

    def users(c) -> dict[str, str]:
        urls = redis_env(c, bundle, acl, "redis://h:1/0")
        return {k: v.split("@")[0].split(":")[1].removeprefix("//") if v else "" for k, v in urls.items()}

    got = {c.name: users(c) for c in plan(bundle, tmp_path / "rlrun.yaml", tmp_path)}
    url, read, tickets = "RLFLEET_REDIS_URL", "RLFLEET_REDIS_READ_URL", "RLFLEET_REDIS_TICKETS_URL"
    worker = {url: "arithmetic-worker", read: "arithmetic-reader", tickets: "arithmetic-tickets"}
    assert got == {
        "origin": {url: "arithmetic-reader"},
        "relay/arithmetic-tier0-0": {url: "arithmetic-reader"},
        "verifier/0": {url: "arithmetic-verifier"},
        "rollout/arithmetic-cpu-0": worker,
        "rollout/arithmetic-cpu-1": worker,
        "rollout/remote-0": {url: ""},  # behind an ingest: no Redis at all
        "trainer": {url: "arithmetic-trainer"},
    }


def test_the_charts_acl_roles_are_the_generated_ones():
    chart = REPO / "charts" / "rlfleet" / "files" / "redis-acl-roles.yaml"
    assert chart.read_text() == chart_roles(), (
        "regenerate: python -m rlfleet.wire.redis_acl > charts/rlfleet/files/redis-acl-roles.yaml"
    )
