"""An ASGI app (FastAPI) served by uvicorn in a daemon thread of a component process: the
verifier's HTTP API and the ingest use it; tests start servers the same way."""

from __future__ import annotations

import threading
import time

import uvicorn


class BackgroundServer:
    """`BackgroundServer(app, host, port, name).start()` serves until `stop()`."""

    def __init__(self, app, host: str, port: int, name: str, config: uvicorn.Config | None = None):
        """`config` replaces the default settings (its app, host and port are used as given)."""
        self.name = name
        self.server = uvicorn.Server(config or uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=name)

    def start(self, timeout: float = 10.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start on {self.server.config.host}:{self.server.config.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
