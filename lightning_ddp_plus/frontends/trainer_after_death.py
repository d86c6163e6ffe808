"""The Trainer's side of ``save_on_rank_death``: the loop's state kept at each optimizer-step boundary, and, when a
survivor's collective or store call says a peer is gone, the last step saved from a survivor (``crash/``).

Which state is saved, so that every save is a whole step:

- the parameters and optimizer state as they are when the survivor learns of the death: DDP's optimizer step has
  no collective, so a death is learnt before a step or after it, never inside one;
- the state of the last step boundary (kept before each batch whose step count changed): a death in a step's
  forward, backward, gradient all-reduce or agreement, or in any micro-batch of an accumulation window, leaves the
  parameters at that boundary, and the resume redoes the step (the whole window) from that boundary's loop counters,
  its running statistics (the window's forwards had moved them) and the survivors' random generators (the dead
  rank's went with it: it starts from ``seed + rank``, ``persistence/generators.py``);
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import callbacks as callbacks_module
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Module

from lightning_ddp_plus.crash.peer_death import peer_gone_in
from lightning_ddp_plus.crash.report import RankDied
from lightning_ddp_plus.crash.survivor_save import save_from_survivor
from lightning_ddp_plus.frontends.after_death import announce_own_error, survivor_save_of
from lightning_ddp_plus.frontends.trainer_preemption import preemption_checkpoint_path
from lightning_ddp_plus.persistence.generators import GENERATORS_KEY, GeneratorSnapshot, packed, unpacked
from lightning_ddp_plus.private_apis.lightning import (
    StepBoundaryLoops,
    in_lightnings_signal_handler,
    trainer_checkpoint,
)
from lightning_ddp_plus.processes.after_death_window import AFTER_DEATH
from lightning_ddp_plus.sync.chunk_runner import BufferSnapshot, SavedBuffer

#: Each fit of a process has its own keys in the store (every rank runs the same fits in the same order).
_FITS = itertools.count()


@dataclass(frozen=True, kw_only=True)
class StepBoundary:
    """The state at an optimizer-step boundary that the parameters and the optimizer do not hold."""

    step: int
    """Optimizer steps applied then."""
    loops: dict[str, Any]
    """``trainer.fit_loop.state_dict()`` then, as Lightning's restore continues it (``resumable_at_boundary``)."""
    at: float
    """``time.monotonic()`` then."""
    buffers: BufferCopy
    """The buffers a batch changes (running statistics) then: a step's forwards move them before its gradients are
    all-reduced, so a step redone after a death starts from these."""
    generators: GeneratorSnapshot
    """This rank's random generators then (taken where a periodic checkpoint's gather takes them, between two
    batches): a step redone draws what the uninterrupted run drew."""


@dataclass(frozen=True)
class BufferCopy:
    """Buffers' values at one moment: for each dtype and device, the buffers, and their values one after another."""

    groups: tuple[tuple[tuple[tuple[str, Tensor], ...], Tensor], ...]

    def values(self, module: Module) -> dict[str, Tensor]:
        """By name, the values of each buffer the module still holds (one replaced since, not updated in place, keeps
        its value now)."""
        now = dict(module.named_buffers())
        return {
            name: part.view_as(buffer)
            for buffers, flat in self.groups
            for (name, buffer), part in zip(buffers, flat.split([b.numel() for _, b in buffers]), strict=True)
            if now.get(name) is buffer
        }


class ChangingBuffers:
    """Copies the buffers a training batch changes (running statistics) at each step boundary. Which ones is learnt
    in a fit's first window (``BufferSnapshot``); from then on each dtype and device is one ``torch.cat`` of flat views
    held across steps: 20 µs a step for 53 BatchNorm layers here, where a walk of the module and a copy a buffer
    took 400 µs."""

    def __init__(self) -> None:
        self._snapshot = BufferSnapshot()
        self._first: list[SavedBuffer] | None = None
        self._groups: list[tuple[tuple[tuple[str, Tensor], ...], list[Tensor]]] | None = None

    def copy(self, module: Module) -> BufferCopy:
        if self._first is None:  # the fit's first boundary: every buffer, to learn from
            self._first = self._snapshot.take(module)
            return BufferCopy(tuple((buffers, flat(views)) for buffers, views in grouped(module.named_buffers())))
        if self._groups is None:
            self._snapshot.learn(module, self._first)
            changing = self._snapshot.changing or set()
            self._groups = grouped((name, b) for name, b in module.named_buffers() if name in changing)
        return BufferCopy(tuple((buffers, flat(views)) for buffers, views in self._groups))


def grouped(buffers: Iterable[tuple[str, Tensor]]) -> list[tuple[tuple[tuple[str, Tensor], ...], list[Tensor]]]:
    """The buffers by dtype, device and layout, each with a flat view (a view follows in-place updates; a buffer
    that is not contiguous has none, and is flattened, a copy, each time)."""
    kinds: dict[tuple[torch.dtype, torch.device, bool], list[tuple[str, Tensor]]] = {}
    for name, buffer in buffers:
        kinds.setdefault((buffer.dtype, buffer.device, buffer.is_contiguous()), []).append((name, buffer))
    return [
        (tuple(kind), [b.detach().view(-1) if contiguous else b.detach() for _, b in kind])
        for (_, _, contiguous), kind in kinds.items()
    ]


def flat(views: list[Tensor]) -> Tensor:
    return torch.cat([view if view.dim() == 1 else view.reshape(-1) for view in views])


class StepBoundaries:
    """Keeps the loop's state of the last optimizer-step boundary during a fit.

    Not a ``Callback``: Lightning calls every hook of every callback at each batch, building each callback's
    ``state_key`` every time, which cost 4 % of a 4.6 ms step here; this is one call before each batch (the epoch loop's
    ``advance``, wrapped once per Trainer) and, per optimizer step, one ``LoopState`` read, one copy of the changing
    buffers (``ChangingBuffers``) and the generators' states (``GeneratorSnapshot``).
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.fit = 0
        self.last: StepBoundary | None = None
        self._buffers = ChangingBuffers()
        self._loops = StepBoundaryLoops(trainer, self._step_starts, due=self._window_starts)

    @classmethod
    def keep(cls, trainer: pl.Trainer) -> StepBoundaries:
        """At the setup of each fit: the Trainer's record, fresh for this fit (and ``AverageSwapped`` after each
        weight-averaging callback)."""
        AverageSwapped.follow(trainer)
        boundaries = _KEPT.get(trainer) or cls(trainer)
        _KEPT[trainer] = boundaries
        boundaries.fit, boundaries.last = next(_FITS), None
        boundaries._loops.new_fit()
        boundaries._buffers = ChangingBuffers()
        return boundaries

    @classmethod
    def of(cls, trainer: pl.Trainer) -> StepBoundaries | None:
        return _KEPT.get(trainer)

    def _window_starts(self) -> bool:  # a window's first batch: the step count changed
        return self.last is None or self.last.step != self.trainer.global_step

    def keep_now(self) -> None:
        """Keep the boundary as it stands now, as a batch that starts an optimizer step keeps it (what
        ``benchmarks/rank_death.py`` times)."""
        self._step_starts(self._loops.read())

    def _step_starts(self, loops: dict[str, Any]) -> None:
        trainer, now = self.trainer, time.monotonic()
        if self.last is not None:
            AFTER_DEATH.step_took(now - self.last.at)
        buffers, generators = self._buffers.copy(trainer.lightning_module), GeneratorSnapshot.take()
        self.last = StepBoundary(step=trainer.global_step, loops=loops, at=now, buffers=buffers, generators=generators)


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
        write=lambda shared: write_boundary(trainer, boundary, path, shared),
        shared=shared_generators(trainer, boundary),
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


def generators_at(trainer: pl.Trainer, boundary: StepBoundary) -> dict[str, Any]:
    """This rank's generator states at the step it holds: the boundary's when the step in progress is redone."""
    return (boundary.generators if boundary.step == trainer.global_step else GeneratorSnapshot.take()).states()


def write_boundary(trainer: pl.Trainer, boundary: StepBoundary, path: str, shared: Mapping[int, bytes]) -> None:
    """This rank's state written to ``path`` as a whole step (see the module's docstring), atomically, with the
    strategy's additions (the data layout, the micro-batch size), the generator states each survivor ``shared``
    for that step (by rank), and without a collective."""
    strategy: Any = trainer.strategy
    AverageSwapped.swap_back(trainer)
    checkpoint = trainer_checkpoint(trainer)
    if boundary.step == trainer.global_step:  # the step in progress was not applied: its batches are redone
        checkpoint["loops"] = {**checkpoint["loops"], "fit_loop": boundary.loops}
        weights = checkpoint["state_dict"]
        weights.update(
            {
                name: value
                for name, value in boundary.buffers.values(trainer.lightning_module).items()
                if name in weights
            }
        )
    checkpoint = strategy.with_run_state(checkpoint, gather_generators=False)  # a gather would include the dead
    held = [unpacked(shared[rank]) if rank in shared else None for rank in range(trainer.world_size)]
    # a survivor that held another step has states of that step: its rank starts seeded, as the dead do
    at_step = [None if states is None or states["step"] != trainer.global_step else states["states"] for states in held]
    checkpoint[GENERATORS_KEY] = at_step
    strategy.io.write_now(strategy.checkpoint_io, checkpoint, path)


def shared_generators(trainer: pl.Trainer, boundary: StepBoundary) -> bytes:
    """What this survivor hands the writer: its generator states at the step it holds, with that step."""
    return packed({"step": trainer.global_step, "states": generators_at(trainer, boundary)})
