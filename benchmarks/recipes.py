"""The two manual-optimization accumulation recipes the benchmarks compare, as one training step each."""

from typing import Any

K = 4


def stock_manual_step(module: Any, loss: Any, batch_idx: int, k: int = K) -> None:
    """Lightning's documented recipe: divide by k, step every k batches; DDP all-reduces on every backward."""
    optimizer = module.optimizers()
    module.manual_backward(loss / k)
    if (batch_idx + 1) % k == 0:
        optimizer.step()
        optimizer.zero_grad()


def plus_manual_step(module: Any, loss: Any) -> None:
    """``ddp_plus(gradient_accumulation_steps=k)``: only the window's last backward all-reduces, and the strategy says
    when the window closes."""
    optimizer = module.optimizers()
    module.manual_backward(loss)
    if module.trainer.strategy.sync_gradients:
        optimizer.step()
        optimizer.zero_grad()
