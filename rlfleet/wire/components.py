"""The component registry: every `rlfleet <component>` process, spelled once.

A component is one kind of process of a run (a pod on a cluster, an OS process under `rlfleet run`).
Its record says what the rest of the code needs to know about it without importing it:
  name     the subcommand, the Kubernetes component label and the stem of its child names and logs
  module   the module whose `main` (or `entry`) runs it, and the options class it takes, as strings
           (this module stays torch-free and imports no service: `rlfleet/cli.py` imports the module
           only once its subcommand is chosen)
  roles    its Redis ACL roles (rlfleet/wire/redis_acl.py): the first is its main client's
           (env RLFLEET_REDIS_URL); a rollout worker reads and takes tickets as users of their own
  ports    the fields of its options that are HTTP ports it serves (endpoints.json, probes)
  metrics  whether it serves Prometheus /metrics and /healthz (its --metrics-port; wire/health.py)
  prerun   its pre-run check, `module:function` as a string (None: it has none): what `rlfleet run` checks
           before anything starts for each component its plan starts (rlfleet/local/launcher.py), so the
           launcher imports no service's inside. The function takes the run's `Bundle` and returns its
           problems as a list of `field: what is wrong and the fix` strings (empty: none), or raises
           ConfigError naming the field and the fix; it starts nothing and reaches no server.
Invariants: names are unique and each is a quoted string in this module only (a test greps rlfleet/);
`COMPONENTS` keeps the order of the CLI's subcommands.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlfleet.config import Bundle

# A component's pre-run check (see the module docstring): the run's bundle -> its problems.
PrerunCheck = Callable[["Bundle"], list[str]]

# The components' names: every other module reads these constants.
TRAINER, ROLLOUT, VERIFIER, INGEST, ORIGIN, RELAY = "trainer", "rollout", "verifier", "ingest", "origin", "relay"

# Redis ACL roles that are not a component's own name (rlfleet/wire/redis_acl.py says what each may do);
# the trainer, the verifier and the ingest each have a role named after them.
WORKER, READER, TICKETS = "worker", "reader", "tickets"


@dataclass(frozen=True)
class ComponentSpec:
    """One component's identity; see the module docstring."""

    name: str
    module: str
    options: str  # the options class's name in `module`
    help: str  # the subcommand's one-line help
    roles: tuple[str, ...]
    ports: tuple[str, ...] = ()
    main: str = "main"
    metrics: bool = True
    prerun: str | None = None  # "module:function", its pre-run check

    @property
    def role(self) -> str:
        """The Redis ACL role of its main client."""
        return self.roles[0]

    @property
    def options_path(self) -> str:
        """The options class's dotted name."""
        return f"{self.module}.{self.options}"

    def prerun_check(self) -> PrerunCheck | None:
        """Its pre-run check, imported from the registry's `module:function` (None: it has none). A path that
        names no module or no function is the registry's mistake: RuntimeError naming the component and path."""
        if self.prerun is None:
            return None
        module_name, _, function = self.prerun.partition(":")
        wrong = f"component {self.name}: its pre-run check {self.prerun!r} in rlfleet/wire/components.py"
        if not module_name or not function:
            raise RuntimeError(f"{wrong} is not `module:function`")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and not (module_name + ".").startswith(exc.name + "."):
                raise  # the module is there; a package it imports is not
            raise RuntimeError(f"{wrong} names no module: {exc}") from exc
        check = getattr(module, function, None)
        if not callable(check):
            raise RuntimeError(f"{wrong} names no function {function!r} of {module_name}")
        return check


COMPONENTS: dict[str, ComponentSpec] = {
    c.name: c
    for c in (
        ComponentSpec(
            TRAINER,
            "rlfleet.services.trainer.main",
            "TrainerOptions",
            "GRPO trainer process",
            (TRAINER,),
            prerun="rlfleet.services.trainer.prerun:prerun_problems",
        ),
        ComponentSpec(
            ROLLOUT,
            "rlfleet.services.rollout.main",
            "RolloutOptions",
            "rollout worker process",
            (WORKER, READER, TICKETS),
        ),
        ComponentSpec(
            VERIFIER,
            "rlfleet.services.toploc.main",
            "VerifierOptions",
            "TOPLOC verification gate process",
            (VERIFIER,),
            ports=("api_port",),
        ),
        ComponentSpec(
            INGEST,
            "rlfleet.services.ingest.main",
            "IngestOptions",
            "authenticated HTTP ingest of rollout groups from workers outside the cluster",
            (INGEST,),
            ports=("port",),
            prerun="rlfleet.services.ingest.prerun:prerun_problems",
        ),
        ComponentSpec(
            ORIGIN,
            "rlfleet.services.shardcast.origin",
            "OriginOptions",
            "Shardcast origin: serves policy versions from the store over HTTP",
            (READER,),
            ports=("port",),
        ),
        ComponentSpec(
            RELAY,
            "rlfleet.services.shardcast.relay",
            "RelayOptions",
            "Shardcast relay: pulls versions from upstream, checks them, serves them",
            (READER,),
            ports=("port",),
        ),
    )
}


def component(name: str) -> ComponentSpec:
    """The record of component `name`; KeyError naming the known ones."""
    try:
        return COMPONENTS[name]
    except KeyError:
        raise KeyError(f"no component {name!r}; the components are {', '.join(COMPONENTS)}") from None
