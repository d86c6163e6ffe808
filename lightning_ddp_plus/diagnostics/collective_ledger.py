"""The collective ledger: on every rank, the last collectives the job issued, in order, with what they were for.

Each record holds the collective's sequence number on this rank, the operation, its size, the phase of the step it
was issued in, the step, and the user's line that led to it (``call_sites``). Ranks in step have issued the same
collectives in the same order, so the same sequence number names the same collective on every rank; when a rank
waits too long, comparing the ranks' ledgers says whether they are out of step (different collectives at one
sequence number) or whether one rank has not reached the collective the others wait in (``stalls``).

The main thread writes it; the stall watchdog's thread reads it. A record is written once when the collective starts
and once when it ends, so a reader sees a consistent record or the one before it.

A record ends when the collective completes, not when its host call returns. On gloo the two are the same. On NCCL a
collective returns once it is queued on a CUDA stream, and a rank whose peer hangs blocks later, at the next host
sync (a ``.item()``, a logging call), outside any record. So on a device whose collectives run behind the host
(``follow_device``), the end of a host call records an event on the current stream (which DDP and a synchronous
collective made wait for the collective's stream): the record stays open until the event completes, and the stall
watchdog asks which issued collective has not completed, and for how long.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from lightning_ddp_plus.diagnostics.call_sites import CallSite, caller_site
from lightning_ddp_plus.diagnostics.phase_timings import PhaseClock, TimedPhase
from lightning_ddp_plus.memory.sizes import format_size
from lightning_ddp_plus.pipeline.component import BackwardEnd, BackwardStart, FitStart, ForwardStart, StepComponent

#: Where in a training step the main thread is.
Phase = Literal["setup", "data fetch", "forward", "backward", "optimizer step", "validation", "checkpoint save"]
#: The phase clock's name of each phase (``None``: not timed).
_TIMED: dict[str, TimedPhase | None] = {
    "data fetch": "data fetch",
    "forward": "compute",
    "backward": "compute",
    "optimizer step": "optimizer step",
}


@dataclass
class CollectiveRecord:
    """One collective on this rank: started at ``started``, still running while ``ended`` is ``None`` (both on this
    process's monotonic clock: only durations are read from them)."""

    sequence: int
    op: str
    size_bytes: int
    phase: str
    step: int
    call_site: CallSite | None
    started: float
    ended: float | None = None

    def describe(self) -> str:
        """``all_reduce of 4 B at model.py:57 in training_step: self.log(...) (collective 17, step 3, forward)``.

        >>> CollectiveRecord(17, "all_reduce", 4, "forward", 3, None, 0.0).describe()
        'all_reduce of 4 B (collective 17, step 3, forward)'
        """
        where = f" at {self.call_site}" if self.call_site is not None else ""
        return (
            f"{self.op} of {format_size(self.size_bytes, digits=1)}{where} "
            f"(collective {self.sequence}, step {self.step}, {self.phase})"
        )

    def as_data(self) -> dict[str, Any]:
        """The record as plain data (it crosses the store to the other ranks as JSON)."""
        return asdict(self)

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> CollectiveRecord:
        site = data.get("call_site")
        return cls(**{**data, "call_site": CallSite(**site) if site else None})


class CollectiveLedger(StepComponent):
    """The last ``length`` collectives of this rank, the phase and the step the main thread is in, and when it last
    made progress (entered or left a collective, or changed phase).

    >>> ledger = CollectiveLedger(length=2)
    >>> for op in ("barrier", "broadcast", "all_reduce"):
    ...     with ledger.collective(op, 8):
    ...         pass
    >>> [record.op for record in ledger.records], ledger.sequence
    (['broadcast', 'all_reduce'], 3)
    """

    def __init__(
        self,
        length: int = 64,
        clock: PhaseClock | None = None,
        device_completion: Callable[[], Callable[[], bool]] | None = None,
    ) -> None:
        #: ``length`` 0: no records (and no call sites looked up); phases and the clock still follow the thread.
        self.records: deque[CollectiveRecord] = deque(maxlen=length)
        #: Told of every phase and collective (straggler attribution), if any.
        self.clock = clock
        self.sequence = 0
        self.phase: Phase = "setup"
        self.step = 0
        #: Made at the end of every collective's host call where the device completes it later: a probe that says
        #: whether the work queued so far has completed (``None``: the host call returned when it completed).
        self.device_completion = device_completion
        #: The rank's device, once followed: a thread that asks its probes must make it its current device first.
        self.device: torch.device | None = None
        self._in_call: CollectiveRecord | None = None
        #: Records whose host call returned before their collective completed, with their probe (a tuple replaced
        #: whole, so that the watchdog's thread reads it while the main thread appends).
        self._pending: tuple[tuple[CollectiveRecord, Callable[[], bool]], ...] = ()
        #: ``time.monotonic()`` of the last progress: a collective entered or left, a phase changed.
        self.progressed = time.monotonic()

    def follow_device(self, device: torch.device) -> None:
        """Collectives on ``device`` complete behind the host (CUDA): records end when its stream's event does, and
        the phase clock times the stream."""
        self.device = device
        if device.type == "cuda":
            self.device_completion = stream_completion
        if self.clock is not None:
            self.clock.follow_device(device)

    def forward_starts(self, forward: ForwardStart) -> None:
        if forward.training:
            self.enter_phase("forward", step=forward.step)

    def before_backward(self, backward: BackwardStart) -> None:
        self.enter_phase("backward")

    def after_backward(self, backward: BackwardEnd) -> None:
        self.enter_phase("optimizer step" if backward.synced else "data fetch")

    def step_done(self, step: int) -> None:
        self.enter_phase("data fetch", step=step)

    @property
    def current(self) -> CollectiveRecord | None:
        """The oldest collective this rank issued that has not completed: one whose host call returned before the
        device completed it, or the one the main thread is in (``None``: none)."""
        for record, done in self._pending:
            if record.ended is None:
                if not done():
                    return record
                record.ended = time.monotonic()  # seen complete now (the watchdog's poll bounds the error)
        return self._in_call

    def enter_phase(self, phase: Phase, step: int | None = None) -> None:
        self.phase = phase
        if step is not None:
            self.step = step
        self.progressed = time.monotonic()
        if self.clock is not None:
            self.clock.switch(_TIMED.get(phase))

    @contextmanager
    def in_phase(self, phase: Phase) -> Iterator[None]:
        """``phase`` for the ``with`` block (a checkpoint save in the middle of another), then the phase before."""
        before = self.phase
        self.enter_phase(phase)
        try:
            yield
        finally:
            self.enter_phase(before)

    @contextmanager
    def collective(
        self, op: str, size_bytes: int = 0, users_call: bool = True, waits: bool = True
    ) -> Iterator[CollectiveRecord | None]:
        """Record the collective that runs inside the ``with`` block, issued from the user's line that led here
        (``users_call=False``: Lightning's loop issued it, and the user's line would only be ``trainer.fit``).

        ``waits=False``: the block also computes (the backward around the gradient all-reduce), and whoever runs it
        tells the clock when the waiting starts."""
        self.sequence += 1
        if self._pending:  # those completed since are dropped
            self._pending = tuple((record, done) for record, done in self._pending if not done())
        clock = self.clock if waits and self.clock is not None and self.clock.phase is not None else None
        resumed = clock.switch("collective wait") if clock is not None else None
        record = None
        if self.records.maxlen:
            site = caller_site() if users_call else None
            record = CollectiveRecord(
                self.sequence, op, size_bytes, self.phase, self.step, site, started=time.monotonic()
            )
            self.records.append(record)
            self._in_call = record
            self.progressed = record.started
        try:
            yield record
        finally:
            if record is not None:
                self._end(record)
            if clock is not None:
                clock.switch(resumed)

    def _end(self, record: CollectiveRecord) -> None:
        """The host call returned: the record ends, or waits for the device to complete the collective."""
        done = self.device_completion() if self.device_completion is not None else None
        self.progressed = time.monotonic()
        if done is None or done():
            record.ended = self.progressed
        else:
            self._pending = (*self._pending, (record, done))
        self._in_call = None

    def last(self, count: int = 8) -> list[CollectiveRecord]:
        """The last ``count`` records, oldest first (a copy: the main thread may append meanwhile)."""
        return list(self.records)[-count:]


def enter_device(device: torch.device | None) -> None:
    """On a thread other than the main one, before it asks this rank's CUDA events: the rank's device becomes the
    thread's current one. CUDA's current device is per thread, and a thread without one works on device 0, where it
    would create a context of its own (about 0.5 GiB) on every rank but the one that owns that GPU."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def stream_completion() -> Callable[[], bool]:
    """A probe of the work queued so far on the current CUDA stream: an event recorded now, asked without waiting."""
    event = torch.cuda.Event()
    event.record()
    return event.query


class BufferBroadcastRecord(StepComponent):
    """DDP's buffer broadcast (``broadcast_buffers``) in the ledger: it runs between DDP's own forward pre-hooks and
    the module's, so the record opens in the wrapper's pre-hook (``forward_starts``) and closes in the module's."""

    def __init__(self, ledger: CollectiveLedger) -> None:
        self.ledger = ledger
        self.broadcasts = False
        self._open = ExitStack()
        self._handles: list[Any] = []

    def fit_starts(self, fit: FitStart) -> None:
        self._handles = self.attach(fit.ddp, fit.module, fit.broadcast_buffers)

    def forward_starts(self, forward: ForwardStart) -> None:  # every forward: DDP broadcasts in evaluation too
        self.record_broadcast(forward.ddp)

    def fit_ends(self, failed: bool) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.close()

    def attach(self, ddp: Any, module: Any, broadcasts: bool) -> list[Any]:
        """Start recording for a new wrapper; returns the hook handle to remove at the end of the fit."""
        self.broadcasts = broadcasts and any(True for _ in module.buffers())
        return [module.register_forward_pre_hook(self._broadcast_done)] if self.broadcasts else []

    def record_broadcast(self, ddp: Any) -> None:
        if self.broadcasts and ddp.require_forward_param_sync:  # DDP's condition to broadcast buffers
            self._open.enter_context(self.ledger.collective("buffer broadcast", users_call=False))

    def _broadcast_done(self, module: Any, args: Any) -> None:
        self._open.close()

    def close(self) -> None:
        self._open.close()
