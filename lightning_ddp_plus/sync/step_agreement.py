"""What every rank must know before an optimizer step, agreed in one exchange after each synced backward.

The per-step guard's check (``step_guard``: did every rank's reducer all-reduce every bucket) is the agreement the
others ride on, and its flags ride in the last gradient bucket (``flag_carrier``), so they cost no collective of
their own:

- an uneven-inputs flag that a rank held back for it (``uneven_inputs``, automatic optimization with k=1): whether
  this batch is some rank's last;
- with ``chunk_size="auto"``, whether some rank ran out of memory in this batch's attempt, and then, in one
  gather, which ranks, in which phase, at how many rows;
- whether some rank got a termination notice (``preemption_signals``), so that every rank stops after this step.

Each flag is declared by the component that owns it (``StepComponent.agreement_flags``: ``uneven``'s two,
``chunks``' out-of-memory flag, ``preemption``'s stop) and read back by name; the pipeline lays them out in
one exchange. ``StepAgreement.after_synced_backward`` returns what was agreed as a ``StepAgreed`` record; a fault of
the guard (a bucket some rank never all-reduced) goes to the run's ``sync_fault``, which the conflict rules decide
(rule R6).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.pipeline.agreement import AgreedFlags
from lightning_ddp_plus.pipeline.component import StepPipeline
from lightning_ddp_plus.sync.accumulation import AccumulationWindow
from lightning_ddp_plus.sync.chunks import OUT_OF_MEMORY, PHASES, ChunkSizer, OutOfMemory
from lightning_ddp_plus.sync.side_channel import SideChannel
from lightning_ddp_plus.sync.step_guard import SyncFault, SyncGuard
from lightning_ddp_plus.sync.uneven import RankBatches, UnevenInputsCheck, uneven_flags


@dataclass(frozen=True)
class StepAgreed:
    """What the ranks agreed after a synced backward: whether this batch ends the epoch on every rank (a held
    uneven-inputs flag), every rank's out-of-memory error in this batch's attempt (empty: none), and every declared
    flag by name (``flags``: the components read theirs, such as preemption's stop)."""

    ends_epoch: bool = False
    out_of_memory: tuple[OutOfMemory, ...] = ()
    flags: AgreedFlags = field(default_factory=AgreedFlags)
    skipped: bool = False
    """A fault's gradients could not be made exact and were dropped on every rank: no step applies them."""


class AgreementEngine(Protocol):
    """What the agreement asks of the engine that owns it: its pipeline, whose components declare the
    flags and give their values, and its answers to a fault, a failed rank's first backward and a failed attempt."""

    pipeline: StepPipeline

    def sync_fault(self, ddp: DistributedDataParallel, fault: SyncFault) -> None:
        """Some rank's reducer did not all-reduce every bucket (now completed on every rank): rule R6 decides."""

    def decide_pending_conflicts(self, ddp: DistributedDataParallel) -> None:
        """A rank that failed before its first backward joins the conflict check's decision (a collective)."""

    def rebuild_reducer(self, ddp: DistributedDataParallel) -> None:
        """A new reducer for the wrapper, after an attempt that failed."""


class StepAgreement:
    """The agreement after every synced backward, and the uneven-inputs decision before every training batch.

    Args:
        engine: the engine (its pipeline's declared flags travel in the agreement; see ``AgreementEngine``).
        guard: the per-step guard, whose check carries the agreement.
        uneven: the uneven-inputs check (its held flag, and its decision).
        chunks: ``chunk_size`` (with ``"auto"``, this rank's failure in the attempt).
        channel: the small gloo group the ranks agree on.
        window: the accumulation window (the step number the guard reports).
    """

    def __init__(
        self,
        engine: AgreementEngine,
        guard: SyncGuard,
        uneven: UnevenInputsCheck,
        chunks: ChunkSizer,
        channel: SideChannel,
        window: AccumulationWindow,
    ) -> None:
        self.engine, self.guard, self.uneven, self.chunks = engine, guard, uneven, chunks
        self.channel, self.window = channel, window
        #: The wrapper of the running fit (set by the engine's ``start_fit``).
        self.ddp: DistributedDataParallel | None = None
        self.epoch = 0

    def batch_starts(self, state: RankBatches, epoch: int, one_synced_backward: bool) -> bool:
        """Before a training batch, on every rank: the uneven-inputs decision. Returns True when this rank must make
        this batch its epoch's last (``uneven_inputs="stop"``); raises ``UnevenInputsError`` (``"error"``).

        ``one_synced_backward``: this batch ends with exactly one synced backward on every rank (automatic
        optimization, k=1), so its flag can travel in the agreement after that backward.
        """
        uneven, channel = self.uneven, self.channel
        if uneven.mode == "join" and not channel.open:  # one rank: its own loader's end ends the epoch
            return uneven.join_batch_starts(lambda values: values, lambda values: [values], epoch, 1)
        if not channel.open:
            return False
        if uneven.mode == "join":
            return uneven.join_batch_starts(channel.total, channel.gather, epoch, channel.size)
        if one_synced_backward and self.guard.active:
            uneven.defer_to_step_check(state)
            self.epoch = epoch
            return False
        return uneven.decide(state, channel.maximum(uneven_flags(state.last)), channel.gather, epoch)

    def flags_now(self) -> list[int]:
        """This rank's flags as its last bucket leaves: the guard's two (none: its news travels in its completion)
        and every declared one."""
        pipeline = self.engine.pipeline
        return [0, 0, *pipeline.flags.pack(pipeline.agreement_values())]

    def after_synced_backward(self, ddp: DistributedDataParallel, failed: bool, started: bool = True) -> StepAgreed:
        """The guard's check with the declared flags riding on it (``failed``: this rank's backward raised what the
        guard takes over; with ``chunks.failure`` set, this rank's attempt ran out of memory, ``started``
        saying whether its synced backward had begun)."""
        flags, values = self.engine.pipeline.flags, self.engine.pipeline.agreement_values()
        if not self.guard.active:  # no check to ride on: the flags rode the last bucket, or take their own all-reduce
            carried = self.guard.carrier.take() if self.guard.carrier.installed else None
            if carried is not None:
                return StepAgreed(flags=flags.read(carried[2:]))
            if not self.engine.pipeline.agreement_needed():
                return StepAgreed(flags=flags.zeros())
            return StepAgreed(flags=flags.read(self.channel.maximum(flags.pack(values))))
        failure, self.chunks.failure = self.chunks.failure, None
        deferred = self.uneven.take_deferred()
        outcome = self.guard.check(
            ddp,
            self.window.stats.optimizer_steps + 1,
            flags.pack(values),
            aborted=failed or failure is not None,
            never_started=failure is not None and not started,
        )
        agreed = flags.read(outcome.flag_maximums)
        if agreed.get(OUT_OF_MEMORY):
            if deferred is not None:  # the batch runs again, and its uneven-inputs flag with it
                self.uneven.defer_to_step_check(deferred)
            return StepAgreed(out_of_memory=self._every_ranks_failure(failure), flags=agreed)
        skipped = outcome.fault is not None and outcome.fault.skipped
        if outcome.fault is not None:
            self.engine.sync_fault(ddp, outcome.fault)
        if deferred is None:
            return StepAgreed(flags=agreed, skipped=skipped)
        ends_epoch = self.uneven.decide(deferred, self.uneven.maximums(agreed), self.channel.gather, self.epoch)
        return StepAgreed(ends_epoch=ends_epoch, flags=agreed, skipped=skipped)

    def agree_on_failure(self, failure: OutOfMemory, synced_backward_started: bool) -> StepAgreed:
        """On a rank whose attempt at a batch ran out of memory (``chunk_size="auto"``), in place of its synced
        backward: issue the bucket all-reduces the other ranks' backward waits for, and agree with them."""
        assert self.ddp is not None and self.guard.active
        self.engine.decide_pending_conflicts(self.ddp)
        self.chunks.failure = failure
        return self.after_synced_backward(self.ddp, failed=True, started=synced_backward_started)

    def reset_reducer(self) -> None:
        """Every rank, after an attempt some rank failed: a backward that failed half way leaves the reducer
        expecting hooks (and, on the first step, bucket orders that differ between ranks)."""
        if self.ddp is not None:
            self.engine.rebuild_reducer(self.ddp)

    def _every_ranks_failure(self, local: OutOfMemory | None) -> tuple[OutOfMemory, ...]:
        """Every rank's failure in this attempt (one gather, only after one)."""
        mine = [1, PHASES.index(local.phase), local.rows, local.batch_rows] if local is not None else [0, 0, 0, 0]
        return tuple(
            OutOfMemory(rank=rank, phase=PHASES[row[1]], rows=row[2], batch_rows=row[3])
            for rank, row in enumerate(self.channel.gather(mine))
            if row[0]
        )
