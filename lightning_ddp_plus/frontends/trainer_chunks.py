"""``chunk_size`` in Lightning's automatic optimization: the chunks of a batch run inside ``training_step``.

Lightning's closure runs ``training_step``, then ``zero_grad`` (at the first batch of an accumulation window), then
``backward`` on the loss returned. The chunks must each run their backward before the next chunk's forward (that is
what saves the memory), so they run in ``training_step``: the batch's gradients are kept aside from the
``zero_grad`` that follows, the loss returned is detached (its value is the batch's), and the closure's ``backward``
only gives the gradients back. Gradient clipping, the precision plugin's step and the optimizer step then see them
as after any backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.engine.engine import DDPPlusEngine
from lightning_ddp_plus.private_apis.lightning import end_epoch_after_this_batch
from lightning_ddp_plus.sync.accumulation import WindowPosition


class TrainerChunks:
    """The Trainer strategy's side of ``chunk_size``: the batch's gradients kept aside between the chunks'
    backwards (in ``training_step``) and the closure's ``backward``.

    Args:
        engine: the strategy's engine (``run_chunks`` runs the chunks).
    """

    def __init__(self, engine: DDPPlusEngine) -> None:
        self.engine = engine
        self._kept: list[tuple[Tensor, Tensor | None]] | None = None

    def run_training_step(
        self,
        ddp: DistributedDataParallel,
        module: Any,
        batch: Any,
        position: WindowPosition,
        step: Callable[[Any], Any],
        backward: Callable[[Tensor], Any],
        rank: int,
    ) -> Any:
        """``batch`` in chunks, each chunk's forward (``step``, Lightning's ``training_step``) and backward
        (``backward``, Lightning's) here, the loss divided by k as Lightning's closure divides it; returns what
        ``training_step`` returns, with the batch's loss (detached) as its loss."""
        engine, trainer = self.engine, module.trainer
        divisor = trainer.accumulate_grad_batches
        parameters = [p for p in module.parameters() if p.requires_grad]
        if position.index == 0:  # Lightning zeroes only after training_step: the chunks must start from nothing
            for parameter in parameters:
                parameter.grad = None

        def chunk_step(chunk: Any) -> tuple[Tensor | None, Any]:
            output = step(chunk)
            loss = output.get("loss") if isinstance(output, dict) else output
            return (loss if isinstance(loss, Tensor) else None), output

        def chunk_backward(loss: Tensor, synced: bool, last: bool) -> Any:
            with engine.backward(
                ddp, loss / divisor, position, synced, divided_by_steps=True, post_forward=True, last_chunk=last
            ) as run:
                run.result = backward(run.loss)
            if run.ends_epoch:  # a held uneven-inputs flag ends the epoch on this batch
                end_epoch_after_this_batch(trainer)
            return run.agreed

        done = engine.run_chunks(
            ddp,
            batch,
            step=chunk_step,
            backward=chunk_backward,
            synced=ddp.require_backward_grad_sync,  # Lightning's loop blocked it mid-window
            rank=rank,
            split_hook=getattr(module, "split_batch", None),
        )
        self._kept = [(p, p.grad) for p in parameters]
        for parameter in parameters:
            parameter.grad = None
        if isinstance(done.output, dict):
            items = {} if done.num_items is None else {"num_items": done.num_items}
            return {**done.output, "loss": done.loss, **items}
        return done.loss

    def restore_gradients(self) -> bool:
        """In the closure's ``backward``: put back what the chunks computed; False when no chunks ran."""
        if self._kept is None:
            return False
        for parameter, gradient in self._kept:
            parameter.grad = gradient
        self._kept = None
        return True
