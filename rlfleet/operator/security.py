"""The security of every pod the operator builds for a run (trainer, origin, verifier, ingest, rollout
workers, relays), and where such a pod may write.

Hardened by default, as restricted Pod Security asks and more:
- pod: non-root, the runtime's seccomp profile, and no service account token mounted: no run component
  calls the Kubernetes API (only rlfleet.operator imports the client; an import contract in
  pyproject.toml keeps it so), so a compromised pod holds no credential for it;
- container: no privilege escalation, every capability dropped, and a read-only root filesystem.
A cluster overrides both contexts (the chart's `runPods.podSecurityContext` and
`runPods.securityContext`, handed to the operator as JSON in RLFLEET_POD_SECURITY_CONTEXT and
RLFLEET_CONTAINER_SECURITY_CONTEXT); a component's `podTemplate` is merged over them as over the rest.

With the root filesystem read-only, a process writes only to its volumes: the cache emptyDir at
names.CACHE_DIR (models, checkpoints, the images' TMPDIR, HF_HOME and XDG_CACHE_HOME) and an emptyDir on
/tmp (libraries that write there whatever TMPDIR says, and images other than ours that set no TMPDIR).
HOME points into the cache volume, so what lands under ~ (Triton's kernel cache ~/.triton, vLLM's
~/.config/vllm usage file, torch's ~/.cache) lands on a volume too.
"""

from __future__ import annotations

import json

from rlfleet.operator import names

POD_SECURITY_CONTEXT = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
HOME_DIR = f"{names.CACHE_DIR}/home"
TMP_VOLUME = {"name": "tmp", "emptyDir": {}}
TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}


def writable_env() -> list[dict]:
    """HOME on the cache volume (module docstring)."""
    return [{"name": "HOME", "value": HOME_DIR}]


def context_from_json(variable: str, text: str | None, default: dict) -> dict:
    """A security context given as a JSON object in environment variable `variable` (`default` when unset);
    anything but a JSON object is an error naming the variable."""
    if text is None:
        return default
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"environment variable {variable} must be a JSON object (a securityContext): {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"environment variable {variable} must be a JSON object (a securityContext), not {text!r}")
    return value
