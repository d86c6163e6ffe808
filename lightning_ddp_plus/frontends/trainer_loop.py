"""What the Trainer strategy reads of, and tells, Lightning's fit loop: where a batch sits in its accumulation window,
whether it is its epoch's last, ending the epoch on it, the rescale of a window that closed early, the sync figures
for the loggers, and a manual static graph's first all-reduce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.private_apis.torch_ddp import flush_static_graph
from lightning_ddp_plus.sync.accumulation import SyncStats, WindowPosition, scale_gradients, window_position
from lightning_ddp_plus.sync.uneven import RankBatches


def position_in_window(trainer: Any, steps: int, forced_length: int | None) -> WindowPosition:
    """The running batch's place in its window of ``steps`` (``forced_length``: an epoch ``uneven_inputs`` ends)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    length = trainer.num_training_batches if forced_length is None else forced_length
    return window_position(max(1, progress.current.ready), steps, length, progress.is_last_batch)


def rank_batches(trainer: Any) -> RankBatches:
    """This rank at the running batch (Lightning's loop knows one batch ahead whether it is the epoch's last)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    length = trainer.num_training_batches
    return RankBatches(
        number=progress.current.ready,
        last=bool(progress.is_last_batch),
        length=int(length) if length != float("inf") else None,
    )


def end_epoch_here(trainer: Any) -> None:
    """The loop ends the epoch after the running batch (and closes an accumulation window on it)."""
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


def rescaling_closure(
    closure: Callable[[], Any], optimizer: Optimizer, rescale: Callable[[], float]
) -> Callable[[], Any]:
    """A window that closed early on an epoch of unknown length: its gradients need k/length (``"mean"``)."""

    def closure_then_rescale() -> Any:
        result = closure()
        scale_gradients(optimizer, rescale())
        return result

    return closure_then_rescale


def log_sync_stats(trainer: Any, stats: SyncStats) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(stats.as_metrics(), step=trainer.global_step)


def flush_manual_static_graph(ddp: Any, module: Any, backward_synced: bool) -> bool:
    """Manual optimization with a static graph: the loss never passes through DDP's output (the backward runs inside
    the wrapper's forward), so nothing queues the first synced backward's delayed all-reduce, and without it torch
    never reduces a gradient (Lightning 2.6 does it in its ``post_backward``, 2.5 does not). Returns True when it
    was queued now."""
    manual = module is not None and not module.automatic_optimization
    if backward_synced and manual and isinstance(ddp, DistributedDataParallel) and ddp.static_graph:
        flush_static_graph(ddp)
        return True
    return False
