"""Write the builtin model builds the examples use into the package (rlfleet/models/weights/NAME-KEY/),
so that a first `rlfleet run` of an example finds its model instead of warm-starting it for minutes.

A build is the same bytes as the one `rlfleet run` would make and cache (builtin.build_builtin, one
torch thread, fixed seed); this script only runs it ahead of time. Rerun it when an example's model,
task or seed, a builtin recipe or the build code changes (tests/core/test_builtin.py names the
missing build); builds no example uses any more are removed.

    python scripts/ship_builtins.py           # build what is missing, remove what no example uses
    python scripts/ship_builtins.py --check   # exit 1 when a build is missing or unused
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def example_builds() -> dict[str, tuple]:
    """NAME-KEY -> (model spec, task spec, seed) of every builtin model the examples use."""
    from rlfleet.config import load_bundle
    from rlfleet.models.builtin import BUILTIN_PREFIX, builtin_dir_name

    builds = {}
    for example in sorted((ROOT / "examples").rglob("*.yaml")):
        docs = example.read_text()
        if "kind: RLRun" not in docs:
            continue  # Helm values files
        spec = load_bundle(str(example)).run.spec
        if spec.model.path.startswith(BUILTIN_PREFIX):
            builds[builtin_dir_name(spec.model, spec.task, spec.trainer.seed)] = (
                spec.model,
                spec.task,
                spec.trainer.seed,
            )
    return builds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    import os

    os.chdir(ROOT)  # the examples name their data sets relative to the repository root
    from rlfleet.models.builtin import BUILTIN_PREFIX, BUILTINS, SHIPPED, build_builtin

    wanted = example_builds()
    present = {p.name for p in SHIPPED.iterdir() if p.is_dir()} if SHIPPED.exists() else set()
    missing, unused = sorted(set(wanted) - present), sorted(present - set(wanted))
    if args.check:
        for name in missing:
            print(f"missing: {SHIPPED / name}")
        for name in unused:
            print(f"unused: {SHIPPED / name}")
        return 1 if missing or unused else 0
    for name in unused:
        shutil.rmtree(SHIPPED / name)
        print(f"removed {SHIPPED / name}")
    SHIPPED.mkdir(parents=True, exist_ok=True)
    for name in missing:
        model, task, seed = wanted[name]
        builtin = model.path[len(BUILTIN_PREFIX) :]
        steps = model.warm_start_steps or BUILTINS[builtin].warm_start_steps
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=SHIPPED, prefix=".build-") as tmp:
            build_builtin(builtin, task, steps, seed, Path(tmp) / "out")
            (Path(tmp) / "out").rename(SHIPPED / name)
        print(f"built {SHIPPED / name} in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
