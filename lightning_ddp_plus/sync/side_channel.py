"""A small gloo group of the job's ranks for per-step flags (the per-step guard, uneven inputs), apart from the
group that carries the gradients: that one may hold bucket all-reduces in flight that a flag all-reduce would be
paired with, and an NCCL group carries no CPU tensors."""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_ddp_plus.pipeline.component import FitStart, StepComponent
from lightning_ddp_plus.private_apis.torch_distributed import lazy_gloo_group


class SideChannel(StepComponent):
    """A small gloo group of the job's ranks for the guard's flags, separate from the group that carries the
    gradients: that one may hold bucket all-reduces in flight that a flag all-reduce would be paired with, and an
    NCCL group carries no CPU tensors. Opened at each fit's start with ``timeout``, closed at its end."""

    def __init__(
        self,
        record: Callable[[str, int], AbstractContextManager[Any]] | None = None,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        self._group: Any = None
        self.timeout = timeout
        #: Called around each collective with its name and size (the engine's collective ledger).
        self.record = record or (lambda op, size: nullcontext())

    def fit_starts(self, fit: FitStart) -> None:
        self.start(self.timeout)

    def fit_ends(self, failed: bool) -> None:
        self.stop()

    @property
    def open(self) -> bool:
        return self._group is not None

    def start(self, timeout: timedelta) -> None:
        """Create the group (a collective: every rank calls it at the same point of its setup). Its pairs of ranks
        connect at their first exchange, not here: most fits never use it (the step's flags ride in the gradient
        buckets), and a full mesh of N - 1 connections per rank is a start cost that grows with the job."""
        self.stop()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = lazy_gloo_group(timeout)

    def stop(self) -> None:
        if self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except (RuntimeError, ValueError):  # the default group went first (interpreter shutdown)
                pass
            self._group = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group) if self._group is not None else 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self._group) if self._group is not None else 1

    def maximum(self, values: Sequence[int]) -> list[int]:
        """Each value's maximum over the ranks (one all-reduce of a few integers)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def total(self, values: Sequence[int]) -> list[int]:
        """Each value's sum over the ranks (one all-reduce of a few integers)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def _all_reduce(self, values: Sequence[int], op: Any) -> list[int]:
        if self._group is None:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64)
        with self.record("flag all_reduce (sync guard, uneven inputs)", 8 * len(values)):
            dist.all_reduce(tensor, op=op, group=self._group)
        return tensor.tolist()

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's values, by rank (all ranks pass the same number of values)."""
        if self._group is None:
            return [list(values)]
        tensor = torch.tensor(list(values), dtype=torch.int64)
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self._group))]
        with self.record("flag all_gather (uneven inputs, phase timings)", 8 * len(values)):
            dist.all_gather(gathered, tensor, group=self._group)
        return [t.tolist() for t in gathered]
