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


def test_ranks_whose_devices_complete_at_different_times_compare_at_the_same_steps():
    """On CUDA a step is timed once its events have completed, which differs per rank; the comparison (a gather)
    must still come at the same steps on every rank. Two ranks as two threads, each with its own faked device (rank
    1's completes 3 steps behind its host), exchange through a real two-party gather: a rank that skipped a
    comparison the other made would leave it waiting (the barrier breaks)."""
    import threading

    from lightning_ddp_plus.diagnostics.phase_timings import StragglerWatch

    exchange = threading.Barrier(2, timeout=10)
    sent: dict[int, list[int]] = {}
    gathered_at: dict[int, list[int]] = {0: [], 1: []}
    findings: dict[int, list] = {0: [], 1: []}

    def run(rank: int, lag_steps: int) -> None:
        stream = {"now": 0.0, "done_until": -1.0}

        class Event:
            def record(self) -> None:
                self.at = stream["now"]

            def query(self) -> bool:
                return self.at <= stream["done_until"]

            def elapsed_time(self, end: "Event") -> float:
                return (end.at - self.at) * 1000

        watch = StragglerWatch(every_n_steps=4, warn=lambda text: None)
        watch.clock.device_timer = Event
        step = 0

        def gather(values):
            gathered_at[rank].append(step)
            sent[rank] = list(values)
            exchange.wait()
            both = [sent[0], sent[1]]
            exchange.wait()
            return both

        for step in range(1, 21):
            watch.clock.switch("compute")
            stream["now"] += 0.010 if rank == 0 else 0.200  # rank 1 is slow in compute
            watch.clock.switch("collective wait")
            stream["now"] += 0.190 if rank == 0 else 0.0  # and rank 0 waits for it
            watch.clock.switch("optimizer step")
            stream["now"] += 0.001
            stream["done_until"] = stream["now"] - lag_steps * 0.211
            watch.close_step(step, rank, gather)
            findings[rank].append(watch.last_finding)
        watch.compare_since_last(step, rank, gather)  # the epoch's end

    threads = [threading.Thread(target=run, args=(rank, lag)) for rank, lag in ((0, 0), (1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not exchange.broken
    assert gathered_at[0] == gathered_at[1] == [4, 8, 12, 16, 20]  # the epoch's end: nothing new since step 20
    # at step 4 rank 1's device had completed 1 of the 4 steps: nobody is named on so little; at step 8 it had
    # completed enough, and both ranks name it
    assert findings[0][3] is None and findings[1][3] is None
    assert [(f.rank, f.phase) for f in (findings[0][7], findings[1][7])] == [(1, "compute")] * 2
