"""`rlfleet operator`'s settings: read once when it starts (the command line and rlfleet.wire.env), never at import."""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.operator import names, peering
from rlfleet.operator.pods import ClusterDefaults
from rlfleet.wire import env

PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True, kw_only=True)
class OperatorOptions:
    """What the operator runs with; the CLI builds it, tests build it the same way."""

    namespaces: tuple[str, ...] = ()  # watched namespaces; empty: the whole cluster
    liveness: str | None = None  # kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz
    verbose: bool = False
    defaults: ClusterDefaults = ClusterDefaults()  # images and pull settings of the workloads
    resync_interval_s: float = env.DEFAULT_RESYNC_INTERVAL_S  # seconds between re-applies and status reads
    peering_name: str | None = None  # kopf peering group (ClusterKopfPeering name); None: standalone, one replica
    peering_lifetime_s: int = peering.DEFAULT_LIFETIME_S  # a silent peer counts as dead after this long

    @classmethod
    def from_env(
        cls,
        namespaces=(),
        liveness: str | None = None,
        verbose: bool = False,
        peering_name: str | None = None,
        peering_lifetime_s: int | None = None,
    ) -> OperatorOptions:
        """Options from the command line plus the RLFLEET_* variables the Helm chart sets."""
        if peering_lifetime_s is None:
            peering_lifetime_s = peering.DEFAULT_LIFETIME_S
        elif peering_lifetime_s < peering.MIN_LIFETIME_S:
            least = peering.MIN_LIFETIME_S
            raise SystemExit(f"--peering-lifetime={peering_lifetime_s} must be at least {least} seconds")
        interval = env.get_float(env.RESYNC_INTERVAL, env.DEFAULT_RESYNC_INTERVAL_S)
        if interval <= 0:
            raise SystemExit(f"environment variable {env.RESYNC_INTERVAL}={interval} must be a positive number")
        policy = env.get(env.IMAGE_PULL_POLICY)
        if policy is not None and policy not in PULL_POLICIES:
            raise SystemExit(f"environment variable {env.IMAGE_PULL_POLICY}={policy!r} must be one of {PULL_POLICIES}")
        pull_secrets = tuple(s.strip() for s in (env.get(env.IMAGE_PULL_SECRETS) or "").split(",") if s.strip())
        defaults = ClusterDefaults(
            image=env.get(env.IMAGE) or names.DEFAULT_IMAGE,
            gpu_image=env.get(env.GPU_IMAGE) or names.DEFAULT_GPU_IMAGE,
            pull_policy=policy,
            pull_secrets=pull_secrets,
        )
        return cls(
            namespaces=tuple(namespaces),
            liveness=liveness,
            verbose=verbose,
            defaults=defaults,
            resync_interval_s=interval,
            peering_name=peering_name or None,
            peering_lifetime_s=peering_lifetime_s,
        )
