"""The ingest's client side: where a worker POSTs a group, and how it resends until the ingest takes it.

The only place the route is spelled (the app serves ROLLOUTS_PATH, workers post to rollouts_url).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import requests

log = logging.getLogger("rlfleet.ingest.client")

ROLLOUTS_PATH = "/v1/{run}/rollouts"
TICKETS_PATH = "/v1/{run}/tickets"


def rollouts_url(base_url: str, run: str) -> str:
    """Where a worker POSTs its groups."""
    return base_url.rstrip("/") + ROLLOUTS_PATH.format(run=run)


def tickets_url(base_url: str, run: str) -> str:
    """Where a worker asks for a work ticket (runs with spec.sampling.assignment: run)."""
    return base_url.rstrip("/") + TICKETS_PATH.format(run=run)


RETRY_STATUSES = (429, 503)  # the ingest's backpressure: wait and resend the same group


def post_group(
    session: requests.Session,
    url: str,
    token: str,
    body: bytes,
    stop: threading.Event,
    max_wait: float = 30.0,
    on_wait: Callable[[float], None] | None = None,
) -> str | None:
    """POST one group message to the ingest until it is accepted; its stream id (None if `stop` was set).

    429/503 wait Retry-After and resend; a connection error waits and resends too (backoff up to
    `max_wait`); `on_wait(seconds)` is told of each wait. Any other refusal (401, 403 banned, 413,
    422) raises: resending cannot help.
    """
    backoff = 0.5
    while not stop.is_set():
        try:
            resp = session.post(
                url,
                data=body,
                timeout=60,
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
        except requests.ConnectionError as exc:
            log.warning("ingest %s unreachable (%s); resending in %.1fs", url, exc, backoff)
            if on_wait:
                on_wait(backoff)
            stop.wait(backoff)
            backoff = min(max_wait, backoff * 2)
            continue
        if resp.status_code == 202:
            return resp.json()["id"]
        if resp.status_code in RETRY_STATUSES:
            wait = min(max_wait, float(resp.headers.get("Retry-After") or 1))
            if on_wait:
                on_wait(wait)
            stop.wait(wait)
            continue
        raise RuntimeError(f"ingest {url} refused the group: HTTP {resp.status_code} {resp.text}")
    return None


def request_ticket(session: requests.Session, url: str, token: str, stop: threading.Event) -> int | None:
    """A work ticket for this token's worker (None if `stop` was set); waits and asks again on 429/503."""
    while not stop.is_set():
        try:
            resp = session.post(url, timeout=60, headers={"Authorization": f"Bearer {token}"})
        except requests.ConnectionError as exc:
            log.warning("ingest %s unreachable (%s); asking again in 1s", url, exc)
            stop.wait(1.0)
            continue
        if resp.status_code == 200:
            return int(resp.json()["ticket"])
        if resp.status_code in RETRY_STATUSES:
            stop.wait(float(resp.headers.get("Retry-After") or 1))
            continue
        raise RuntimeError(f"ingest {url} refused a ticket: HTTP {resp.status_code} {resp.text}")
    return None
