"""The operator's subcommands of the command line (rlfleet/cli.py): `rlfleet operator`, `operator-uninstall`,
`render` and `crds`, each as its arguments and the function it runs. Only argparse is imported here: an action
imports what it runs once its subcommand is chosen, so the command line never loads kopf or the Kubernetes
client for another subcommand."""

from __future__ import annotations

import argparse


def _operator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable; default: all)"
    )
    p.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--verbose", action="store_true")
    p.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="run as one of several replicas: kopf peering through ClusterKopfPeering NAME, the oldest acts",
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=None,
        metavar="SECONDS",
        help="with --peering: a replica silent this long counts as dead and a standby takes over (default 20)",
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics of the operator's reconciles (0 = none)"
    )


def _uninstall_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--release", required=True, help="Helm release name (its runs carry app.kubernetes.io/instance)")
    p.add_argument(
        "--namespace", "-n", action="append", default=[], help="namespace the operator watches (default: all)"
    )
    p.add_argument("--delete-runs", default="release", choices=["release", "all"], help="release: refuse other runs")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for the operator to let the runs go")


def _render_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="multi-document RLRun YAML, with what a cluster needs (spec.redis, spec.store, ...)")
    p.add_argument("--namespace", "-n", default="default", help="namespace of the objects (default: default)")
    p.add_argument("--image", default=None, help="image of components that name none (the operator's RLFLEET_IMAGE)")
    p.add_argument("--gpu-image", default=None, help="image of components with GPUs (RLFLEET_GPU_IMAGE)")
    p.add_argument("--pull-policy", default=None, choices=["Always", "IfNotPresent", "Never"], help="imagePullPolicy")
    p.add_argument(
        "--pull-secret", dest="pull_secrets", action="append", default=[], help="imagePullSecrets name (repeatable)"
    )


def _crds_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", default=None, help="directory to write one YAML file per CRD into (default: print to stdout)"
    )


def _operator(args: argparse.Namespace) -> int:
    from rlfleet.operator.handlers import run_operator
    from rlfleet.operator.options import OperatorOptions

    options = OperatorOptions.from_env(
        args.namespace, args.liveness, args.verbose, args.peering, args.peering_lifetime, args.metrics_port
    )
    return run_operator(options)


def _operator_uninstall(args: argparse.Namespace) -> int:
    from rlfleet.operator.kube import connect
    from rlfleet.operator.uninstall import uninstall

    client = connect()
    try:
        return uninstall(client, args.release, tuple(args.namespace), args.delete_runs, args.timeout)
    finally:
        client.close()


def _render(args: argparse.Namespace) -> int:
    from rlfleet.config import load_bundle
    from rlfleet.operator import names
    from rlfleet.operator.pods import ClusterDefaults
    from rlfleet.operator.render import render_text

    defaults = ClusterDefaults(
        image=args.image or names.DEFAULT_IMAGE,
        gpu_image=args.gpu_image or names.DEFAULT_GPU_IMAGE,
        pull_policy=args.pull_policy,
        pull_secrets=tuple(args.pull_secrets),
    )
    print(render_text(load_bundle(args.file), args.namespace, defaults, args.file), end="")
    return 0


def _crds(args: argparse.Namespace) -> int:
    from rlfleet.operator.crd import crd_files, write_crds

    if args.out:
        for path in write_crds(args.out):
            print(path)
    else:
        print("---\n".join(crd_files().values()), end="")
    return 0


# name, one-line help, arguments, action; in the order of `rlfleet --help`.
SUBCOMMANDS = (
    (
        "operator",
        "Kubernetes operator (kopf): reconciles RLRun, InferencePool and RelayTier",
        _operator_args,
        _operator,
    ),
    (
        "operator-uninstall",
        "the Helm chart's pre-delete hook: delete the release's RLRuns and wait while the operator cleans them up",
        _uninstall_args,
        _operator_uninstall,
    ),
    (
        "render",
        "print every Kubernetes object the operator would create for a config file (like helm template)",
        _render_args,
        _render,
    ),
    ("crds", "write the CustomResourceDefinitions generated from the config models", _crds_args, _crds),
)
