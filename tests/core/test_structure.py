"""The package's shape: no import circles (in rlfleet, and across the whole repository), files and functions
held to the size rule (code lines and parameters, counted by scripts/structure.py, with its allow-lists),
and the import contracts of pyproject.toml ([tool.importlinter]) kept by import-linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts import structure
from scripts.structure import (
    LONG_FILES_ALLOWED,
    LONG_FUNCTIONS_ALLOWED,
    MAX_CODE_LINES,
    SOURCE_FOLDERS,
    code_lines,
    code_lines_per_file,
    find_cycle,
    functions,
    not_allowed,
    too_big_functions,
)
from tests.support import REPO

PACKAGE = REPO / "rlfleet"


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


SOURCE = '''"""A module docstring
of two lines."""

# a comment line

import os  # a comment after code: the line is code

TABLE = """a string that spans
two lines is code"""


class Box:
    """A class docstring."""

    def method(self, a, b, c, d, e, f, g, h):
        """Eight parameters beside self: within the rule."""
        return a


def many(a, b, c, d, e, /, f, g, *args, h, i, **kwargs):
    # *args and **kwargs are not counted; nine named parameters are
    return os.sep
'''


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    # import, TABLE (2), class, def method, return a, def many, return os.sep
    assert code_lines(SOURCE) == 8
    assert code_lines('"""Only a docstring."""\n\n# and a comment\n') == 0
    assert code_lines("def f():\n    return 1\n") == 2


def test_functions_are_found_with_their_code_lines_and_parameters():
    found = {f.name: f for f in functions(SOURCE, "m.py")}
    assert sorted(found) == ["m.py:Box.method", "m.py:many"]
    assert (found["m.py:Box.method"].lines, found["m.py:Box.method"].parameters) == (2, 8)
    assert (found["m.py:many"].lines, found["m.py:many"].parameters) == (2, 9)
    assert [f.name for f in functions(SOURCE, "m.py") if f.too_big] == ["m.py:many"]


def test_a_function_over_80_code_lines_is_found_and_its_docstring_is_free(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(78))
    docstring = '    """\n' + "    Documentation.\n" * 30 + '    """\n'
    (tmp_path / "rlfleet").mkdir()
    (tmp_path / "rlfleet/m.py").write_text(
        f"def short():\n{docstring}{body}    return 0\n\n\ndef long():\n{body}    y = 1\n    return y\n\n\n"
        "def outer():\n    def inner(a, b, c, d, e, f, g, h, i):\n        return a\n\n    return inner\n"
    )
    found = {f.name: (f.lines, f.parameters) for f in too_big_functions(tmp_path)}
    assert found == {"rlfleet/m.py:long": (81, 0), "rlfleet/m.py:outer.inner": (2, 9)}  # short: 80 of 112
    assert code_lines_per_file(tmp_path) == {"rlfleet/m.py": 80 + 81 + 4}


def test_an_allow_listed_function_passes_and_the_list_is_short_and_says_why():
    over = ["rlfleet/a.py:table", "rlfleet/b.py:handler"]
    assert not_allowed(over, {"rlfleet/a.py:table": "a literal"}) == ["rlfleet/b.py:handler"]
    assert not_allowed(over, {"rlfleet/a.py:table": "a literal", "rlfleet/b.py:handler": "a table"}) == []
    six = {f"rlfleet/m.py:f{i}": "a literal" for i in range(6)}
    with pytest.raises(ValueError, match="6 entries on an allow-list of at most 5"):
        not_allowed(over, six)
    with pytest.raises(ValueError, match="without a reason"):
        not_allowed(over, {"rlfleet/a.py:table": " "})


def test_no_file_in_rlfleet_is_over_320_code_lines():
    """Code lines: docstrings, comments and blank lines are free, so nobody squeezes them to meet the rule."""
    over = {path: n for path, n in code_lines_per_file(REPO).items() if n > MAX_CODE_LINES}
    assert not not_allowed(over, LONG_FILES_ALLOWED), (
        f"files over {MAX_CODE_LINES} code lines (split each into ideas of its own): {over}"
    )


def test_no_function_in_rlfleet_is_over_80_code_lines_or_8_parameters():
    """Outside the allow-list of scripts/structure.py (at most 5, each with its reason): a long function is
    split into steps that each have a name, and a long parameter list becomes a typed record."""
    over = {f.name: f"{f.lines} code lines, {f.parameters} parameters" for f in too_big_functions(REPO)}
    breaking = not_allowed(over, LONG_FUNCTIONS_ALLOWED)
    assert not breaking, f"functions over the rule: { {name: over[name] for name in breaking} }"


def test_every_allow_listed_name_still_exists_and_still_needs_it():
    """An entry for a function that was split, renamed or shortened comes off the list."""
    over = {f.name for f in too_big_functions(REPO)}
    assert set(LONG_FUNCTIONS_ALLOWED) <= over, set(LONG_FUNCTIONS_ALLOWED) - over
    per_file = code_lines_per_file(REPO)
    assert all(per_file.get(path, 0) > MAX_CODE_LINES for path in LONG_FILES_ALLOWED), LONG_FILES_ALLOWED


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
