"""One backward through the engine, as both front ends run it: the conflict check's decision at the first one, the
accumulation window's loss scale, the backward itself (in the ledger when it all-reduces), then the ranks'
agreement. A backward that raised what the per-step guard can take over (a static graph that gained a parameter) is
completed by the guard, which then raises ``DDPConflictError`` or skips the step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.conflicts.check import recovers_in_backward
from lightning_ddp_plus.sync.accumulation import WindowPosition
from lightning_ddp_plus.sync.step_agreement import StepAgreed

if TYPE_CHECKING:
    from lightning_ddp_plus.engine.engine import DDPPlusEngine


@dataclass(frozen=True)
class BackwardDone:
    """What a guarded backward returned, and what the ranks agreed after it."""

    result: Any
    agreed: StepAgreed

    @property
    def ends_epoch(self) -> bool:
        """A held uneven-inputs flag decided that this batch ends the epoch on every rank."""
        return self.agreed.ends_epoch


def in_ledger(engine: DDPPlusEngine, synced: bool, users_call: bool) -> AbstractContextManager[Any]:
    """Around a backward: a synced one is the gradient all-reduce of its step, in the ledger (``users_call``: the
    user called the backward, as ``manual_backward`` or ``fabric.backward``, so the user's line is named)."""
    if not synced:
        return nullcontext()
    # the backward computes inside the block too: the clock is switched to waiting when the gradients are computed
    return engine.ledger.collective("gradient all_reduce", engine.gradient_bytes, users_call=users_call, waits=False)


def trainable(ddp: DistributedDataParallel) -> list[Tensor]:
    return [parameter for parameter in ddp.module.parameters() if parameter.requires_grad]


def guarded_backward(
    engine: DDPPlusEngine,
    ddp: DistributedDataParallel,
    loss: Tensor,
    position: WindowPosition,
    synced: bool,
    *,
    divided_by_steps: bool,
    post_forward: bool,
    run: Callable[[Tensor], Any],
    restore: Callable[[], None],
    last_chunk: bool = True,
) -> BackwardDone:
    """The backward of ``loss`` at ``position`` of the window: ``run(scaled loss)`` runs it, ``restore`` runs
    whatever happens (``divided_by_steps``: Lightning already divided the loss by k; ``post_forward``: DDP's forward
    had finished, not so in Lightning's manual optimization; ``last_chunk``: no chunk of the batch follows)."""
    if synced:  # a notice received so far travels in this backward's agreement (announced before its buckets)
        engine.preemption.announce()
    decided = engine.before_backward(ddp, loss, post_forward=post_forward)
    assert decided is not None
    padding = engine.uneven.padding  # a rank that ran out repeats its last batch with weight 0 ("join")
    closes = synced and last_chunk and position.closes_window
    count = engine.items.take()
    if count is None:
        scale: Tensor | float = engine.window.loss_scale(position, divided_by_steps) * (0.0 if padding else 1.0)
    else:  # num_items: the items' summed loss; the window's end divides by the items (sync.item_averaging)
        undo, count = (engine.window.steps if divided_by_steps else 1), (0 if padding else count)
        engine.items.recorded(count, decided * undo)
        if closes:
            engine.items.before_closing_backward(trainable(ddp), ddp.process_group)
        scale = undo * engine.items.loss_factor(count)
    scaled = decided * scale if not isinstance(scale, float) or scale != 1.0 else decided
    result: Any = scaled
    failed = False
    try:
        # with the loss divided by k, Lightning's loop called the backward: the user's line would be trainer.fit
        with in_ledger(engine, synced, users_call=not divided_by_steps):
            result = run(scaled)
    except RuntimeError as error:
        if not (synced and engine.sync_guard.active and recovers_in_backward(error)):
            raise
        failed = True
    finally:
        restore()
    agreed = engine.after_backward(synced, failed=failed)
    if closes and not agreed.out_of_memory:
        engine.items.window_closed(trainable(ddp), ddp.process_group)
    return BackwardDone(result, agreed)
