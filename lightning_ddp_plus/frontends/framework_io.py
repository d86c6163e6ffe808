"""What both front ends do around their framework's collectives and checkpoint IO, written once.

``FrontEndIO`` runs a collective inside the ledger's record and a save through an atomic view of the checkpoint IO.
The overrides that read the same in both front ends are built here from their framework's own method and assigned in
each class body (``barrier = recorded_collective(DDPStrategy.barrier)``): the shared ``DDPPlusFrontEnd`` still
overrides nothing of Lightning, and each front end's overrides stay listed in its own class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from lightning.fabric.plugins import CheckpointIO
from torch import Tensor

from lightning_ddp_plus.engine.engine import DDPPlusEngine
from lightning_ddp_plus.persistence.io import AtomicSaves


def tensor_bytes(tensor: Any) -> int:
    """What a collective on ``tensor`` moves, for the ledger (0 for what is not a tensor)."""
    return int(tensor.numel() * tensor.element_size()) if isinstance(tensor, Tensor) else 0


T = TypeVar("T")


class FrontEndIO:
    """What both front ends do around their framework's collectives and checkpoint IO, written once: each override
    passes the framework's own method (``super().barrier``, ...), which runs inside the ledger's record, and a save
    runs in the ledger's ``checkpoint save`` phase through an atomic view of the checkpoint IO.

    Args:
        engine: the front end's engine (its ledger).
        atomic_checkpoints: ``atomic_checkpoints``: saves through the IO you passed are made atomic.
    """

    def __init__(self, engine: DDPPlusEngine, atomic_checkpoints: bool) -> None:
        self.engine = engine
        self.atomic_saves = AtomicSaves(atomic_checkpoints)

    def collective(self, op: str, size_bytes: int, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``, a collective of ``size_bytes``, recorded in the ledger as ``op``."""
        with self.engine.collective(op, size_bytes):
            return call(*args, **kwargs)

    def save(self, io: CheckpointIO, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call`` (the framework's ``save_checkpoint``) in the save's phase, writing through an atomic view of
        ``io``."""
        with self.engine.in_phase("checkpoint save"), self.atomic_saves.saving(io):
            return call(*args, **kwargs)

    def write_now(self, io: CheckpointIO, checkpoint: dict[str, Any], path: str) -> None:
        """A survivor's save: ``checkpoint`` written to ``path`` through an atomic view of ``io``, by this rank
        alone, and its bytes there when this returns (an ``AsyncCheckpointIO``'s pending writes finished, its error
        raised: the survivors say "saved" after this, and the launcher may end the process then)."""
        self.save(io, lambda: (self.saving_view or io).save_checkpoint(checkpoint, path))
        io.teardown()

    def checkpoint_io(self, passed: CheckpointIO | None) -> CheckpointIO | None:
        """The IO the framework keeps: the one you passed, as passed, or an atomic default."""
        return self.atomic_saves.default_io(passed)

    @property
    def saving_view(self) -> CheckpointIO | None:
        """During a save: the atomic view the framework writes through."""
        return self.atomic_saves.saving_view


class WithIO(Protocol):
    """A front end: its ``FrontEndIO``."""

    io: FrontEndIO


def recorded_collective(method: Callable[..., T], op: str | None = None) -> Callable[..., T]:
    """A front end's override of ``method``, its framework's collective (``DDPStrategy.barrier``, ...): the
    framework's own, recorded in the ledger as ``op`` (the method's name unless given) with the bytes of its first
    argument when that is a tensor."""
    name = op or method.__name__

    def collective(self: WithIO, *args: Any, **kwargs: Any) -> T:
        size = tensor_bytes(args[0]) if args else 0
        return self.io.collective(name, size, method, self, *args, **kwargs)

    collective.__name__, collective.__doc__ = method.__name__, f"``{method.__qualname__}``, recorded in the ledger."
    return collective


def atomic_checkpoint_io(framework: type) -> property:
    """A front end's ``checkpoint_io`` over ``framework`` (its ``DDPStrategy``): the checkpoint IO you passed, as
    passed, or an atomic default (``atomic_checkpoints``); during a save, the atomic view the framework writes
    through."""
    inherited = inspect.getattr_static(framework, "checkpoint_io").fget

    def get(self: Any) -> CheckpointIO:
        self._checkpoint_io = self.io.checkpoint_io(self._checkpoint_io)
        framework_io: CheckpointIO = inherited(self)  # as the framework keeps it (Lightning's default, ...)
        return self.io.saving_view or framework_io

    def set(self: Any, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    return property(get, set, doc=atomic_checkpoint_io.__doc__)
