"""Fabric's side of the save after a rank's death: ``with fabric.strategy.save_after_rank_death(path, state):``
around the user's loop.

Fabric has no loop of its own, so the block is the switch: inside it, when a collective or store call raises that a
peer is gone, the survivors agree on the last optimizer step one of them holds, the lowest rank holding it writes
``state`` (as ``fabric.save`` would, from that rank: rank 0 may be the dead one) to ``path`` atomically, and the block
ends with ``RankDied``. Outside it, a rank's death ends the job as Lightning's observer does, but in 0.5 s.

Which step the state holds is counted here, not read from the user's loop: the strategy counts the optimizer steps
applied since the block began and writes ``state[step_key]`` as the value it had then plus those. A death is learnt
in a collective, and DDP's optimizer step has none, so the parameters and optimizer state are a whole step; a
collective the user issues after ``optimizer.step()`` and before counting it (a logged all-reduce) would otherwise
save the step under the count before it.
"""

from __future__ import annotations

import itertools
import os
import time
from types import TracebackType
from typing import Any

from typing_extensions import Self

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, describe_bad_value
from lightning_ddp_plus.crash.peer_death import peer_gone_in
from lightning_ddp_plus.crash.survivor_save import SurvivorSave, save_from_survivor
from lightning_ddp_plus.frontends.after_death import announce_own_error, survivor_save_of
from lightning_ddp_plus.private_apis.lightning import fabric_checkpoint
from lightning_ddp_plus.processes.after_death_window import AFTER_DEATH

#: Each block of a process has its own keys in the store (every rank enters the same blocks in the same order).
_BLOCKS = itertools.count()
_NAME = "fabric.strategy.save_after_rank_death"


class FabricAfterDeath:
    """The ``with`` block of ``fabric.strategy.save_after_rank_death`` (see the module's docstring).

    Args:
        strategy: the ``DDPPlusFabricStrategy``.
        path: the file the survivor writes.
        state: what ``fabric.save`` would take: modules, optimizers and plain values, read when the save happens.
        step_key: the entry of ``state`` that counts optimizer steps.
    """

    def __init__(self, strategy: Any, path: str | os.PathLike[str], state: dict[str, Any], step_key: str) -> None:
        check_block_arguments(path, state, step_key)
        self.strategy, self.path, self.state, self.step_key = strategy, os.fspath(path), state, step_key
        self.block = -1
        self.first_step, self.applied_before = 0, 0
        self.last_step_at: float | None = None

    def __enter__(self) -> Self:
        if self.strategy.after_death is not None:
            raise RuntimeError(f"`{_NAME}` is already active: one block at a time, around the whole loop.")
        self.block = next(_BLOCKS)
        self.first_step, self.applied_before = self.state[self.step_key], self.steps_applied()
        self.strategy.after_death, self.last_step_at = self, None
        AFTER_DEATH.enabled = True
        return self

    def steps_applied(self) -> int:
        steps: int = self.strategy.engine.optimizer_steps
        return steps

    def step_applied(self) -> None:
        """After each optimizer step: the time between steps bounds how long a survivor may take to learn of a death
        (``AFTER_DEATH``)."""
        now = time.monotonic()
        if self.last_step_at is not None:
            AFTER_DEATH.step_took(now - self.last_step_at)
        self.last_step_at = now

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.strategy.after_death = None
        cause = peer_gone_in(error)
        if error is None or cause is None:
            AFTER_DEATH.enabled = False  # a failure or an end that is not a death: the job ends as Fabric ends it
            if error is not None and not isinstance(error, KeyboardInterrupt):
                announce_own_error(self.strategy, f"fabric{self.block}", error)
            return
        with AFTER_DEATH.saving():
            died = save_from_survivor(self._survivor_save(cause))
        raise died from error

    def _survivor_save(self, cause: str) -> SurvivorSave:
        step = self.first_step + self.steps_applied() - self.applied_before
        return survivor_save_of(
            self.strategy,
            f"fabric{self.block}",
            step=step,
            cause=cause,
            path=self.path,
            write=lambda _shared: self._write(step),  # Fabric's saves hold no generator states
            resume_from="your last periodic `fabric.save`",
            resume_hint=f"resume with `fabric.load({self.path!r}, state)`: `state[{self.step_key!r}]` holds the step",
        )

    def _write(self, step: int) -> None:
        strategy = self.strategy
        checkpoint = fabric_checkpoint(strategy, {**self.state, self.step_key: step})
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        strategy.io.write_now(strategy.checkpoint_io, checkpoint, self.path)


def check_block_arguments(path: Any, state: Any, step_key: Any) -> None:
    """The four marks for ``save_after_rank_death``'s arguments, before the loop starts."""
    if not isinstance(path, (str, os.PathLike)):
        allowed, fix = "it must be a file path (a `str` or `os.PathLike`).", "pass e.g. 'checkpoints/last.ckpt'."
        raise ArgumentTypeError(describe_bad_value(f"{_NAME}(path)", path, allowed, fix))
    if not isinstance(state, dict):
        allowed = "it must be the dict `fabric.save` takes (modules, optimizers and plain values)."
        fix = "pass e.g. `{'model': model, 'optimizer': optimizer, 'step': 0}`, the dict your loop updates."
        raise ArgumentTypeError(describe_bad_value(f"{_NAME}(state)", type(state).__name__, allowed, fix))
    if step_key not in state or isinstance(state[step_key], bool) or not isinstance(state[step_key], int):
        held = "absent" if step_key not in state else repr(state[step_key])
        allowed = (
            f"`state[{step_key!r}]` must be an int counting optimizer steps (it is {held}): the save writes there."
        )
        fix = (
            f"put the optimizer steps done so far in `state[{step_key!r}]` (0 for a fresh run), or pass the name of "
            "the entry that counts them as `step_key`."
        )
        raise ArgumentValueError(describe_bad_value(f"{_NAME}(step_key)", step_key, allowed, fix))
