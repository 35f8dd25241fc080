"""A component's `podTemplate` override merged into the pod template the operator built (pure).

The rules are those of Kubernetes' strategic merge patch for the lists a pod has, so an override reads
the way `kubectl patch` users expect:
  - maps merge key by key; a scalar or a list in the override replaces the built one; `null` removes;
  - lists of named things merge by their key: containers, initContainers, ephemeralContainers,
    volumes, env, imagePullSecrets and resourceClaims by `name`, volumeMounts and volumeDevices by
    `mountPath`/`devicePath`, ports by `containerPort`; an element whose key matches merges into the
    built one (so `containers: [{name: rollout, resources: ...}]` amends the main container), others are
    appended (sidecars, extra volumes such as /dev/shm);
  - any other list (tolerations, args, command...) replaces the built one.
The operator's own fields win nowhere: what the user writes is what the pod gets, including fields
that break it (a changed `command`); the API server still validates the result.
"""

from __future__ import annotations

import copy

MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
}


def _merge_list(built: list, override: list, key: str) -> list:
    out = copy.deepcopy(built)
    index = {item.get(key): i for i, item in enumerate(out) if isinstance(item, dict)}
    for item in override:
        if isinstance(item, dict) and item.get(key) in index:
            i = index[item[key]]
            out[i] = merge(out[i], item)
        else:
            out.append(copy.deepcopy(item))
    return out


def merge(built: dict, override: dict) -> dict:
    """`override` merged into `built` (neither is changed), by the rules in the module docstring."""
    out = copy.deepcopy(built)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list) and key in MERGE_KEYS:
            out[key] = _merge_list(out[key], value, MERGE_KEYS[key])
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_pod_template(built: dict, override: dict) -> dict:
    """A pod template with a component's podTemplate (a PodTemplateSpec fragment) merged in."""
    return merge(built, override)
