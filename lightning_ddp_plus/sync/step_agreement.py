"""What every rank must know before an optimizer step, agreed in one exchange after each synced backward.

The per-step guard's check (``step_guard``: did every rank's reducer all-reduce every bucket) is the agreement the
others ride on, so they cost no collective of their own:

- an uneven-inputs flag that a rank held back for it (``uneven_inputs``, automatic optimization with k=1): whether
  this batch is some rank's last;
- with ``micro_batch_size="auto"``, whether some rank ran out of memory in this batch's attempt, and then, in one
  gather, which ranks, in which phase, at how many rows;
- whether some rank got a termination notice (``preemption_signals``), so that every rank stops after this step.

``StepAgreement.after_synced_backward`` returns what was agreed as a ``StepAgreed`` record; a fault of the guard (a
bucket some rank never all-reduced) goes to ``on_fault``, which the conflict rules decide (rule R6).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.sync.accumulation import AccumulationWindow
from lightning_ddp_plus.sync.micro_batches import PHASES, OutOfMemory
from lightning_ddp_plus.sync.side_channel import SideChannel
from lightning_ddp_plus.sync.step_guard import SyncFault, SyncGuard
from lightning_ddp_plus.sync.uneven import RankBatches, UnevenInputsCheck, uneven_flags


@dataclass(frozen=True)
class StepAgreed:
    """What the ranks agreed after a synced backward: whether this batch ends the epoch on every rank (a held
    uneven-inputs flag), every rank's out-of-memory error in this batch's attempt (empty: none), and whether some
    rank got a termination notice (every rank stops after this step)."""

    ends_epoch: bool = False
    out_of_memory: tuple[OutOfMemory, ...] = ()
    stop: bool = False


class StepAgreement:
    """The agreement after every synced backward, and the uneven-inputs decision before every training batch.

    Args:
        guard: the per-step guard, whose check carries the agreement.
        uneven: the uneven-inputs check.
        channel: the small gloo group the ranks agree on.
        window: the accumulation window (the step number the guard reports).
        carries_out_of_memory: ``micro_batch_size="auto"``: every agreement carries an out-of-memory flag (the
            setting is the same on every rank, so the flags have the same length everywhere).
        on_fault: what a fault of the guard leads to (raise, or resolve and train on).
        before_failure_agreement: what a rank that failed must still do before it agrees (the others' first
            backward may decide the conflict check with a collective).
        rebuild_reducer: a new reducer for the wrapper, after an attempt that failed.
        stop_requested: this rank's termination-notice flag (announced before the backward, see
            ``preemption.stop``), ``None`` when notices are off.
    """

    def __init__(
        self,
        guard: SyncGuard,
        uneven: UnevenInputsCheck,
        channel: SideChannel,
        window: AccumulationWindow,
        carries_out_of_memory: bool,
        on_fault: Callable[[DistributedDataParallel, SyncFault], None],
        before_failure_agreement: Callable[[DistributedDataParallel], None],
        rebuild_reducer: Callable[[DistributedDataParallel], None],
        stop_requested: Callable[[], bool | None] = lambda: None,
    ) -> None:
        self.guard, self.uneven, self.channel, self.window = guard, uneven, channel, window
        self.carries_out_of_memory = carries_out_of_memory
        self.on_fault, self.before_failure_agreement = on_fault, before_failure_agreement
        self.rebuild_reducer, self.stop_requested = rebuild_reducer, stop_requested
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
            if state.last:
                self.guard.request_agreement()
            return False
        return uneven.decide(state, channel.maximum(uneven_flags(state.last)), channel.gather, epoch)

    def after_synced_backward(
        self,
        ddp: DistributedDataParallel,
        failed: bool,
        out_of_memory: OutOfMemory | None = None,
        started: bool = True,
    ) -> StepAgreed:
        """The guard's check with the flags that ride on it (``failed``: this rank's backward raised what the guard
        takes over; ``out_of_memory``: this rank's attempt failed, ``started`` saying whether its synced backward
        had begun)."""
        if not self.guard.active:  # no check to ride on: one flag all-reduce per step, only with notices on
            mine = self.stop_requested()
            return StepAgreed(stop=mine is not None and bool(self.channel.maximum([int(mine)])[0]))
        deferred = self.uneven.take_deferred()
        flags = uneven_flags(deferred.last) if deferred else [0, 0]
        if self.carries_out_of_memory:
            flags.append(int(out_of_memory is not None))
        flags.append(int(bool(self.stop_requested())))
        outcome = self.guard.check(
            ddp,
            self.window.stats.optimizer_steps + 1,
            flags,
            aborted=failed or out_of_memory is not None,
            never_started=out_of_memory is not None and not started,
        )
        stop = bool(outcome.flag_maximums[-1])
        if self.carries_out_of_memory and outcome.flag_maximums[-2]:
            if deferred is not None:  # the batch runs again, and its uneven-inputs flag with it
                self.uneven.defer_to_step_check(deferred)
                if deferred.last:
                    self.guard.request_agreement()
            return StepAgreed(out_of_memory=self._every_ranks_failure(out_of_memory))
        if outcome.fault is not None:
            self.on_fault(ddp, outcome.fault)
        if deferred is None:
            return StepAgreed(stop=stop)
        ends_epoch = self.uneven.decide(deferred, outcome.flag_maximums, self.channel.gather, self.epoch)
        return StepAgreed(ends_epoch=ends_epoch, stop=stop)

    def agree_on_failure(self, failure: OutOfMemory, synced_backward_started: bool) -> StepAgreed:
        """On a rank whose attempt at a batch ran out of memory (``micro_batch_size="auto"``), in place of its synced
        backward: issue the bucket all-reduces the other ranks' backward waits for, and agree with them."""
        assert self.ddp is not None and self.guard.active
        self.before_failure_agreement(self.ddp)
        return self.after_synced_backward(self.ddp, failed=True, out_of_memory=failure, started=synced_backward_started)

    def reset_reducer(self) -> None:
        """Every rank, after an attempt some rank failed: a backward that failed half way leaves the reducer
        expecting hooks (and, on the first step, bucket orders that differ between ranks)."""
        if self.ddp is not None:
            self.rebuild_reducer(self.ddp)

    def _every_ranks_failure(self, local: OutOfMemory | None) -> tuple[OutOfMemory, ...]:
        """Every rank's failure in this attempt (one gather, only after one)."""
        mine = [1, PHASES.index(local.phase), local.rows, local.batch_rows] if local is not None else [0, 0, 0, 0]
        return tuple(
            OutOfMemory(rank=rank, phase=PHASES[row[1]], rows=row[2], batch_rows=row[3])
            for rank, row in enumerate(self.channel.gather(mine))
            if row[0]
        )
