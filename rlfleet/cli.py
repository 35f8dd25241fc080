"""`rlfleet` command line: one subcommand per process, plus `run`, `report`, `validate`, `filter`, `join`, `render`,
`crds` and `toploc`. The operator's own subcommands (`operator`, `operator-uninstall`, `render`, `crds`) are
declared beside it, in rlfleet/operator/commands.py.

Each subcommand parses its arguments and hands off to one function; a component's `main` takes
its typed options (a dataclass whose fields are the argument names), and heavy imports (torch)
happen after argument parsing. Defaults of run settings live in the config models, so an
argument that overrides one defaults to None here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

from rlfleet.operator import commands as operator_commands
from rlfleet.wire.components import COMPONENTS, INGEST, ORIGIN, RELAY, ROLLOUT, TRAINER, VERIFIER


def _add_component_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", required=True, type=Path, help="RLRun YAML (the same file `rlfleet run` and kubectl take)"
    )
    p.add_argument("--redis-url", default=None, help="overrides spec.redis.url (env RLFLEET_REDIS_URL)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics and /healthz port (0 = none)")


def _trainer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", default=None, type=Path, help="where metrics.jsonl is written")
    p.add_argument("--steps", type=int, default=None, help="override spec.trainer.steps")
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="rank processes of this replica (spec.trainer.ranksPerReplica): with N > 1 this process starts N "
        "ranks with the torchrun environment (rlfleet/services/trainer/ranks.py)",
    )
    p.add_argument(
        "--hold-when-done",
        action="store_true",
        help="after the last step wait for SIGTERM instead of exiting (what the operator's pods do)",
    )


def _rollout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-id", required=True)
    p.add_argument("--pool", default=None, help="InferencePool name (default: the file's only pool)")
    p.add_argument("--relay-url", dest="relay_urls", action="append", default=[], help="relay base URL (repeatable)")
    p.add_argument("--cache-dir", required=True, type=Path, help="where downloaded policy versions are kept")


def _verifier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--consumer", required=True, help="consumer name in the verifier group")
    p.add_argument("--origin-url", required=True, help="trusted checkpoint source (origin or relay base URL)")
    p.add_argument("--cache-dir", required=True, type=Path)
    p.add_argument(
        "--api-port", type=int, default=0, help="HTTP API port: /verify, /workers, /healthz, /metrics, /docs (0 = none)"
    )
    p.add_argument("--api-host", default="127.0.0.1", help="HTTP API bind address (0.0.0.0 in a pod)")


def _ingest_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--tokens-file",
        default=None,
        type=Path,
        help="YAML/JSON {workerId: token} file (overrides spec.ingest.tokensFile)",
    )
    p.add_argument(
        "--invites-file",
        default=None,
        type=Path,
        help="YAML/JSON list of invite codes (overrides spec.ingest.admission.invitesFile)",
    )
    p.add_argument(
        "--relay-url",
        dest="relay_urls",
        action="append",
        default=[],
        help="relay base URL the run document announces (repeatable; overrides spec.ingest.admission.relayUrls)",
    )
    _tls_server_args(p)


def _tls_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-cert-file", default=None, type=Path, help="PEM certificate chain: serve HTTPS only (with --tls-key-file)"
    )
    p.add_argument("--tls-key-file", default=None, type=Path, help="PEM private key of --tls-cert-file")


def _origin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)


def _relay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="upstream base URL (origin or a lower-tier relay)")
    p.add_argument("--cache-dir", required=True, type=Path)
    p.add_argument(
        "--keep-versions", type=int, default=None, help="versions kept on disk (default spec.shardcast.keepVersions)"
    )
    p.add_argument(
        "--max-disk-bytes",
        type=int,
        default=None,
        help="disk bound of the cache (default spec.shardcast.relayMaxDiskBytes; none: keep-versions only)",
    )
    _tls_server_args(p)


# Each component's own arguments (the names of its options class's fields).
COMPONENT_ARGS = {
    TRAINER: _trainer_args,
    ROLLOUT: _rollout_args,
    VERIFIER: _verifier_args,
    INGEST: _ingest_args,
    ORIGIN: _origin_args,
    RELAY: _relay_args,
}


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="multi-document RLRun YAML")
    p.add_argument(
        "--run-dir", default=None, help="where logs, metrics and the summary go (default runs/NAME-TIMESTAMP)"
    )
    p.add_argument("--steps", type=int, default=None, help="override spec.trainer.steps")
    p.add_argument("--no-progress", action="store_true", help="print one line per step instead of a progress bar")
    p.add_argument(
        "--prometheus",
        action="store_true",
        help="start `prometheus` (when installed) on 127.0.0.1 beside the run to scrape every component; print its URL",
    )


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a run directory of `rlfleet run` (metrics.jsonl, workers.json, logs/)")


def _filter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="RLRun YAML with a math or code task (its model, dataset and sampling)")
    p.add_argument("--out", required=True, type=Path, help="JSONL file the rated rows are written to")
    p.add_argument("-k", type=int, default=8, help="completions per row (default 8)")
    p.add_argument("--max-rows", type=int, default=None, help="rate only the first N rows (and write only them)")
    p.add_argument("--engine", choices=["torch", "vllm", "auto"], default="torch", help="rollout engine")
    p.add_argument("--temperature", type=float, default=None, help="default: spec.sampling.temperature")
    p.add_argument("--max-tokens", type=int, default=None, help="default: spec.sampling.maxTokens")
    p.add_argument("--pass-reward", type=float, default=1.0, help="a completion passes at this reward or more")
    p.add_argument("--seed", type=int, default=0, help="seed of row 0's completions (row i: seed + i)")


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file")


def _join_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the run document: http(s)://INGEST/v1/RUN")
    p.add_argument("--code", default=None, help="invite code (runs with spec.ingest.admission.mode: invite)")
    p.add_argument(
        "--ca-file",
        default=None,
        type=Path,
        help="PEM CA bundle that checks the https:// ingest and relays (default: system store; RLFLEET_TLS_CA_FILE)",
    )
    p.add_argument("--engine", default=None, choices=["torch", "vllm"], help="default: the first the run admits")
    p.add_argument(
        "--work-dir", default=None, type=Path, help="config, credentials, cache (default ./rlfleet-join-RUN)"
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics and /healthz port (0 = none)")


def _toploc_args(p: argparse.ArgumentParser) -> None:
    tsub = p.add_subparsers(dest="toploc_command", required=True)
    c = tsub.add_parser("conformance", help="check this implementation against a directory of reference case files")
    c.add_argument("dir")


def _validate(args: argparse.Namespace) -> int:
    from rlfleet.config import load_bundle
    from rlfleet.wire.topology import bundle_graph

    bundle = load_bundle(args.file)
    bundle_graph(bundle, args.file)
    print(
        f"{args.file}: valid: RLRun {bundle.run.metadata.name}, "
        f"{len(bundle.pools)} InferencePool, {len(bundle.relays)} RelayTier"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    from rlfleet.local.launcher import run_local
    from rlfleet.models.sources import ModelSourceError

    try:
        return run_local(
            args.file, run_dir=args.run_dir, steps=args.steps, progress=not args.no_progress, prometheus=args.prometheus
        )
    except ModelSourceError as exc:  # before any component started: nothing to stop, nothing lost
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before any component started (e.g. while the builtin model is built)
        print("rlfleet: interrupted before the run started", file=sys.stderr)
        return 130


def _report(args: argparse.Namespace) -> int:
    from rlfleet.local.run_report import write_html_report

    if not (args.run_dir / "metrics.jsonl").is_file():
        print(
            f"rlfleet report: {args.run_dir}: no metrics.jsonl; give a run directory of `rlfleet run`", file=sys.stderr
        )
        return 2
    print(write_html_report(args.run_dir))
    return 0


def _filter(args: argparse.Namespace) -> int:
    from rlfleet.services.rollout.difficulty import FilterOptions
    from rlfleet.services.rollout.difficulty import main as filter_main

    fields = [f.name for f in dataclasses.fields(FilterOptions)]
    return filter_main(FilterOptions(**{name: getattr(args, name) for name in fields}))


def _join(args: argparse.Namespace) -> int:
    from rlfleet.services.rollout.join import JoinOptions
    from rlfleet.services.rollout.join import main as join_main

    return join_main(JoinOptions(args.url, args.code, args.engine, args.work_dir, args.metrics_port, args.ca_file))


def _toploc(args: argparse.Namespace) -> int:
    from rlfleet.proofs.conformance import run_conformance_cli

    return run_conformance_cli(args.dir)


# The subcommands around the components': name, one-line help, its arguments, what it runs (each action
# imports what it needs only once its subcommand is chosen). `run`, `report`, `filter` and
# `validate` come before the components' subcommands (COMPONENTS), the rest after them.
_BEFORE_COMPONENTS = (
    ("run", "run a whole RLRun on this machine (embedded Redis, local store)", _run_args, _run),
    ("report", "write RUN_DIR/report/index.html (and its PNGs) from a run directory", _report_args, _report),
    (
        "filter",
        "sample the base model on the run's dataset and write the rows with their solve rates",
        _filter_args,
        _filter,
    ),
    ("validate", "check a config file and print every error with its field path", _validate_args, _validate),
)
_AFTER_COMPONENTS = (
    ("join", "join a run through its ingest and work for it (from the run document URL alone)", _join_args, _join),
    *operator_commands.SUBCOMMANDS,
    ("toploc", "TOPLOC tools", _toploc_args, _toploc),
)

_ACTIONS = {name: action for name, _, _, action in (*_BEFORE_COMPONENTS, *_AFTER_COMPONENTS)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet", description="Asynchronous decentralized RL for language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_args, _ in _BEFORE_COMPONENTS:
        add_args(sub.add_parser(name, help=help_text))
    for spec in COMPONENTS.values():  # one subcommand per component of the registry, in its order
        p = sub.add_parser(spec.name, help=spec.help)
        _add_component_args(p)
        COMPONENT_ARGS[spec.name](p)
    for name, help_text, add_args, _ in _AFTER_COMPONENTS:
        add_args(sub.add_parser(name, help=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rlfleet.config import ConfigError

    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(exc.report(), file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in _ACTIONS:
        return _ACTIONS[args.command](args)
    spec = COMPONENTS[args.command]  # argparse rejects any other command
    module = importlib.import_module(spec.module)
    options_cls = getattr(module, spec.options)
    options = options_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(options_cls)})
    return getattr(module, spec.main)(options)


if __name__ == "__main__":
    sys.exit(main())
