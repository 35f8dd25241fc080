"""The package's shape: no import circles (in rlfleet, and across the whole repository), files that read
as one idea, and the import contracts of pyproject.toml ([tool.importlinter]) kept by import-linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts import structure
from scripts.structure import SOURCE_FOLDERS, find_cycle
from tests.support import REPO

PACKAGE = REPO / "rlfleet"
MAX_LINES = 400


def module_imports(roots: tuple[str, ...] = ("rlfleet",)) -> dict[str, set[str]]:
    """This checkout's import graph over `roots` (scripts/structure.py reads it, for any checkout)."""
    return structure.module_imports(REPO, roots)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_module_that_imports_its_own_package_back_is_a_circle(tmp_path):
    """`from pkg import sibling` in pkg/mod.py runs pkg/__init__.py, which imports pkg.mod (here lazily): the
    package and its module import each other. An import of a submodule by its full name is no such edge."""
    repo = write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "def make():\n    from pkg.mod import Thing\n    return Thing()\n",
            "pkg/mod.py": "from pkg import helper\n\nclass Thing:\n    pass\n",
            "pkg/helper.py": "VALUE = 1\n",
        },
    )
    edges = structure.module_imports(repo, ("pkg",))
    assert edges["pkg.mod"] == {"pkg", "pkg.helper"}
    assert find_cycle(edges) == ["pkg", "pkg.mod", "pkg"]
    (repo / "pkg/mod.py").write_text("from pkg.helper import VALUE\n\nclass Thing:\n    pass\n")
    edges = structure.module_imports(repo, ("pkg",))
    assert edges["pkg.mod"] == {"pkg.helper"}
    assert find_cycle(edges) is None


def test_a_package_importing_its_modules_that_import_each_other_is_no_circle(tmp_path):
    repo = write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\nfrom .b import B\n",
            "pkg/a.py": "A = 1\n",
            "pkg/b.py": "from pkg.a import A\nfrom .a import A as again\nfrom .c import C\n\nB = A + again + C\n",
            "pkg/c.py": "from . import a\n\nC = a.A\n",  # through the package, which imports c only by way of b
        },
    )
    edges = structure.module_imports(repo, ("pkg",))
    assert edges == {"pkg": {"pkg.a", "pkg.b"}, "pkg.a": set(), "pkg.b": {"pkg.a", "pkg.c"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(edges) is None


def test_no_import_circle_in_rlfleet():
    edges = module_imports()
    assert "rlfleet.engines.torch_engine" in edges["rlfleet.engines"]
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_import_circle_anywhere_in_the_repository():
    """The product, the testbed, the tests and the scripts and benchmarks around them, together: a
    circle between a benchmark and a test module is as much a circle as one inside rlfleet."""
    edges = module_imports(SOURCE_FOLDERS)
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
