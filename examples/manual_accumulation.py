"""Gradient accumulation in manual optimization with ``DDPPlusStrategy``: one all-reduce per optimizer step.

Lightning's documented manual recipe calls ``manual_backward`` on every micro-batch with DDP all-reducing every
time. With ``DDPPlusStrategy(gradient_accumulation_steps=k)`` the strategy knows where each micro-batch sits in its
window: ``manual_backward`` skips the all-reduce on all but the last, and divides the loss by the window's real
length (do not divide it yourself). ``strategy.sync_gradients`` is True on the micro-batch that closes a window.

    python examples/manual_accumulation.py        # 2 CPU processes, gloo, k=4
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `examples.*` importable when run as a script

import lightning as L
from torch import Tensor, nn

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.demo.spirals import SpiralClassifier, SpiralDataModule


class ManualAccumulationClassifier(SpiralClassifier):
    """The spiral classifier, optimized by hand with accumulation."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.manual_backward(loss)  # no all-reduce unless this micro-batch closes the window
        if self.trainer.strategy.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()
        self.log("train_loss", loss, prog_bar=True)
        return loss


def main() -> None:
    L.seed_everything(7)
    strategy = DDPPlusStrategy(process_group_backend="gloo", timeout="5m", gradient_accumulation_steps=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(ManualAccumulationClassifier(lr=0.01), datamodule=SpiralDataModule(batch_size=32))
    if trainer.is_global_zero:
        print(f"sync stats on rank 0: {strategy.sync_stats}")


if __name__ == "__main__":
    main()
