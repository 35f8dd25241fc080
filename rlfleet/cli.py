"""`rlfleet` command line: one subcommand per process, plus `run`, `validate` and `toploc`.

Each subcommand parses its arguments and hands off to one function; heavy imports (torch)
happen inside those functions, after argument parsing.
"""
from __future__ import annotations

import argparse
import sys


def _add_component_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="RLRun YAML (the same file `rlfleet run` and kubectl take)")
    p.add_argument("--redis-url", default=None, help="overrides spec.redis.url (env RLFLEET_REDIS_URL)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = none)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet", description="Asynchronous decentralized RL for language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run a whole RLRun on this machine (embedded Redis, local store)")
    p.add_argument("file", help="multi-document RLRun YAML")
    p.add_argument("--run-dir", default=None, help="where logs, metrics and the summary go (default runs/NAME-TIMESTAMP)")
    p.add_argument("--steps", type=int, default=None, help="override spec.trainer.steps")
    p.add_argument("--no-progress", action="store_true", help="print one line per step instead of a progress bar")

    p = sub.add_parser("validate", help="check a config file and print every error with its field path")
    p.add_argument("file")

    p = sub.add_parser("trainer", help="GRPO trainer process")
    _add_component_args(p)
    p.add_argument("--output-dir", default=None, help="where metrics.jsonl is written")
    p.add_argument("--steps", type=int, default=None, help="override spec.trainer.steps")

    p = sub.add_parser("rollout", help="rollout worker process")
    _add_component_args(p)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--pool", default=None, help="InferencePool name (default: the first in the file)")
    p.add_argument("--relay-url", action="append", default=[], help="relay base URL (repeatable)")
    p.add_argument("--cache-dir", required=True, help="where downloaded policy versions are kept")

    p = sub.add_parser("verifier", help="TOPLOC verification gate process")
    _add_component_args(p)
    p.add_argument("--consumer", required=True, help="consumer name in the verifier group")
    p.add_argument("--origin-url", required=True, help="trusted checkpoint source (origin or relay base URL)")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--api-port", type=int, default=0, help="HTTP API port: /verify, /workers, /healthz, /metrics, /docs (0 = none)")
    p.add_argument("--api-host", default="127.0.0.1", help="HTTP API bind address (0.0.0.0 in a pod)")

    p = sub.add_parser("ingest", help="authenticated HTTP ingest of rollout groups from workers outside the cluster")
    _add_component_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens-file", default=None, help="YAML/JSON {workerId: token} file (overrides spec.ingest.tokensFile)")

    p = sub.add_parser("origin", help="Shardcast origin: serves policy versions from the store over HTTP")
    _add_component_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)

    p = sub.add_parser("relay", help="Shardcast relay: pulls versions from upstream, checks them, serves them")
    _add_component_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="upstream base URL (origin or a lower-tier relay)")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--keep-versions", type=int, default=None)
    p.add_argument("--max-disk-bytes", type=int, default=None,
                   help="disk bound of the cache (default spec.shardcast.relayMaxDiskBytes; none: keep-versions only)")

    p = sub.add_parser("operator", help="Kubernetes operator (kopf): reconciles RLRun, InferencePool and RelayTier")
    p.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable; default: all)")
    p.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--verbose", action="store_true")

    p = sub.add_parser("crds", help="write the CustomResourceDefinitions generated from the config models")
    p.add_argument("--out", default=None, help="directory to write one YAML file per CRD into (default: print to stdout)")

    p = sub.add_parser("toploc", help="TOPLOC tools")
    tsub = p.add_subparsers(dest="toploc_command", required=True)
    c = tsub.add_parser("conformance", help="check this implementation against a directory of reference case files")
    c.add_argument("dir")
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
    if args.command == "validate":
        from rlfleet.config import load_bundle

        bundle = load_bundle(args.file)
        print(f"{args.file}: valid: RLRun {bundle.run.metadata.name}, "
              f"{len(bundle.pools)} InferencePool, {len(bundle.relays)} RelayTier")
        return 0
    if args.command == "run":
        from rlfleet.launcher import run_local

        return run_local(args.file, run_dir=args.run_dir, steps=args.steps, progress=not args.no_progress)
    if args.command == "operator":
        from rlfleet.k8s.operator import run_operator

        return run_operator(namespaces=args.namespace, liveness=args.liveness, verbose=args.verbose)
    if args.command == "crds":
        from rlfleet.k8s.crd import crd_files, write_crds

        if args.out:
            for path in write_crds(args.out):
                print(path)
        else:
            print("---\n".join(crd_files().values()), end="")
        return 0
    if args.command == "toploc":
        from rlfleet.services.toploc.conformance import run_conformance_cli

        return run_conformance_cli(args.dir)
    if args.command == "trainer":
        from rlfleet.services.trainer.main import main as component_main
    elif args.command == "rollout":
        from rlfleet.services.rollout.main import main as component_main
    elif args.command == "verifier":
        from rlfleet.services.toploc.gate import main as component_main
    elif args.command == "ingest":
        from rlfleet.services.ingest.app import main as component_main
    elif args.command == "origin":
        from rlfleet.services.shardcast.origin import main as component_main
    elif args.command == "relay":
        from rlfleet.services.shardcast.relay import main as component_main
    else:  # argparse rejects anything else
        raise AssertionError(args.command)
    return component_main(args)


if __name__ == "__main__":
    sys.exit(main())
