"""tests/containers.py without podman: a rendered pod becomes the container a kubelet would start
(volumes laid out, env and `$(VAR)` resolved), and `podman run` gets a pod's restrictions."""

from __future__ import annotations

import json
import stat

from rlfleet.operator import names
from tests.containers import CPU_IMAGE, PodContainer, Volume, run_args
from tests.images.rendered import SECRETS, cluster_bundle, rendered_pods


def pod(tmp_path, suffix: str) -> PodContainer:
    pods, config_maps = rendered_pods(cluster_bundle("arithmetic"))
    [(name, template)] = [(n, t) for n, t in pods if n.endswith(suffix)]
    return PodContainer.from_pod(template, f"{name}-1", tmp_path, config_maps, SECRETS, pod_index=1)


def test_trainer_pod_gets_its_volumes_env_and_secrets(tmp_path):
    trainer = pod(tmp_path, "trainer")
    assert trainer.image == CPU_IMAGE and trainer.command[:2] == ["rlfleet", "trainer"]
    env = trainer.env
    assert env[names.ENV_POD_NAME] == "arithmetic-trainer-1" and env["GROUP_RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["RLFLEET_REDIS_URL"] == SECRETS["redis"][names.REDIS_URL_KEY]  # secretKeyRef
    assert env["AWS_SECRET_ACCESS_KEY"] == "secret"  # envFrom the store credentials
    assert env["RLFLEET_TORCH_THREADS"] == "1"  # its CPU request (resourceFieldRef)
    mounts = {v.target: v for v in trainer.volumes}
    assert set(mounts) == {names.CONFIG_DIR, names.CACHE_DIR, "/tmp", names.SIGNING_DIR}
    config = mounts[names.CONFIG_DIR]
    assert config.read_only and "kind: RLRun" in (config.host / names.CONFIG_FILE).read_text()
    assert (mounts[names.SIGNING_DIR].host / names.SIGNING_KEY).read_text() == SECRETS["signing"][names.SIGNING_KEY]
    assert not (mounts[names.SIGNING_DIR].host / names.PUBLIC_KEY).exists(), "only the listed item is mounted"
    cache = mounts[names.CACHE_DIR]
    assert not cache.read_only and stat.S_IMODE(cache.host.stat().st_mode) == 0o777


def test_pod_name_is_expanded_in_arguments(tmp_path):
    verifier = pod(tmp_path, "verifier")
    assert verifier.command[verifier.command.index("--consumer") + 1] == "arithmetic-verifier-1"
    assert not any("$(" in a for a in verifier.command)


def test_podman_run_gets_a_pods_restrictions(tmp_path):
    argv = pod(tmp_path, "origin").run_args(network="ns:/run/netns/origin")
    image_at = argv.index(CPU_IMAGE)
    options, command = argv[:image_at], argv[image_at + 1 :]
    assert {"--read-only", "--read-only-tmpfs=false", "--cap-drop=all", "--security-opt=no-new-privileges"} <= set(
        options
    )
    assert "--network=ns:/run/netns/origin" in options and "--rm" in options
    assert f"--entrypoint={json.dumps(['rlfleet'])}" in options and command[0] == "origin"
    assert f"--volume={tmp_path / 'config'}:{names.CONFIG_DIR}:ro" in options
    plain = run_args("img", ["x"], volumes=[Volume(tmp_path, "/data")], read_only=False, user="0")
    assert "--read-only" not in plain and "--user=0" in plain and f"--volume={tmp_path}:/data:rw" in plain
