"""What ``DDPPlusFabricStrategy`` keeps of the user's loop: where it stands in the accumulation window
(``FabricWindow``: Fabric has no loop of its own to read), and Fabric's backward-sync control, which keeps the run's
first backward with a static graph synced (rule R3)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ddp_plus.engine.engine import DDPPlusEngine
from lightning_ddp_plus.preemption.report import PreemptionReport, raise_preempted
from lightning_ddp_plus.private_apis.lightning import DDPBackwardSyncControl
from lightning_ddp_plus.sync.accumulation import WindowPosition
from lightning_ddp_plus.sync.uneven import RankBatches, items_marked_last

T = TypeVar("T")


def chunk_result(value: Any) -> tuple[Any, Any]:
    """What ``train_in_chunks``' ``loss_of`` returned, as the chunk runner takes it: (loss, output); a mapping
    ``{"loss": ..., "num_items": ...}`` is the output too, so that its count is read."""
    return (value.get("loss"), value) if isinstance(value, dict) else (value, None)


class FirstStaticBackwardSynced(DDPBackwardSyncControl):
    """Fabric's ``no_backward_sync``, but the run's first backward with a static graph all-reduces."""

    def __init__(self, engine: DDPPlusEngine) -> None:
        self.engine = engine

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager[Any]:
        if enabled and self.engine.must_sync_first_backward():
            return nullcontext()
        return super().no_backward_sync(module, enabled)


class FabricWindow:
    """The user's loop in the accumulation window: which item is the epoch's last (``items``), the position of the
    running micro-batch, whether its forward turned gradient sync off, and the last backward's position, which says
    when to step.

    Args:
        engine: the strategy's engine (its window, the uneven-inputs agreement).
    """

    def __init__(self, engine: DDPPlusEngine) -> None:
        self.engine = engine
        self.position: WindowPosition | None = None
        self.last_position: WindowPosition | None = None
        self.next_is_last = False
        self.turned_sync_off = False
        self.epoch = -1
        self.ddp: DistributedDataParallel | None = None

    def follow(self, ddp: DistributedDataParallel) -> None:
        """A module was set up: the window follows its wrapper from its start."""
        if self.ddp is not None:
            rank_zero_warn(
                "DDPPlusFabricStrategy: a second module was set up; the conflict check, accumulation, replica guard and "
                "telemetry now follow it (one module per strategy is supported)."
            )
        self.ddp, self.position, self.last_position = ddp, None, None

    def items(self, iterable: Iterable[T]) -> Iterator[T]:
        """The items of one epoch, each rank saying before each whether it is its last (see the strategy's
        ``micro_batches``)."""
        self.epoch += 1
        batches = self.engine.padded(iterable) if self.ddp is not None else iterable
        length = len(iterable) if isinstance(iterable, Sized) and batches is iterable else None
        try:
            for item, last in items_marked_last(batches, self._ends_here, length):
                self.next_is_last = last
                yield item
        finally:
            self.next_is_last = False
            self.engine.padding_ends()

    def _ends_here(self, state: RankBatches) -> bool:
        return self.ddp is not None and self.engine.batch_starts(state, self.epoch, one_synced=False, loaders=None)

    def before_forward(self, ddp: DistributedDataParallel) -> None:
        """At a training forward (the engine's ``before_training_forward``): a micro-batch that does not close its
        window runs without gradient sync."""
        if self.engine.accumulation_steps == 1:
            return
        self.position = self.engine.next_position(is_last=self.next_is_last)
        if ddp.require_backward_grad_sync and not self.engine.syncs(self.position):
            ddp.require_backward_grad_sync = False
            self.turned_sync_off = True

    def backward_position(self) -> WindowPosition:
        return self.position or self.engine.next_position(is_last=self.next_is_last)

    def sync_back_on(self, ddp: DistributedDataParallel) -> None:
        if self.turned_sync_off:
            ddp.require_backward_grad_sync = True
            self.turned_sync_off = False

    def moves_on(self, position: WindowPosition) -> None:
        self.engine.moved_on(position)
        self.last_position, self.position = position, None

    @property
    def closes_window(self) -> bool:
        """The last backward closed its window (or there is no window): time to step."""
        last = self.last_position
        return last is None or last.closes_window or self.engine.accumulation_steps == 1

    def gradient_rescale(self) -> float:
        """A window that closed early: its gradients need k/length (``"mean"``)."""
        return 1.0 if self.last_position is None else self.engine.gradient_rescale(self.last_position)


def train_in_chunks(strategy: Any, module: Module, batch: T, loss_of: Callable[[Module, T], Any]) -> Tensor | None:
    """``DDPPlusFabricStrategy.train_in_chunks``: one micro-batch in chunks, the last chunk's backward synced."""
    window, engine = strategy.window, strategy.engine
    ddp = window.ddp
    if ddp is None:
        raise RuntimeError("train_in_chunks needs the module set up first: `fabric.setup(model, optimizer)`.")
    position = engine.next_position(is_last=window.next_is_last)
    synced = engine.syncs(position)
    with engine.out_of_memory_explained(batch, strategy.global_rank, strategy.world_size):
        done = engine.run_chunks(
            ddp,
            batch,
            step=lambda chunk: chunk_result(loss_of(module, chunk)),
            backward=lambda loss, synced_now, last: strategy._backward_at(
                ddp, loss, module, position, synced_now, as_fabric_backward=True, last_chunk=last
            ),
            synced=synced,
            rank=strategy.global_rank,
        )
    window.moves_on(position)
    loss: Tensor | None = done.loss
    return loss


def end_an_ignored_stop(engine: DDPPlusEngine, rank: int) -> None:
    """Before a Fabric backward: a stop the ranks agreed, whose step the loop applied and went past without
    ``end_preempted``, ends the loop here with ``Preempted`` (143 for SIGTERM), nothing saved. Every rank holds the
    same decision and steps, so every rank ends at the same backward. A loop that never reads
    ``preemption_agreed`` is thus still stopped by a notice, one step later, as it was before the strategy held it."""
    decision = engine.preemption_agreed
    if decision is None or (decision.stop_after is not None and engine.optimizer_steps < decision.stop_after):
        return
    hint = (
        "this loop does not check `fabric.strategy.preemption_agreed` after its optimizer step; save there and "
        "call `fabric.strategy.end_preempted(path)` to lose nothing (the preemption guide)"
    )
    raise_preempted(PreemptionReport(decision, None, 0.0, hint), rank == 0)
