"""Run rlfleet's images under podman on this machine: as root, without a daemon or a registry.

podman reads the settings in scripts/podman/ (runc, cgroupfs, ulimits, a storage root of its own),
the same ones scripts/images.sh builds with, so the images `make images` built are the ones found here.

- `run_container(image, ...)` starts one container: env, volumes, a network (`none`, `host`, or a
  network namespace `ns:/run/netns/NAME`), read-only root filesystem, no capabilities, no privilege
  escalation, the image's own (non-root) user unless told otherwise.
- `PodContainer.from_pod(...)` turns the container of a pod template the operator renders into
  such a run, as a kubelet would: ConfigMap and Secret volumes become read-only host directories
  holding their keys, emptyDirs fresh world-writable host directories, `valueFrom` env values (field,
  Secret key, CPU request) and
  `$(VAR)` references in the arguments are resolved (the images tests run rendered pods with it; the
  cluster in a box's container mode, tests/cluster/inabox/oci.py, uses `run_args` with the volumes
  and environment its kubelet resolved).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PODMAN_CONF = REPO / "scripts" / "podman"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CPU_IMAGE = f"ghcr.io/rlfleet/rlfleet:{VERSION}"
OPERATOR_IMAGE = f"ghcr.io/rlfleet/rlfleet-operator:{VERSION}"


def podman_env() -> dict[str, str]:
    """The environment podman runs with: this project's containers.conf and storage.conf."""
    return {
        **os.environ,
        "CONTAINERS_CONF": str(PODMAN_CONF / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(PODMAN_CONF / "storage.conf"),
    }


def podman(*args: str, timeout: float | None = 120, check: bool = True) -> subprocess.CompletedProcess:
    """`podman ARGS...` with this project's settings; stdout and stderr captured as text."""
    proc = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return proc


def unavailable(*images: str) -> str | None:
    """Why the images cannot be run here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "needs root: podman runs the images as root here (rootless podman is not set up)"
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman)"
    missing = [i for i in images if podman("image", "exists", i, check=False).returncode != 0]
    if missing:
        return f"image(s) not built: {', '.join(missing)} (make images)"
    return None


def require(*images: str) -> None:
    """Skip the calling test, with the reason, where the images cannot run here; fail instead under
    RLFLEET_IMAGES_REQUIRED=1 (.ci/run sets it after it built them), where they must run."""
    import pytest

    reason = unavailable(*images)
    if reason and os.environ.get("RLFLEET_IMAGES_REQUIRED") == "1" and os.geteuid() == 0:
        pytest.fail(f"RLFLEET_IMAGES_REQUIRED=1 but {reason}")
    if reason:
        pytest.skip(reason)


@dataclass(frozen=True)
class Volume:
    """A host directory or file mounted at `target` in the container."""

    host: Path
    target: str
    read_only: bool = False

    def arg(self) -> str:
        return f"{self.host}:{self.target}:{'ro' if self.read_only else 'rw'}"


def run_args(
    image: str,
    args: list[str] = (),
    *,
    entrypoint: list[str] | None = None,
    env: dict[str, str] | None = None,
    volumes: list[Volume] = (),
    network: str = "none",
    read_only: bool = True,
    user: str | None = None,
    workdir: str | None = None,
    name: str | None = None,
    cap_drop: bool = True,
    no_new_privileges: bool = True,
) -> list[str]:
    """The `podman run` arguments for one container (removed when it exits).

    A read-only root filesystem is as a pod's `readOnlyRootFilesystem: true`: no tmpfs on /tmp or
    /run either (podman adds them by default), so only the given volumes are writable. `cap_drop` and
    `no_new_privileges` are a pod's `capabilities.drop: [ALL]` and `allowPrivilegeEscalation: false`."""
    argv = ["run", "--rm", f"--network={network}"]
    if cap_drop:
        argv.append("--cap-drop=all")
    if no_new_privileges:
        argv.append("--security-opt=no-new-privileges")
    if read_only:
        argv += ["--read-only", "--read-only-tmpfs=false"]
    if user:
        argv.append(f"--user={user}")
    if workdir:
        argv.append(f"--workdir={workdir}")
    if name:
        argv.append(f"--name={name}")
    if entrypoint is not None:
        # podman takes the entrypoint as a JSON array; the rest of the command line follows the image.
        argv.append(f"--entrypoint={json.dumps(entrypoint)}")
    for key, value in (env or {}).items():
        argv.append(f"--env={key}={value}")
    argv += [f"--volume={v.arg()}" for v in volumes]
    return [*argv, image, *args]


def run_container(image: str, args: list[str] = (), *, timeout: float = 300, **options) -> subprocess.CompletedProcess:
    """Run one container to its end (see `run_args` for the options); its exit code is not checked."""
    return podman(*run_args(image, list(args), **options), timeout=timeout, check=False)


# ---- pods as containers --------------------------------------------------------------------------


@dataclass
class PodContainer:
    """The first container of a pod template, ready to run: image, command, env and volumes."""

    image: str
    command: list[str]
    env: dict[str, str]
    volumes: list[Volume] = field(default_factory=list)
    workdir: str | None = None

    @classmethod
    def from_pod(
        cls,
        template: dict,
        pod_name: str,
        root: Path,
        config_maps: dict[str, dict[str, str]],
        secrets: dict[str, dict[str, str]] | None = None,
        pod_index: int = 0,
    ) -> PodContainer:
        """Lay out the pod's volumes under `root` and resolve its env as a kubelet would.

        `config_maps` and `secrets` are the objects' `data` by name (secrets as plain text)."""
        secrets = secrets or {}
        spec = template["spec"]
        [container] = spec["containers"]
        fields = {"metadata.name": pod_name, "metadata.labels['apps.kubernetes.io/pod-index']": str(pod_index)}
        env: dict[str, str] = {}
        for ref in container.get("envFrom", []):
            env.update(secrets[ref["secretRef"]["name"]])
        for item in container.get("env", []):
            env[item["name"]] = _env_value(item, fields, secrets, env, container.get("resources") or {})
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        volumes = []
        for volume in spec.get("volumes", []):
            mount = mounts.get(volume["name"])
            if mount is None:
                continue
            host = root / volume["name"]
            host.mkdir(parents=True)
            read_only = mount.get("readOnly", False)
            if "emptyDir" in volume:
                host.chmod(0o777)  # as a kubelet creates an emptyDir: writable by the pod's user
            elif "configMap" in volume:
                _write_keys(host, config_maps[volume["configMap"]["name"]], volume["configMap"].get("items"))
                read_only = True
            elif "secret" in volume:
                _write_keys(host, secrets[volume["secret"]["secretName"]], volume["secret"].get("items"))
                read_only = True
            else:
                raise ValueError(f"volume {volume['name']}: only emptyDir, configMap and secret are supported")
            volumes.append(Volume(host, mount["mountPath"], read_only))
        command = [_expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
        return cls(container["image"], command, env, volumes, container.get("workingDir"))

    def run_args(self, network: str = "none", command: list[str] | None = None, **options) -> list[str]:
        """`podman run` arguments for this container (its own command unless `command` replaces it)."""
        command = command or self.command
        return run_args(
            self.image,
            command[1:],
            entrypoint=command[:1],
            env=self.env,
            volumes=self.volumes,
            network=network,
            workdir=self.workdir,
            **options,
        )

    def run(self, network: str = "none", command: list[str] | None = None, timeout: float = 300, **options):
        """Run the container to its end; the CompletedProcess (exit code not checked)."""
        return podman(*self.run_args(network, command, **options), timeout=timeout, check=False)


def _env_value(
    item: dict, fields: dict[str, str], secrets: dict[str, dict[str, str]], env: dict[str, str], resources: dict
) -> str:
    if "value" in item:
        return _expand(item["value"], env)
    source = item["valueFrom"]
    if "fieldRef" in source:
        return fields[source["fieldRef"]["fieldPath"]]
    if "resourceFieldRef" in source:  # requests.cpu / limits.cpu, whole CPUs (a kubelet rounds up)
        ref = source["resourceFieldRef"]
        kind, name = ref["resource"].split(".", 1)
        assert name == "cpu" and str(ref.get("divisor", "1")) == "1", f"env {item['name']}: only CPUs are resolved here"
        value = str((resources.get(kind) or {}).get(name, "0"))
        return str(math.ceil(float(value[:-1]) / 1000 if value.endswith("m") else float(value)))
    if "secretKeyRef" in source:
        return secrets[source["secretKeyRef"]["name"]][source["secretKeyRef"]["key"]]
    raise ValueError(f"env {item['name']}: unsupported valueFrom {sorted(source)}")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command, args and env values (a name it does not know stays)."""
    for key, value in env.items():
        text = text.replace(f"$({key})", value)
    return text


def _write_keys(directory: Path, data: dict[str, str], items: list[dict] | None) -> None:
    """A ConfigMap or Secret volume: one file per key (or per listed item, at its path)."""
    for item in items or [{"key": k, "path": k} for k in data]:
        path = directory / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data[item["key"]])
        path.chmod(0o644)
