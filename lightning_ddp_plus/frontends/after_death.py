"""What both front ends hand the survivors' save after a rank's death (``crash.survivor_save``): the job's store
unless its host (rank 0 under the popen launcher) is gone, the ranks the launcher saw die, and, under
``optimizer_sharding``, why nothing can be saved."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_ddp_plus.crash.survivor_save import SurvivorSave
from lightning_ddp_plus.crash.survivors import SurvivorAgreement
from lightning_ddp_plus.private_apis.torch_distributed import default_store
from lightning_ddp_plus.processes.after_death_window import AFTER_DEATH
from lightning_ddp_plus.processes.launcher import launching_process_gone
from lightning_ddp_plus.processes.reachability import ProcessesHere
from lightning_ddp_plus.sharding.optimizer import is_zero_redundancy


def announce_own_error(strategy: Any, keys: str, error: BaseException) -> None:
    """A rank whose fit ends with an error that is not a peer's death, before its process ends: said in the store,
    so that the survivors, who see its process end, save nothing."""
    if isinstance(error, torch.OutOfMemoryError):  # the state is whole: a death like any other, saved after
        return
    store = None if launching_process_gone() else default_store()
    SurvivorAgreement(store, strategy.global_rank, strategy.world_size, keys).announce_own_error(error)


def survivor_save_of(
    strategy: Any,
    keys: str,
    *,
    step: int,
    cause: str,
    path: str,
    write: Callable[[Mapping[int, bytes]], None],
    resume_from: str,
    shared: bytes = b"",
    resume_hint: str | None = None,
    not_savable: str | None = None,
) -> SurvivorSave:
    """This rank's part in the save, for ``strategy`` (either front end); ``keys``: this fit's or block's keys in the
    store; ``resume_from``: what to resume from when nothing can be saved; ``not_savable``: why the front end can
    save nothing whole (the others' reasons, the strategy's, are added here)."""
    store = None if launching_process_gone() else default_store()  # rank 0 hosted it: no reconnecting
    # the launcher's view, and the peers' processes on this machine (under torchrun no launcher of ours sees a death)
    here = ProcessesHere(store, strategy.world_size, strategy.global_rank)
    known_dead = lambda: AFTER_DEATH.dead_ranks | here.gone()
    agreement = SurvivorAgreement(store, strategy.global_rank, strategy.world_size, keys, known_dead)
    own_errors = agreement.peers_own_errors()
    if own_errors:
        rank, error = next(iter(own_errors.items()))
        not_savable = (
            f"rank {rank} ended with an error of its own ({error}), which is not a death: a save now could hold what "
            "that error was raised about (a NaN check after a step, say), so the files there are as they were; "
            "its log holds the traceback"
        )
    zero = any(is_zero_redundancy(optimizer) for optimizer in getattr(strategy, "optimizers", []))
    if not_savable is None and strategy.engine.arguments.optimizer_sharding:
        not_savable = (
            "under `optimizer_sharding` each rank holds the only copy of its shard of the optimizer state, and the "
            f"dead rank's is lost; resume from {resume_from}, or train with `optimizer_sharding=False` to have "
            "every survivor hold the whole state"
        )
    elif not_savable is None and zero:
        not_savable = (
            "a `ZeroRedundancyOptimizer` holds each rank's shard of its state on that rank only (saving gathers them, "
            f"`consolidate_state_dict`), and the dead rank's is lost; resume from {resume_from}, or use a plain "
            "optimizer to have every survivor hold the whole state"
        )
    return SurvivorSave(
        agreement=agreement,
        step=step,
        cause=cause,
        path=path,
        write=write,
        not_savable=not_savable,
        resume_hint=resume_hint,
        shared=shared,
    )
