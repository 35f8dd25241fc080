"""A pool's workers download from its run's top relay tier, and `kubectl apply -f rlrun.yaml` creates the pool
before the tier: the pool is first built pointing at the origin. A tier's creation re-applies its run's pools at
once (rlfleet/operator/handlers.py tier_changed), so the workers are replaced before they have loaded a model
rather than restarted on the run's next timer.

This module runs its own emulator and operator with a resync interval far longer than the test, so only the
tier's own handler can have repointed the pool.
"""

from __future__ import annotations

import pytest

from tests.operator.cluster import EmulatedCluster
from tests.operator.conftest import operator_process
from tests.operator.kubectl import SIGNING_SECRET, create, example, get, secret
from tests.support import wait_for

NO_TIMER_S = "3600"  # the run's timer never fires while these tests run


@pytest.fixture(scope="module")
def untimed_api(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("relay-order")
    with EmulatedCluster() as emulated:
        with operator_process(emulated.kubeconfig(workdir / "kubeconfig"), workdir / "operator.log", NO_TIMER_S):
            yield emulated.url


def rollout_sources(api: str, ns: str) -> list[str] | None:
    """The --relay-url arguments of pool arithmetic-cpu's rollout Deployment; None before it exists."""
    body = get(api, "Deployment", ns, "arithmetic-cpu-rollout")
    if body is None:
        return None
    args = body["spec"]["template"]["spec"]["containers"][0]["args"]
    return [args[i + 1] for i, a in enumerate(args) if a == "--relay-url"]


def test_tiers_applied_after_their_pool_repoint_the_pool_at_once(untimed_api, redis_url):
    api, ns = untimed_api, "t-relay-order"
    run, pool, tier0 = example(redis_url)
    assert (run["kind"], pool["kind"], tier0["kind"]) == ("RLRun", "InferencePool", "RelayTier")
    secret(api, ns, "arithmetic-signing", SIGNING_SECRET)
    create(api, ns, run)
    create(api, ns, pool)
    origin = f"http://arithmetic-origin.{ns}.svc:8080"
    wait_for("the pool on the origin (no tier yet)", lambda: rollout_sources(api, ns) == [origin], 30)

    create(api, ns, tier0)
    tier0_url = f"http://arithmetic-tier0-relay.{ns}.svc:8080"
    wait_for("the pool on tier 0", lambda: rollout_sources(api, ns) == [tier0_url], 30)

    # a tier above it: the pool moves to the new top tier, which pulls from tier 0
    tier1 = {**tier0, "metadata": {"name": "arithmetic-tier1"}, "spec": {**tier0["spec"], "tier": 1}}
    create(api, ns, tier1)
    tier1_url = f"http://arithmetic-tier1-relay.{ns}.svc:8080"
    wait_for("the pool on tier 1", lambda: rollout_sources(api, ns) == [tier1_url], 30)
    relay1 = wait_for("tier 1's relay", lambda: get(api, "Deployment", ns, "arithmetic-tier1-relay"), 30)
    assert tier0_url in relay1["spec"]["template"]["spec"]["containers"][0]["args"]
