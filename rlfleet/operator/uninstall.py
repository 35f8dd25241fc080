"""`rlfleet operator-uninstall`: the chart's pre-delete hook, so `helm uninstall` never leaves a run stuck.

Every RLRun holds the operator's finalizer (rlfleet.io/cleanup) until the operator has stopped its pods and
deleted its Redis keys. Helm deletes the runs it rendered (values `runs`) together with the operator's
Deployment; with the operator gone first, nothing ever removes the finalizer and the run stays, Terminating,
for good. The hook runs before Helm deletes anything, while the operator still runs:

  1. list the RLRuns in the operator's namespaces (`--namespace`, repeated; none: every namespace);
  2. the release's own (labels app.kubernetes.io/instance=RELEASE, app.kubernetes.io/managed-by=Helm) are
     to go; any other run is refused with `--delete-runs release` (exit 1, naming them, before anything is
     deleted: Helm stops the uninstall and the operator keeps running them) and goes too with `all`;
  3. delete those runs (their pools and tiers follow by owner references; neither holds a finalizer)
     and wait until the operator has let every one of them go; exit 2 naming those still there after
     `--timeout` seconds (an operator scaled to 0 never lets them go: scale it up, or delete them first).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import kubernetes

from rlfleet.operator import names
from rlfleet.operator.kube import request_timeout

BOUND = request_timeout(30.0)  # each API request of the hook: a hung API server fails it, never hangs it


def _key(run: dict) -> str:
    return f"{run['metadata']['namespace']}/{run['metadata']['name']}"


def list_runs(custom: kubernetes.client.CustomObjectsApi, namespaces: tuple[str, ...]) -> list[dict]:
    plural = names.RLRUN.plural
    if not namespaces:
        return (
            custom.list_cluster_custom_object(names.GROUP, names.VERSION, plural, _request_timeout=BOUND).get("items")
            or []
        )
    runs: list[dict] = []
    for ns in namespaces:
        listed = custom.list_namespaced_custom_object(names.GROUP, names.VERSION, ns, plural, _request_timeout=BOUND)
        runs += listed.get("items") or []
    return runs


def of_release(run: dict, release: str) -> bool:
    labels = run["metadata"].get("labels") or {}
    return labels.get("app.kubernetes.io/instance") == release and labels.get("app.kubernetes.io/managed-by") == "Helm"


def uninstall(
    client: kubernetes.client.ApiClient,
    release: str,
    namespaces: tuple[str, ...] = (),
    delete_runs: str = "release",
    timeout_s: float = 240.0,
    poll_s: float = 2.0,
    say: Callable[[str], None] = print,
) -> int:
    """The hook's work (module docstring); the exit status: 0 done, 1 refused, 2 runs left after the timeout."""
    custom = kubernetes.client.CustomObjectsApi(client)
    runs = list_runs(custom, namespaces)
    others = [r for r in runs if not of_release(r, release)]
    if others and delete_runs == "release":
        say(
            f"refusing to uninstall: {len(others)} RLRuns not rendered by release {release} still exist "
            f"({', '.join(sorted(map(_key, others)))}); without the operator they would stay stuck on their finalizer "
            "when deleted. Delete them first (kubectl delete rlruns --all -n NAMESPACE), or set "
            "uninstall.deleteRuns: all to let the uninstall delete them"
        )
        return 1
    doomed = {r["metadata"]["uid"]: r for r in runs if delete_runs == "all" or of_release(r, release)}
    for run in doomed.values():
        meta = run["metadata"]
        try:
            custom.delete_namespaced_custom_object(
                names.GROUP, names.VERSION, meta["namespace"], names.RLRUN.plural, meta["name"], _request_timeout=BOUND
            )
            say(f"deleted RLRun {_key(run)}")
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
    deadline = time.monotonic() + timeout_s
    while True:
        left = [r for r in list_runs(custom, namespaces) if r["metadata"]["uid"] in doomed]
        if not left:
            say(f"the operator let go of {len(doomed)} RLRuns")
            return 0
        if time.monotonic() >= deadline:
            say(
                f"after {timeout_s:.0f} s the operator has not let go of {', '.join(sorted(map(_key, left)))}: is it "
                "running (operator.replicas > 0)? Its log says why a run's cleanup waits"
            )
            return 2
        time.sleep(poll_s)
