"""Two `rlfleet operator --peering` processes on one emulated cluster: one reconciles, the other stands by
and takes over when the first dies (rlfleet/operator/peering.py).

These tests run their own emulator and operators (not the session's standalone one, which would
reconcile too). Each operator logs in with its own bearer token, so the emulator's request record
says which of them made each request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from rlfleet.operator import peering
from rlfleet.operator.options import OperatorOptions
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RunKeys, encode_json
from tests.operator.cluster import EmulatedCluster
from tests.operator.conftest import CHART_ENV, RESYNC_INTERVAL_S, stop_operator, wait_until_healthy
from tests.operator.kubectl import apply_example, get, patch, redis_db
from tests.operator.rbac import denied
from tests.support import CHART, redis_from_url, render_chart, scrape, wait_for

PEERING = "rlfleet-ha-test"
LIFETIME_S = 4  # keep-alives every second; a killed leader's entry expires within 4 s
WRITES = {"create", "patch", "update", "delete"}


class Operator:
    """One `rlfleet operator --peering` process logged in to the emulator with its own token."""

    def __init__(self, emulator: EmulatedCluster, workdir: Path, name: str):
        self.name, self.log = name, workdir / f"{name}.log"
        kubeconfig = emulator.kubeconfig(workdir / f"{name}.kubeconfig", token=name)
        self.port, self.metrics_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update(
            KUBECONFIG=str(kubeconfig),
            RLFLEET_RESYNC_INTERVAL=RESYNC_INTERVAL_S,
            PYTHONUNBUFFERED="1",
            POD_ID=name,  # kopf's peer id, as the chart sets it from the pod's name
            **CHART_ENV,
        )
        command = [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "operator",
            "--liveness",
            f"http://127.0.0.1:{self.port}/healthz",
        ]
        command += [
            "--peering",
            PEERING,
            "--peering-lifetime",
            str(LIFETIME_S),
            "--metrics-port",
            str(self.metrics_port),
        ]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_started(self) -> None:
        wait_until_healthy(self.process, self.port, self.log, self.name)

    def active(self) -> float | None:
        """Its rlfleet_operator_active gauge: 1 while it reconciles, 0 on standby."""
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics").get(("rlfleet_operator_active", frozenset()))

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            stop_operator(self.process)


@pytest.fixture
def ha_emulator():
    with EmulatedCluster() as emulated:
        yield emulated


@pytest.fixture
def operators(ha_emulator, tmp_path):
    """Start operators by name, oldest first; all are stopped afterwards."""
    started: list[Operator] = []

    def start(name: str) -> Operator:
        operator = Operator(ha_emulator, tmp_path, name)
        started.append(operator)
        operator.wait_started()
        return operator

    yield start
    for operator in started:
        operator.stop()


def peers(api: str) -> dict:
    r = requests.get(f"{api}/apis/{peering.GROUP}/{peering.VERSION}/{peering.PLURAL}/{PEERING}", timeout=5)
    return (r.json().get("status") or {}) if r.status_code == 200 else {}


def writes_by(emulator: EmulatedCluster, token: str) -> list:
    """What `token` wrote, besides its own peering keep-alives: the objects it reconciles, and Events."""
    return [c for c in emulator.cluster.calls if c.token == token and c.verb in WRITES and c.group != peering.GROUP]


def test_two_operators_one_acts_the_other_takes_over_when_it_is_killed(ha_emulator, operators, redis_url):
    api, ns, url = ha_emulator.url, "t-ha", redis_db(redis_url, 13)
    leader = operators("operator-a")
    standby = operators("operator-b")  # started later: a lower priority, so it stands by
    both = wait_for("both peers in the peering object", lambda: (p := peers(api)) and len(p) == 2 and p, timeout=20)
    assert both["operator-a"]["priority"] > both["operator-b"]["priority"], "the older replica must lead"
    assert both["operator-a"]["lifetime"] == LIFETIME_S
    wait_for("the leader's gauge at 1", lambda: leader.active() == 1, timeout=10)
    wait_for("the standby's gauge at 0", lambda: standby.active() == 0, timeout=10)

    apply_example(api, ns, url)
    wait_for("the run's children", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout"), timeout=30)
    wait_for("the run's status", lambda: get(api, "RLRun", ns, "arithmetic")["status"]["phase"], timeout=30)
    time.sleep(3 * float(RESYNC_INTERVAL_S))  # three timer rounds (and keep-alives) the standby sits out
    assert writes_by(ha_emulator, "operator-a"), f"the leader wrote nothing: {leader.tail()}"
    assert not writes_by(ha_emulator, "operator-b"), f"the standby acted too: {writes_by(ha_emulator, 'operator-b')}"
    calls = ha_emulator.cluster.calls
    standby_reads = {c.resource for c in calls if c.token == "operator-b" and c.group == "rlfleet.io"}
    assert not standby_reads, f"the standby watched the rlfleet kinds while paused: {standby_reads}"

    leader.process.send_signal(signal.SIGKILL)  # no goodbye: its entry stays until it expires
    leader.process.wait()
    killed = time.monotonic()
    # the run moves on after the kill: the standby must scale the pool and read the progress
    patch(api, "InferencePool", ns, "arithmetic-cpu", {"spec": {"replicas": 3}}, sub="scale")
    client = redis_from_url(url)
    client.xadd(RunKeys("arithmetic").policy, encode_json({"version": 1, "time": time.time(), "reward": 0.5}))
    client.close()
    wait_for(
        "the standby to scale the pool",
        lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout")["spec"]["replicas"] == 3,
        timeout=LIFETIME_S + 30,
    )
    failover_s = time.monotonic() - killed
    wait_for("progress in status", lambda: get(api, "RLRun", ns, "arithmetic")["status"].get("step") == 1, timeout=20)
    assert writes_by(ha_emulator, "operator-b"), f"the scale came from elsewhere: {standby.tail()}"
    wait_for("the new leader's gauge at 1", lambda: standby.active() == 1, timeout=10)
    assert "operator-a" not in peers(api), "the dead leader's entry stayed in the peering object"
    print(
        f"failover: the standby applied a change {failover_s:.1f}s after the leader's SIGKILL (lifetime {LIFETIME_S}s)"
    )

    # every request both made, peering included, is one the chart grants with operator.replicas > 1
    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(CHART) as chart:
        objects = render_chart(chart, {"operator": {"replicas": 2}})
    calls = [c for c in ha_emulator.cluster.calls if c.token.startswith("operator-")]
    refused = sorted({(c.verb, c.group, c.resource) for c in denied(calls, objects)})
    assert not refused, f"requests the chart's RBAC (operator.replicas: 2) denies: {refused}"


def test_a_stopped_leader_leaves_the_peering_and_the_standby_resumes_at_once(ha_emulator, operators):
    """SIGTERM (a rolling update, a drained node): kopf removes the leader's entry on the way out, so
    the standby need not wait out the lifetime."""
    api = ha_emulator.url
    leader = operators("operator-a")
    operators("operator-b")
    wait_for("both peers", lambda: len(peers(api)) == 2, timeout=20)
    calls = ha_emulator.cluster.calls
    assert not [c for c in calls if c.token == "operator-b" and c.group == "rlfleet.io"], "the standby acted"
    leader.stop()
    assert leader.process.returncode == 0, leader.tail()
    assert list(peers(api)) == ["operator-b"], "the stopped leader's entry is still there"
    wait_for(
        "the standby watching the rlfleet kinds",
        lambda: (
            {c.resource for c in calls if c.token == "operator-b" and c.verb == "watch" and c.group == "rlfleet.io"}
            >= {"rlruns", "inferencepools", "relaytiers"}
        ),
        timeout=20,
    )


def test_peering_options_are_checked(ha_emulator, tmp_path):
    with pytest.raises(SystemExit, match="--peering-lifetime=1 must be at least 2 seconds"):
        OperatorOptions.from_env(peering_name=PEERING, peering_lifetime_s=1)
    assert OperatorOptions.from_env().peering_name is None, "standalone unless --peering is given"
    assert peering.priority(2_000_000_000) > peering.priority(3_000_000_000), "older replicas lead"


def test_the_peering_object_is_made_once_and_a_refusal_says_what_to_grant(ha_emulator, tmp_path):
    from rlfleet.operator.kube import connect

    client = connect(str(ha_emulator.kubeconfig(tmp_path / "config")))
    try:
        assert peering.ensure_peering_object(client, "made-once") is True
        assert peering.ensure_peering_object(client, "made-once") is False, "a second replica finds it made"
        ha_emulator.cluster.forbidden.add((peering.PLURAL, None, None))  # a create names no object
        with pytest.raises(SystemExit, match="grant create, get, list, watch and patch on clusterkopfpeerings"):
            peering.ensure_peering_object(client, "refused")
    finally:
        client.close()
