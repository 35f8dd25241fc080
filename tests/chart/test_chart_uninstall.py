"""`helm uninstall`'s pre-delete hook (issue 28): a Job with the operator's image and service account that runs
`rlfleet operator-uninstall` for the release, over the namespaces the operator watches. What it does against an
API server and the operator is tested in tests/operator/test_one_apply.py and, in the box,
tests/cluster/test_one_apply.py."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.chart.test_chart import CHART, KUBE_VERSIONS, RELEASE, by_kind, render

helm = pytest.importorskip("helm_python")


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def test_the_hook_runs_the_uninstall_command_before_anything_is_deleted(chart):
    """Bug: no hook; Helm deleted the release's runs and the operator together, and the runs stayed on their
    finalizer."""
    values = {"operator": {"watchNamespaces": ["team-a", "team-b"]}, "uninstall": {"deleteRuns": "all"}}
    objects = render(chart, values)
    [job] = by_kind(objects, "Job")
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-delete"
    assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
    pod = job["spec"]["template"]["spec"]
    [operator] = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-operator")]
    operator_pod = operator["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == operator_pod["serviceAccountName"]
    [container] = pod["containers"]
    assert container["image"] == operator_pod["containers"][0]["image"]
    assert container["command"] == ["rlfleet", "operator-uninstall"]
    assert container["args"] == [
        f"--release={RELEASE}",
        "--delete-runs=all",
        "--timeout=240",
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] > 240, "the Job outlives the command's own timeout"

    assert not by_kind(render(chart, {"uninstall": {"enabled": False}}), "Job")
    with pytest.raises(Exception, match="deleteRuns"):
        render(chart, {"uninstall": {"deleteRuns": "some"}})
