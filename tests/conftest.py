"""The suite's order: the files that take longest first, so that the two workers (``--dist loadfile`` with
``--no-loadscope-reorder``, which keeps this order) finish together instead of one waiting on the last long file.
Measured on 2 cores; a file not named keeps its place after these. Only the order changes, never what runs."""

from pathlib import Path

import pytest

#: Longest first (seconds of one worker, from `--durations`, rounded): a new slow file goes where its time puts it.
LONGEST_FIRST = (
    "test_restart.py",  # ~185
    "test_failures.py",  # ~170
    "test_memory_plan.py",  # ~170 (its step-peak job alone ~160)
    "test_benchmarks_link_smoke.py",  # ~155
    "test_benchmarks_smoke.py",  # ~130
    "test_world_size.py",  # ~90
    "test_preemption.py",  # ~75
    "test_resume_multinode.py",  # ~65
    "test_link_faults.py",  # ~60
    "test_zoo.py",  # ~60
    "test_checkpoint_jobs.py",  # ~60
    "test_fabric.py",  # ~50
    "test_micro_batches.py",  # ~50
    "test_diagnostics.py",  # ~40
    "test_comm_hooks.py",  # ~35
    "test_buckets.py",  # ~31
    "test_sharding.py",  # ~30
    "test_step_guard.py",  # ~30
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(Path(str(item.fspath)).name, len(LONGEST_FIRST)))
