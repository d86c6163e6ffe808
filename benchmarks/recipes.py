"""What the benchmarks compare, written once: the two manual-optimization accumulation recipes (one training step
each), bare DDP under Lightning, and ``ddp_plus`` with its flags on the side channel."""

from collections.abc import Iterator
from contextlib import contextmanager
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


def no_sigterm_broadcast() -> Any:
    """A callback that turns Lightning's per-step SIGTERM broadcast off: bare DDP under Lightning, the floor."""
    import lightning.pytorch as pl

    class NoBroadcast(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None

    return NoBroadcast()


@contextmanager
def flags_on_side_channel(on: bool = True) -> Iterator[None]:
    """With ``on``, ``ddp_plus`` fits started inside let nothing ride in the gradient buckets, as with a
    ``ddp_comm_hook``: the step's flags take an all-reduce of their own. Without, nothing is imported or changed."""
    if not on:
        yield
        return
    from lightning_ddp_plus.sync import comm_hooks

    rides = comm_hooks.flags_ride_buckets
    comm_hooks.flags_ride_buckets = lambda *args: False
    try:
        yield
    finally:
        comm_hooks.flags_ride_buckets = rides
