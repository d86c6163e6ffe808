"""``DDPPlusFabricStrategy``: the same engine for Lightning Fabric, registered as ``Fabric(strategy="ddp_plus")``.

The arguments of ``DDPPlusStrategy`` but the Trainer's only (``engine/arguments.py``), and accumulation: with
``gradient_accumulation_steps=k`` iterate ``fabric.strategy.micro_batches(loader)`` (it marks the last item, which
closes a window, and carries ``uneven_inputs``), call ``fabric.backward(loss)`` (or, with ``chunk_size``,
``fabric.strategy.train_in_chunks(model, batch, loss_of)``), and step when ``fabric.strategy.sync_gradients``
says so (the Fabric guide shows the loop). ``fabric.no_backward_sync`` works too (``fabric_loop.py``). After a step
for which ``fabric.strategy.preemption_agreed`` is set, save and call ``fabric.strategy.end_preempted(path)``. Around
the loop, ``with fabric.strategy.save_after_rank_death(path, state):`` saves the last step from a survivor when a
rank dies (``fabric_after_death.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_deprecation, rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_ddp_plus.config.messages import renamed_message
from lightning_ddp_plus.engine.arguments import takes_declared_arguments
from lightning_ddp_plus.engine.keywords import DDPPlusFabricStrategyKeywords
from lightning_ddp_plus.frontends.common import DDPPlusFrontEnd
from lightning_ddp_plus.frontends.fabric_after_death import FabricAfterDeath
from lightning_ddp_plus.frontends.fabric_loop import (
    FabricWindow,
    FirstStaticBackwardSynced,
    end_an_ignored_stop,
    train_in_chunks,
)
from lightning_ddp_plus.frontends.framework_io import atomic_checkpoint_io, recorded_collective
from lightning_ddp_plus.frontends.registry import register_names
from lightning_ddp_plus.private_apis.lightning import fabric_backward
from lightning_ddp_plus.processes.launcher import ParentWatchedFabricLauncher, nodes_of_this_attempt, watch_parent
from lightning_ddp_plus.sync.accumulation import WindowPosition, scale_gradients
from lightning_ddp_plus.sync.step_agreement import StepAgreed

T = TypeVar("T")


class DDPPlusFabricStrategy(DDPPlusFrontEnd, DDPStrategy):
    """Fabric's ``DDPStrategy`` with every DDP knob typed and validated, on the engine ``DDPPlusStrategy`` uses.

    The arguments of ``DDPPlusStrategy`` but the Trainer's only (``help(DDPPlusFabricStrategy.__init__)``);
    accumulation and preemption as the module's docstring says.

    Example:
        >>> from lightning_ddp_plus.frontends.fabric import DDPPlusFabricStrategy
        >>> DDPPlusFabricStrategy(gradient_accumulation_steps=4, timeout="10m").timeout
        datetime.timedelta(seconds=600)
    """

    front_end = "DDPPlusFabricStrategy"
    registry_label = "DDP Plus strategy (Fabric)"

    # overrides that read the same in both front ends, each from its framework's own method (framework_io.py)
    checkpoint_io = atomic_checkpoint_io(DDPStrategy)
    barrier = recorded_collective(DDPStrategy.barrier)
    broadcast = recorded_collective(DDPStrategy.broadcast)
    all_gather = recorded_collective(DDPStrategy.all_gather)
    all_reduce = recorded_collective(DDPStrategy.all_reduce)  # `fabric.all_reduce`
    _get_process_group_backend = DDPPlusFrontEnd._backend_for_device
    register_strategies = classmethod(register_names)

    @takes_declared_arguments("DDPPlusFabricStrategy")
    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **arguments: Unpack[DDPPlusFabricStrategyKeywords],
    ) -> None:
        """Fabric's plumbing, then every argument ``DDPPlusArguments`` declares but the Trainer's only.

        Args:
            accelerator: set by ``Fabric``.
            parallel_devices: set by ``Fabric``.
            cluster_environment: set by ``Fabric`` unless given.
            checkpoint_io: checkpoint plugin, as in Fabric's ``DDPStrategy``; kept as passed (see ``atomic_checkpoints``).
            precision: set by ``Fabric`` unless given (Fabric's name for the Trainer's ``precision_plugin``).
        """
        declared = self._start_engine(arguments)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=declared.backend,
            timeout=declared.process_group_timeout,  # the engine sets `timeout` at the first training step
            start_method=declared.start_method,
        )
        self.window = FabricWindow(self.engine)
        self.engine.before_training_forward = self.window.before_forward
        self._backward_sync_control = FirstStaticBackwardSynced(self.engine)
        self.after_death: FabricAfterDeath | None = None  # the active `save_after_rank_death` block

    @property
    def sync_gradients(self) -> bool:
        """After ``fabric.backward``: True when that micro-batch closed its window, i.e. when to step."""
        return self.window.closes_window

    @override
    def _configure_launcher(self) -> None:
        # Fabric's connector calls this before anything is launched: judge the backend against the device here.
        assert self.parallel_devices is not None
        self._judge_backend_before_launch(self.parallel_devices[0].type)
        environment, devices = self.cluster_environment, self.num_processes
        self.num_nodes, changed = nodes_of_this_attempt(environment, devices, self.num_nodes, "Fabric")
        if changed:  # an elastic job on fewer or more nodes than Fabric(num_nodes=...) says
            rank_zero_info(changed)
        super()._configure_launcher()
        if self._start_method == "popen":
            assert self.cluster_environment is not None
            self._launcher = ParentWatchedFabricLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        self.engine.watch_notices()  # the notice handlers, until `teardown`
        super().setup_environment()
        self._environment_ready()

    @override
    def teardown(self) -> None:
        self.engine.end_notices()
        self.engine.teardown()
        self.engine.release_environment()
        super().teardown()

    @override
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self.io.save(self.checkpoint_io, super().save_checkpoint, *args, **kwargs)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        with self._consolidation(optimizer):
            return super().get_optimizer_state(optimizer)

    @override
    def _setup_distributed(self) -> None:
        watch_parent()  # a child rank ends when rank 0's process is gone (a failure in the user's loop there)
        self._prepare_environment()
        super()._setup_distributed()

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp = self._wrap(module, self._determine_ddp_device_ids())
        self.window.follow(ddp)
        rank_zero_info(self.describe())
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """With ``optimizer_sharding``: the optimizer as a ``ShardedOptimizer``. A learning-rate scheduler built on
        the optimizer before ``fabric.setup`` keeps working (they share the parameter groups)."""
        return self.engine.shard_optimizers([super().setup_optimizer(optimizer)], None, self.precision)[0]

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Tensor:
        clipped = self.engine.clip_norm("`fabric.clip_gradients`", self.precision, optimizer, *args, **kwargs)
        return clipped if clipped is not None else super().clip_gradients_norm(module, optimizer, *args, **kwargs)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
        self.engine.refuse_clipping("`fabric.clip_gradients`")
        super().clip_gradients_value(module, optimizer, *args, **kwargs)

    def micro_batches(self, iterable: Iterable[T]) -> Iterator[T]:
        """The items of ``iterable`` (the epoch's loader), the last one marked so that it closes its window. One call
        is one epoch for ``uneven_inputs``: ``"error"`` raises ``UnevenInputsError`` on every rank, ``"stop"`` ends
        every rank at the first rank's last item, ``"join"`` repeats a finished rank's last item (its loss counts 0)
        until every rank's have."""
        return self.window.items(iterable)

    def train_in_chunks(self, module: Module, batch: T, loss_of: Callable[[Module, T], Tensor]) -> Tensor | None:
        """One micro-batch in chunks of ``chunk_size`` rows (``"auto"``: halved on every rank after an
        out-of-memory error on any): ``loss_of(module, chunk)`` returns a chunk's loss, a mean over its rows (or
        ``{"loss", "num_items"}``); the last chunk's backward all-reduces. Returns the batch's loss, detached."""
        return train_in_chunks(self, module, batch, loss_of)

    def train_micro_batches(self, module: Module, batch: T, loss_of: Callable[[Module, T], Tensor]) -> Tensor | None:
        """Deprecated since 0.2.0: the former name of ``train_in_chunks`` (it trains one micro-batch, in chunks)."""
        fix = "call `fabric.strategy.train_in_chunks(model, batch, loss_of)`"
        rank_zero_deprecation(renamed_message("train_micro_batches", "train_in_chunks", "0.2.0", fix))
        return self.train_in_chunks(module, batch, loss_of)

    def save_after_rank_death(
        self, path: str | os.PathLike[str], state: dict[str, Any], step_key: str = "step"
    ) -> FabricAfterDeath:
        """A ``with`` block around your loop: when a rank dies inside it, the survivors save the last optimizer step
        one of them holds, ``state`` as ``fabric.save`` would with ``state[step_key]`` set to that step, to ``path``
        (atomically, from a survivor), and the block ends with ``RankDied`` (the Fabric guide, "When a rank dies")."""
        return FabricAfterDeath(self, path, state, step_key)

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        ddp = self.window.ddp
        self.give_num_items(kwargs)  # `fabric.backward(loss, num_items=n)`
        if ddp is None:
            return super().backward(tensor, module, *args, **kwargs)
        position = self.window.backward_position()
        self._backward_at(ddp, tensor, module, position, self.engine.forward_synced, *args, **kwargs)
        self.window.moves_on(position)
        return None

    def _backward_at(
        self,
        ddp: DistributedDataParallel,
        loss: Tensor,
        module: Any,
        position: WindowPosition,
        synced: bool,
        *args: Any,
        as_fabric_backward: bool = False,
        last_chunk: bool = True,
        **kwargs: Any,
    ) -> StepAgreed:
        end_an_ignored_stop(self.engine, self.global_rank)

        with self.engine.backward(
            ddp, loss, position, synced, divided_by_steps=False, post_forward=True, last_chunk=last_chunk
        ) as backward:
            try:  # marked as `fabric.backward` marks it: Fabric's module refuses others
                with fabric_backward(as_fabric_backward):
                    super().backward(backward.loss, module, *args, **kwargs)
            finally:
                self.window.sync_back_on(ddp)
        assert backward.agreed is not None
        return backward.agreed

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        scale_gradients(optimizer, self.window.gradient_rescale())
        output = super().optimizer_step(optimizer, **kwargs)
        self.engine.step_done()
        if self.after_death is not None:
            self.after_death.step_applied()
        return output
