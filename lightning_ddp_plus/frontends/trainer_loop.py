"""What the Trainer strategy reads of, and tells, Lightning's fit loop: k settled with the Trainer before launch, the
loader a fit trains on, where a batch sits in its accumulation window, whether it is its epoch's last, ending the
epoch on it, a backward in its window, the rescale of a window that closed early, the sync figures for the loggers,
a manual static graph's first all-reduce, and the callbacks the strategy adds to the Trainer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.diagnostics.telemetry import DDPTelemetry
from lightning_ddp_plus.engine.engine import BackwardRun, DDPPlusEngine
from lightning_ddp_plus.frontends.trainer_after_death import StepBoundaries
from lightning_ddp_plus.frontends.trainer_preemption import PreemptionSave
from lightning_ddp_plus.persistence.resume import ResumeCoordinator
from lightning_ddp_plus.private_apis.lightning import end_epoch_after_this_batch, trainer_of
from lightning_ddp_plus.private_apis.torch_ddp import flush_static_graph
from lightning_ddp_plus.sync.accumulation import SyncStats, WindowPosition, scale_gradients, window_position
from lightning_ddp_plus.sync.chunks import refuse_chunks
from lightning_ddp_plus.sync.uneven import RankBatches, even_by_construction


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


@contextmanager
def backward_in_window(
    engine: DDPPlusEngine, ddp: DistributedDataParallel, module: Any, position: WindowPosition, loss: Tensor
) -> Iterator[BackwardRun]:
    """The Trainer's backward of ``loss`` at ``position`` of its window, as a ``with`` block around Lightning's
    backward (run on ``backward.loss``); ``backward.synced`` says whether it all-reduced. In automatic
    optimization the loop decided the sync before the forward (``block_backward_sync``); in manual optimization it is
    decided here, before Lightning's ``pre_backward`` prepares the reducer, and switched back on afterwards."""
    automatic = module.automatic_optimization
    syncs = ddp.require_backward_grad_sync if automatic else engine.syncs(position)
    if not syncs:
        ddp.require_backward_grad_sync = False
    with engine.backward(ddp, loss, position, syncs, divided_by_steps=automatic, post_forward=automatic) as backward:
        try:
            yield backward
        finally:
            if not automatic:
                ddp.require_backward_grad_sync = True
    if backward.ends_epoch:
        end_epoch_after_this_batch(module.trainer)


def settle_accumulation(engine: DDPPlusEngine, module: Any, trainer: Any) -> None:
    """In every process, before anything starts: k settled once with the Trainer's ``accumulate_grad_batches``,
    which then says what Lightning's loop must do (k in automatic optimization, where the loop accumulates; 1 in
    manual, where Lightning refuses it and the engine accumulates), and what ``chunk_size`` refuses."""
    steps = engine.settle_accumulation(trainer.accumulate_grad_batches)
    manual = module is not None and not module.automatic_optimization
    refuse_chunks(engine.arguments.chunk_size, manual, steps, module)
    trainer.accumulate_grad_batches = 1 if manual else steps


def training_dataloader(dataloader: Any, module: Any, engine: DDPPlusEngine, resume: ResumeCoordinator) -> Any:
    """The loader a fit trains on: continued where a checkpoint's epoch stopped, and padded for
    ``uneven_inputs="join"`` where its shards are not even by construction."""
    trainer = trainer_of(module) if module is not None else None
    if trainer is None or trainer.state.stage != RunningStage.TRAINING:
        return dataloader
    dataloader = resume.dataloader(dataloader, trainer)
    return dataloader if even_by_construction([dataloader]) else engine.padded(dataloader)


def log_sync_stats_every_n_steps(trainer: Any, step: int, stats: SyncStats) -> None:
    if step % max(1, getattr(trainer, "log_every_n_steps", 1)) == 0:
        log_sync_stats(trainer, stats)


class StragglersAtEpochEnd(Callback):
    """At the end of every training epoch, on every rank: the steps since the last straggler comparison are compared
    (``find_stragglers_every_n_steps``), so that an epoch shorter than the cadence names its straggler."""

    def __init__(self, engine: DDPPlusEngine) -> None:
        self.engine = engine

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.engine.end_of_epoch()


def add_strategy_callbacks(trainer: Any, engine: DDPPlusEngine) -> None:
    """The strategy's callbacks, each once (a second fit finds them there): ``DDPTelemetry`` with ``telemetry``,
    ``PreemptionSave`` with ``preemption_signals``, ``StragglersAtEpochEnd`` with ``find_stragglers_every_n_steps``;
    and, with ``save_on_rank_death``, the step boundaries kept for this fit (not a callback: see ``StepBoundaries``)."""
    callbacks: list[Callback] = trainer.callbacks  # set by Lightning's callback connector
    arguments = engine.arguments
    added = [
        DDPTelemetry() if arguments.telemetry else None,
        PreemptionSave(engine) if arguments.preemption_signals else None,
        StragglersAtEpochEnd(engine) if arguments.find_stragglers_every_n_steps is not None else None,
    ]
    for callback in added:
        if callback is not None and not any(type(present) is type(callback) for present in callbacks):
            callbacks.append(callback)
    if arguments.save_on_rank_death and trainer.training:
        StepBoundaries.keep(trainer)
