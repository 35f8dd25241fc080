"""What is wrong with a run's pods, read from their status as the kubelet and the scheduler write it:
a pure function from Pod objects to named problems, each naming the pod and the container.

    Unschedulable              condition PodScheduled False, reason Unschedulable: the scheduler's message
    ErrImagePull / ImagePullBackOff / InvalidImageName
                               a container waits for its image: the image is named
    CreateContainerConfigError / CreateContainerError / RunContainerError
                               the container cannot be made (a missing Secret key, a bad command)
    OOMKilled                  the container was (last) terminated for exceeding its memory limit
    CrashLoopBackOff           the container keeps exiting: the last exit code
    RestartLimitExceeded       restartCount reached RESTART_LIMIT with none of the above showing now
A pod being deleted has no problems (it is going). Each container yields at most one problem, the first
of the list above that applies; the order of problems is the order of the pods, then of the containers.
"""

from __future__ import annotations

from dataclasses import dataclass

RESTART_LIMIT = 5  # restarts after which a container that runs again is still reported
PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")
CREATE_REASONS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
COMPONENT_LABEL = "app.kubernetes.io/component"


@dataclass(frozen=True)
class PodProblem:
    reason: str  # CamelCase, as in the table above
    pod: str
    container: str  # "" for a pod-level problem (Unschedulable)
    component: str  # the pod's app.kubernetes.io/component label (trainer, rollout, ...)
    detail: str

    def describe(self) -> str:
        where = f"pod {self.pod}" + (f" container {self.container}" if self.container else "")
        return f"{where}: {self.reason}: {self.detail}"


def _terminated_reason(status: dict) -> tuple[str | None, int | None]:
    """(reason, exit code) of the container's current or last termination."""
    for key in ("state", "lastState"):
        ended = (status.get(key) or {}).get("terminated")
        if ended:
            return ended.get("reason"), ended.get("exitCode")
    return None, None


def _container_problem(pod: str, component: str, status: dict) -> PodProblem | None:
    name, image = status.get("name", ""), status.get("image", "")
    waiting = (status.get("state") or {}).get("waiting") or {}
    reason, message = waiting.get("reason"), waiting.get("message") or ""
    restarts = int(status.get("restartCount") or 0)
    if reason in PULL_REASONS:
        return PodProblem(reason, pod, name, component, f"image {image!r} cannot be pulled" + _tail(message))
    if reason in CREATE_REASONS:
        return PodProblem(reason, pod, name, component, message or "the container cannot be created")
    ended, code = _terminated_reason(status)
    if ended == "OOMKilled":
        return PodProblem(
            "OOMKilled", pod, name, component, f"killed for exceeding its memory limit ({restarts} restarts)"
        )
    if reason == "CrashLoopBackOff":
        return PodProblem(
            reason, pod, name, component, f"exited with code {code} ({restarts} restarts)" + _tail(message)
        )
    if restarts >= RESTART_LIMIT:
        return PodProblem(
            "RestartLimitExceeded", pod, name, component, f"restarted {restarts} times (last exit code {code})"
        )
    return None


def _tail(message: str) -> str:
    return f": {message}" if message else ""


def pod_problems(pods: list[dict]) -> list[PodProblem]:
    """Every problem of `pods` (Pod objects as the API returns them), in pod then container order."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        name, component = meta.get("name", ""), (meta.get("labels") or {}).get(COMPONENT_LABEL, "")
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                if cond.get("reason") == "Unschedulable":
                    out.append(PodProblem("Unschedulable", name, "", component, cond.get("message") or "no node fits"))
        for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            problem = _container_problem(name, component, container)
            if problem:
                out.append(problem)
    return out


def summary(problems: list[PodProblem], limit: int = 1000) -> str:
    """One message for a condition: every problem described, cut at `limit` characters."""
    text = "; ".join(p.describe() for p in problems)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def described(condition: dict) -> list[tuple[str, str]]:
    """(reason, description) of each problem a PodsHealthy condition names (what `summary` wrote)."""
    if condition.get("status") != "False":
        return []
    parts = [m for m in (condition.get("message") or "").split("; ") if m.count(": ") >= 2]
    return [(m.split(": ", 2)[1], m) for m in parts]
