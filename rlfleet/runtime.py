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


def open_run_store(ctx: Context, source: str = "config"):
    """The run's checkpoint store: env RLFLEET_STORE_URI (set by the local launcher) or spec.store.uri."""
    from rlfleet.store import open_store

    spec = ctx.bundle.run.spec.store
    uri = os.environ.get("RLFLEET_STORE_URI") or spec.uri
    if not uri:
        raise ConfigError(source, ["spec.store.uri: required outside `rlfleet run` (file:///dir or s3://bucket/prefix)"])
    return open_store(uri, spec.endpoint_url)


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create a consumer group reading the stream from its start; an existing group is kept."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def latest_announced_version(client: redis.Redis, keys: RunKeys) -> int | None:
    """The newest version on the policy stream, or None before the first publish."""
    from rlfleet.streams import decode_json

    entries = client.xrevrange(keys.policy, count=1)
    return int(decode_json(entries[0][1])["version"]) if entries else None


def configure_torch_threads() -> None:
    """Intra-op threads from RLFLEET_TORCH_THREADS (the local launcher sets 1: many processes share few cores)."""
    threads = os.environ.get("RLFLEET_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
