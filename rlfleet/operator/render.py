"""`rlfleet render FILE`: every Kubernetes object the operator would create for a config bundle, like
`helm template`, to review or diff a change, feed GitOps, or compare in tests.

Pure: the same builders the operator applies, for the run, each pool and each relay tier of the file,
in the operator's apply order. What only a live cluster knows is left out: owner references (the
parents' uids), Secret contents, progress (a rendered run is active, i.e. not yet complete).
"""

from __future__ import annotations

import yaml

from rlfleet.config import Bundle, ConfigError
from rlfleet.operator.builders import build_pool_children, build_relay_children, build_run_children
from rlfleet.operator.pods import ClusterDefaults
from rlfleet.operator.resources import SpecError


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config documents in ConfigMaps) as literal blocks, so a diff reads line by line."""


def _text(dumper: yaml.SafeDumper, data: str):
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _text)


def render_bundle(
    bundle: Bundle, namespace: str, defaults: ClusterDefaults = ClusterDefaults(), source: str = "<config>"
) -> list[dict]:
    """The children of the run, its relay tiers and its pools; ConfigError naming each document's problems."""
    run, objects, problems = bundle.run, [], list[str]()

    def build(who: str, fn, *args) -> None:
        try:
            objects.extend(fn(*args))
        except SpecError as exc:
            problems.extend(f"{who}: {p}" for p in exc.problems)

    build(f"RLRun {run.metadata.name}", build_run_children, run, namespace, None, defaults)
    for tier in bundle.relays:
        build(
            f"RelayTier {tier.metadata.name}", build_relay_children, run, tier, bundle.relays, namespace, None, defaults
        )
    for pool in bundle.pools:
        build(
            f"InferencePool {pool.metadata.name}",
            build_pool_children,
            run,
            pool,
            bundle.relays,
            namespace,
            None,
            defaults,
        )
    if problems:
        raise ConfigError(source, problems)
    return objects


def render_text(
    bundle: Bundle, namespace: str, defaults: ClusterDefaults = ClusterDefaults(), source: str = "<config>"
) -> str:
    """The objects as one multi-document YAML stream, each headed by a `# Source:` comment as helm does."""
    parts = []
    for obj in render_bundle(bundle, namespace, defaults, source):
        head = f"# Source: {obj['kind']} {obj['metadata']['name']}\n"
        parts.append(head + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120))
    return "---\n".join(parts)
