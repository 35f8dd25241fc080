"""Kueue: a run queued as pod groups, the way Kueue's `pod` integration admits pods it has no job API for.

Kueue admits a custom resource through `spec.suspend` only with an integration built into Kueue (or a
controller built on its Go job framework); an RLRun has neither. What Kueue does support for pods made by
other controllers is the pod group: pods carrying the label `kueue.x-k8s.io/queue-name` (a LocalQueue) are
held by a scheduling gate until Kueue admits them; pods that also carry the label
`kueue.x-k8s.io/pod-group-name` and the annotation `kueue.x-k8s.io/pod-group-total-count`, consistently,
are admitted together, as one Workload named after the group, once that many exist.

So a queue-name label on an RLRun (or on an InferencePool or RelayTier, which otherwise take their run's)
reaches the pod templates the operator builds, with these groups:
    the run's own pods (trainer ranks, verifier, origin, ingest)   group <run>, size: their replicas
    a pool's workers                                               group <its workload's name>, size: replicas
    a tier's relays                                                group <its workload's name>, size: replicas
The run's own pods are one gang: a trainer without its verifier or origin cannot train. Pools and tiers
are admitted apart, so the quota of a big pool never holds back the trainer, and a pool's workers start
when its group fits. Invariants: the size counts the workload at full scale even while the run is
suspended or finished (no pod exists then; the template stays the same, so resuming rolls nothing);
only pod templates carry the labels, never the Deployments and StatefulSets, which Kueue's own
`deployment` and `statefulset` integrations would otherwise take over; changing a pool's replicas
changes its group size, so its pods roll and are admitted again as a group of the new size.
"""

from __future__ import annotations

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
GROUP_SIZE_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def queue_of(*label_sets: dict[str, str] | None) -> str | None:
    """The first queue name found in `label_sets` (the object's own labels, then its run's)."""
    for labels in label_sets:
        if labels and labels.get(QUEUE_LABEL):
            return labels[QUEUE_LABEL]
    return None


def grouped(children: list[dict], queue: str | None, group: str, size: int) -> list[dict]:
    """`children` with every workload's pod template in pod group `group` of `size` pods on `queue`
    (the templates' metadata replaced in place; unchanged without a queue)."""
    if not queue:
        return children
    for child in children:
        if child["kind"] not in WORKLOAD_KINDS:
            continue
        meta = child["spec"]["template"].setdefault("metadata", {})
        # new dicts: the builders share one labels dict between a workload and its pod template
        meta["labels"] = {**(meta.get("labels") or {}), QUEUE_LABEL: queue, GROUP_LABEL: group}
        meta["annotations"] = {**(meta.get("annotations") or {}), GROUP_SIZE_ANNOTATION: str(size)}
    return children
