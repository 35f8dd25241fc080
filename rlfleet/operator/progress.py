"""What the operator reads from (and deletes in) a run's Redis: progress for its status, its keys when
the run is deleted. Blocking calls with short timeouts; the reconciler runs them in a thread."""

from __future__ import annotations

from rlfleet.wire.streams import RunKeys

REDIS_TIMEOUT_S = 3.0


def _client(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)


def read_progress(url: str, run_name: str) -> dict:
    """step / policyVersion / reward from the policy stream, accepted / rejected from the stats hash, and
    `failure` (reason, message) when a component recorded a fatal config error (wire/runtime.py record_failure)."""
    from rlfleet.wire.runtime import latest_announced_version, read_failure
    from rlfleet.wire.streams import decode_json

    keys = RunKeys(run_name)
    client = _client(url)
    try:
        out: dict = {"step": 0}
        version = latest_announced_version(client, keys)
        if version is not None:
            newest = decode_json(client.xrevrange(keys.policy, count=1)[0][1])
            # The step, not the version, says when the run is done: a resume may publish versions ahead of it.
            step = newest.get("step", version)
            out.update(step=step if isinstance(step, int) else version, policyVersion=version)
            if isinstance(newest.get("reward"), (int, float)):
                out["reward"] = float(newest["reward"])
        failure = read_failure(client, keys)
        if failure:  # not status: Observation.failure (lifecycle.py) turns it into the Failed condition
            out["failure"] = failure
        stats = {k.decode(): int(v) for k, v in client.hgetall(keys.stats).items()}
        out.update(accepted=stats.get("accepted", 0), rejected=stats.get("rejected", 0))
        return out
    finally:
        client.close()


def delete_run_keys(url: str, run_name: str) -> int:
    client = _client(url)
    try:
        return client.delete(*RunKeys(run_name).all())
    finally:
        client.close()
