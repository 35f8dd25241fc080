"""What every component process does first: read the config, connect to Redis, set up logging
and metrics. Nothing here knows whether the process runs locally or in a pod."""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import redis
from redis import Redis

from rlfleet.config import Bundle, ConfigError, load_bundle
from rlfleet.wire import env
from rlfleet.wire.health import Health, serve
from rlfleet.wire.streams import RunKeys, stream_entries
from rlfleet.wire.views import VIEWS, view_bundle


@dataclass(frozen=True, kw_only=True)
class ComponentOptions:
    """What every component process takes on its command line (each component adds its own fields)."""

    config: Path  # the RLRun YAML, the same file `rlfleet run` and kubectl take
    redis_url: str | None = None  # overrides env.REDIS_URL and spec.redis.url
    metrics_port: int = 0  # Prometheus /metrics and /healthz port (wire/health.py); 0 = none


@dataclass
class Context:
    bundle: Bundle
    redis: redis.Redis | None  # None only for a component that may run without it (component_context)
    keys: RunKeys
    stop: threading.Event
    redis_url: str = ""  # what `redis` connects to (a component that needs other client settings reconnects)
    health: Health = field(default_factory=Health)  # what /healthz answers: a component registers its checks

    @property
    def run_name(self) -> str:
        return self.bundle.run.metadata.name

    @property
    def client(self) -> Redis:
        """`redis` for a component that cannot run without it (component_context refused to start it without)."""
        if self.redis is None:
            raise ConfigError(
                "redis", [f"spec.redis.url: this component needs Redis (or pass --redis-url / {env.REDIS_URL})"]
            )
        return self.redis


def setup_logging(component: str) -> logging.Logger:
    logging.basicConfig(
        level=env.get(env.LOG_LEVEL) or env.DEFAULT_LOG_LEVEL,
        format=f"%(asctime)s {component} %(levelname)s %(name)s: %(message)s",
    )
    return logging.getLogger(f"rlfleet.{component}")


def component_context(
    options: ComponentOptions, component: str, redis_optional: bool = False, health_check: bool = False
) -> Context:
    """Load the config as `component` reads it (its view, rlfleet/wire/views.py: reading a field outside
    it raises ViewError, and the operator rolls the component's pods exactly when its view changes),
    connect Redis, serve /metrics and /healthz (ctx.health; wire/health.py), and turn SIGTERM/SIGINT into `stop`.
    `redis_optional`: a component that can work without Redis (a relay following its upstream, a worker
    posting to an ingest) gets `redis=None` when no URL is given instead of an error.
    `health_check`: the component registers a check on ctx.health; /healthz answers "starting" until then."""
    setup_logging(component)
    bundle = view_bundle(load_bundle(options.config), VIEWS[component])
    url = options.redis_url or env.get(env.REDIS_URL) or bundle.run.spec.redis.url
    if not url and not redis_optional:
        raise ConfigError(
            str(options.config),
            [f"spec.redis.url: required outside `rlfleet run` (or pass --redis-url / {env.REDIS_URL})"],
        )
    client = connect_redis(url) if url else None
    health = Health(pending=health_check)
    if options.metrics_port:
        serve(options.metrics_port, "127.0.0.1" if env.get(env.LOCAL) else "0.0.0.0", health)
    stop = threading.Event()

    def _on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    keys = RunKeys(bundle.run.metadata.name)
    return Context(bundle=bundle, redis=client, keys=keys, stop=stop, redis_url=url or "", health=health)


# A component rides out a Redis restart (a pod rescheduled, the local launcher's restart with its
# append-only file) by retrying for about half a minute before an error reaches its code.
REDIS_RETRIES = 20


def connect_redis(url: str) -> redis.Redis:
    """A client that retries a command on connection errors with exponential back-off (0.1 s doubling to
    2 s, REDIS_RETRIES times). A retried write can apply twice if the reply was lost; the stream
    consumers tolerate that (the gate's commit acknowledges first, the trainer keeps trained ids)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), REDIS_RETRIES),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create a consumer group reading the stream from its start; an existing group is kept."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def latest_announced_version(client: redis.Redis, keys: RunKeys) -> int | None:
    """The newest version on the policy stream, or None before the first publish."""
    return announced_version(client.xrevrange(keys.policy, count=1))


def announced_version(newest_entry: object) -> int | None:
    """The version of the policy stream's newest entry, from the reply of `XREVRANGE policy + - COUNT 1` (for a
    caller that reads it in a pipeline with other commands), or None before the first publish."""
    from rlfleet.wire.streams import decode_json

    entries = stream_entries(newest_entry)
    return int(decode_json(entries[0][1])["version"]) if entries else None


def record_failure(client: redis.Redis, keys: RunKeys, reason: str, message: str) -> None:
    """Record a fatal error of the run's config (reason: a CamelCase word, message: the field and the fix) where the
    operator reads it (`read_failure`) to set the run's Failed condition instead of restarting the pod forever."""
    client.hset(keys.failure, mapping={"reason": reason, "message": message, "time": str(time.time())})


def read_failure(client: redis.Redis, keys: RunKeys) -> tuple[str, str] | None:
    """(reason, message) of the run's recorded fatal error, or None."""
    raw = cast(dict, client.hgetall(keys.failure))
    record = {_text(k): _text(v) for k, v in raw.items()}
    return (record["reason"], record.get("message", "")) if record.get("reason") else None


def fail_run(ctx: Context, reason: str, message: str, hold: bool) -> int:
    """A fatal config error found by a component (the trainer): logged, recorded for the operator (which sets the
    run's Failed condition with `reason` and scales the workloads to 0), and exit status 2. In a pod (`hold`) the
    process waits to be stopped instead: a StatefulSet restarts a container that exits, repeating the error."""
    logging.getLogger("rlfleet").error("%s", message)
    record_failure(ctx.client, ctx.keys, reason, message)
    if hold:
        ctx.stop.wait()
    return 2


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
