"""The cluster-in-a-box tests (marker `cluster`): root, iproute2 and the Helm SDK needed, skipped with the
reason otherwise. A failed test prints what every pod of the open boxes logged."""

from __future__ import annotations

import pytest

from testbed import unavailable_reason


def box_unavailable() -> str | None:
    reason = unavailable_reason()
    if reason:
        return f"the cluster in a box {reason.removeprefix('the network testbed ')}"
    try:
        import helm_python  # noqa: F401
    except ImportError:
        return "the cluster in a box installs the chart with the Helm SDK: pip install helm-python-sdk"
    return None


def pytest_collection_modifyitems(config, items):
    reason = box_unavailable()
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.slow)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "tests/cluster/" in str(item.fspath).replace("\\", "/"):
        from tests.cluster.inabox.box import OPEN

        for box in OPEN:
            report.sections.append(("what the box's pods logged", box.report()))
