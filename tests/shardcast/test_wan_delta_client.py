"""The client role of `benchmarks/broadcast.py --wan --delta` (benchmarks/delta.py `delta_client`) on plain
127.0.0.1, without a testbed: a process that follows v0..v2 through an origin must install each version
verified, taking v0 whole and v1, v2 as deltas against the version it holds, and report what it received."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from rlfleet.config import DeltaSpec
from rlfleet.services.shardcast import origin
from rlfleet.versions.publish import PolicyPublisher, local_entries
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import open_store
from tests.support import REPO, serving, trained_versions

RUN = "delta-bench"  # benchmarks/delta.py RUN: the run the role follows


def test_delta_client_role_installs_each_version_from_a_delta_against_the_one_it_holds(tmp_path):
    private, public = generate_keypair(tmp_path / "keys")
    sources = trained_versions(tmp_path / "src", 3, "bfloat16")
    store = open_store(f"file://{tmp_path / 'store'}")
    spec = DeltaSpec(full_every=10**6, max_ratio=1.0, max_chain_ratio=100.0)  # every version after v0 a delta
    publisher = PolicyPublisher(store, RUN, spec, make_signer(load_private_key(private)), 8192)
    for v, src in enumerate(sources):
        shutil.copytree(src, tmp_path / f"copy{v}")
        publisher.publish(v, tmp_path / f"copy{v}")
    publisher.close()
    whole = sum(e.size for e in local_entries(sources[0]))
    dest = tmp_path / "client"
    with serving(origin.make_app(store, RUN)) as url:
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "broadcast.py"), "--delta-client", json.dumps([url])]
            + [str(dest), public, json.dumps([0, 1, 2])],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "waiting"
    rows = [json.loads(line) for line in lines[1:]]
    assert [r["version"] for r in rows] == [0, 1, 2]
    assert rows[0]["report"]["kinds"] == ["full"] and rows[0]["bytes"] >= whole
    for r in rows[1:]:
        assert r["report"]["kinds"] == ["delta"] and not r["report"]["rejected"]
        assert 0 < r["bytes"] < 0.5 * whole
        assert r["first"] <= r["last"] <= r["done"]
    want = {e.name: e.sha256 for e in local_entries(sources[2])}
    assert {e.name: e.sha256 for e in local_entries(dest / "v2")} == want
    assert not (dest / "v0").exists()  # it keeps the version it holds, not the one before
