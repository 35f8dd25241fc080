"""The ingest's client side: where a worker POSTs a group (or asks for a work ticket), and how it resends
until the ingest takes it.

The only place the routes are spelled (the app serves these paths, workers post to
rollouts_url and tickets_url). Resending is safe: the ingest stores a group once per content and worker
and answers a resend with the first entry's id.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import requests

from rlfleet.wire import tls

log = logging.getLogger("rlfleet.ingest.client")

ROLLOUTS_PATH = "/v1/{run}/rollouts"
TICKETS_PATH = "/v1/{run}/tickets"
RUN_PATH = "/v1/{run}"  # the public run document (door.py)
JOIN_PATH = "/v1/{run}/join"


def rollouts_url(base_url: str, run: str) -> str:
    """Where a worker POSTs its groups."""
    return base_url.rstrip("/") + ROLLOUTS_PATH.format(run=run)


def tickets_url(base_url: str, run: str) -> str:
    """Where a worker asks for a work ticket (runs with spec.sampling.assignment: run)."""
    return base_url.rstrip("/") + TICKETS_PATH.format(run=run)


def run_document_url(base_url: str, run: str) -> str:
    return base_url.rstrip("/") + RUN_PATH.format(run=run)


def join_url(base_url: str, run: str) -> str:
    return base_url.rstrip("/") + JOIN_PATH.format(run=run)


# The ingest's backpressure and transient trouble: wait and resend the same request. 5xx and timeouts
# too: a submission is idempotent, so a resend after a reply that was lost or failed never duplicates.
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)


def _post_until(
    session: requests.Session,
    url: str,
    token: str,
    body: bytes,
    stop: threading.Event,
    ok: tuple[int, ...],
    max_wait: float,
    on_wait: Callable[[float], None] | None,
) -> requests.Response | None:
    backoff = 0.5

    def wait(seconds: float) -> None:
        if on_wait:
            on_wait(seconds)
        stop.wait(seconds)

    while not stop.is_set():
        try:
            resp = session.post(
                url,
                data=body,
                timeout=60,
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                verify=tls.requests_verify(),  # per request: a session's `verify` loses to env REQUESTS_CA_BUNDLE
            )
        except (requests.ConnectionError, requests.Timeout) as exc:
            if tls.untrusted(exc):  # a certificate that does not verify: resending cannot help
                raise RuntimeError(f"ingest {url}: {tls.describe(exc)}") from None
            log.warning("ingest %s unreachable (%s); resending in %.1fs", url, exc, backoff)
            wait(backoff)
            backoff = min(max_wait, backoff * 2)
            continue
        if resp.status_code in ok:
            return resp
        if resp.status_code in RETRY_STATUSES:
            retry_after = resp.headers.get("Retry-After")
            wait(min(max_wait, float(retry_after) if retry_after else backoff))
            if not retry_after:
                backoff = min(max_wait, backoff * 2)
            continue
        raise RuntimeError(f"ingest {url} refused the request: HTTP {resp.status_code} {resp.text}")
    return None


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

    408/429/5xx wait (Retry-After, else backoff up to `max_wait`) and resend; a connection error or a
    timeout waits and resends too; `on_wait(seconds)` is told of each wait. Any other refusal (401, 403
    banned, 413, 422) raises, as does an https:// ingest whose certificate does not verify (wire/tls.py):
    resending cannot help.
    """
    resp = _post_until(session, url, token, body, stop, (202,), max_wait, on_wait)
    return None if resp is None else resp.json()["id"]


def request_ticket(
    session: requests.Session, url: str, token: str, stop: threading.Event, max_wait: float = 30.0
) -> int | None:
    """A work ticket for this token's worker (None if `stop` was set); retried as post_group is."""
    resp = _post_until(session, url, token, b"", stop, (200,), max_wait, None)
    return None if resp is None else int(resp.json()["ticket"])
