"""The suite's order: the files that take longest first, so that the two workers (``--dist loadfile`` with
``--no-loadscope-reorder``, which keeps this order) finish together instead of one waiting on the last long file.
Measured on 2 cores; a file not named keeps its place after these. Only the order changes, never what runs."""

from pathlib import Path

import pytest

from tests import warm

#: Longest first (seconds of one worker, from `--durations`, rounded): a new slow file goes where its time puts it.
LONGEST_FIRST = (
    "test_failures.py",  # ~205
    "test_rank_death.py",  # ~215 (its 10 kills and their resume ~185)
    "test_rank_death_saves.py",  # ~115 (5 jobs, one on 2 nodes of 2 ranks)
    "test_benchmarks_smoke.py",  # ~150
    "test_restart.py",  # ~140
    "test_memory_plan.py",  # ~120 (its step-peak job alone ~110)
    "test_fabric_rank_death.py",  # ~110
    "test_preemption.py",  # ~100
    "test_benchmarks_link_smoke.py",  # ~80
    "test_link_faults.py",  # ~65
    "test_world_size.py",  # ~75
    "test_comm_hooks.py",  # ~60
    "test_resume_multinode.py",  # ~57
    "test_zoo.py",  # ~53
    "test_sharding.py",  # ~60
    "test_checkpoint_jobs.py",  # ~47
    "test_fabric.py",  # ~46
    "test_micro_batches.py",  # ~45
    "test_ddp_training.py",  # ~44
    "test_buckets.py",  # ~35
    "test_diagnostics.py",  # ~32
    "test_bad_input.py",  # ~25
    "test_step_guard.py",  # ~24
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(Path(str(item.fspath)).name, len(LONGEST_FIRST)))


def pytest_sessionfinish() -> None:
    warm.stop()
