"""The package's shape: no import circles (in rlfleet, and across the whole repository), files that read
as one idea, and the import contracts of pyproject.toml ([tool.importlinter]) kept by import-linter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

PACKAGE = REPO / "rlfleet"
MAX_LINES = 400


# Folders whose .py files are scripts run as `python <folder>/X.py`: their folder is on sys.path, so a
# sibling is imported by its bare name (`from wan_runs import Bed` in benchmarks/ is benchmarks.wan_runs).
SCRIPT_FOLDERS = ("benchmarks", "scripts")
TOP_LEVEL = ("rlfleet", "testbed", "tests", *SCRIPT_FOLDERS)


def module_imports(roots: tuple[str, ...] = ("rlfleet",)) -> dict[str, set[str]]:
    """Module -> the modules it imports, for the modules under `roots` (folders of the repository),
    function-level and TYPE_CHECKING imports included (a lazy import still ties the two modules
    together; a type-only one still makes the reader go round). Relative imports are resolved; in a
    script folder a bare name of a sibling file is that file."""
    modules = {}
    for root in roots:
        for path in (REPO / root).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        sibling = package if package in SCRIPT_FOLDERS else None
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
                targets = [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            if sibling:
                targets = [f"{sibling}.{t}" if f"{sibling}.{t.partition('.')[0]}" in modules else t for t in targets]
            for target in filter(None, map(resolve, targets)):
                if target != module:
                    edges[module].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path a -> ... -> a, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges[module]):
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


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_rlfleet():
    edges = module_imports()
    assert "rlfleet.services.rollout.engines.torch_engine" in edges["rlfleet.services.rollout.engines"]
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_import_circle_anywhere_in_the_repository():
    """The product, the testbed, the tests and the scripts and benchmarks around them, together: a
    circle between a benchmark and a test module is as much a circle as one inside rlfleet."""
    edges = module_imports(TOP_LEVEL)
    # the finder sees what it must: a bare sibling import of a benchmark, a relative import in tests
    assert "benchmarks.wan_runs" in edges["benchmarks.broadcast_wan"]
    assert "benchmarks.delta" in edges["benchmarks.broadcast"]  # a lazy import counts
    assert "tests.support" in edges["benchmarks.rollout"]
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_file_in_rlfleet_is_over_the_line_budget():
    long = {
        str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split each into ideas of its own): {long}"


def test_import_contracts_hold():
    """import-linter checks pyproject.toml's contracts: the operator, shardcast and ingest never import
    torch, transformers or vllm (slim images), and services reach each other only through public modules."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), str(REPO / "pyproject.toml"), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def test_the_ground_floor_holds_few_modules():
    """rlfleet/'s own modules are the entry points, not rooms: everything else lives in a package named
    for what it is (local, versions, wire, models, config, tasks, services, operator)."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 6, f"loose modules in rlfleet/: {loose}; group them into a package"
