"""`rlfleet operator`'s settings: read once when it starts (the command line and rlfleet.wire.env), never at import."""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.operator import names, peering, security
from rlfleet.operator.kube import request_timeout
from rlfleet.operator.pods import ClusterDefaults
from rlfleet.operator.rundefaults import RunDefaults
from rlfleet.wire import env

PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True, kw_only=True)
class OperatorOptions:
    """What the operator runs with; the CLI builds it, tests build it the same way."""

    namespaces: tuple[str, ...] = ()  # watched namespaces; empty: the whole cluster
    liveness: str | None = None  # kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz
    verbose: bool = False
    defaults: ClusterDefaults = ClusterDefaults()  # images, pull settings and security contexts of the workloads
    resync_interval_s: float = env.DEFAULT_RESYNC_INTERVAL_S  # seconds between re-applies and status reads
    peering_name: str | None = None  # kopf peering group (ClusterKopfPeering name); None: standalone, one replica
    peering_lifetime_s: int = peering.DEFAULT_LIFETIME_S  # a silent peer counts as dead after this long
    api_timeout_s: float = env.DEFAULT_API_TIMEOUT_S  # the bound on each API request, ours and kopf's
    run_defaults: RunDefaults = RunDefaults()  # the chart's Redis and store, for runs that name none
    metrics_port: int = 0  # Prometheus /metrics (metrics.py) on this port; 0: none

    @classmethod
    def from_env(
        cls,
        namespaces=(),
        liveness: str | None = None,
        verbose: bool = False,
        peering_name: str | None = None,
        peering_lifetime_s: int | None = None,
        metrics_port: int = 0,
    ) -> OperatorOptions:
        """Options from the command line plus the RLFLEET_* variables the Helm chart sets."""
        if peering_lifetime_s is None:
            peering_lifetime_s = peering.DEFAULT_LIFETIME_S
        elif peering_lifetime_s < peering.MIN_LIFETIME_S:
            least = peering.MIN_LIFETIME_S
            raise SystemExit(f"--peering-lifetime={peering_lifetime_s} must be at least {least} seconds")
        if not 0 <= metrics_port <= 65535:
            raise SystemExit(f"--metrics-port={metrics_port} must be a TCP port (1-65535), or 0 for no metrics")
        interval = env.get_float(env.RESYNC_INTERVAL, env.DEFAULT_RESYNC_INTERVAL_S)
        if interval <= 0:
            raise SystemExit(f"environment variable {env.RESYNC_INTERVAL}={interval} must be a positive number")
        api_timeout = env.get_float(env.API_TIMEOUT, env.DEFAULT_API_TIMEOUT_S)
        if api_timeout <= 0:
            raise SystemExit(f"environment variable {env.API_TIMEOUT}={api_timeout} must be a positive number")
        policy = env.get(env.IMAGE_PULL_POLICY)
        if policy is not None and policy not in PULL_POLICIES:
            raise SystemExit(f"environment variable {env.IMAGE_PULL_POLICY}={policy!r} must be one of {PULL_POLICIES}")
        pull_secrets = tuple(s.strip() for s in (env.get(env.IMAGE_PULL_SECRETS) or "").split(",") if s.strip())
        defaults = ClusterDefaults(
            image=env.get(env.IMAGE) or names.DEFAULT_IMAGE,
            gpu_image=env.get(env.GPU_IMAGE) or names.DEFAULT_GPU_IMAGE,
            pull_policy=policy,
            pull_secrets=pull_secrets,
            pod_security=security.context_from_json(
                env.POD_SECURITY_CONTEXT, env.get(env.POD_SECURITY_CONTEXT), security.POD_SECURITY_CONTEXT
            ),
            container_security=security.context_from_json(
                env.CONTAINER_SECURITY_CONTEXT,
                env.get(env.CONTAINER_SECURITY_CONTEXT),
                security.CONTAINER_SECURITY_CONTEXT,
            ),
        )
        return cls(
            namespaces=tuple(namespaces),
            liveness=liveness,
            verbose=verbose,
            defaults=defaults,
            resync_interval_s=interval,
            peering_name=peering_name or None,
            peering_lifetime_s=peering_lifetime_s,
            api_timeout_s=api_timeout,
            run_defaults=RunDefaults.from_env(),
            metrics_port=metrics_port,
        )


def bound_kopf_requests(settings, options: OperatorOptions) -> None:
    """kopf's own API requests (its patches, Events, peering, the watch streams' connections) get the same
    bound as ours (kube.request_timeout): by default kopf waits 5 minutes for an answer and without limit
    for a connection. A watch stream's total length is not bounded by this (kopf reconnects streams)."""
    connect, read = request_timeout(options.api_timeout_s)
    settings.networking.connect_timeout = connect
    settings.networking.request_timeout = read
