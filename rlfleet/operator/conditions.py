"""Status helpers: conditions (a map keyed by type, whose transition time moves only when the status
does) and the selector string the scale subresource reads."""

from __future__ import annotations

from rlfleet.operator import names


def build_condition(
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
    previous: list[dict] | None = None,
) -> dict:
    """A condition; lastTransitionTime moves only when its status changes."""
    status = "True" if ok else "False"
    old = next((c for c in previous or [] if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def merge_conditions(previous: list[dict] | None, *new: dict) -> list[dict]:
    """Replace conditions of the same type, keep the others (status.conditions is a map keyed by type)."""
    types = {c["type"] for c in new}
    return [c for c in previous or [] if c.get("type") not in types] + list(new)


def workload_selector(child: dict) -> str:
    return names.selector_string(child["spec"]["selector"]["matchLabels"])
