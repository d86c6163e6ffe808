"""Straggler attribution's decision, without processes (the real 2-rank runs are in ``test_diagnostics.py``)."""

import pytest

from lightning_ddp_plus.diagnostics.phase_timings import THRESHOLDS, PhaseTimes, find_straggler


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
