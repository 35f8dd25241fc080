"""The repository's structure in numbers, read from the code's own imports (nothing is run or imported).

    python scripts/structure.py [--repo DIR] [--json]

Prints, for the checkout at DIR (default: this one), what a newcomer meets:
  rooms      each package of rlfleet/ (and each loose module beside them) with its files and lines;
  arrows     imports between rooms, counted (function-level imports included: a lazy import still ties
             two rooms together); a pair of rooms that import each other is a room-level circle;
  circles    module-level import circles anywhere in the repository (rlfleet, tests, benchmarks, scripts,
             testbed), found by depth-first search;
  habits     functions of 8 or more parameters, `manifest: dict` parameters, files over 400 lines, and
             the modules that spell each component's name as a string.
Run it on two checkouts (e.g. `git worktree add /tmp/before REV`) to compare a change's before and after.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections import Counter
from pathlib import Path

COMPONENTS = ("trainer", "rollout", "verifier", "ingest", "origin", "relay")
SOURCE_FOLDERS = ("rlfleet", "testbed", "tests", "benchmarks", "scripts")
MAX_LINES = 400


# Folders whose .py files are scripts run as `python <folder>/X.py`: their folder is on sys.path, so a
# sibling is imported by its bare name (`from wan_runs import Bed` in benchmarks/ is benchmarks.wan_runs).
SCRIPT_FOLDERS = ("benchmarks", "scripts")


def module_imports(repo: Path, roots: tuple[str, ...] = SOURCE_FOLDERS) -> dict[str, set[str]]:
    """Module -> the modules it imports, for the modules under `roots` (folders of the repository),
    function-level and TYPE_CHECKING imports included (a lazy import still ties the two modules
    together; a type-only one still makes the reader go round). Relative imports are resolved; in a
    script folder a bare name of a sibling file is that file.

    A package and its own module that import each other are a circle too: `from pkg import x` in
    pkg/mod.py reads pkg's namespace, which pkg/__init__.py is still building when it is the one that
    imports pkg.mod (at its top or in a function). So `from pkg import x` (or `from . import x`) in pkg's
    own module is an arrow to pkg when pkg/__init__.py imports that module back. Otherwise it is only an
    arrow to x: the import system hands over a submodule without the package's `__init__` being done, so
    a sibling imported through the package, or by its full name, ties the two siblings and no more."""
    modules = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if "data" in parts:  # test data, not code
                continue
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    packages = {m for m, path in modules.items() if path.name == "__init__.py"}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    own_package: dict[str, str] = {}  # module -> its package, named by a `from pkg import x` in it
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        sibling = package if package in SCRIPT_FOLDERS else None
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names]
                if base in packages and module.startswith(f"{base}."):
                    own_package[module] = base
            if sibling:
                targets = [f"{sibling}.{t}" if f"{sibling}.{t.partition('.')[0]}" in modules else t for t in targets]
            for target in filter(None, map(resolve, targets)):
                if target != module:
                    edges[module].add(target)
    for module, package in own_package.items():
        if module in edges[package]:
            edges[module].add(package)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path a -> ... -> a, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def all_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Circles, one per strongly connected group of modules (each reported once, by find_cycle on it)."""
    cycles, remaining = [], dict(edges)
    while cycle := find_cycle(remaining):
        cycles.append(cycle)
        for module in cycle:
            remaining.pop(module, None)
        remaining = {m: {t for t in ts if t in remaining} for m, ts in remaining.items()}
    return cycles


def _rlfleet_modules(repo: Path):
    for path in sorted((repo / "rlfleet").rglob("*.py")):
        parts = list(path.relative_to(repo).with_suffix("").parts)
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def room(module: str) -> str | None:
    """The room of an rlfleet module: its package under rlfleet/ (`rlfleet.services` and its
    sub-packages count as one room each: `rlfleet.services.trainer`), or the loose module itself."""
    parts = module.split(".")
    if parts[0] != "rlfleet" or len(parts) < 2:
        return None
    if parts[1] == "services" and len(parts) > 2:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def many_parameters(repo: Path, at_least: int = 8) -> list[str]:
    out = []
    for path in sorted((repo / "rlfleet").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                count = len([n for n in names if n not in ("self", "cls")])
                if count >= at_least:
                    out.append(f"{path.relative_to(repo)}:{node.name} ({count})")
    return out


def measure(repo: Path) -> dict:
    edges = module_imports(repo)
    package = repo / "rlfleet"
    rooms: dict[str, dict] = {}
    for module, path in _rlfleet_modules(repo):
        if (r := room(module)) is None:
            continue
        entry = rooms.setdefault(r, {"files": 0, "lines": 0})
        entry["files"] += 1
        entry["lines"] += len(path.read_text().splitlines())
    arrows: Counter[tuple[str, str]] = Counter()
    for module, targets in edges.items():
        for target in targets:
            a, b = room(module), room(target)
            if a and b and a != b:
                arrows[(a, b)] += 1
    room_circles = sorted({tuple(sorted((a, b))) for (a, b) in arrows if (b, a) in arrows})
    sources = [p for p in package.rglob("*.py")]
    names = {
        c: sorted(str(p.relative_to(repo)) for p in sources if re.search(rf"[\"']{c}[\"']", p.read_text()))
        for c in COMPONENTS
    }
    return {
        "loose_modules": sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py"),
        "rooms": dict(sorted(rooms.items())),
        "arrows": {f"{a} -> {b}": n for (a, b), n in sorted(arrows.items())},
        "room_circles": [" <-> ".join(pair) for pair in room_circles],
        "module_circles": [" -> ".join(c) for c in all_cycles(edges)],
        "functions_with_8_or_more_parameters": many_parameters(repo),
        "manifest_dict_parameters": sum(p.read_text().count("manifest: dict") for p in sources),
        "files_over_400_lines": sorted(
            str(p.relative_to(repo)) for p in sources if len(p.read_text().splitlines()) > MAX_LINES
        ),
        "modules_spelling_each_component": names,
    }


def print_report(m: dict) -> None:
    print(f"loose modules in rlfleet/: {len(m['loose_modules'])}: {', '.join(m['loose_modules'])}")
    print(f"\nrooms ({len(m['rooms'])}):")
    for name, r in m["rooms"].items():
        print(f"  {name:36} {r['files']:3} files {r['lines']:6} lines")
    print(f"\narrows between rooms: {len(m['arrows'])} (imports counted)")
    for arrow, n in m["arrows"].items():
        print(f"  {arrow:70} {n}")
    print(f"\nrooms that import each other: {len(m['room_circles'])}")
    for pair in m["room_circles"]:
        print(f"  {pair}")
    print(f"\nmodule import circles in the repository: {len(m['module_circles'])}")
    for cycle in m["module_circles"]:
        print(f"  {cycle}")
    many = m["functions_with_8_or_more_parameters"]
    print(f"\nfunctions with 8 or more parameters: {len(many)}")
    for f in many:
        print(f"  {f}")
    print(f"\n`manifest: dict` parameters: {m['manifest_dict_parameters']}")
    print(f"files over {MAX_LINES} lines in rlfleet/: {len(m['files_over_400_lines'])} {m['files_over_400_lines']}")
    print("\nmodules that spell a component's name as a string:")
    for c, files in m["modules_spelling_each_component"].items():
        print(f"  {c:9} {len(files)}: {', '.join(files)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = parser.parse_args()
    m = measure(args.repo.resolve())
    if args.json:
        print(json.dumps(m, indent=2))
    else:
        print_report(m)


if __name__ == "__main__":
    main()
