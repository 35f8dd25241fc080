"""What both ways the kubelet starts a container (a process, kubelet.py; a podman container, oci.py) share:
the errors that keep a container waiting (CreateContainerConfigError, ErrImagePull), and Kubernetes' $(VAR) expansion of
command and args. It imports neither, so kubelet.py -> oci.py -> this module stays a tree."""

from __future__ import annotations

import re

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class ConfigError(Exception):
    """What keeps a container from starting until the cluster changes (CreateContainerConfigError)."""

    reason = "CreateContainerConfigError"


class ImageMissing(ConfigError):
    """An image the box has not got: ErrImagePull at the first try, then ImagePullBackOff, as a kubelet."""

    reason = "ErrImagePull"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; an unknown name stays as it is."""
    return _REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)
