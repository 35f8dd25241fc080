"""TLS in the pods the operator builds (rlfleet/operator/certificates.py): the ingest and a relay tier with
tls.secretName mount their kubernetes.io/tls Secret, serve HTTPS with it (flags) and are probed over HTTPS; the
tier's in-cluster clients reach it by https://; the run's spec.tls CA bundle reaches the relays and workers
(mounted, RLFLEET_TLS_CA_FILE) and no other pod; the Secrets are checked before pods would hang on them."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.operator import builders as b
from rlfleet.operator import crd, names
from rlfleet.operator.secrets import SecretNeed, run_secrets
from rlfleet.wire import env
from tests.operator.test_builders import EXAMPLE, NS, _by_kind_and_name, _container, _env, _pod_volumes

TLS_FLAGS = {"--tls-cert-file": "/var/run/rlfleet/tls/tls.crt", "--tls-key-file": "/var/run/rlfleet/tls/tls.key"}
CA_FILE = "/var/run/rlfleet/tls-ca/ca.crt"


def bundle(tier_spec: dict | None = None, **run_spec):
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    docs[0]["spec"].update(
        redis={"url": "redis://redis:6379/0"},
        store={"uri": "s3://ckpt/runs"},
        shardcast={"signingKeySecret": "arithmetic-signing"},
        **run_spec,
    )
    [tier] = [d for d in docs if d["kind"] == "RelayTier"]
    tier["spec"].update(tier_spec or {})
    return parse_bundle(yaml.safe_dump_all(docs))


def flags(workload: dict) -> dict[str, str]:
    args = _container(workload)["args"]
    return {flag: args[args.index(flag) + 1] for flag in TLS_FLAGS if flag in args}


def probe_schemes(workload: dict) -> set[str | None]:
    c = _container(workload)
    return {c[p]["httpGet"].get("scheme") for p in ("startupProbe", "livenessProbe", "readinessProbe")}


def served_with(workload: dict, secret: str) -> None:
    """`workload` serves HTTPS from the kubernetes.io/tls Secret `secret`, and is probed over HTTPS."""
    assert flags(workload) == TLS_FLAGS
    assert {"name": "tls", "mountPath": "/var/run/rlfleet/tls", "readOnly": True} in _container(workload)[
        "volumeMounts"
    ]
    items = [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]
    assert {"name": "tls", "secret": {"secretName": secret, "items": items}} in _pod_volumes(workload)
    assert probe_schemes(workload) == {"HTTPS"}
    kubernetes_validate.validate(workload, "1.30", strict=True)


def test_an_ingest_with_a_tls_secret_serves_https_from_it_and_is_probed_over_https():
    run = bundle(ingest={"tokens": "worker-tokens", "tls": {"secretName": "ingest-cert"}}).run
    children = _by_kind_and_name(b.build_run_children(run, NS))
    served_with(children[("Deployment", "arithmetic-ingest")], "ingest-cert")
    for name in ("arithmetic-origin", "arithmetic-verifier"):  # no other server of the run serves TLS
        assert not flags(children[("Deployment", name)]) and "ingest-cert" not in str(children[("Deployment", name)])
    assert SecretNeed("ingest-cert", "spec.ingest.tls.secretName", ("tls.crt", "tls.key")) in run_secrets(run)

    plain = _by_kind_and_name(b.build_run_children(bundle(ingest={"tokens": "worker-tokens"}).run, NS))
    ingest = plain[("Deployment", "arithmetic-ingest")]
    assert not flags(ingest) and probe_schemes(ingest) == {None} and "tls" not in str(_pod_volumes(ingest))


def test_a_relay_tier_with_a_tls_secret_serves_https_and_its_clients_in_the_cluster_reach_it_by_https():
    data = bundle({"tls": {"secretName": "relay-cert"}})
    run, pool, [tier] = data.run, data.pools[0], data.relays
    relay = _by_kind_and_name(b.build_relay_children(run, tier, [tier], NS))[("Deployment", "arithmetic-tier0-relay")]
    served_with(relay, "relay-cert")
    assert b.resolve_pool_relays(run, pool, [tier], NS) == [f"https://arithmetic-tier0-relay.{NS}.svc:8080"]
    # a tier above it pulls from it by https://, and serves plain HTTP itself
    plain = tier.spec.tls.model_copy(update={"secret_name": None})
    edge = tier.model_copy(
        update={
            "metadata": tier.metadata.model_copy(update={"name": "edge"}),
            "spec": tier.spec.model_copy(update={"tier": 1, "tls": plain}),
        }
    )
    assert b.resolve_upstream(run, edge, [tier, edge], NS) == f"https://arithmetic-tier0-relay.{NS}.svc:8080"
    assert b.resolve_pool_relays(run, pool, [tier, edge], NS) == [f"http://edge-relay.{NS}.svc:8080"]
    edge_relay = _by_kind_and_name(b.build_relay_children(run, edge, [tier, edge], NS))[("Deployment", "edge-relay")]
    assert not flags(edge_relay) and probe_schemes(edge_relay) == {None}


@pytest.mark.parametrize("source", ["caSecret", "caConfigMap"])
def test_the_runs_ca_bundle_reaches_the_relays_and_workers_and_no_other_pod(source):
    data = bundle(tls={source: "fleet-ca"})
    run, pool, [tier] = data.run, data.pools[0], data.relays
    items = [{"key": "ca.crt", "path": "ca.crt"}]
    volume = (
        {"name": "tls-ca", "secret": {"secretName": "fleet-ca", "items": items}}
        if source == "caSecret"
        else {"name": "tls-ca", "configMap": {"name": "fleet-ca", "items": items}}
    )
    clients = [
        _by_kind_and_name(b.build_relay_children(run, tier, [tier], NS))[("Deployment", "arithmetic-tier0-relay")],
        b.build_rollout_workload(run, pool, b.resolve_pool_relays(run, pool, [tier], NS), NS),
    ]
    for workload in clients:
        assert _env(workload)[env.TLS_CA_FILE] == CA_FILE
        assert {"name": "tls-ca", "mountPath": "/var/run/rlfleet/tls-ca", "readOnly": True} in _container(workload)[
            "volumeMounts"
        ]
        assert volume in _pod_volumes(workload)
        kubernetes_validate.validate(workload, "1.30", strict=True)
    for child in b.build_run_children(run, NS):  # trainer, verifier, origin: no https:// peer
        if child["kind"] in ("Deployment", "StatefulSet"):
            assert env.TLS_CA_FILE not in _env(child) and "fleet-ca" not in str(child), child["metadata"]["name"]
    need = SecretNeed("fleet-ca", "spec.tls.caSecret", ("ca.crt",))
    remote = bundle(tls={source: "fleet-ca"}, remote=True).run  # another cluster's copy of the run
    assert (need in run_secrets(run) and need in run_secrets(remote)) == (source == "caSecret")


def test_a_ca_bundle_is_named_once():
    with pytest.raises(ConfigError, match="caSecret or in caConfigMap, not both"):
        bundle(tls={"caSecret": "a", "caConfigMap": "b"})
    spec = crd.build_crd(names.RLRUN)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    [rule] = spec["properties"]["tls"]["x-kubernetes-validations"]  # kubectl apply refuses it too
    assert rule["rule"] == "!has(self.caSecret) || !has(self.caConfigMap)" and "not both" in rule["message"]
