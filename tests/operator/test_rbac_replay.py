"""Every API request the operator made during the operator tests, replayed against the RBAC the chart
renders (the real Helm SDK): a request the chart's Roles/ClusterRoles would deny fails the test.

The emulator records each request as RBAC sees it (verb, API group, resource/subresource, namespace,
name). This module sorts after the other operator tests, so with the whole directory it replays all
of their requests; on its own it first drives a run through what touches the most kinds (a Redis URL
Secret, an ingest, scaling, suspend, a TTL, deletion) so it never passes on an empty record.
"""

from __future__ import annotations

import pytest

from rlfleet.wire.streams import RunKeys, encode_json
from tests.operator.kubectl import apply_example, get, patch, redis_db, secret
from tests.operator.rbac import denied
from tests.support import CHART, redis_from_url, render_chart, wait_for


def _drive_a_run(api, redis_url) -> None:
    """A run through what touches the most kinds: its Redis URL from a Secret (progress shows in its status),
    an ingest, scaling, suspend, completion and its TTL (the operator deletes it)."""
    ns, url = "t-rbac", redis_db(redis_url, 12)
    secret(api, ns, "redis-auth", {"url": url})
    secret(api, ns, "worker-tokens", {"tokens.yaml": "w0: t0\n"})
    apply_example(api, ns, url, redis={"urlSecret": "redis-auth"}, ingest={"tokens": "worker-tokens"})
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    patch(api, "InferencePool", ns, "arithmetic-cpu", {"spec": {"replicas": 3}}, sub="scale")
    wait_for("scaled", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout")["spec"]["replicas"] == 3)
    patch(api, "RLRun", ns, "arithmetic", {"spec": {"suspend": True}})
    wait_for("suspended", lambda: get(api, "RLRun", ns, "arithmetic")["status"]["phase"] == "Suspended")
    client = redis_from_url(url)
    client.xadd(RunKeys("arithmetic").policy, encode_json({"version": 1}))
    client.close()
    wait_for(
        "progress read through the Secret's URL", lambda: get(api, "RLRun", ns, "arithmetic")["status"]["step"] == 1
    )
    patch(
        api,
        "RLRun",
        ns,
        "arithmetic",
        {"spec": {"suspend": False, "trainer": {"steps": 1}, "ttlSecondsAfterFinished": 0}},
    )
    wait_for("deleted after its TTL", lambda: get(api, "RLRun", ns, "arithmetic") is None, timeout=20)


@pytest.fixture(scope="module")
def chart():
    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def test_the_charts_rbac_allows_every_request_the_operator_made(api, emulator, redis_url, chart):
    """Bug: the operator read Secrets (spec.redis.urlSecret) but the chart granted no `get` on them."""
    _drive_a_run(api, redis_url)
    # the tests' own requests (kubectl's part, made with `requests`) are not the operator's
    operator_calls = [c for c in emulator.cluster.calls if not c.agent.startswith("python-requests")]
    made = {(c.verb, c.group, c.resource) for c in operator_calls}
    for expected in (
        ("get", "", "secrets"),
        ("patch", "apps", "statefulsets"),
        ("patch", "rlfleet.io", "rlruns/status"),
        ("list", "rlfleet.io", "relaytiers"),
        ("create", "", "events"),
        ("watch", "rlfleet.io", "rlruns"),
        ("delete", "rlfleet.io", "rlruns"),
        ("patch", "policy", "poddisruptionbudgets"),
    ):
        assert expected in made, f"the record lacks {expected}: the replay would prove little"
    objects = render_chart(chart, {})
    refused = sorted({(c.verb, c.group, c.resource, c.namespace is None) for c in denied(operator_calls, objects)})
    assert not refused, f"requests the chart's RBAC denies (verb, group, resource, cluster-wide): {refused}"
