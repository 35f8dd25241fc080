"""The local launcher's plan: the processes `rlfleet run` starts (pure; nothing is started)."""

from __future__ import annotations

import sys

from rlfleet.cli import build_parser
from rlfleet.config import load_bundle
from rlfleet.local.launcher import take_tracker_credentials
from rlfleet.local.plan import Process, endpoints, plan
from rlfleet.wire.components import TRAINER
from tests.support import REPO

ROOT = REPO


def test_trainer_replicas_are_ranks_with_the_torchrun_environment_of_the_trainer_pods(tmp_path):
    config = tmp_path / "rlrun.yaml"
    text = (ROOT / "examples" / "arithmetic" / "rlrun.yaml").read_text()
    config.write_text(
        text.replace("    maxAsyncLevel: 2\n", "    maxAsyncLevel: 2\n    replicas: 3\n    sharding: fsdp\n")
    )
    comps = plan(load_bundle(config), config, tmp_path)
    trainers = [c for c in comps if c.kind == TRAINER]
    assert [c.name for c in trainers] == ["trainer/2", "trainer/1", "trainer"], "rank 0 last: the launcher waits on it"
    assert [c.env["GROUP_RANK"] for c in trainers] == ["2", "1", "0"]
    assert {c.env["WORLD_SIZE"] for c in trainers} == {"3"}
    assert len({(c.env["MASTER_ADDR"], c.env["MASTER_PORT"]) for c in trainers}) == 1, "one rendezvous"
    assert len({c.log for c in trainers}) == 3
    assert all("--ranks" not in c.argv for c in trainers), "a replica of one rank is the rank"


def test_a_trainer_replica_of_several_ranks_is_one_process_that_starts_them(tmp_path):
    config = tmp_path / "rlrun.yaml"
    text = (ROOT / "examples" / "arithmetic" / "rlrun.yaml").read_text()
    config.write_text(
        text.replace("    maxAsyncLevel: 2\n", "    maxAsyncLevel: 2\n    replicas: 2\n    ranksPerReplica: 2\n")
    )
    trainers = [c for c in plan(load_bundle(config), config, tmp_path) if c.kind == TRAINER]
    assert [(c.name, c.rank, c.env["GROUP_RANK"]) for c in trainers] == [("trainer/1", 2, "1"), ("trainer", 0, "0")]
    assert {c.env["WORLD_SIZE"] for c in trainers} == {"4"}, "2 replicas x 2 ranks"
    assert all(c.argv[c.argv.index("--ranks") + 1] == "2" for c in trainers)


def test_one_trainer_replica_gets_no_distributed_environment(tmp_path):
    config = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
    trainers = [c for c in plan(load_bundle(config), config, tmp_path) if c.kind == TRAINER]
    assert [(c.name, c.env) for c in trainers] == [("trainer", {})]


def test_each_process_s_command_line_is_built_from_its_record(tmp_path):
    config = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
    procs = plan(load_bundle(config), config, tmp_path, steps=7)
    by_name = {p.name: p for p in procs}
    assert list(by_name) == [
        "origin",
        "relay/arithmetic-tier0-0",
        "verifier/0",
        "rollout/arithmetic-cpu-0",
        "rollout/arithmetic-cpu-1",
        "trainer",
    ]
    origin, relay, verifier = by_name["origin"], by_name["relay/arithmetic-tier0-0"], by_name["verifier/0"]
    relay_url, cache = f"http://127.0.0.1:{relay.port}", tmp_path / "cache"
    head = [sys.executable, "-m", "rlfleet.cli"]
    argv = {p.name: p.argv[3:] for p in procs}
    origin_url, common = f"http://127.0.0.1:{origin.port}", ["--config", str(config)]
    relay_args = ["--port", str(relay.port), "--upstream", origin_url, "--cache-dir", str(cache / "arithmetic-tier0-0")]
    verifier_args = ["--consumer", "verifier-0", "--origin-url", origin_url, "--cache-dir", str(cache / "verifier-0")]

    def worker(i: int) -> list[str]:
        worker_id = f"arithmetic-cpu-{i}"
        return [
            "--worker-id",
            worker_id,
            "--pool",
            "arithmetic-cpu",
            "--relay-url",
            relay_url,
            "--cache-dir",
            str(cache / worker_id),
        ]

    def metrics(name: str) -> list[str]:  # every process serves /metrics on a port of its own
        return ["--metrics-port", str(by_name[name].metrics_port)]

    assert argv == {
        "origin": ["origin", *common, "--port", str(origin.port), *metrics("origin")],
        "relay/arithmetic-tier0-0": [
            "relay",
            *common,
            *relay_args,
            "--keep-versions",
            "3",
            *metrics("relay/arithmetic-tier0-0"),
        ],
        "verifier/0": [
            "verifier",
            *common,
            *verifier_args,
            "--api-port",
            str(verifier.api_port),
            *metrics("verifier/0"),
        ],
        "rollout/arithmetic-cpu-0": ["rollout", *common, *worker(0), *metrics("rollout/arithmetic-cpu-0")],
        "rollout/arithmetic-cpu-1": ["rollout", *common, *worker(1), *metrics("rollout/arithmetic-cpu-1")],
        "trainer": ["trainer", *common, "--output-dir", str(tmp_path), "--steps", "7", *metrics("trainer")],
    }
    ports = [port for p in procs for port in (*p.http_ports, p.metrics_port)]
    assert len(set(ports)) == len(ports), "two processes on one port"
    assert all(p.argv[:3] == head for p in procs)
    assert [p.log.name for p in procs] == [
        "origin.log",
        "relay-arithmetic-tier0-0.log",
        "verifier-0.log",
        "rollout-arithmetic-cpu-0.log",
        "rollout-arithmetic-cpu-1.log",
        "trainer.log",
    ]
    parser = build_parser()
    for p in procs:  # the CLI reads back what the record says
        args = parser.parse_args(p.argv[3:])
        assert args.command == p.kind
        for option in ("port", "upstream", "pool", "relay_urls", "cache_dir", "api_port", "steps", "metrics_port"):
            if getattr(p, option) not in (None, []):
                assert getattr(args, option) == getattr(p, option), (p.name, option)
    assert [c.done_on_success for c in map(Process.component, procs)] == [False] * 5 + [True]


def test_endpoints_are_the_http_ports_the_registry_names(tmp_path):
    config = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
    procs = plan(load_bundle(config), config, tmp_path)
    by_name = {p.name: p for p in procs}
    assert endpoints("redis://r", procs) == {
        "redis": "redis://r",
        "http": {
            "origin": f"http://127.0.0.1:{by_name['origin'].port}",
            "relay/arithmetic-tier0-0": f"http://127.0.0.1:{by_name['relay/arithmetic-tier0-0'].port}",
            "verifier/0": f"http://127.0.0.1:{by_name['verifier/0'].api_port}",
        },
        "metrics": {name: f"http://127.0.0.1:{p.metrics_port}/metrics" for name, p in by_name.items()},
    }
    assert len(endpoints("redis://r", procs)["metrics"]) == len(procs) == 6


def test_a_local_run_counts_every_trainer_rank_against_the_machine(tmp_path):
    import pytest

    from rlfleet.config import ConfigError
    from rlfleet.local.plan import check_local_size

    config = tmp_path / "rlrun.yaml"
    text = (ROOT / "examples" / "arithmetic" / "rlrun.yaml").read_text()
    config.write_text(text.replace("    maxAsyncLevel: 2\n", "    maxAsyncLevel: 2\n    ranksPerReplica: 64\n"))
    processes = plan(load_bundle(config), config, tmp_path)
    assert len(processes) < 64
    with pytest.raises(ConfigError, match=r"start 69 processes .* or trainer.ranksPerReplica"):
        check_local_size(processes, str(config))


def test_only_the_trainer_gets_the_trackers_credentials():
    environ = {"WANDB_API_KEY": "k", "MLFLOW_TRACKING_TOKEN": "t", "HOME": "/root"}
    assert take_tracker_credentials(environ) == {"WANDB_API_KEY": "k", "MLFLOW_TRACKING_TOKEN": "t"}
    assert environ == {"HOME": "/root"}  # what every other process starts with


def test_a_run_that_admits_outside_workers_plans_an_ingest_announcing_its_own_relays(tmp_path):
    import pytest

    from rlfleet.config import ConfigError
    from rlfleet.local.plan import check_local_size, join_url
    from rlfleet.services.ingest.door import local_admission_problems
    from tests.runs import pool, relay_tier, rlrun, write_rlrun

    def planned(admission: dict, replicas: int = 0):
        config = write_rlrun(
            tmp_path / "rlrun.yaml",
            rlrun("door", ingest={"admission": admission}),
            pool("p", "door", replicas=replicas),
            relay_tier("t0", "door", replicas=2),
        )
        bundle = load_bundle(config)
        return bundle, plan(bundle, config, tmp_path)

    bundle, procs = planned({"mode": "open"})
    [ingest] = [p for p in procs if p.kind == "ingest"]
    relays = [f"http://127.0.0.1:{p.port}" for p in procs if p.kind == "relay"]
    assert ingest.relay_urls == relays and len(relays) == 2  # the relays the run's own pools download from
    args = build_parser().parse_args(ingest.argv[3:])
    assert (args.command, args.port, args.relay_urls) == ("ingest", ingest.port, relays)
    assert join_url(procs, bundle) == f"http://127.0.0.1:{ingest.port}/v1/door"
    assert endpoints("redis://r", procs, join_url(procs, bundle))["join"] == join_url(procs, bundle)
    check_local_size(procs, "rlrun.yaml")  # no worker of its own: the outside workers feed the trainer
    assert local_admission_problems(bundle.run.spec) == []

    _, procs = planned({"mode": "open", "relayUrls": ["https://relay.example.org"]})
    assert [p.relay_urls for p in procs if p.kind == "ingest"] == [[]], "the spec's public relays are announced"
    bundle, procs = planned({"mode": "tokens"})
    assert not [p for p in procs if p.kind == "ingest"] and join_url(procs, bundle) is None
    with pytest.raises(ConfigError, match="or admit outside workers"):
        check_local_size(procs, "rlrun.yaml")
    tokens = rlrun("door", ingest={"tokensFile": "tokens.yaml"})
    config = write_rlrun(tmp_path / "tokens.yaml", tokens, pool(run="door"))
    procs = plan(load_bundle(config), config, tmp_path)  # workers with written tokens submit there; none join
    assert [p.kind for p in procs].count("ingest") == 1 and join_url(procs, load_bundle(config)) is None

    bundle, _ = planned({"mode": "invite"}, replicas=1)
    assert "invitesFile: mode invite needs" in local_admission_problems(bundle.run.spec)[0]
    (tmp_path / "codes.yaml").write_text("{not: a list}")
    bundle, _ = planned({"mode": "invite", "invitesFile": str(tmp_path / "codes.yaml")}, replicas=1)
    assert "must be a non-empty list of invite codes" in local_admission_problems(bundle.run.spec)[0]


def test_the_components_started_are_the_kinds_of_the_plan_in_its_order(tmp_path):
    from rlfleet.local.plan import components_started
    from tests.runs import extended, pool, relay_tier, rlrun, write_rlrun

    example = (ROOT / "examples" / "arithmetic" / "rlrun.yaml").read_text()
    bundles = {"example": example, "relays": extended(example, relay_tier("t0", replicas=2))}
    for name, text in bundles.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    write_rlrun(tmp_path / "open.yaml", rlrun(ingest={"admission": {"mode": "open"}}), pool(replicas=0))
    write_rlrun(tmp_path / "default-pool.yaml", rlrun(ingest={"tokensFile": "tokens.yaml"}))
    for config in sorted(tmp_path.glob("*.yaml")):
        bundle = load_bundle(config)
        kinds = list(dict.fromkeys(p.kind for p in plan(bundle, config, tmp_path)))
        assert components_started(bundle) == kinds, config.name
    assert components_started(load_bundle(tmp_path / "open.yaml")) == ["origin", "verifier", "ingest", "trainer"]
    assert "relay" in components_started(load_bundle(tmp_path / "relays.yaml"))
