"""``ShardedOptimizer``: torch's ``ZeroRedundancyOptimizer`` for ``optimizer_sharding="all_reduce"`` and
``"overlap"``, in a module of its own: importing ``torch.distributed.optim`` costs about 0.2 s (DTensor, FSDP's
utilities), which every rank would pay at ``import lightning_ddp_plus``; it is imported where a sharded optimizer is
built (``sharding.optimizer.shard``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_plus.private_apis.torch_distributed import mark_stepped, zero_overlaps_with_ddp


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` that shares the parameter-group dicts of the optimizer it replaces.

    A learning-rate scheduler built on the original optimizer (in ``configure_optimizers``, or before
    ``fabric.setup``) changes ``lr`` in those dicts, and the step reads it from them; a ``load_state_dict`` updates
    them in place instead of replacing them, so that link survives a checkpoint restore. After ``state_dict`` the
    shares gathered on rank 0 are released, so a save leaves no full copy of the optimizer state behind.
    """

    replaced: Optimizer | None = None

    @override
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]  # ZeroRedundancyOptimizer's own step is narrower
        if self.replaced is not None:
            mark_stepped(self.replaced)  # a scheduler on it checks this
        if zero_overlaps_with_ddp(self):
            # the step ran inside the backward (the overlap hook); Lightning's closure still has to run it
            return closure() if closure is not None else None
        return super().step(closure=closure, **kwargs)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = self.param_groups
        super().load_state_dict(state_dict)
        for kept, loaded in zip(groups, self.param_groups):
            kept.update(loaded)
        self.param_groups = groups

    @override
    def state_dict(self) -> dict[str, Any]:
        try:
            return super().state_dict()
        finally:
            self._all_state_dicts: list[dict[str, Any]] = []
