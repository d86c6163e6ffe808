"""Straggler attribution's decision, without processes (the real 2-rank runs are in ``test_diagnostics.py``)."""

from typing import ClassVar

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


class FakeDeviceEvent:
    """A CUDA timing event with the device faked: ``record`` takes the fake stream's time; ``query`` says whether the
    stream has run past it."""

    stream: ClassVar[dict[str, float]] = {"now": 0.0, "done_until": 0.0}

    def record(self) -> None:
        self.at = self.stream["now"]

    def query(self) -> bool:
        return self.at <= self.stream["done_until"]

    def elapsed_time(self, end: "FakeDeviceEvent") -> float:
        return (end.at - self.at) * 1000


def test_on_a_device_the_phases_are_its_stream_time_read_once_the_step_completed():
    """The host switches phases at once (it only queues kernels); the stream spends 30 ms in compute and 50 ms
    waiting for the gradient all-reduce. The step is read when its last event has completed, never waited for."""
    from lightning_ddp_plus.diagnostics.phase_timings import PhaseClock

    stream = FakeDeviceEvent.stream
    stream.update(now=0.0, done_until=-1.0)
    clock = PhaseClock(window=10, device_timer=FakeDeviceEvent)
    for phase, device_seconds in (("data fetch", 0.002), ("compute", 0.030), ("collective wait", 0.050)):
        clock.switch(phase)
        stream["now"] += device_seconds
    clock.switch("optimizer step")
    stream["now"] += 0.004
    clock.end_step()
    assert len(clock.steps) == 0  # queued, not done: nothing read, nothing waited for
    stream["done_until"] = stream["now"]
    medians = clock.medians(rank=1)
    assert len(clock.steps) == 1
    assert [round(medians.of(phase)) for phase in ("data fetch", "compute", "collective wait")] == [2, 30, 50]
    assert round(medians.of("optimizer step")) == 4


def test_a_cuda_device_switches_the_clock_to_events_and_a_cpu_one_keeps_host_time():
    import torch

    from lightning_ddp_plus.diagnostics.collective_ledger import CollectiveLedger
    from lightning_ddp_plus.diagnostics.phase_timings import PhaseClock

    clock = PhaseClock(window=10)
    ledger = CollectiveLedger(clock=clock)
    ledger.follow_device(torch.device("cpu"))
    assert clock.device_timer is None
    ledger.follow_device(torch.device("cuda", 0))
    assert clock.device_timer is not None
