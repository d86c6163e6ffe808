"""Resolving a resume on all ranks at once, and loading it no wider than it must be.

The strategy hands Lightning ``NEWEST_READABLE`` instead of ``ckpt_path="last"``, so that every rank, with or without
files in its view, reaches ``resume_start``; there, once the process group exists, rank 0 lists the candidates of
the run's own checkpoint directories (``checkpoint_files``), checks them newest first, and broadcasts its choice,
so all ranks load the same file. What happens when nothing is readable depends on who asked:

- ``resume_from_last="always"``: checkpoints exist and none is readable -> ``CheckpointResumeError`` on every rank
  (nothing there yet is a first run: it starts from scratch with a warning, as Lightning does);
- ``"on_restart"`` and a user's ``ckpt_path="last"``: a warning naming every file and why, then a start from
  scratch (a restart must not fail the same way until torchrun's restarts are used up).

The chosen file is loaded with ``weights_only=True``. A checkpoint that holds more than tensors and plain containers
(hyperparameters of your own classes, say) is loaded again with ``weights_only=False``, with a warning naming the
reason: it passed the check and lies in a directory this run's callbacks write to, so this job wrote it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from lightning_ddp_plus.persistence.files import (
    NEWEST_READABLE,
    CheckpointResumeError,
    ResumeChoice,
    choose_resume,
    present_reason,
    resume_candidates,
    unreadable_reason,
)
from lightning_ddp_plus.persistence.io import AtomicCheckpointIO, accepts_argument, is_local_path

#: Who asked for the resume: the strategy's ``resume_from_last`` mode, or ``"last"`` (the user's ``ckpt_path``).
ResumeRequest = str


def checkpoint_directories(trainer: Any) -> tuple[list[str], list[str]]:
    """The directories of the run's ``ModelCheckpoint`` callbacks (resolved by their ``setup``) and the files of its
    ``OnExceptionCheckpoint`` callbacks."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    directories = [
        str(callback.dirpath)
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint) and callback.dirpath
    ]
    files = [str(callback.ckpt_path) for callback in trainer.callbacks if isinstance(callback, OnExceptionCheckpoint)]
    return directories, files


def writes_torch_zip(checkpoint_io: CheckpointIO) -> bool:
    """Whether files of ``checkpoint_io`` are ``torch.save`` archives, which can be checked without loading."""
    if isinstance(checkpoint_io, AtomicCheckpointIO):
        checkpoint_io = checkpoint_io.checkpoint_io
    inner = getattr(checkpoint_io, "checkpoint_io", None)  # AsyncCheckpointIO writes through its inner IO
    if inner is not None and not isinstance(checkpoint_io, TorchCheckpointIO):
        return writes_torch_zip(inner)
    return type(checkpoint_io) is TorchCheckpointIO


def choose(trainer: Any, checkpoint_io: CheckpointIO) -> ResumeChoice | None:
    """Rank 0's choice (``None`` when a checkpoint directory is not local: then Lightning's own ``"last"`` rule)."""
    directories, files = checkpoint_directories(trainer)
    if not all(is_local_path(path) for path in [*directories, *files]):
        return None
    check = unreadable_reason if writes_torch_zip(checkpoint_io) else present_reason
    return choose_resume(resume_candidates(directories, files), check)


def resolve(
    choice: ResumeChoice | None,
    request: ResumeRequest,
    directories: list[str],
    lightning_last: Callable[[], Any],
    warn: Callable[[str], None],
    info: Callable[[str], None],
) -> Any:
    """The ``ckpt_path`` that Lightning's ``resume_start`` gets for ``choice`` (the same on every rank)."""
    where = ", ".join(directories) or "the run's checkpoint directories (none configured)"
    if choice is None:
        info("DDPPlusStrategy: the checkpoint directory is not local; Lightning's rule for 'last' picks the file.")
        return lightning_last()
    if choice.path is not None:
        if choice.skipped:
            warn(
                f"DDPPlusStrategy: not resuming from {len(choice.skipped)} newer checkpoint(s): "
                f"{choice.describe_skipped()}. Resuming from {choice.path}, the newest readable checkpoint, instead."
            )
        else:
            info(f"DDPPlusStrategy: resuming from {choice.path}, the newest readable checkpoint in {where}.")
        return choice.path
    if choice.candidates == 0:
        warn(
            f"DDPPlusStrategy: a resume was requested but there is no checkpoint in {where} yet; starting from scratch."
        )
        return None
    message = f"none of the {choice.candidates} checkpoints in {where} is readable: {choice.describe_skipped()}"
    if request == "always":
        raise CheckpointResumeError(
            f"DDPPlusStrategy(resume_from_last='always'): {message}. Delete or restore those files to start from "
            "scratch or from a good copy, pass `ckpt_path=` a checkpoint you trust, or set `resume_from_last="
            "'on_restart'` to start from scratch when nothing is readable."
        )
    warn(f"DDPPlusStrategy: {message}. Starting from scratch.")
    return None


def load(checkpoint_io: CheckpointIO, path: str, warn: Callable[[str], None]) -> dict[str, Any]:
    """Load the chosen checkpoint with ``weights_only=True``, or, when its contents need more and the checkpoint IO
    can say so, with ``weights_only=False`` and a warning (see the module's docstring)."""
    if not accepts_argument(checkpoint_io.load_checkpoint, "weights_only"):
        warn(
            f"DDPPlusStrategy: {type(checkpoint_io).__name__}.load_checkpoint takes no `weights_only`, so {path} is "
            "loaded as that checkpoint IO loads it."
        )
        return checkpoint_io.load_checkpoint(path)
    try:
        return checkpoint_io.load_checkpoint(path, weights_only=True)
    except pickle.UnpicklingError as error:
        reason = next((line for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        warn(
            f"DDPPlusStrategy: {path} holds more than tensors and plain containers ({reason.strip() or error}); it "
            f"lies in {os.path.dirname(path)}, which this run's own callbacks write to, so it is loaded with "
            "`weights_only=False`. To keep resumes weights-only, register those classes with "
            "`torch.serialization.add_safe_globals([...])`."
        )
        return checkpoint_io.load_checkpoint(path, weights_only=False)


__all__ = ["NEWEST_READABLE", "checkpoint_directories", "choose", "load", "resolve"]
