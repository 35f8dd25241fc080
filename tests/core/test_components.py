"""The component registry (rlfleet/wire/components.py) is the one place a component is named: the CLI,
the Redis ACL roles and the operator's names all read it, and no other module spells a name."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re

import pytest

from rlfleet import cli
from rlfleet.operator import names
from rlfleet.wire import components, redis_acl
from rlfleet.wire.components import COMPONENTS
from tests.support import REPO

NAMES = ["trainer", "rollout", "verifier", "ingest", "origin", "relay"]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_registry_holds_the_six_components_in_the_cli_order():
    assert list(COMPONENTS) == NAMES
    assert all(name == spec.name for name, spec in COMPONENTS.items())


def test_the_cli_has_one_subcommand_per_component_whose_arguments_are_its_options():
    subcommands = _subcommands()
    assert [c for c in subcommands if c in COMPONENTS] == list(COMPONENTS)
    for spec in COMPONENTS.values():
        module = importlib.import_module(spec.module)
        options = {f.name for f in dataclasses.fields(getattr(module, spec.options))}
        dests = {a.dest for a in subcommands[spec.name]._actions if a.dest != "help"}
        assert options == dests, spec.name
        assert callable(getattr(module, spec.main)), spec.name
        assert set(spec.ports) <= options, f"{spec.name}: its ports are options"


def test_the_acl_roles_and_the_operator_names_are_the_registry_s():
    assert redis_acl.COMPONENT_ROLES == {spec.name: spec.roles[0] for spec in COMPONENTS.values()}
    assert list(redis_acl.WORKER_ROLES.values()) == list(COMPONENTS["rollout"].roles)
    assert {role for spec in COMPONENTS.values() for role in spec.roles} <= set(redis_acl.ROLES)
    operator_names = [names.TRAINER, names.ROLLOUT, names.VERIFIER, names.INGEST, names.ORIGIN, names.RELAY]
    assert operator_names == list(COMPONENTS)


def test_an_unknown_component_is_named_with_the_known_ones():
    with pytest.raises(KeyError, match="no component 'trainers'; the components are trainer, rollout"):
        components.component("trainers")


def test_no_module_but_the_registry_spells_a_component_name():
    """`grep -rn '"trainer"' rlfleet/` (and the other five, either quote) hits rlfleet/wire/components.py only."""
    quoted = re.compile(r"""(["'])(""" + "|".join(NAMES) + r""")\1""")
    hits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted((REPO / "rlfleet").rglob("*.py"))
        if path != REPO / "rlfleet" / "wire" / "components.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if quoted.search(line)
    ]
    assert not hits, "use the constants of rlfleet/wire/components.py:\n" + "\n".join(hits)


def test_the_api_version_is_spelled_once():
    hits = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "rlfleet").rglob("*.py"))
        if re.search(r"""["']rlfleet\.io/v1alpha1["']""", path.read_text())
    ]
    assert hits == ["rlfleet/config/base.py"]
    assert names.API_VERSION == f"{names.GROUP}/{names.VERSION}" == "rlfleet.io/v1alpha1"


def test_a_component_s_pre_run_check_is_found_from_its_registry_record_and_run_by_the_launcher(tmp_path):
    from rlfleet.config import ConfigError, load_bundle
    from rlfleet.local.launcher import prerun_checks
    from tests.runs import pool, rlrun, write_rlrun

    checks = {name: spec.prerun_check() for name, spec in COMPONENTS.items()}
    assert {name for name, check in checks.items() if check is not None} == {"trainer", "ingest"}
    config = write_rlrun(tmp_path / "rlrun.yaml", rlrun(ingest={"admission": {"mode": "invite"}}), pool())
    bundle = load_bundle(config)
    [problem] = checks["ingest"](bundle)
    assert problem.startswith("spec.ingest.admission.invitesFile: mode invite needs a YAML/JSON list of invite codes")
    assert checks["trainer"](bundle) == []
    with pytest.raises(ConfigError) as err:
        prerun_checks(bundle, str(config))  # the launcher finds the ingest's check by the registry alone
    assert err.value.problems == [problem]
    good = write_rlrun(tmp_path / "good.yaml", rlrun(), pool())
    prerun_checks(load_bundle(good), str(good))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("rlfleet.services.ingest.prerun:no_such_check", "names no function 'no_such_check'"),
        ("rlfleet.services.ingest.no_such_module:prerun_problems", "names no module"),
        ("rlfleet.services.ingest.prerun", "is not `module:function`"),
    ],
)
def test_a_wrong_pre_run_check_path_in_the_registry_fails_loudly(tmp_path, monkeypatch, path, message):
    from rlfleet.config import load_bundle
    from rlfleet.local.launcher import prerun_checks
    from tests.runs import pool, rlrun, write_rlrun

    wrong = dataclasses.replace(COMPONENTS["ingest"], prerun=path)
    with pytest.raises(RuntimeError, match=f"component ingest: its pre-run check {re.escape(repr(path))}.*{message}"):
        wrong.prerun_check()
    monkeypatch.setitem(COMPONENTS, "ingest", wrong)
    config = write_rlrun(tmp_path / "rlrun.yaml", rlrun(ingest={"admission": {"mode": "open"}}), pool())
    with pytest.raises(RuntimeError, match=message):
        prerun_checks(load_bundle(config), str(config))
