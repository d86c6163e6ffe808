"""Elastic restarts (``torchrun --max-restarts N``): a restarted attempt forms its process group every time, resumes
from the last checkpoint by itself, and continues mid-epoch at the batch where the checkpoint was taken.

Why restarts failed (measured here: 2 of 3 tries hung, with stock Lightning too): torchrun's agent hosts one TCPStore
for the whole job and every attempt's workers connect to it on the same ``MASTER_PORT`` with no per-attempt prefix
(``torch.distributed.rendezvous._create_c10d_store``). Gloo publishes each rank's listening address under fixed keys,
so a restarted rank may read the previous attempt's address of its peer: "Connection refused" when that process is
gone, a 5-minute "Connect timeout" when it is still closing, success when the new key happens to come first. The
group is therefore created here on a ``PrefixStore`` named after ``TORCHELASTIC_RESTART_COUNT``.

Lightning restores the loop counters of a mid-epoch checkpoint but starts the epoch's data from its first batch, so
the first batches are seen twice and the last ones never; ``SkipFirstSampler`` skips what the epoch had consumed.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Sampler

log = logging.getLogger(__name__)

ResumeMode = Literal["on_restart", "always", "never"]
RESUME_MODES: tuple[str, ...] = ("on_restart", "always", "never")


def restart_attempt() -> int | None:
    """The attempt number under torchrun (0 for the first), or ``None`` when torchrun did not start this process."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(value) if value is not None and value.isdigit() else None


def init_process_group(
    cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta, device_id: torch.device | None
) -> None:
    """``init_process_group`` on a store of its own for this restart attempt (see the module's docstring)."""
    if dist.is_initialized():
        return
    rank, world_size = cluster_environment.global_rank(), cluster_environment.world_size()
    os.environ["MASTER_ADDR"] = cluster_environment.main_address
    os.environ["MASTER_PORT"] = str(cluster_environment.main_port)
    store, rank, world_size = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store = dist.PrefixStore(f"ddp_plus/attempt_{restart_attempt()}/", store)
    log.info(
        f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}, attempt {restart_attempt()}"
    )
    kwargs: dict[str, Any] = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)


def should_resume(mode: str) -> bool:
    """Whether to resume from the last checkpoint: ``"on_restart"`` in a restarted torchrun attempt only."""
    if mode == "always":
        return True
    return mode == "on_restart" and (restart_attempt() or 0) > 0


class SkipFirstSampler(Sampler):
    """``sampler`` without its first ``skip`` indices, on its next pass only (the rest of an interrupted epoch).

    >>> sampler = SkipFirstSampler(range(10), skip=4)
    >>> list(sampler), list(sampler), len(sampler)
    ([4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 10)
    """

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def batches_consumed_before_restart(trainer: Any) -> int:
    """Batches of the current epoch that a mid-epoch checkpoint had consumed (0 when not restarting mid-epoch).

    Read when the training loader is built, after the checkpoint's loop state is restored and before Lightning
    classifies the restart (``restarted_mid_epoch`` is computed later); a checkpoint taken on the epoch's last batch
    continues with the next epoch, whose data starts at its beginning.
    """
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_loop.batch_progress
    if not fit_loop.restarting or progress.is_last_batch:
        return 0
    return int(progress.current.ready)


def resume_dataloader(dataloader: Any, trainer: Any) -> Any:
    """The training loader continuing where the checkpoint's epoch stopped, or ``dataloader`` itself."""
    consumed = batches_consumed_before_restart(trainer)
    if consumed == 0 or not isinstance(dataloader, DataLoader) or dataloader.batch_size is None:
        return dataloader
    from lightning.pytorch.utilities.data import _update_dataloader

    rank_zero_info(
        f"DDPPlusStrategy: resuming mid-epoch, skipping the {consumed} batches the epoch had consumed before the "
        "checkpoint (Lightning's warning that the loader is not resumable does not apply: the sampler is)."
    )
    return _update_dataloader(dataloader, SkipFirstSampler(dataloader.sampler, consumed * dataloader.batch_size))
