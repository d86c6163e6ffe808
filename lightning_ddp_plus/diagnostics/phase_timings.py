"""Straggler attribution: every rank times the phases of its optimizer steps, and every N steps the ranks compare
their medians to name a rank that the others wait for.

Timed phases, per optimizer step and rank:

- **data fetch**: from the end of the previous optimizer step to the next training forward (the next batch, and the
  loop's work between steps: callbacks, logging);
- **compute**: the forward and the backward on this rank, less the time waited in collectives within them;
- **collective wait**: time inside collectives (``self.log(..., sync_dist=True)``, a barrier, DDP's buffer broadcast
  at the start of the forward), and, in a synced backward, from the moment this rank's autograd graph has computed
  every gradient to the moment the gradient all-reduce is done;
- **optimizer step**: from the end of the synced backward to the end of the optimizer step.

Validation and checkpoint saving are not timed (they do not repeat per step).

Why this finds the straggler: DDP's gradient all-reduce makes every rank's step as long as the slowest rank's. The
slow rank spends its extra time in its own phase (data fetch, compute or optimizer step); every other rank spends
about the same time waiting in the next collective. So a straggler is a rank whose phase takes longer than on the
others by a margin that matters against the step (``StragglerThresholds``), while the others wait about as much
longer than it does. A rank that is slower but that nobody waits for is not a straggler.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from lightning_ddp_plus.pipeline.component import BackwardStart, EpochEnd, FitStart, StepComponent
from lightning_ddp_plus.private_apis.torch_distributed import queue_backward_callback
from lightning_ddp_plus.sync.side_channel import SideChannel

TimedPhase = Literal["data fetch", "compute", "collective wait", "optimizer step"]
TIMED_PHASES: tuple[TimedPhase, ...] = ("data fetch", "compute", "collective wait", "optimizer step")
#: The phases a rank spends on its own work, where a straggler is slow (the others wait in collectives meanwhile).
OWN_PHASES: tuple[TimedPhase, ...] = ("data fetch", "compute", "optimizer step")


@dataclass(frozen=True)
class StragglerThresholds:
    """When a rank counts as the straggler (see ``docs/guides/failures.md`` for how these were chosen).

    A rank's phase median exceeds the others' (the median of their medians) by at least ``min_excess_ms`` and by
    at least ``min_excess_share`` of the step (the median over ranks of the sum of the phases), and the others wait
    in collectives at least ``min_wait_share`` of that excess longer than it does.
    """

    min_excess_ms: float = 20.0
    min_excess_share: float = 0.25
    min_wait_share: float = 0.5


#: How long a warning about the same rank and phase is held back after one was given.
REPEAT_AFTER_SECONDS = 300.0
#: The thresholds in use: chosen from the noise of balanced runs (see ``StragglerThresholds``).
THRESHOLDS = StragglerThresholds()


@dataclass(frozen=True)
class PhaseTimes:
    """One rank's median milliseconds per optimizer step in each phase, over the last ``steps`` steps."""

    rank: int
    data_fetch_ms: float
    compute_ms: float
    collective_wait_ms: float
    optimizer_step_ms: float

    def of(self, phase: TimedPhase) -> float:
        return float(getattr(self, phase.replace(" ", "_") + "_ms"))

    @property
    def total_ms(self) -> float:
        return sum(self.of(phase) for phase in TIMED_PHASES)

    def as_microseconds(self) -> list[int]:
        """The four medians as whole microseconds (what the ranks exchange: the side channel carries integers)."""
        return [round(self.of(phase) * 1000) for phase in TIMED_PHASES]

    @classmethod
    def from_microseconds(cls, rank: int, values: Sequence[int]) -> PhaseTimes:
        return cls(rank, *(value / 1000 for value in values))


@dataclass(frozen=True)
class StragglerFinding:
    """A rank the others wait for: its phase median against the others', and what the others wait for it."""

    rank: int
    phase: TimedPhase
    its_ms: float
    others_ms: float
    its_wait_ms: float
    others_wait_ms: float
    steps: int

    def describe(self) -> str:
        """
        >>> StragglerFinding(1, "data fetch", 152.0, 3.0, 1.0, 148.0, 50).describe()  # doctest: +NORMALIZE_WHITESPACE
        'rank 1 is the straggler: data fetch 152 ms per step against 3 ms on the others (median of the last 50
        steps); every rank waits for it (the others wait 148 ms per step in collectives, rank 1 waits 1 ms).'
        """
        return (
            f"rank {self.rank} is the straggler: {self.phase} {self.its_ms:.0f} ms per step against "
            f"{self.others_ms:.0f} ms on the others (median of the last {self.steps} steps); every rank waits for it "
            f"(the others wait {self.others_wait_ms:.0f} ms per step in collectives, rank {self.rank} waits "
            f"{self.its_wait_ms:.0f} ms)."
        )


def find_straggler(
    times: Sequence[PhaseTimes], steps: int, thresholds: StragglerThresholds = THRESHOLDS
) -> StragglerFinding | None:
    """The rank the others wait for, in the phase where it is slowest against them, or ``None`` (a balanced run).

    >>> balanced = [PhaseTimes(0, 3, 40, 5, 2), PhaseTimes(1, 4, 41, 4, 2)]
    >>> find_straggler(balanced, 50) is None
    True
    >>> slow_data = [PhaseTimes(0, 3, 40, 155, 2), PhaseTimes(1, 152, 41, 6, 2)]
    >>> finding = find_straggler(slow_data, 50)
    >>> finding.rank, finding.phase
    (1, 'data fetch')
    >>> nobody_waits = [PhaseTimes(0, 3, 40, 5, 2), PhaseTimes(1, 152, 41, 6, 2)]  # slower, but nobody waits for it
    >>> find_straggler(nobody_waits, 50) is None
    True
    """
    if len(times) < 2:
        return None
    step_ms = statistics.median(rank_times.total_ms for rank_times in times)
    candidates = []
    for phase in OWN_PHASES:
        slowest = max(times, key=lambda rank_times: rank_times.of(phase))
        others = [rank_times for rank_times in times if rank_times.rank != slowest.rank]
        others_ms = statistics.median(rank_times.of(phase) for rank_times in others)
        excess = slowest.of(phase) - others_ms
        others_wait = statistics.median(rank_times.collective_wait_ms for rank_times in others)
        waited_for = others_wait - slowest.collective_wait_ms
        if (
            excess >= thresholds.min_excess_ms
            and excess >= thresholds.min_excess_share * step_ms
            and waited_for >= thresholds.min_wait_share * excess
        ):
            finding = StragglerFinding(
                slowest.rank, phase, slowest.of(phase), others_ms, slowest.collective_wait_ms, others_wait, steps
            )
            candidates.append((excess, finding))
    return max(candidates, key=lambda candidate: candidate[0])[1] if candidates else None


class DeviceEvent(Protocol):
    """What the clock needs of a CUDA event (``torch.cuda.Event(enable_timing=True)``)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...


class PhaseClock:
    """This rank's time per phase: the current step's totals, and the last ``window`` steps' (for the medians).

    The main thread switches it (the engine and the collective ledger, at each phase and collective); ``None`` is a
    phase that is not timed (setup, validation, checkpoint saving).

    On CPU the phases are host time. On CUDA (``follow_device``) the host only queues kernels, and a rank waiting for
    a peer waits at the next host sync, in whatever phase that is: so there every switch records an event on the
    current stream, and a step's phases are the device time between its events. They are read once the step's last
    event has completed (asked without waiting, at the end of every step), so no step waits for the device; a
    comparison reads the steps settled by then.

    >>> clock = PhaseClock(window=50)
    >>> for phase in ("data fetch", "compute", "collective wait", "optimizer step"):
    ...     _ = clock.switch(phase)
    >>> clock.end_step()
    >>> len(clock.steps), [round(ms) for ms in clock.steps[0]]
    (1, [0, 0, 0, 0])
    """

    def __init__(self, window: int, device_timer: Callable[[], DeviceEvent] | None = None) -> None:
        #: Milliseconds per phase (in ``TIMED_PHASES``' order) of each of the last ``window`` optimizer steps.
        self.steps: deque[list[float]] = deque(maxlen=window)
        #: Makes a timing event on the device's current stream (``None``: host time).
        self.device_timer = device_timer
        self.reset()

    def follow_device(self, device: Any) -> None:
        """Time the phases on ``device``'s stream where its work runs behind the host (CUDA)."""
        if getattr(device, "type", None) == "cuda":
            import torch

            self.device_timer = lambda: torch.cuda.Event(enable_timing=True)

    def reset(self) -> None:
        self.phase: TimedPhase | None = None
        self._since = time.perf_counter()
        self._current = [0.0] * len(TIMED_PHASES)
        #: On the device: the current step's (phase, event at its start), and the closed steps not yet settled.
        self._marks: list[tuple[TimedPhase | None, DeviceEvent]] = []
        self._unsettled: deque[list[tuple[TimedPhase | None, DeviceEvent]]] = deque()
        self.steps.clear()

    def switch(self, phase: TimedPhase | None) -> TimedPhase | None:
        """Time from now on goes to ``phase``; returns the phase it went to until now."""
        now = time.perf_counter()
        previous = self.phase
        if self.device_timer is not None:
            event = self.device_timer()
            event.record()
            self._marks.append((phase, event))
        elif previous is not None:
            self._current[TIMED_PHASES.index(previous)] += now - self._since
        self.phase, self._since = phase, now
        return previous

    def end_step(self) -> None:
        """Close the current optimizer step (time goes on into the phase in effect, which the next step gets)."""
        self.switch(self.phase)
        if self.device_timer is not None:  # the step's last mark opens the next one
            self._unsettled.append(self._marks)
            self._marks = [self._marks[-1]]
            self._settle()
            return
        self.steps.append([seconds * 1000 for seconds in self._current])
        self._current = [0.0] * len(TIMED_PHASES)

    def _settle(self) -> None:
        """The closed steps whose events have all completed, oldest first, as milliseconds per phase."""
        while self._unsettled and self._unsettled[0][-1][1].query():
            marks = self._unsettled.popleft()
            totals = [0.0] * len(TIMED_PHASES)
            for (phase, start), (_, end) in itertools.pairwise(marks):
                if phase is not None:
                    totals[TIMED_PHASES.index(phase)] += start.elapsed_time(end)
            self.steps.append(totals)

    def medians(self, rank: int, last: int | None = None) -> PhaseTimes:
        """This rank's median per phase over the steps in the window (``last``: over its last ones only)."""
        if self.device_timer is not None:
            self._settle()
        if last is not None and 0 < last < len(self.steps):
            return PhaseTimes(
                rank, *(statistics.median(column) for column in zip(*list(self.steps)[-last:], strict=True))
            )
        if not self.steps:
            return PhaseTimes(rank, *[0.0] * len(TIMED_PHASES))
        return PhaseTimes(rank, *(statistics.median(column) for column in zip(*self.steps, strict=True)))


#: The fewest steps a comparison at the end of a fit reads (fewer say too little about a rank's usual step).
MIN_STEPS_COMPARED = 8


class StragglerWatch(StepComponent):
    """Every ``every_n_steps`` optimizer steps, the ranks exchange their phase medians (one gather of five integers
    per rank on the side channel) and a straggler is warned about, once per rank and phase every
    ``repeat_after_seconds``.

    Args:
        every_n_steps: steps between comparisons, and the window of the medians.
        warn: how a finding reaches the user (rank 0 only: every rank decides alike).
        channel: the side channel the ranks compare on, in a run (``None``: ``compare`` is given the gather).
    """

    def __init__(
        self,
        every_n_steps: int,
        warn: Callable[[str], None],
        repeat_after_seconds: float = REPEAT_AFTER_SECONDS,
        channel: SideChannel | None = None,
    ) -> None:
        self.every_n_steps, self.channel = every_n_steps, channel
        self.clock = PhaseClock(window=every_n_steps)
        self._warn = warn
        self.repeat_after_seconds = repeat_after_seconds
        self._warned_at: dict[tuple[int, str], float] = {}
        #: Every rank's medians at the last comparison (for telemetry and the report).
        self.last_times: list[PhaseTimes] = []
        self.last_finding: StragglerFinding | None = None
        self._compared_at = 0
        #: Steps closed in this fit: the same on every rank, unlike the steps timed (on CUDA a step is timed once
        #: its events completed, which differs per rank), so it alone decides when the ranks compare.
        self._closed = 0
        self._due = False  # a comparison due at the step closed last (run once the loop counted it)

    def fit_starts(self, fit: FitStart) -> None:
        self.reset()

    def before_backward(self, backward: BackwardStart) -> None:
        if backward.forward_synced:
            self.backward_starts(backward.loss)

    def step_done(self, step: int) -> None:
        self._due = self.end_step(step)

    def step_counted(self, step: int) -> None:
        assert self.channel is not None
        if self._due:
            self._due = False
            self._compare(step, self.channel.rank, self.channel.gather, self.every_n_steps)

    def epoch_ends(self, end: EpochEnd) -> None:
        assert self.channel is not None
        self.compare_since_last(end.step, self.channel.rank, self.channel.gather)

    def backward_starts(self, loss: Any) -> None:
        """Before a synced backward: once its graph is computed, the rest of it is waiting for the gradient
        all-reduce (the reducer's own callback, queued after this one, waits for it)."""
        if loss is not None and loss.grad_fn is not None:
            loss.grad_fn.register_prehook(lambda grad_outputs: queue_backward_callback(self._waiting))

    def _waiting(self) -> None:
        self.clock.switch("collective wait")

    def reset(self) -> None:
        """A new fit: no steps timed yet (the clock object stays: the ledger holds it)."""
        self.clock.reset()
        self.last_times, self.last_finding = [], None
        self._compared_at = self._closed = 0
        self._due = False

    def close_step(self, step: int, rank: int, gather: Callable[[Sequence[int]], list[list[int]]]) -> None:
        """Close the step; on every ``every_n_steps``-th, compare the ranks (a collective: every rank calls it at the
        same steps) and warn about a straggler."""
        if self.end_step(step):
            self._compare(step, rank, gather, self.every_n_steps)

    def end_step(self, step: int) -> bool:
        """Close the step's timing; whether the ranks compare at it (every ``every_n_steps``-th)."""
        self.clock.end_step()
        self._closed += 1
        return step % self.every_n_steps == 0 and self._closed >= self.every_n_steps

    def compare_since_last(self, step: int, rank: int, gather: Callable[[Sequence[int]], list[list[int]]]) -> None:
        """At the end of an epoch and of a fit, on every rank (a collective): the steps since the last comparison
        are compared too, when there are at least ``MIN_STEPS_COMPARED``, so that a run or an epoch shorter than
        ``every_n_steps``, or the tail of a longer one, names its straggler."""
        since = min(step - self._compared_at, self._closed)
        if since >= MIN_STEPS_COMPARED:
            self._compare(step, rank, gather, since)

    def _compare(self, step: int, rank: int, gather: Callable[[Sequence[int]], list[list[int]]], steps: int) -> None:
        """Every rank calls it at the same step; each sends its medians over the steps it has timed of the last
        ``steps`` and how many those are, and a rank whose device has not yet completed ``MIN_STEPS_COMPARED`` of
        them keeps anyone from being named this time (its medians would say too little)."""
        self._compared_at = step
        timed = min(steps, len(self.clock.steps))
        gathered = gather([*self.clock.medians(rank, last=steps).as_microseconds(), timed])
        self.last_times = [PhaseTimes.from_microseconds(other, values[:-1]) for other, values in enumerate(gathered)]
        enough = all(values[-1] >= min(steps, MIN_STEPS_COMPARED) for values in gathered)
        self.last_finding = finding = find_straggler(self.last_times, steps) if enough else None
        if finding is None:
            return
        now = time.monotonic()
        key = (finding.rank, finding.phase)
        if now - self._warned_at.get(key, -self.repeat_after_seconds) >= self.repeat_after_seconds:
            self._warned_at[key] = now
            self._warn(f"lightning-ddp-plus: {finding.describe()}")
