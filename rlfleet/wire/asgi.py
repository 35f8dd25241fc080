"""An ASGI app (FastAPI) served by uvicorn in a daemon thread of a component process: the
verifier's HTTP API and the ingest use it; tests start servers the same way. `TLSServer`: a uvicorn
server that loads a renewed certificate while it serves (the ingest's, wire/tls.py)."""

from __future__ import annotations

import threading
import time

import uvicorn

from rlfleet.wire import tls


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


class TLSServer(uvicorn.Server):
    """A uvicorn server whose HTTPS certificate (its config's ssl_certfile and ssl_keyfile) is reloaded when its
    files change: checked every tls.RELOAD_INTERVAL_S from uvicorn's own tick, on the event loop that does the
    handshakes (tls.CertificateReloader). A plain-HTTP config serves as uvicorn.Server does."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        config.load()  # makes config.ssl, the context every handshake uses
        files = (config.ssl_certfile, config.ssl_keyfile)
        self.reloader = None
        if config.ssl is not None and files[0] and files[1]:
            self.reloader = tls.CertificateReloader(config.ssl, str(files[0]), str(files[1]))
        self.checked = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self.reloader is not None and time.monotonic() - self.checked > tls.RELOAD_INTERVAL_S:
            self.reloader.check()
            self.checked = time.monotonic()
        return await super().on_tick(counter)
