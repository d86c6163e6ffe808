"""Test-run wiring: ``pytest`` runs on two xdist workers (``-n 2 --dist loadgroup`` in ``pyproject.toml``); the
multi-process jobs run one after another on one of them, since each starts its own ranks and two at once would
share the 2 cores, while the other worker runs the tests without processes beside them."""

import pytest

GROUP = "multiprocess"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every ``multiprocess`` test in one xdist group.

    xdist's own ``xdist_group`` marker does not work on pytest 9.2 (xdist 3.8 writes the group into
    ``item._nodeid``, which pytest 9.2 no longer reads), so the group suffix is written where the installed pytest
    keeps the id.
    """
    if not config.getoption("loadgroup", default=False):
        return
    for item in items:
        if item.get_closest_marker("multiprocess") is None or item.nodeid.endswith(f"@{GROUP}"):
            continue
        node_id = getattr(item, "_id", None)
        if node_id is not None and hasattr(type(node_id), "parse"):
            item._id = type(node_id).parse(f"{item.nodeid}@{GROUP}")
        else:
            item._nodeid = f"{item.nodeid}@{GROUP}"
