"""Straggler attribution in real 2-rank Trainer runs: a rank slow to fetch its batches, slow in its training step,
or slow with the others waiting in DDP's buffer broadcast rather than in the gradient all-reduce, is named with its
phase and figures; a balanced run names no one. The decision itself is tested without processes."""

import pytest

from lightning_ddp_plus.diagnostics.phase_timings import THRESHOLDS, PhaseTimes, find_straggler
from tests.helpers import run_case_job

pytestmark = pytest.mark.multiprocess

DELAY_S = 0.15
CASES = [
    {"name": "balanced", "slow": None, "rank": 0, "delay_s": 0, "steps": 40, "every": 10},
    {"name": "slow data on rank 1", "slow": "data", "rank": 1, "delay_s": DELAY_S, "steps": 20, "every": 10},
    {"name": "slow compute on rank 1", "slow": "compute", "rank": 1, "delay_s": DELAY_S, "steps": 20, "every": 10},
    # a BatchNorm: DDP broadcasts buffers at every forward, so rank 1 waits there, not in the gradient all-reduce
    {
        "name": "slow data on rank 0, buffers",
        "slow": "data",
        "rank": 0,
        "delay_s": DELAY_S,
        "steps": 20,
        "every": 10,
        "buffers": True,
    },
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    found = run_case_job("straggler_job.py", CASES, tmp_path_factory.mktemp("stragglers") / "results.json")
    return {case["name"]: case for case in found}


@pytest.mark.parametrize(
    ("name", "rank", "phase"),
    [
        ("slow data on rank 1", 1, "data fetch"),
        ("slow compute on rank 1", 1, "compute"),
        ("slow data on rank 0, buffers", 0, "data fetch"),
    ],
)
def test_the_slow_rank_is_named_once_with_its_phase_and_figures(results, name, rank, phase):
    outcome = results[name]
    assert len(outcome["warnings"]) == 1, outcome["warnings"]  # two comparisons, one warning: repeats are held back
    warning = outcome["warnings"][0]
    assert f"rank {rank} is the straggler: {phase} " in warning
    assert "median of the last 10 steps" in warning and "every rank waits for it" in warning
    last = {times["rank"]: times for times in outcome["comparisons"][-1]}
    slow, other = last[rank], last[1 - rank]
    key = phase.replace(" ", "_") + "_ms"
    assert slow[key] - other[key] > 0.8 * DELAY_S * 1000  # the delay lands in the phase it was put in
    assert other["collective_wait_ms"] - slow["collective_wait_ms"] > 0.8 * DELAY_S * 1000  # and the other waits


def test_a_balanced_run_names_no_one(results):
    outcome = results["balanced"]
    assert outcome["warnings"] == []
    assert len(outcome["comparisons"]) == 4  # every 10 steps, 40 steps
    for comparison in outcome["comparisons"]:
        times = [PhaseTimes(**rank_times) for rank_times in comparison]
        assert find_straggler(times, 10) is None


def test_a_rank_slower_by_less_than_the_thresholds_is_not_named():
    step = [PhaseTimes(0, 2, 100, 25, 1), PhaseTimes(1, 2 + 15, 100, 10, 1)]  # 15 ms: under the 20 ms floor
    assert find_straggler(step, 50) is None
    share = [PhaseTimes(0, 2, 400, 55, 1), PhaseTimes(1, 2 + 50, 400, 5, 1)]  # 50 ms of a 460 ms step: under 25 %
    assert THRESHOLDS.min_excess_share * 458 > 50
    assert find_straggler(share, 50) is None
    named = [PhaseTimes(0, 2, 100, 55, 1), PhaseTimes(1, 2 + 50, 100, 5, 1)]
    finding = find_straggler(named, 50)
    assert finding is not None and (finding.rank, finding.phase) == (1, "data fetch")


def test_the_phase_that_is_slowest_against_the_others_is_named_when_several_are_slower():
    times = [PhaseTimes(0, 2, 50, 260, 1), PhaseTimes(1, 62, 250, 10, 1), PhaseTimes(2, 2, 50, 255, 1)]
    finding = find_straggler(times, 50)
    assert finding is not None and (finding.rank, finding.phase) == (1, "compute")
    assert finding.others_ms == 50 and finding.others_wait_ms == pytest.approx(257.5)
