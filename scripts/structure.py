"""The repository's structure in numbers, read from the code's own source (nothing is run or imported).

    python scripts/structure.py [--repo DIR] [--json]

Prints, for the checkout at DIR (default: this one), what a newcomer meets:
  rooms      each package of rlfleet/ (each service of rlfleet/services/ is a room of its own, and each
             loose module beside them one too) with its files, lines and code lines;
  arrows     imports between rooms, counted (function-level imports included: a lazy import still ties
             two rooms together); a pair of rooms that import each other is a room-level circle;
  circles    module-level import circles anywhere in the repository (rlfleet, tests, benchmarks, scripts,
             testbed), found by depth-first search;
  contract   the exceptions (`ignore_imports`) of pyproject.toml's independence contract of the services;
  size       code lines per file (max, p90, total, files over 320) and the functions over 80 code lines
             or 8 parameters, those on the allow-lists below marked with their reason;
  habits     `manifest: dict` parameters, the modules outside rlfleet/config that read `max_async_level`,
             and the modules that spell each component's name as a string.
Run it on two checkouts (e.g. `git worktree add /tmp/before REV`) to compare a change's before and after.

The size rule (tests/core/test_structure.py holds rlfleet/ to it, with the helpers here) counts code lines:
lines that hold a token of code, so docstrings, comments and blank lines are free and nobody rewraps a
docstring or drops a blank line to meet it. A file has at most 320 code lines; a function at most 80 code
lines (its nested functions included) and 8 parameters (`self` and `cls` not counted, nor `*args` and
`**kwargs`). The few justified exceptions are named below with their reason, at most 5 on each list.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import math
import re
import tokenize
import tomllib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

COMPONENTS = ("trainer", "rollout", "verifier", "ingest", "origin", "relay")
SOURCE_FOLDERS = ("rlfleet", "testbed", "tests", "benchmarks", "scripts")
MAX_CODE_LINES = 320  # per file of rlfleet/
MAX_FUNCTION_LINES = 80  # code lines per function
MAX_PARAMETERS = 8
MAX_ALLOWED = 5  # entries on each allow-list

# `path:function` (a method as `Class.method`, a nested function as `outer.inner`) -> why it may break the
# function rule. Only declarative code belongs here: a table or a literal that reads best whole.
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}
# path -> why it may hold more than MAX_CODE_LINES code lines (none needs it).
LONG_FILES_ALLOWED: dict[str, str] = {}


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


_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


def _docstrings(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where each docstring (a module's, class's or function's first statement, a string) starts and ends."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    spans.append(((first.lineno, first.col_offset), (first.end_lineno or 0, first.end_col_offset or 0)))
    return spans


def code_line_numbers(source: str) -> set[int]:
    """The numbers of the lines that hold a token of code: not a docstring, a comment or a blank line (a
    string that spans lines and is not a docstring is code on each of them)."""
    docstrings = _docstrings(ast.parse(source))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in _NOT_CODE or any(a <= token.start and token.end <= b for a, b in docstrings):
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def code_lines(source: str) -> int:
    return len(code_line_numbers(source))


@dataclass(frozen=True)
class Function:
    name: str  # path:qualified name
    lines: int  # code lines, nested functions included
    parameters: int  # self and cls, *args and **kwargs not counted

    @property
    def too_big(self) -> bool:
        return self.lines > MAX_FUNCTION_LINES or self.parameters > MAX_PARAMETERS


def functions(source: str, path: str) -> list[Function]:
    """Every function and method of `source` (the file at `path`), nested ones included, in order."""
    lines = code_line_numbers(source)
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a = child.args
                named = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                body = sum(1 for n in lines if child.lineno <= n <= (child.end_lineno or child.lineno))
                parameters = len([n for n in named if n not in ("self", "cls")])
                found.append(Function(f"{path}:{prefix}{child.name}", body, parameters))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def check_allow_list(allowed: Mapping[str, str]) -> None:
    """An allow-list names at most MAX_ALLOWED exceptions, each with its reason (ValueError otherwise)."""
    if len(allowed) > MAX_ALLOWED:
        raise ValueError(f"{len(allowed)} entries on an allow-list of at most {MAX_ALLOWED}: {sorted(allowed)}")
    if silent := sorted(name for name, reason in allowed.items() if not reason.strip()):
        raise ValueError(f"allow-listed without a reason: {silent}")


def not_allowed(names: Iterable[str], allowed: Mapping[str, str]) -> list[str]:
    """The names that break a rule and are not on its allow-list (which is checked first)."""
    check_allow_list(allowed)
    return sorted(set(names) - set(allowed))


def too_big_functions(repo: Path) -> list[Function]:
    """The functions of rlfleet/ over MAX_FUNCTION_LINES code lines or MAX_PARAMETERS parameters."""
    return [
        f
        for path in sorted((repo / "rlfleet").rglob("*.py"))
        for f in functions(path.read_text(), str(path.relative_to(repo)))
        if f.too_big
    ]


def code_lines_per_file(repo: Path) -> dict[str, int]:
    return {str(p.relative_to(repo)): code_lines(p.read_text()) for p in sorted((repo / "rlfleet").rglob("*.py"))}


def services_contract_exceptions(repo: Path) -> dict[str, list[str]]:
    """The `ignore_imports` of each independence contract of pyproject.toml among the services."""
    config = tomllib.loads((repo / "pyproject.toml").read_text())
    contracts = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    return {
        c["name"]: list(c.get("ignore_imports", []))
        for c in contracts
        if c.get("type") == "independence" and all(m.startswith("rlfleet.services.") for m in c.get("modules", []))
    }


def async_window_readers(repo: Path) -> list[str]:
    """The modules outside rlfleet/config that read `max_async_level` (an attribute of that name)."""
    readers = []
    for path in sorted((repo / "rlfleet").rglob("*.py")):
        if path.relative_to(repo).parts[1] == "config":
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Attribute) and n.attr == "max_async_level" for n in ast.walk(tree)):
            readers.append(str(path.relative_to(repo)))
    return readers


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


def measure(repo: Path) -> dict:
    edges = module_imports(repo)
    package = repo / "rlfleet"
    rooms: dict[str, dict] = {}
    for module, path in _rlfleet_modules(repo):
        if (r := room(module)) is None:
            continue
        entry = rooms.setdefault(r, {"files": 0, "lines": 0, "code_lines": 0})
        text = path.read_text()
        entry["files"] += 1
        entry["lines"] += len(text.splitlines())
        entry["code_lines"] += code_lines(text)
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
    per_file = code_lines_per_file(repo)
    counts = sorted(per_file.values())
    return {
        "loose_modules": sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py"),
        "rooms": dict(sorted(rooms.items())),
        "arrows": {f"{a} -> {b}": n for (a, b), n in sorted(arrows.items())},
        "room_circles": [" <-> ".join(pair) for pair in room_circles],
        "module_circles": [" -> ".join(c) for c in all_cycles(edges)],
        "services_contract_exceptions": services_contract_exceptions(repo),
        "functions_over_the_rule": [
            {
                "function": f.name,
                "code_lines": f.lines,
                "parameters": f.parameters,
                "allowed": LONG_FUNCTIONS_ALLOWED.get(f.name),
            }
            for f in too_big_functions(repo)
        ],
        "code_lines_per_file": {
            "max": counts[-1],
            "p90": counts[math.ceil(0.9 * len(counts)) - 1],
            "total": sum(counts),
            "files": len(counts),
            "over": {
                path: {"code_lines": n, "allowed": LONG_FILES_ALLOWED.get(path)}
                for path, n in per_file.items()
                if n > MAX_CODE_LINES
            },
        },
        "modules_reading_max_async_level": async_window_readers(repo),
        "manifest_dict_parameters": sum(p.read_text().count("manifest: dict") for p in sources),
        "modules_spelling_each_component": names,
    }


def print_report(m: dict) -> None:
    print(f"loose modules in rlfleet/: {len(m['loose_modules'])}: {', '.join(m['loose_modules'])}")
    print(f"\nrooms ({len(m['rooms'])}):")
    for name, r in m["rooms"].items():
        print(f"  {name:36} {r['files']:3} files {r['lines']:6} lines {r['code_lines']:6} code lines")
    print(f"\narrows between rooms: {len(m['arrows'])} (imports counted)")
    for arrow, n in m["arrows"].items():
        print(f"  {arrow:70} {n}")
    print(f"\nrooms that import each other: {len(m['room_circles'])}")
    for pair in m["room_circles"]:
        print(f"  {pair}")
    print(f"\nmodule import circles in the repository: {len(m['module_circles'])}")
    for cycle in m["module_circles"]:
        print(f"  {cycle}")
    for name, exceptions in m["services_contract_exceptions"].items():
        print(f"\nexceptions of the services' contract ({name}): {len(exceptions)}")
        for e in exceptions:
            print(f"  {e}")
    over = m["functions_over_the_rule"]
    allowed = [f for f in over if f["allowed"]]
    print(
        f"\nfunctions over {MAX_FUNCTION_LINES} code lines or {MAX_PARAMETERS} parameters: {len(over)} "
        f"({len(allowed)} allow-listed)"
    )
    for f in over:
        mark = f"  allowed: {f['allowed']}" if f["allowed"] else ""
        print(f"  {f['function']:60} {f['code_lines']:4} lines {f['parameters']:3} parameters{mark}")
    c = m["code_lines_per_file"]
    print(
        f"\ncode lines per file in rlfleet/ ({c['files']} files): max {c['max']}, p90 {c['p90']}, "
        f"total {c['total']}; over {MAX_CODE_LINES}: {len(c['over'])}"
    )
    for path, f in c["over"].items():
        mark = f"  allowed: {f['allowed']}" if f["allowed"] else ""
        print(f"  {path:60} {f['code_lines']:4}{mark}")
    readers = m["modules_reading_max_async_level"]
    print(f"\nmodules outside rlfleet/config that read max_async_level: {len(readers)}: {', '.join(readers)}")
    print(f"`manifest: dict` parameters: {m['manifest_dict_parameters']}")
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
