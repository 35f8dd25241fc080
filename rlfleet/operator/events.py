"""Kubernetes Events the operator posts (core/v1, what `kubectl describe` and `kubectl get events` show):
Normal for children it created and phase changes, Warning for what a user must act on. Pure builder;
the reconciler posts an Event when something changes, never on every resync."""

from __future__ import annotations

import datetime

from rlfleet.operator import names
from rlfleet.operator.lifecycle import timestamp


def build_event(body: dict, type_: str, reason: str, message: str, now: datetime.datetime) -> dict:
    """An Event about the custom resource `body` (as the API returns it)."""
    meta = body["metadata"]
    at = timestamp(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": body.get("apiVersion", names.API_VERSION),
            "kind": body["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": names.FIELD_MANAGER},
        "reportingComponent": names.FIELD_MANAGER,
        "firstTimestamp": at,
        "lastTimestamp": at,
        "count": 1,
    }
