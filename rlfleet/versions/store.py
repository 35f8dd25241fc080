"""The checkpoint store seam: a tiny key/value interface over a directory or an S3 bucket.

Keys are relative, `/`-separated paths (`run/policy/v3/model.safetensors`); `..`, empty parts and
leading slashes are refused. Invariants:
  - a write is all-or-nothing: the file store writes a temp file and `os.replace`s it; S3 PUTs
    (and boto3's managed multipart uploads) only become visible when complete;
  - a missing key raises `KeyError(key)` from every read;
  - `list(prefix)` is a plain string-prefix match (S3 semantics) and returns sorted keys;
  - nothing is created implicitly on S3: a missing bucket is an error that names it.
Ordering between keys (the manifest written last) is the caller's job, see rlfleet.versions.checkpoint.
`open_store(uri)` is the factory, keyed by URI scheme. S3 goes through boto3 (retries, multipart).
"""

from __future__ import annotations

import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.config import ConfigError
from rlfleet.wire import env

if TYPE_CHECKING:
    from rlfleet.wire.runtime import Context

CHUNK = 1 << 20
TMP_PREFIX = ".tmp-"  # file-store temp files; never listed
URI_FORMS = "file:///absolute/dir, file://./relative/dir (relative to the working directory) or s3://bucket/prefix"


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative key, else raise ValueError naming it."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"store key {key!r} must be a relative path of non-empty parts without '.', '..' or '\\'")
    return key


class CheckpointStore(ABC):
    """Bytes under string keys. Implementations: FileStore, S3Store."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (S3: boto3 managed, multipart for large files)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def download(self, key: str, dest: Path) -> None:
        """Copy `key` to the local file `dest` (replaced atomically)."""

    @abstractmethod
    def open_read(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Stream bytes [start, end) of `key` (end exclusive, None = to the end) in chunks.
        The key is opened eagerly: KeyError is raised by this call, not by the first `next`."""

    def local_path(self, key: str) -> Path | None:
        """The local file that holds `key` (servers sendfile it), or None when the store is remote.
        KeyError if a local store has no such key."""
        return None

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys starting with `prefix`, sorted."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with `prefix` (no error if there are none)."""


class FileStore(CheckpointStore):
    """A directory; the key is the relative path. The root is created on the first write."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_atomic(self, key: str, write) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write_atomic(key, lambda f: f.write(data))

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as src:
            self._write_atomic(key, lambda f: shutil.copyfileobj(src, f, CHUNK))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise KeyError(key) from None

    def download(self, key: str, dest: Path) -> None:
        src, dest = self._path(key), Path(dest)
        if not src.is_file():
            raise KeyError(key)
        tmp = dest.parent / f"{TMP_PREFIX}{dest.name}.{uuid.uuid4().hex}"
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def open_read(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        try:
            f = open(self._path(key), "rb")
        except (FileNotFoundError, IsADirectoryError):
            raise KeyError(key) from None
        f.seek(start)

        def chunks() -> Iterator[bytes]:
            with f:
                left = None if end is None else max(0, end - start)
                while left is None or left > 0:
                    data = f.read(CHUNK if left is None else min(CHUNK, left))
                    if not data:
                        return
                    if left is not None:
                        left -= len(data)
                    yield data

        return chunks()

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise KeyError(key)
        return path.stat().st_size

    def local_path(self, key: str) -> Path:
        path = self._path(key)
        if not path.is_file():
            raise KeyError(key)
        return path

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix.rpartition("/")[0] if prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    continue
                key = (Path(dirpath) / name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> None:
        dirs: set[Path] = set()
        for key in self.list(prefix):
            path = self._path(key)
            path.unlink(missing_ok=True)
            dirs.update(p for p in path.parents if self.root in p.parents)
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):  # deepest first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()


class S3Store(CheckpointStore):
    """`s3://bucket/prefix` through one boto3 client (thread-safe; retries in "standard" mode)."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        self.client = boto3.client(
            "s3", endpoint_url=self.endpoint_url, config=Config(retries={"mode": "standard"}, max_pool_connections=32)
        )
        self._check_bucket()

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}', endpoint_url={self.endpoint_url!r})"

    def _check_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchBucket", "NotFound"):
                where = self.endpoint_url or "the AWS default endpoint"
                raise FileNotFoundError(
                    f"S3 bucket {self.bucket!r} does not exist at {where}; create it first "
                    f"(e.g. `aws s3 mb s3://{self.bucket}`) — rlfleet never creates buckets"
                ) from None
            raise

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _missing(self, exc, key: str) -> KeyError | None:
        return KeyError(key) if _code(exc) in ("404", "NoSuchKey", "NotFound") else None

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_file(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key))

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self.open_read(key))

    def download(self, key: str, dest: Path) -> None:
        from botocore.exceptions import ClientError

        try:  # boto3 writes a temp file and renames it into place
            self.client.download_file(self.bucket, self._key(key), str(dest))
        except ClientError as exc:
            raise (self._missing(exc, key) or exc) from None

    def open_read(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        if end is not None and end <= start:
            return iter(())
        kwargs = {"Bucket": self.bucket, "Key": self._key(key)}
        if start or end is not None:  # HTTP ranges are inclusive
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            body = self.client.get_object(**kwargs)["Body"]
        except ClientError as exc:
            if _code(exc) == "InvalidRange":  # start at or past the end: nothing to read
                return iter(())
            raise (self._missing(exc, key) or exc) from None

        def chunks() -> Iterator[bytes]:
            with body:
                yield from body.iter_chunks(CHUNK)

        return chunks()

    def size(self, key: str) -> int:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
        except ClientError as exc:
            raise (self._missing(exc, key) or exc) from None

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except KeyError:
            return False

    def _full_keys(self, prefix: str) -> list[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def list(self, prefix: str) -> list[str]:
        cut = len(self.prefix) + 1 if self.prefix else 0
        return sorted(k[cut:] for k in self._full_keys(prefix))

    def delete_prefix(self, prefix: str) -> None:
        keys = self._full_keys(prefix)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})


def _code(exc) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def open_store(uri: str, endpoint_url: str | None = None) -> CheckpointStore:
    """The store for `uri`: file:///abs, file://./rel (relative to the cwd) or s3://bucket/prefix."""
    bad = ValueError(f"store uri {uri!r} is not supported; use {URI_FORMS}")
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if path.startswith("/"):
            return FileStore(Path(path))
        if path == "." or path.startswith("./"):
            return FileStore(Path.cwd() / path)
        raise bad
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise bad
        return S3Store(bucket, prefix, endpoint_url=endpoint_url)
    raise bad


def open_run_store(ctx: Context, source: str = "config") -> CheckpointStore:
    """The run's checkpoint store: env RLFLEET_STORE_URI (set by the local launcher) or spec.store.uri."""
    spec = ctx.bundle.run.spec.store
    uri = env.get(env.STORE_URI) or spec.uri
    if not uri:
        raise ConfigError(
            source, ["spec.store.uri: required outside `rlfleet run` (file:///dir or s3://bucket/prefix)"]
        )
    return open_store(uri, spec.endpoint_url)
