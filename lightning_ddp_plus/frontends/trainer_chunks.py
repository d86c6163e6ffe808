"""``micro_batch_size`` in Lightning's automatic optimization: the chunks of a batch run inside ``training_step``.

Lightning's closure runs ``training_step``, then ``zero_grad`` (at the first batch of an accumulation window), then
``backward`` on the loss returned. The chunks must each run their backward before the next chunk's forward (that is
what saves the memory), so they run in ``training_step``: the batch's gradients are kept aside from the
``zero_grad`` that follows, the loss returned is detached (its value is the batch's), and the closure's ``backward``
only gives the gradients back. Gradient clipping, the precision plugin's step and the optimizer step then see them
as after any backward.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.sync.micro_batches import CHECKPOINT_KEY, refuse_micro_batches


class TrainerChunks:
    """The Trainer strategy's side of ``micro_batch_size`` (the loop over chunks is ``_train_in_chunks``)."""

    def __init__(self, strategy: Any) -> None:  # the DDPPlusStrategy (its module imports this one)
        self.strategy = strategy
        self._kept: list[tuple[Tensor, Tensor | None]] | None = None
        #: The training batch running now (the out-of-memory error names its rows).
        self.batch: Any = None

    def refuse(self, manual: bool, accumulation_steps: int, module: pl.LightningModule | None) -> None:
        """Before launch: what ``micro_batch_size`` cannot run with raises (see ``refuse_micro_batches``)."""
        refuse_micro_batches(self.strategy.options.micro_batch_size, manual, accumulation_steps, module)

    def batch_starts(self, args: tuple[Any, ...]) -> Any:
        self.batch = args[0] if args else None
        return self.batch

    @property
    def apply(self) -> bool:
        """The training step runs in chunks: ``micro_batch_size`` is set and the wrapper exists."""
        strategy = self.strategy
        return (
            strategy.engine.micro_batches.active
            and isinstance(strategy.model, DistributedDataParallel)
            and strategy.lightning_module is not None
        )

    def saving(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint with the size in effect, so that a resume starts from it."""
        if self.strategy.engine.micro_batches.active:
            checkpoint[CHECKPOINT_KEY] = self.strategy.engine.micro_batches.state_dict()
        return checkpoint

    def loaded(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        self.strategy.engine.micro_batches.load_state_dict(checkpoint.get(CHECKPOINT_KEY, {}))
        return checkpoint

    def training_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The batch in chunks, each chunk's forward and backward here; returns what ``training_step`` returns,
        with the batch's loss (detached) as its loss."""
        strategy = self.strategy
        ddp, module = strategy.model, strategy.lightning_module
        trainer = module.trainer
        position = strategy._position()
        parameters = [p for p in module.parameters() if p.requires_grad]
        if position.index == 0:  # Lightning zeroes only after training_step: the chunks must start from nothing
            for parameter in parameters:
                parameter.grad = None
        optimizer: Optimizer | None = trainer.optimizers[0] if trainer.optimizers else None
        divisor = trainer.accumulate_grad_batches  # as Lightning's closure divides the batch's loss by k

        def step(chunk: Any) -> tuple[Tensor | None, Any]:
            output = DDPStrategy.training_step(strategy, chunk, *args[1:], **kwargs)  # Lightning's, past our override
            loss = output.get("loss") if isinstance(output, dict) else output
            return (loss if isinstance(loss, Tensor) else None), output

        def backward(loss: Tensor, synced: bool) -> None:
            done = strategy._guarded_backward(
                ddp,
                loss / divisor,
                position,
                synced,
                divided_by_steps=True,
                post_forward=True,
                run=lambda loss: DDPStrategy.backward(strategy, loss, optimizer),
                restore=lambda: None,
            )
            if done.ends_epoch:
                strategy._end_epoch_here()

        done = strategy._train_in_chunks(
            ddp,
            args[0],
            step=step,
            backward=backward,
            synced=ddp.require_backward_grad_sync,  # Lightning's loop blocked it mid-window
            split_hook=getattr(module, "split_batch", None),
        )
        self._kept = [(p, p.grad) for p in parameters]
        for parameter in parameters:
            parameter.grad = None
        if isinstance(done.output, dict):
            return {**done.output, "loss": done.loss}
        return done.loss

    def give_gradients_back(self) -> bool:
        """In the closure's ``backward``: put back what the chunks computed; False when no chunks ran."""
        if self._kept is None:
            return False
        for parameter, gradient in self._kept:
            parameter.grad = gradient
        self._kept = None
        return True
