"""The package's shape: no import circles, files that read as one idea, and the import contracts of
pyproject.toml ([tool.importlinter]) kept by import-linter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

PACKAGE = REPO / "rlfleet"
MAX_LINES = 400


def module_imports() -> dict[str, set[str]]:
    """rlfleet module -> the rlfleet modules it imports, function-level imports included (a lazy
    import still ties the two modules together)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
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
