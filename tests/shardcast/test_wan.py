"""Shardcast over a simulated WAN (testbed): `benchmarks/broadcast.py --wan` on its `small`
topology, 64 MiB through 1 relay to 4 clients (origin up 400 Mbit/s, relay up 800, clients down
200), and the same clients straight from the origin. Every client must hold the verified version
and the testbed must leave no namespace behind. Root only (skipped with the reason otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed import unavailable_reason
from testbed.commands import NETNS_ETC, namespaces
from tests.support import REPO

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]


def test_small_wan_broadcast_reaches_every_client_verified_and_cleans_up(tmp_path):
    out = tmp_path / "wan.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "broadcast.py"), "--wan", "--topology", "small"]
        + ["--systems", "tree", "direct", "--json", str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = json.loads(out.read_text())["runs"][0]
    assert (run["topology"]["clients"], run["topology"]["relays"], run["topology"]["size_mib"]) == (4, 1, 64)
    for name, system in run["systems"].items():
        # a client reports only after fetch_version checked every shard against the signed manifest
        assert system["clients_ok"] == system["clients"] == 4, name
        assert system["seconds"] is not None and system["bound_seconds"] > 0, name
        assert all(p[-1][1] >= 64 << 20 for p in system["client_progress"]), name  # it all came over the links
    tree = run["systems"]["tree"]
    assert len(tree["relay_pull_seconds"]) == 1  # the relay pulled and verified the whole version
    assert tree["relay_bytes_out"][0] >= 4 * (64 << 20)  # and served every client
    assert run["systems"]["direct"]["relay_bytes_out"] == []
    tag = run["testbed"]
    assert not [ns for ns in namespaces() if ns.startswith(tag)]
    assert not list(NETNS_ETC.glob(f"{tag}-*"))
