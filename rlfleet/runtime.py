"""What every component process does first: read the config, connect to Redis, set up logging
and metrics. Nothing here knows whether the process runs locally or in a pod."""
from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

import redis

from rlfleet.config import Bundle, ConfigError, load_bundle
from rlfleet.streams import RunKeys


@dataclass
class Context:
    bundle: Bundle
    redis: redis.Redis
    keys: RunKeys
    stop: threading.Event

    @property
    def run_name(self) -> str:
        return self.bundle.run.metadata.name


def setup_logging(component: str) -> logging.Logger:
    logging.basicConfig(
        level=os.environ.get("RLFLEET_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {component} %(levelname)s %(name)s: %(message)s",
    )
    return logging.getLogger(f"rlfleet.{component}")


def component_context(args, component: str) -> Context:
    """Load the config, connect Redis, start /metrics, and turn SIGTERM/SIGINT into `stop`."""
    setup_logging(component)
    bundle = load_bundle(args.config)
    url = args.redis_url or os.environ.get("RLFLEET_REDIS_URL") or bundle.run.spec.redis.url
    if not url:
        raise ConfigError(args.config, ["spec.redis.url: required outside `rlfleet run` (or pass --redis-url / RLFLEET_REDIS_URL)"])
    client = redis.Redis.from_url(url)
    if getattr(args, "metrics_port", 0):
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr="127.0.0.1" if "RLFLEET_LOCAL" in os.environ else "0.0.0.0")
    stop = threading.Event()

    def _on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return Context(bundle=bundle, redis=client, keys=RunKeys(bundle.run.metadata.name), stop=stop)
