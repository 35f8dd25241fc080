"""Container mode of the pod runner: a pod's container is a podman container of the image it names, as a
kubelet's runtime would start it, where that image is on this machine (`make images` builds the
project's). The kubelet (kubelet.py) lays out the volumes and resolves the environment exactly as in
process mode; this module only turns them into one `podman run`:

- the image's own entrypoint, command, environment, working directory and user, except where the pod
  says otherwise (`command` replaces the entrypoint and drops the image's command, `args` replace the
  command, `env` adds to the image's, `workingDir`, `runAsUser` / `runAsGroup`);
- the pod's network namespace (`--network ns:/run/netns/NS`: its IP on the cluster's bridge), its host
  name, and its hosts file bound on /etc/hosts (the runner rewrites that file in place as Services
  change, so a running container sees new names, as with cluster DNS);
- every volume bound at its mountPath (read-only where the pod or the volume kind says so);
- the container's securityContext: `readOnlyRootFilesystem` (no tmpfs added on /tmp or /run either),
  `capabilities.drop: [ALL]`, `allowPrivilegeEscalation: false`; `runAsNonRoot` refuses an image whose
  user is root, as a kubelet does.
The `podman run` process is the pod's process: its exit code is the container's, signals reach the
container through `podman kill`. Every container carries the label `io.rlfleet.inabox=<runner>`, so
`remove_all` removes whatever a runner left behind however it stopped.
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

from tests.containers import Volume, podman, podman_env, run_args

from .container_config import ConfigError, expand

LABEL = "io.rlfleet.inabox"


@functools.cache
def image_user(image: str) -> str | None:
    """The USER of a local image ('' for root), or None when podman has no such image here."""
    found = podman("image", "inspect", "--format", "{{.Config.User}}", image, check=False)
    return found.stdout.strip() if found.returncode == 0 else None


def is_local(image: str) -> bool:
    return image_user(image) is not None


def _is_root(user: str | int | None) -> bool:
    return str(user if user is not None else "").split(":", 1)[0] in ("", "0", "root")


def container_name(runner: str, pod, restarts: int) -> str:
    return f"inabox-{runner}-{pod.namespace}-{pod.name}-{pod.uid[:8]}-{restarts}"


def run_argv(pod, runner: str, env: dict[str, str], mounts: list[dict], hosts_file: Path) -> list[str]:
    """The `podman run` arguments of the pod's container now (see the module docstring)."""
    container = pod.container
    security = {**(pod.spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    user = None
    if "runAsUser" in security:
        user = f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}"
    if security.get("runAsNonRoot") and _is_root(user if user is not None else image_user(container["image"])):
        raise ConfigError("container has runAsNonRoot and image will run as root")
    command = [expand(a, env) for a in container.get("command") or []]
    args = [expand(a, env) for a in container.get("args") or []]
    volumes = [Volume(Path(m["source"]), m["target"], m["readOnly"]) for m in mounts]
    argv = run_args(
        container["image"],
        args,
        entrypoint=command or None,
        env=env,
        volumes=[*volumes, Volume(hosts_file, "/etc/hosts", read_only=True)],
        network=f"ns:/run/netns/{pod.host.netns}",
        read_only=bool(security.get("readOnlyRootFilesystem")),
        user=user,
        workdir=container.get("workingDir"),
        name=container_name(runner, pod, pod.restarts),
        cap_drop="ALL" in ((security.get("capabilities") or {}).get("drop") or []),
        no_new_privileges=security.get("allowPrivilegeEscalation") is False,
    )
    # podman would write its own /etc/hosts and take the host name from the name; the pod's are bound.
    options = ["--no-hosts", f"--hostname={pod.name}", f"--label={LABEL}={runner}", "--pull=never"]
    return [argv[0], *options, *argv[1:]]


def popen(argv: list[str], log) -> subprocess.Popen:
    """`podman run ARGV` in a session of its own, its output to the pod's log."""
    return subprocess.Popen(
        ["podman", *argv], env=podman_env(), stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
    )


def kill(name: str, signal: int) -> bool:
    """Send `signal` to the container's first process; False when there is no such container (yet)."""
    return podman("kill", f"--signal={signal}", name, check=False, timeout=30).returncode == 0


def main_pid(name: str) -> int:
    """The host pid of the container's first process (the program the pod runs)."""
    inspected = json.loads(podman("container", "inspect", name).stdout)
    return int(inspected[0]["State"]["Pid"])


def remove_all(runner: str) -> None:
    """Remove every container of `runner`, running or not."""
    ids = podman("ps", "--all", "--quiet", f"--filter=label={LABEL}={runner}", check=False).stdout.split()
    if ids:
        podman("rm", "--force", "--time=0", *ids, check=False, timeout=120)
