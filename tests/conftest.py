"""The suite's order: the files that take longest first, so that the two workers (``--dist loadfile`` with
``--no-loadscope-reorder``, which keeps this order) finish together instead of one waiting on the last long file.
Measured on 2 cores; a file not named keeps its place after these. Only the order changes, never what runs."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import warm

#: Longest first (seconds of one worker, from `--durations` with the job processes forked warm, rounded): a new slow file
#: goes where its time puts it.
LONGEST_FIRST = (
    "test_restart.py",  # ~220 (torchrun agents and their workers start fresh)
    "test_failures.py",  # ~215
    "test_rank_death.py",  # ~195 (its kills and their resume ~160)
    "test_memory_plan.py",  # ~165 (its step-peak job alone ~135)
    "test_benchmarks_link_smoke.py",  # ~100
    "test_benchmarks_smoke.py",  # ~95
    "test_rank_death_saves.py",  # ~95 (5 jobs, one on 2 nodes of 2 ranks)
    "test_fabric_rank_death.py",  # ~75
    "test_link_faults.py",  # ~65
    "test_chunks.py",  # ~65
    "test_preemption.py",  # ~60
    "test_sharding.py",  # ~45
    "test_resume_multinode.py",  # ~45
    "test_item_averaging.py",  # ~40
    "test_zoo.py",  # ~35
    "test_ddp_training.py",  # ~35
    "test_report.py",  # ~30
    "test_comm_hooks.py",  # ~30
    "test_step_cost.py",  # ~40 (many short jobs)
    "test_diagnostics.py",  # ~20
    "test_fabric.py",  # ~20
    "test_step_guard.py",  # ~15
    "test_world_size.py",  # ~15
    "test_buckets.py",  # ~15
    "test_bad_input.py",  # ~10
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(Path(str(item.fspath)).name, len(LONGEST_FIRST)))


@pytest.fixture(autouse=True)
def jobs_temporary_folder(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The processes a test starts write their temporary files in a folder of its own (``TMPDIR``), removed after the
    test: torchrun's agent makes a log folder there at each start (``torchelastic_*``) and never removes it."""
    folder = tempfile.mkdtemp(prefix="ddp-plus-test-")
    monkeypatch.setenv("TMPDIR", folder)
    try:
        yield
    finally:
        shutil.rmtree(folder)


def pytest_sessionfinish() -> None:
    warm.stop()
