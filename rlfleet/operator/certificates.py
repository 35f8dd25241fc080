"""TLS in the pods the operator builds (the processes' side is rlfleet/wire/tls.py). Pure.

  a server      (the ingest with spec.ingest.tls.secretName, a relay tier with tls.secretName): the
                kubernetes.io/tls Secret's tls.crt and tls.key mounted at names.TLS_DIR and passed as
                --tls-cert-file / --tls-key-file, so the process serves only HTTPS; its probes ask over HTTPS
                (the kubelet does not verify the certificate), and its in-cluster URLs are https://
  a client      (relays and rollout workers: what pulls checkpoints from relays and posts to an ingest) of a
                run with spec.tls.caSecret or caConfigMap: that object's ca.crt mounted at names.TLS_CA_DIR
                and env RLFLEET_TLS_CA_FILE naming it, the bundle every https:// server is verified with.
Only the keys named are mounted (a cert-manager Secret's ca.crt never reaches a server that does not use it).
"""

from __future__ import annotations

from rlfleet.config import RLRun
from rlfleet.config.infra import ServerTLSSpec
from rlfleet.operator import names
from rlfleet.operator.pods import secret_volume
from rlfleet.wire import env, tls

# (env, volume mounts, volumes) of one concern of a pod; args take the place of env for a server.
PodParts = tuple[list, list[dict], list[dict]]


def server_tls(spec: ServerTLSSpec) -> PodParts:
    """(args, volume mounts, volumes) of a server that serves HTTPS from spec.secretName; nothing without it."""
    if not spec.secret_name:
        return [], [], []
    args = [
        "--tls-cert-file",
        f"{names.TLS_DIR}/{tls.TLS_CERT_KEY}",
        "--tls-key-file",
        f"{names.TLS_DIR}/{tls.TLS_KEY_KEY}",
    ]
    return (
        args,
        [{"name": "tls", "mountPath": names.TLS_DIR, "readOnly": True}],
        [secret_volume("tls", spec.secret_name, [tls.TLS_CERT_KEY, tls.TLS_KEY_KEY])],
    )


def client_trust(run: RLRun) -> PodParts:
    """(env, volume mounts, volumes) that give a client pod the run's CA bundle (spec.tls); nothing without one."""
    trust = run.spec.tls
    items = [{"key": tls.CA_KEY, "path": tls.CA_KEY}]
    if trust.ca_secret:
        source: dict = {"secret": {"secretName": trust.ca_secret, "items": items}}
    elif trust.ca_config_map:
        source = {"configMap": {"name": trust.ca_config_map, "items": items}}
    else:
        return [], [], []
    return (
        [{"name": env.TLS_CA_FILE, "value": f"{names.TLS_CA_DIR}/{tls.CA_KEY}"}],
        [{"name": "tls-ca", "mountPath": names.TLS_CA_DIR, "readOnly": True}],
        [{"name": "tls-ca", **source}],
    )
