"""Test-run wiring: the multi-process jobs run one after another on one xdist worker (each starts its own ranks, and
two at once would share 2 cores), while the other worker runs the tests without processes beside them."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
