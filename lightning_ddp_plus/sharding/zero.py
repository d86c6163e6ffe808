"""``optimizer_sharding`` in a run: the communication hook its mode needs, its optimizers, and how they clip.

The engine owns one ``ZeroSharding``: it picks DDP's hook (``True``: the reduce-scatter, whose state the optimizers
share), wraps the optimizers when a front end sets them up, and answers for clipping, which ``"overlap"`` refuses and
``True`` computes over every rank's chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_plus.config.messages import ArgumentValueError, describe_bad_value
from lightning_ddp_plus.pipeline.component import FitStart, StepComponent
from lightning_ddp_plus.sharding.optimizer import OptimizerSharding, refuse_clipping, shard_optimizers
from lightning_ddp_plus.sharding.reduce_scatter import GradientShards, reduce_scatter_hook
from lightning_ddp_plus.sharding.sharded_step import BucketShardedOptimizer, route_norm_clipping


class ZeroSharding(StepComponent):
    """``optimizer_sharding`` as a run applies it.

    Args:
        mode: ``optimizer_sharding``.
        info: how a one-line report reaches the user.
        timeout: the collective timeout of the exchange group it opens on gloo (``GradientShards.exchange_group``).
    """

    def __init__(
        self, mode: OptimizerSharding, info: Callable[[str], None], timeout: timedelta = timedelta(minutes=30)
    ):
        self.mode, self._info, self.timeout = mode, info, timeout
        #: ``True``: the reduce-scatter hook's state, shared by the sharded optimizers.
        self.shards = GradientShards() if mode is True else None

    @override
    def fit_starts(self, fit: FitStart) -> None:
        """gloo: the hook's exchanges get a group of their own (a collective: every rank is here together)."""
        self.fit_ends(failed=False)
        if self.shards is not None and self.shards.uses_exchange:
            self.shards.exchange_group = dist.new_group(backend="gloo", timeout=self.timeout)

    @override
    def fit_ends(self, failed: bool) -> None:
        if self.shards is not None and self.shards.exchange_group is not None:
            try:
                dist.destroy_process_group(self.shards.exchange_group)
            except (RuntimeError, ValueError):  # the default group went first (interpreter shutdown)
                pass
            self.shards.exchange_group = None

    def rebuilding(self, rebuild: Callable[[Any], None]) -> Callable[[Any], None]:
        """``rebuild`` (a new reducer after a failed attempt), which first drops what the failed backward received
        (a partial of a method: the strategy is pickled for ``ddp_spawn``)."""
        return functools.partial(self._rebuild_after_failure, rebuild)

    def _rebuild_after_failure(self, rebuild: Callable[[Any], None], ddp: Any) -> None:
        if self.shards is not None:
            self.shards.consumed()
        rebuild(ddp)

    def hook(self, comm_hook: Any, comm_state: Any) -> tuple[Any, Any]:
        """The hook DDP gets, and its state: ``True``'s reduce-scatter, or the user's (``ddp_comm_hook``)."""
        return (comm_hook, comm_state) if self.shards is None else (reduce_scatter_hook, self.shards)

    def shard(
        self,
        optimizers: list[Optimizer],
        ddp: DistributedDataParallel | None,
        static_graph: bool,
        clipping: str | None = None,
        precision: Any = None,
    ) -> list[Optimizer]:
        """Each optimizer sharded as the mode says. ``clipping``: what will clip (refused with ``"overlap"``);
        ``precision``: the front end's precision plugin (refused with ``True`` when it scales fp16 gradients;
        Lightning's then clips a sharded optimizer by the whole norm)."""
        if clipping is not None:
            refuse_clipping(self.mode, clipping, "Lightning")
        if self.shards is not None and getattr(precision, "scaler", None) is not None:
            raise ArgumentValueError(
                describe_bad_value(
                    "optimizer_sharding",
                    True,
                    "fp16 mixed precision's gradient scaler checks each rank's own gradients for inf and skips the "
                    "step where it finds one, and with sharding each rank holds only its chunks: ranks would "
                    "disagree on the step (and wait for each other's all-gather forever).",
                    "use `precision='bf16-mixed'` (no scaler), or `optimizer_sharding='all_reduce'` (every rank holds "
                    "the whole gradient).",
                )
            )
        # Lightning's plugin clips through the precision; Fabric's clips through the strategy (``clip_norm``)
        if self.shards is not None and hasattr(precision, "clip_grad_by_norm"):
            route_norm_clipping(precision)
        return shard_optimizers(optimizers, self.mode, ddp, static_graph, self._info, self.shards)

    def clip_norm(
        self, clipping: str, precision: Any, optimizer: Optimizer, *args: Any, **kwargs: Any
    ) -> Tensor | None:
        """Fabric's clipping by norm: refused with ``"overlap"``; over every rank's chunks for ``True`` (after the
        precision unscaled the gradients); ``None``: the plain clipping applies."""
        refuse_clipping(self.mode, clipping, "it")
        if not isinstance(optimizer, BucketShardedOptimizer):
            return None
        precision.unscale_gradients(optimizer)
        return optimizer.clip_grad_norm_(*args, **kwargs)

    def refuse_clipping(self, clipping: str) -> None:
        """Fabric's clipping by value: refused with ``"overlap"``; elementwise, it needs nothing else."""
        refuse_clipping(self.mode, clipping, "it")
