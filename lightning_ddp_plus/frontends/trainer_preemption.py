"""The Trainer's side of preemption (``preemption_signals``): the notice handlers for the fit, Lightning's own
termination handling kept off them, and, once the ranks agreed to stop, the save and the end.

Where the save goes, so that the next run finds it:

- with SLURM's ``auto_requeue`` (Lightning's ``SLURMEnvironment``), Lightning's requeue checkpoint
  (``hpc_ckpt_N.ckpt`` in ``default_root_dir``), from which the requeued job's ``fit`` resumes by itself; rank 0
  then requeues the job (``scontrol requeue``), as Lightning's handler would have;
- else the first ``ModelCheckpoint``'s ``last.ckpt``, which ``ckpt_path="last"`` and ``resume_from_last`` find;
- else (no ``ModelCheckpoint``) ``default_root_dir/checkpoints/last.ckpt``, which they find too.

The save is made at the step boundary after the agreed step, before the next batch is fetched (or, when no batch
follows, at the end of training): every callback's and the module's ``on_train_batch_end``, the batch counted as
completed, the validation and schedulers the batch triggers, and, at an epoch's last batch, the epoch's end and the
next one's start have run. The resume continues at the next batch, so each hook of each step runs once across both
runs. The loop's state is saved as Lightning's restore continues it (``resumable_at_boundary``): as it stands, a
restore would run the last batch's end again where validation is due at it (an epoch's last batch): the logged step
counted twice, and a step-interval ``ReduceLROnPlateau`` stepped again.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_ddp_plus.engine.engine import DDPPlusEngine
from lightning_ddp_plus.persistence.resume import NO_CHECKPOINT_CALLBACK_PATH
from lightning_ddp_plus.preemption.report import PreemptionReport, raise_preempted
from lightning_ddp_plus.preemption.slurm import requeue
from lightning_ddp_plus.preemption.stop import StopDecision
from lightning_ddp_plus.private_apis.lightning import (
    before_each_batch,
    leave_signals_to,
    resumable_at_boundary,
    slurm_requeue_checkpoint_path,
    trainer_checkpoint,
)


def slurm_requeues(trainer: pl.Trainer) -> SLURMEnvironment | None:
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return environment if isinstance(environment, SLURMEnvironment) and environment.auto_requeue else None


def watch_for_notices(engine: DDPPlusEngine, trainer: pl.Trainer | None) -> None:
    """In each process, before a fit starts: the notice handlers on (SLURM's requeue signal added with
    ``auto_requeue``), and Lightning's own handling kept off them. ``validate``, ``test`` and ``predict`` keep
    Lightning's own handling: they have no step to save."""
    if trainer is None or not trainer.training:
        return
    slurm = slurm_requeues(trainer)
    requeue_signal = slurm.requeue_signal.name if slurm is not None and slurm.requeue_signal is not None else None
    watch = engine.watch_notices(also=requeue_signal)
    if watch is not None:
        leave_signals_to(trainer, watch.reinstall, watch.previous_handlers(), "SIGTERM" in watch.signals)


def pass_on_held_notice(trainer: pl.Trainer | None) -> None:
    """In each process, once ``fit`` is over (the launcher calls it): a notice that came after the last step's
    agreement, to the handlers from before the fit. Not at the strategy's teardown: ``on_fit_end``, the teardown
    hooks and an asynchronous checkpoint's pending writes come after it, and the default handler ends the process."""
    engine = getattr(getattr(trainer, "strategy", None), "engine", None)
    if isinstance(engine, DDPPlusEngine):
        engine.pass_on_held_notice()


def preemption_checkpoint_path(trainer: pl.Trainer) -> str:
    """Where the agreed step is saved (see the module's docstring)."""
    if slurm_requeues(trainer) is not None:
        return slurm_requeue_checkpoint_path(trainer)
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return os.path.join(str(callback.dirpath), callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
    return os.path.join(str(trainer.default_root_dir), NO_CHECKPOINT_CALLBACK_PATH)


def save_at_boundary(trainer: pl.Trainer, path: str) -> None:
    """``trainer.save_checkpoint(path)`` at a step boundary, its loop state given as Lightning's restore continues
    it (``resumable_at_boundary``): the resume counts the last batch's end once."""
    checkpoint = trainer_checkpoint(trainer)
    fit_loop = resumable_at_boundary(checkpoint["loops"]["fit_loop"])
    checkpoint["loops"] = {**checkpoint["loops"], "fit_loop": fit_loop}
    trainer.strategy.save_checkpoint(checkpoint, path)
    trainer.strategy.barrier("Trainer.save_checkpoint")


def end_preempted(trainer: pl.Trainer, decision: StopDecision) -> None:
    """Every rank: save the agreed step (rank 0 writes, every rank waits), rank 0 says so in one line (and
    requeues on SLURM), then ``Preempted`` ends the fit."""
    report, requeues = PreemptionReport(decision), slurm_requeues(trainer) is not None
    if decision.stop_after is not None:
        path, started = preemption_checkpoint_path(trainer), time.monotonic()
        save_at_boundary(trainer, path)
        # an asynchronous checkpoint IO returns before the file is written: the line and SLURM's requeue wait for it
        # (its teardown finishes the pending writes; nothing is saved after this in the fit)
        trainer.strategy.checkpoint_io.teardown()
        hint = "the requeued job resumes by itself" if requeues else 'resume with ckpt_path="last"'
        report = PreemptionReport(decision, path, time.monotonic() - started, hint)
    also = (requeue(os.environ),) if trainer.is_global_zero and requeues and decision.stop_after is not None else ()
    raise_preempted(report, trainer.is_global_zero, *also)


class PreemptionSave(Callback):
    """Saves the agreed step at the step boundary after it, and ends the fit (added by the strategy)."""

    def __init__(self, engine: DDPPlusEngine) -> None:
        self.engine = engine
        self._undo: Callable[[], None] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        decision = self.engine.notice_before_first_step()
        if decision is not None:
            end_preempted(trainer, decision)
        self._undo = before_each_batch(trainer, functools.partial(self._at_step_boundary, trainer))

    def _at_step_boundary(self, trainer: pl.Trainer) -> None:
        decision = self.engine.preemption_agreed  # agreed at an earlier synced backward; its step is applied
        if decision is not None and decision.stop_after is not None:
            self.teardown(trainer, trainer.lightning_module, "fit")
            end_preempted(trainer, decision)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_step_boundary(trainer)  # the agreed step was the last one: no batch follows

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
