"""The Trainer's side of ``save_on_rank_death``: the loop's state kept at each optimizer-step boundary, and, when a
survivor's collective or store call says a peer is gone, the last step saved from a survivor (``crash/``).

Which state is saved, so that every save is a whole step:

- the parameters and optimizer state as they are when the survivor learns of the death: DDP's optimizer step has
  no collective, so a death is learnt before a step or after it, never inside one;
- the loop's state of the last step boundary (kept before each batch whose step count changed, a few counters):
  a death in a step's forward, backward, gradient all-reduce or agreement, or in any micro-batch of an accumulation
  window, leaves the parameters at that boundary, and the resume redoes the step (the whole window);
- when the step was applied before the death (a collective in a step-end hook, in validation, or at the epoch's
  end), the loop's state as it is: Lightning's own mid-batch or mid-validation checkpoint, which its resume
  continues as it continues any checkpoint taken at that point;
- the training weights, not an average that a ``WeightAveraging`` callback (``EMAWeightAveraging``) swapped in for
  validation: its swap back runs before the save (``AverageSwapped``).

The file is the one ``ckpt_path="last"`` and ``resume_from_last`` look for (``preemption_checkpoint_path``), written
atomically through the strategy's checkpoint IO by the survivor chosen, not by rank 0, which may be the dead one.
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import callbacks as callbacks_module
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from lightning_ddp_plus.crash.peer_death import peer_gone_in
from lightning_ddp_plus.crash.report import RankDied
from lightning_ddp_plus.crash.survivor_save import save_from_survivor
from lightning_ddp_plus.frontends.after_death import announce_own_error, survivor_save_of
from lightning_ddp_plus.frontends.trainer_preemption import preemption_checkpoint_path
from lightning_ddp_plus.private_apis.lightning import (
    LoopState,
    before_each_batch,
    in_lightnings_signal_handler,
    resumable_at_boundary,
    trainer_checkpoint,
)
from lightning_ddp_plus.processes.launcher import AFTER_DEATH

#: Each fit of a process has its own keys in the store (every rank runs the same fits in the same order).
_FITS = itertools.count()


@dataclass(frozen=True, kw_only=True)
class StepBoundary:
    """The loop's state at an optimizer-step boundary."""

    step: int
    """Optimizer steps applied then."""
    loops: dict[str, Any]
    """``trainer.fit_loop.state_dict()`` then, as Lightning's restore continues it (``resumable_at_boundary``)."""
    at: float
    """``time.monotonic()`` then."""


class StepBoundaries:
    """Keeps the loop's state of the last optimizer-step boundary during a fit.

    Not a ``Callback``: Lightning calls every hook of every callback at each batch, building each callback's
    ``state_key`` every time, which cost 4 % of a 4.6 ms step here; this is one call before each batch (the epoch loop's
    ``advance``, wrapped once per Trainer) and one ``LoopState`` read per optimizer step.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.fit = 0
        self.last: StepBoundary | None = None
        self._loop_state: LoopState | None = None
        before_each_batch(trainer, self._batch_starts)

    @classmethod
    def keep(cls, trainer: pl.Trainer) -> StepBoundaries:
        """At the setup of each fit: the Trainer's record, fresh for this fit (and ``AverageSwapped`` after each
        weight-averaging callback)."""
        AverageSwapped.follow(trainer)
        boundaries = _KEPT.get(trainer) or cls(trainer)
        _KEPT[trainer] = boundaries
        boundaries.fit, boundaries.last, boundaries._loop_state = next(_FITS), None, None
        return boundaries

    @classmethod
    def of(cls, trainer: pl.Trainer) -> StepBoundaries | None:
        return _KEPT.get(trainer)

    def _batch_starts(self) -> None:
        trainer = self.trainer
        if self.last is None or self.last.step != trainer.global_step:  # a window's first batch
            if self._loop_state is None:  # the loops as this fit runs them (after a checkpoint's restore)
                self._loop_state = LoopState(trainer.fit_loop)
            now = time.monotonic()
            if self.last is not None:
                AFTER_DEATH.step_took(now - self.last.at)
            loops = resumable_at_boundary(self._loop_state())
            self.last = StepBoundary(step=trainer.global_step, loops=loops, at=now)


_KEPT: weakref.WeakKeyDictionary[Any, StepBoundaries] = weakref.WeakKeyDictionary()


class AverageSwapped(Callback):
    """Right after a ``WeightAveraging`` callback: whether it holds the average in the module for validation (between
    its ``on_validation_epoch_start`` and ``on_validation_epoch_end``, which issue no collective, so a death is learnt
    on either side of them, never inside). A survivor's save swaps the training weights back first."""

    def __init__(self, averaging: Callback) -> None:
        self.averaging, self.swapped = averaging, False

    @classmethod
    def follow(cls, trainer: Any) -> None:  # `callbacks` is set by Lightning's callback connector
        averaging = getattr(callbacks_module, "WeightAveraging", None)  # Lightning 2.6 on
        callbacks: list[Callback] = trainer.callbacks
        followed = {id(callback.averaging) for callback in callbacks if isinstance(callback, cls)}
        for index in reversed(range(len(callbacks))):
            callback = callbacks[index]
            if averaging is not None and isinstance(callback, averaging) and id(callback) not in followed:
                callbacks.insert(index + 1, cls(callback))

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.swapped = True

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.swapped = False

    @classmethod
    def swap_back(cls, trainer: Any) -> None:
        """Before a survivor's save: each average held for validation swapped out again, as its epoch's end does."""
        for callback in trainer.callbacks:
            if isinstance(callback, cls) and callback.swapped:
                callback.averaging.on_validation_epoch_end(trainer, trainer.lightning_module)
                callback.swapped = False


def save_after_rank_death(trainer: pl.Trainer, error: BaseException) -> RankDied | None:
    """In a survivor, as ``error`` leaves the fit: when it says a peer is gone, agree on the step with the other
    survivors, save it (if this rank is the one chosen) and return the ``RankDied`` to raise; else ``None``."""
    cause = peer_gone_in(error)
    boundaries = StepBoundaries.of(trainer)
    fitting = trainer.state.fn == TrainerFn.FITTING  # its validation included
    if not fitting or boundaries is None or boundaries.last is None:
        return None
    if cause is None:
        announce_own_error(trainer.strategy, str(boundaries.fit), error)
        return None
    strategy: Any = trainer.strategy
    path, boundary = preemption_checkpoint_path(trainer), boundaries.last
    resume_from = "your last periodic checkpoint (a `ModelCheckpoint`)"
    save = survivor_save_of(
        strategy,
        str(boundaries.fit),
        step=trainer.global_step,
        cause=cause,
        path=path,
        write=lambda: write_boundary(trainer, boundary, path),
        resume_from=resume_from,
        not_savable=half_a_batch(trainer, boundary, resume_from) or in_a_signal_handler(error, resume_from),
    )
    return save_from_survivor(save)


def half_a_batch(trainer: Any, boundary: StepBoundary, resume_from: str) -> str | None:
    """Why nothing whole can be saved when a death came inside a training step of manual optimization that had
    applied some of its optimizer steps (a GAN's generator, not yet its discriminator): those steps are in the
    weights, the batch's others and its end are not, and no loop state pairs with that (a mid-batch checkpoint runs
    the batch again, so its applied steps twice). ``None`` otherwise."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    applied = trainer.global_step - boundary.step  # manual optimization counts each optimizer.step() at once
    in_training_step = progress.processed < progress.started
    if trainer.lightning_module.automatic_optimization or not in_training_step or applied <= 0:
        return None
    return (
        f"it died inside a training step of manual optimization after {applied} of its optimizer steps, so a save "
        f"would hold half a batch (those steps applied, the others and the batch's end not); resume from "
        f"{resume_from}"
    )


def in_a_signal_handler(error: BaseException, resume_from: str) -> str | None:
    """Why nothing whole can be saved when the death was learnt inside Lightning's own signal handler (kept with
    ``preemption_signals=[]``): it ran at whatever line the main thread was on, half-way through an optimizer step
    perhaps, so the weights may hold part of a step. ``None`` otherwise."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        handler = in_lightnings_signal_handler(link)
        if handler is not None:
            return (
                f"it was learnt in a collective of Lightning's own signal handler (`{handler}`, a SIGTERM's or "
                "SLURM's), which ran at whatever line training was on, so the weights may hold part of a step; "
                f"resume from {resume_from}, or keep SIGTERM in `preemption_signals` to have a notice agreed at a "
                "step boundary"
            )
        link = link.__cause__ or link.__context__
    return None


def write_boundary(trainer: pl.Trainer, boundary: StepBoundary, path: str) -> None:
    """This rank's state written to ``path`` as a whole step (see the module's docstring), atomically, with the
    strategy's additions (the data layout, the micro-batch size) and without a collective."""
    strategy: Any = trainer.strategy
    AverageSwapped.swap_back(trainer)
    checkpoint = trainer_checkpoint(trainer)
    if boundary.step == trainer.global_step:  # the step in progress was not applied: its batches are redone
        checkpoint["loops"] = {**checkpoint["loops"], "fit_loop": boundary.loops}
    checkpoint = strategy.with_run_state(checkpoint, gather_generators=False)  # a gather would include the dead
    strategy.io.write_now(strategy.checkpoint_io, checkpoint, path)
