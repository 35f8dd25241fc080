"""spec.model.path from every source (rlfleet/models/sources.py): a local directory, s3:// (moto's server over
HTTP) and hf:// (tests/hub_server.py, a local server speaking the hub's file API), each resolved and cached, and
every way each can fail as one clear error naming spec.model.path and the fix."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import requests

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.config.model import ModelSpec
from rlfleet.config.tasks import ArithmeticTaskSpec
from rlfleet.models.sources import ModelSourceError, local_model_path, resolve_model_path
from rlfleet.wire.ports import free_port
from tests.hub_server import Hub
from tests.runs import bundle_yaml, pool, rlrun, write_rlrun
from tests.support import serving_hub, tiny_policy_dir, wait_for

TASK = ArithmeticTaskSpec(type="arithmetic")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_policy_dir(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture
def hub(model_dir, tmp_path, monkeypatch):
    """The hub serving acme/tiny (the tiny model) and acme/tokenizer-only (no config.json, no weights); HF_ENDPOINT
    points at it and HF_HOME at an empty cache."""
    hub = Hub()
    hub.add("acme/tiny", model_dir)
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(model_dir / "tokenizer.json", partial)
    hub.add("acme/tokenizer-only", partial)
    with serving_hub(hub, tmp_path / "hf", monkeypatch):
        yield hub


def resolve(path: str, **kwargs):
    return resolve_model_path(ModelSpec(path=path), TASK, **kwargs)


def test_a_local_directory_is_used_as_it_is(model_dir):
    assert resolve(str(model_dir)) == model_dir
    assert local_model_path(ModelSpec(path=str(model_dir)), TASK) == model_dir


def test_a_hub_model_is_downloaded_once_and_then_read_from_the_cache(hub, model_dir, monkeypatch):
    path = resolve("hf://acme/tiny", caller="trainer")
    assert (path / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    downloads = [r for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]]
    assert len(downloads) == 5, hub.requests  # config, generation config, weights, tokenizer and its config
    assert all("rlfleet/trainer" in r["agent"] for r in hub.requests if r["path"] != "/healthz")

    commit = hub.repos["acme/tiny"].commit
    before = len(hub.requests)
    assert resolve(f"hf://acme/tiny@{commit}") == path
    assert hub.requests[before:] == [], "a commit already in the cache is never asked for again"

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read when resolving, not when huggingface_hub was imported
    assert resolve("hf://acme/tiny") == path
    assert hub.requests[before:] == []


@pytest.mark.parametrize(
    "path, message",
    [
        ("hf://acme/nope", r"spec.model.path: 'hf://acme/nope': no repository acme/nope at http://127\.0\.0\.1:\d+ "),
        ("hf://acme/tiny@v9", r"acme/tiny has no revision 'v9' at .*; use an existing branch, tag or commit"),
        (
            "hf://acme/tokenizer-only",
            r"'hf://acme/tokenizer-only' is not an HF model: no config.json and no weights \(\*\.safetensors",
        ),
    ],
)
def test_a_hub_model_that_cannot_be_had_is_one_clear_error(hub, path, message):
    with pytest.raises(ModelSourceError, match=message):
        resolve(path)


def test_offline_with_nothing_cached_and_an_unreachable_hub_are_clear_errors(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match=r"HF_HUB_OFFLINE is set and acme/tiny@main is not in the cache"):
        resolve("hf://acme/tiny")
    assert [r for r in hub.requests if r["path"] != "/healthz"] == [], "offline asks the hub nothing"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(ModelSourceError, match=r"cannot reach the hub at http://127.0.0.1:\d+ .* check the network"):
        resolve("hf://acme/tiny")


def upload(client, bucket: str, prefix: str, directory) -> None:
    for file in sorted(directory.iterdir()):
        client.upload_file(str(file), bucket, f"{prefix}/{file.name}")


def test_an_s3_model_is_downloaded_once_and_cached_by_content(s3_bucket, model_dir, tmp_path, monkeypatch):
    client, name = s3_bucket
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "cache"))
    upload(client, name, "tiny", model_dir)
    path = resolve(f"s3://{name}/tiny")
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in model_dir.iterdir())
    assert (path / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert local_model_path(ModelSpec(path=f"s3://{name}/tiny"), TASK) is None, "a worker never fetches it"

    (path / "marker").write_text("the cached copy")  # the same content resolves to the same copy
    assert resolve(f"s3://{name}/tiny/") == path and (path / "marker").exists()
    client.put_object(Bucket=name, Key="tiny/config.json", Body=(model_dir / "config.json").read_bytes() + b" ")
    changed = resolve(f"s3://{name}/tiny")
    assert changed != path and (changed / "config.json").read_bytes().endswith(b" "), "a changed object, a new copy"
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, changed.name]), "no temporary left"


def test_an_s3_model_that_cannot_be_had_is_one_clear_error(s3_bucket, model_dir, tmp_path, monkeypatch):
    client, name = s3_bucket
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelSourceError, match=rf"no objects under 's3://{name}/missing' at http.*aws s3 sync"):
        resolve(f"s3://{name}/missing")
    with pytest.raises(ModelSourceError, match=r"cannot read 's3://no-such-bucket-x/m' .*\(NoSuchBucket\); create"):
        resolve("s3://no-such-bucket-x/m")
    client.upload_file(str(model_dir / "config.json"), name, "noweights/config.json")
    with pytest.raises(ModelSourceError, match=r"is not an HF model: no weights"):
        resolve(f"s3://{name}/noweights")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ModelSourceError, match=r"cannot list .* check spec.model.endpointUrl"):
        resolve(f"s3://{name}/tiny", store_endpoint=None)


def test_the_model_endpoint_then_the_store_endpoint_then_the_environment(s3_bucket, model_dir, tmp_path, monkeypatch):
    client, name = s3_bucket
    endpoint = client.meta.endpoint_url
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "cache"))
    upload(client, name, "tiny", model_dir)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # unreachable: must not be used
    assert resolve(f"s3://{name}/tiny", store_endpoint=endpoint).is_dir()
    spec = ModelSpec(path=f"s3://{name}/tiny", endpointUrl=endpoint)
    assert resolve_model_path(spec, TASK, store_endpoint="http://127.0.0.1:9").is_dir()


def test_a_missing_directory_says_how_to_name_a_hub_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=r"'Qwen/Qwen2.5-0.5B' is no directory .*write hf://Qwen/Qwen2.5-0.5B"):
        resolve("Qwen/Qwen2.5-0.5B")


@pytest.mark.parametrize(
    "path, message",
    [
        ("s3://bucket-only", r"'s3://bucket-only' must be s3://bucket/prefix"),
        ("hf://no-org", r"'hf://no-org' must be hf://ORG/NAME or hf://ORG/NAME@REVISION"),
        ("hf://a/b@x@y", r"'hf://a/b@x@y' must be hf://ORG/NAME"),
        (
            "gs://bucket/m",
            r"'gs://bucket/m': unknown scheme gs://; use builtin://NAME, s3://bucket/prefix, hf://ORG/NAME",
        ),
    ],
)
def test_rlfleet_validate_checks_the_source_syntax(tmp_path, path, message):
    with pytest.raises(ConfigError, match=rf"spec.model: .*path: {message}"):
        parse_bundle(bundle_yaml(rlrun(model=path), pool()))
    config = write_rlrun(tmp_path / "run.yaml", rlrun(model=path), pool())
    done = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "validate", str(config)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "spec.model" in done.stderr and path in done.stderr


def test_lora_over_a_model_workers_never_fetch_is_refused():
    with pytest.raises(ConfigError, match=r"spec: .*model.path: 'hf://acme/tiny' with trainer.lora: workers apply"):
        parse_bundle(bundle_yaml(rlrun(model="hf://acme/tiny", trainer={"lora": {"rank": 4}}), pool()))


def test_rlfleet_run_of_a_model_that_cannot_be_had_stops_before_anything_starts(hub, tmp_path):
    config = write_rlrun(tmp_path / "run.yaml", rlrun(model="hf://acme/nope"), pool(replicas=1))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{config}: spec.model.path: 'hf://acme/nope': no repository acme/nope" in done.stderr
    assert (run_dir / "rlrun.yaml").read_text() == config.read_text(), "the run's config is kept"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [], "no component was started"


def test_the_trainer_records_a_model_it_cannot_have_for_the_operator_and_holds(hub, tmp_path, redis_url):
    """`rlfleet trainer` (as in a pod: --hold-when-done) with a model that does not exist: the error, no traceback,
    the run's failure record (which the operator turns into Failed, reason ModelUnavailable), and it waits to be
    stopped instead of exiting into a StatefulSet restart; without --hold-when-done it exits with status 2."""
    from rlfleet.wire.runtime import read_failure
    from rlfleet.wire.streams import RunKeys
    from tests.support import redis_from_url, start_trainer, trainer_run_config

    config = tmp_path / "run.yaml"
    config.write_text(trainer_run_config("hf://acme/nope", tmp_path / "store", "{steps: 2}"))
    client = redis_from_url(redis_url)
    proc = start_trainer(config, redis_url, tmp_path, "--hold-when-done")
    try:
        failure = wait_for("the failure record", lambda: read_failure(client, RunKeys("tr")), timeout=120)
        assert failure[0] == "ModelUnavailable"
        assert failure[1].startswith("spec.model.path: 'hf://acme/nope': no repository acme/nope at http://127.0.0.1")
        time.sleep(1)
        assert proc.poll() is None, "held, not exited"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 2
    log = (tmp_path / "trainer.log").read_text()
    assert "no repository acme/nope" in log and "Traceback" not in log, log
    client.delete(RunKeys("tr").failure)
    once = start_trainer(config, redis_url, tmp_path, log="once.log")
    assert once.wait(120) == 2, (tmp_path / "once.log").read_text()
    assert read_failure(client, RunKeys("tr"))[0] == "ModelUnavailable"
    client.close()


def test_s3_credentials_the_endpoint_refuses_are_one_clear_error(tmp_path, monkeypatch):
    """moto's server with its IAM checks on (INITIAL_NO_AUTH_ACTION_COUNT=0): it knows no access key, as S3
    refuses a wrong one."""
    port = free_port()
    log = open(tmp_path / "moto.log", "wb")
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log, env=env
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for("moto with IAM checks", lambda: _answers(url), timeout=60)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        with pytest.raises(
            ModelSourceError, match=r"cannot read 's3://models/tiny' at http.*\(InvalidAccessKeyId\); fix"
        ):
            resolve("s3://models/tiny", store_endpoint=url)
    finally:
        server.terminate()
        server.wait(10)
        log.close()


def _answers(url: str) -> bool:
    try:
        requests.get(url, timeout=2)
        return True
    except requests.RequestException:
        return False
