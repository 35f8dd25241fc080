"""Fetching a base model's files from S3 and the hub for the resolver (sources.py): a whole HF directory
(every object under an S3 prefix, a hub repository's snapshot) into the cache, and the clients and error
messages a single file's fetch (a GGUF) shares with it. Every failure is a `ModelSourceError` naming
spec.model.path and the fix."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rlfleet.config.model import HUB_ID
from rlfleet.models.builtin import cache_root, publish
from rlfleet.wire import env

FIELD = "spec.model.path"
S3_PREFIX = "s3://"
HUB_PREFIX = "hf://"
# Hub files a transformers model never needs from a repository that ships several formats.
HUB_IGNORE = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "*.gguf", "*.tflite"]
HUB_IGNORE_KEEP_BIN = [p for p in HUB_IGNORE if p != "*.bin"]


class ModelSourceError(ValueError):
    """The base model cannot be resolved; the message starts with spec.model.path and says the fix."""


# ---- S3 ------------------------------------------------------------------------------------------


def s3_client(endpoint: str | None, caller: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint, config=Config(retries={"mode": "standard"}, user_agent_extra=f"rlfleet/{caller}")
    )


def from_s3(path: str, endpoint: str | None, caller: str) -> Path:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = path[len(S3_PREFIX) :].partition("/")
    prefix = prefix.rstrip("/") + "/"
    where = endpoint or "the AWS default endpoint"
    client = s3_client(endpoint, caller)
    try:
        objects = [
            (obj["Key"], obj["Size"], obj.get("ETag", ""))
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for obj in page.get("Contents", [])
            if not obj["Key"].endswith("/")
        ]
    except ClientError as exc:
        raise ModelSourceError(s3_message(path, exc, where)) from None
    except BotoCoreError as exc:
        raise ModelSourceError(s3_unreachable(path, where, exc)) from None
    if not objects:
        raise ModelSourceError(
            f"{FIELD}: no objects under {path!r} at {where}; upload the model directory there "
            f"(e.g. `aws s3 sync ./my-model {path}`) or fix the prefix"
        )
    blob = "\n".join([endpoint or "", bucket, prefix, *(f"{k} {s} {e}" for k, s, e in sorted(objects))])
    dest = cache_root() / "s3" / hashlib.sha256(blob.encode()).hexdigest()[:24]
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".fetch-"))
    try:
        for key, _, _ in objects:
            target = tmp / key[len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                client.download_file(bucket, key, str(target))
            except ClientError as exc:
                raise ModelSourceError(s3_message(f"s3://{bucket}/{key}", exc, where)) from None
        publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def s3_unreachable(path: str, where: str, exc, doing: str = "list") -> str:
    return (
        f"{FIELD}: cannot {doing} {path!r} at {where}: {exc}; check spec.model.endpointUrl (or "
        f"spec.store.endpointUrl, AWS_ENDPOINT_URL) and the credentials (on a cluster spec.store.credentialsSecret)"
    )


def s3_message(path: str, exc, where: str) -> str:
    code = exc.response.get("Error", {}).get("Code", "?")
    credentials = (
        "fix the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; on a cluster spec.store.credentialsSecret)"
    )
    access = "grant the credentials read access (s3:ListBucket, s3:GetObject) to it"
    fixes = {
        "NoSuchBucket": "create the bucket or fix its name",
        "InvalidAccessKeyId": credentials,
        "SignatureDoesNotMatch": credentials,
        "AccessDenied": access,
        "403": access,
        "NoSuchKey": "upload the file there or fix the key",
        "404": "fix the bucket and key, or upload the file there",
    }
    fix = fixes.get(code, "check the bucket, prefix and credentials")
    return f"{FIELD}: cannot read {path!r} at {where} ({code}); {fix}"


# ---- the hub -------------------------------------------------------------------------------------


def hub_settings() -> tuple[str | None, Path, bool, str | None]:
    """(endpoint, cache dir, offline, token) from the environment now: huggingface_hub reads HF_ENDPOINT,
    HF_HOME and HF_HUB_OFFLINE once, at import, which may precede the settings of the process that resolves."""
    home = env.get(env.HF_HOME)
    cache = env.get(env.HF_HUB_CACHE) or (Path(home) / "hub" if home else Path.home() / ".cache/huggingface/hub")
    offline = (env.get(env.HF_HUB_OFFLINE) or "").strip().lower() in ("1", "true", "yes", "on")
    return env.get(env.HF_ENDPOINT) or None, Path(cache), offline, env.get(env.HF_TOKEN) or None


def from_hub(path: str, caller: str) -> Path:
    from huggingface_hub import snapshot_download

    match = HUB_ID.match(path[len(HUB_PREFIX) :])
    assert match is not None  # model_path_problem checked it
    repo, revision = match.group("repo"), match.group("rev") or "main"
    endpoint, cache, offline, token = hub_settings()

    def download(ignore: list[str]) -> Path:
        return Path(
            snapshot_download(
                repo,
                revision=revision,
                endpoint=endpoint,
                cache_dir=cache,
                local_files_only=offline,
                token=token,
                ignore_patterns=ignore,
                user_agent=f"rlfleet/{caller}",
            )
        )

    with hub_errors(path, repo, revision):
        snapshot = download(HUB_IGNORE)
        if not any(snapshot.glob("*.safetensors")):  # an older repository with PyTorch weights only
            snapshot = download(HUB_IGNORE_KEEP_BIN)
        return snapshot


@contextlib.contextmanager
def hub_errors(path: str, repo: str, revision: str) -> Iterator[None]:
    """huggingface_hub's errors while fetching from `repo` at `revision`, each as one ModelSourceError with the fix."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint, cache, offline, _ = hub_settings()
    where = endpoint or "huggingface.co"
    try:
        yield
    except RevisionNotFoundError:
        raise ModelSourceError(
            f"{FIELD}: {path!r}: {repo} has no revision {revision!r} at {where}; use an existing branch, tag or "
            f"commit after @ (or none for main)"
        ) from None
    except GatedRepoError:
        raise ModelSourceError(
            f"{FIELD}: {path!r}: {repo} is gated at {where}; accept its terms with your account and give a token "
            f"(HF_TOKEN; on a cluster spec.model.tokenSecret)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"{FIELD}: {path!r}: no repository {repo} at {where} (or it is private and no valid token was given); "
            f"fix the id, or give a token (HF_TOKEN; on a cluster spec.model.tokenSecret)"
        ) from None
    except RemoteEntryNotFoundError:
        raise ModelSourceError(
            f"{FIELD}: {path!r}: {repo}@{revision} at {where} has no such file; fix the file's path after the "
            f"revision (the repository's files: {where.rstrip('/')}/{repo}/tree/{revision})"
        ) from None
    except LocalEntryNotFoundError:
        if offline:
            raise ModelSourceError(
                f"{FIELD}: {path!r}: HF_HUB_OFFLINE is set and {repo}@{revision} is not in the cache {str(cache)!r}; "
                f"download it once with the network on (or unset HF_HUB_OFFLINE), or set HF_HOME to a cache that "
                f"has it"
            ) from None
        raise ModelSourceError(
            f"{FIELD}: {path!r}: cannot reach the hub at {where} and {repo}@{revision} is not in the cache "
            f"{str(cache)!r}; check the network and HF_ENDPOINT"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelSourceError(
            f"{FIELD}: {path!r}: downloading from {where} failed: {exc}; check the network, HF_ENDPOINT and HF_TOKEN"
        ) from None
