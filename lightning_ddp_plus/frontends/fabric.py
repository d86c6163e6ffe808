"""``DDPPlusFabricStrategy``: the same engine for Lightning Fabric, registered as ``Fabric(strategy="ddp_plus")``.

The same typed knobs and validation as ``DDPPlusStrategy``, named communication hooks on every backend, the conflict
check on the first training forward of the module set up with ``fabric.setup``, the replica guard, telemetry, and
accumulation: with ``gradient_accumulation_steps=k`` the strategy runs the forward of every micro-batch that does not
close its window without gradient sync, scales each loss by 1/window length, and says when to step::

    fabric = Fabric(strategy=DDPPlusFabricStrategy(gradient_accumulation_steps=4), accelerator="cpu", devices=2)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    for batch in fabric.strategy.micro_batches(loader):  # knows the loader's last batch, which closes a window
        loss = model(batch)
        fabric.backward(loss)
        if fabric.strategy.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()

Fabric's own idiom, ``with fabric.no_backward_sync(model, enabled=...)``, works too (with ``static_graph`` the run's
first backward is synced, as torch requires).

The per-step guard (``sync_guard``) checks every synced ``fabric.backward``. ``uneven_inputs`` needs
``micro_batches``: it is where every rank says whether the item it yields is its last, where ``"stop"`` ends the
iteration on every rank together, and where ``"join"`` repeats a finished rank's last item with weight 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, TypeVar

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_plus.config.backend import has_default_backend, resolve_backend_for_device
from lightning_ddp_plus.config.timeout import DEFAULT_TIMEOUT, TimeoutLike
from lightning_ddp_plus.engine.engine import DDPPlusEngine, EngineViews
from lightning_ddp_plus.engine.options import ConflictMode, DDPPlusOptions, StartMethod
from lightning_ddp_plus.frontends.strategy import REGISTERED_NAMES
from lightning_ddp_plus.persistence.io import AtomicCheckpoints
from lightning_ddp_plus.processes import reachability
from lightning_ddp_plus.processes.launcher import register_process_group_shutdown
from lightning_ddp_plus.sharding.optimizer import OptimizerSharding, check_overlap_backend
from lightning_ddp_plus.sync.accumulation import ShortWindow, WindowPosition, scale_gradients
from lightning_ddp_plus.sync.uneven import RankBatches, UnevenInputs, UnevenInputsError
from lightning_ddp_plus.sync.wrapper import wrapping_stream

T = TypeVar("T")
_END = object()


class _SyncControl(_DDPBackwardSyncControl):
    """Fabric's ``no_backward_sync``, except for the run's first backward with a static graph, which torch needs
    synced (rule R3)."""

    def __init__(self, engine: DDPPlusEngine) -> None:
        self.engine = engine

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager[Any]:
        if enabled and self.engine.window.must_sync_first_backward(self.engine.settings.static_graph):
            return nullcontext()
        return super().no_backward_sync(module, enabled)


class DDPPlusFabricStrategy(AtomicCheckpoints, EngineViews, DDPStrategy):
    """Fabric's ``DDPStrategy`` with every DDP knob typed and validated, on the engine ``DDPPlusStrategy`` uses.

    Arguments are those of ``DDPPlusStrategy`` (see there); ``gradient_accumulation_steps`` works as described in this
    module's docstring.

    Example:
        >>> from lightning_ddp_plus.frontends.fabric import DDPPlusFabricStrategy
        >>> DDPPlusFabricStrategy(gradient_accumulation_steps=4, timeout="10m").timeout
        datetime.timedelta(seconds=600)
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: TimeoutLike | None = DEFAULT_TIMEOUT,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float | Literal["auto"] | None = None,
        broadcast_buffers: bool | Literal["auto"] = True,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        ddp_comm_hook: str | Callable[..., Any] | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        gradient_accumulation_steps: int | None = None,
        short_window: ShortWindow = "mean",
        checkpointing_conflict: ConflictMode = "error",
        verify_replicas_every_n_steps: int | None = None,
        telemetry: bool = False,
        start_method: StartMethod = "popen",
        sync_guard: bool = True,
        uneven_inputs: UnevenInputs = "error",
        atomic_checkpoints: bool = True,
        optimizer_sharding: OptimizerSharding = False,
        **kwargs: Any,
    ) -> None:
        options = DDPPlusOptions.from_arguments(locals(), ddp_kwargs=kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=options.backend,
            timeout=options.timeout,
            start_method=start_method,
        )
        self.engine = DDPPlusEngine(options, warn=rank_zero_warn, info=rank_zero_info)
        self.engine.before_training_forward = self._window_before_forward
        self._backward_sync_control = _SyncControl(self.engine)
        self._ddp: DistributedDataParallel | None = None
        self._position: WindowPosition | None = None
        self._last_position: WindowPosition | None = None
        self._next_is_last = False
        self._turned_sync_off = False
        self._epoch = -1

    # ------------------------------------------------------------------ read-only views of the engine

    @property
    def sync_gradients(self) -> bool:
        """After ``fabric.backward``: True when that micro-batch closed its accumulation window (its backward
        all-reduced), i.e. when to call ``optimizer.step()``."""
        return self._last_position is None or self._last_position.closes_window or self.gradient_accumulation_steps == 1

    # ------------------------------------------------------------------ launching and process group

    @override
    def _configure_launcher(self) -> None:
        # Fabric's connector calls this before anything is launched: judge the backend against the device here.
        assert self.parallel_devices is not None
        device = self.parallel_devices[0].type
        if self.options.backend is not None or has_default_backend(device):  # else the connector names the problem
            self._process_group_backend = resolve_backend_for_device(
                self.options.backend, device, check_available=self.options.backend is not None
            )
            check_overlap_backend(self.options.optimizer_sharding, self._process_group_backend)
        super()._configure_launcher()

    @override
    def _get_process_group_backend(self) -> str:
        return resolve_backend_for_device(self.options.backend, self.root_device.type, check_available=False)

    @override
    def _setup_distributed(self) -> None:
        resolve_backend_for_device(self.options.backend, self.root_device.type)  # present in this torch?
        super()._setup_distributed()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        register_process_group_shutdown()
        reachability.publish_host()

    # ------------------------------------------------------------------ the wrapper

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self._ddp is not None:
            rank_zero_warn(
                "DDPPlusFabricStrategy: a second module was set up; the conflict check, accumulation, replica guard and "
                "telemetry now follow it (one module per strategy is supported)."
            )
        device_ids = self._determine_ddp_device_ids()
        with wrapping_stream(self.root_device, device_ids):
            self._ddp = self.engine.wrap(module, device_ids)
        self._position = self._last_position = None
        rank_zero_info(
            self.engine.describe(
                self._process_group_backend or "auto", self.world_size, self.options.start_method, None
            )
        )
        return self._ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """With ``optimizer_sharding``: the optimizer as a ``ShardedOptimizer``. A learning-rate scheduler built on
        the optimizer before ``fabric.setup`` keeps working (they share the parameter groups)."""
        return self.engine.shard_optimizers([super().setup_optimizer(optimizer)])[0]

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Tensor:
        self._refuse_clipping_after_an_overlapped_step()
        return super().clip_gradients_norm(module, optimizer, *args, **kwargs)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
        self._refuse_clipping_after_an_overlapped_step()
        return super().clip_gradients_value(module, optimizer, *args, **kwargs)

    def _refuse_clipping_after_an_overlapped_step(self) -> None:
        if self.options.optimizer_sharding == "overlap":
            raise ValueError(
                "`fabric.clip_gradients` with `optimizer_sharding='overlap'`: the overlapped optimizer step ran inside "
                "the backward, so the gradients it used can no longer be clipped. Fix: use `optimizer_sharding=True`."
            )

    @override
    def teardown(self) -> None:
        self.engine.teardown()
        super().teardown()

    # ------------------------------------------------------------------ accumulation and backward

    def micro_batches(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of ``iterable`` (e.g. the epoch's loader), marking the last one, so that it closes its
        accumulation window even when the epoch's length is not a multiple of k (or not known). Each call is one
        epoch for ``uneven_inputs``: before each item every rank says whether it is its last; ``"error"`` raises
        ``UnevenInputsError`` on every rank, ``"stop"`` makes that item the last on every rank, and with ``"join"``
        a rank whose items ran out yields its last one again (its loss then counts 0 in ``fabric.backward``) until
        every rank's have."""
        self._epoch += 1
        if self.options.uneven_inputs == "join" and self._ddp is not None:
            yield from self._joined(iterable)
            return
        length = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
        iterator = iter(iterable)
        try:
            item = next(iterator)
        except StopIteration:
            return
        number = 0
        for following in iterator:
            number += 1
            if self._ends_here(RankBatches(number, last=False, length=length)):
                break
            self._next_is_last = False
            yield item
            item = following
        else:
            number += 1
            self._ends_here(RankBatches(number, last=True, length=length))
        self._next_is_last = True
        try:
            yield item
        finally:
            self._next_is_last = False

    def _joined(self, iterable: Iterable[T]) -> Iterator[T]:
        state = self.engine.uneven.padding_state
        state.flags, state.read = [], 0
        iterator = iter(iterable)
        current = next(iterator, _END)
        if current is _END:
            raise UnevenInputsError(
                "uneven_inputs='join': this rank has no item to train on, so none to repeat while the others train. "
                "Fix: give every rank at least one batch."
            )
        following, padding, number = next(iterator, _END), False, 0
        try:
            while True:
                number += 1
                next_padding = padding or following is _END
                state.flags[state.read :] = [padding, next_padding]  # what PaddingState.advance reads next
                ends = self._ends_here(RankBatches(number, last=next_padding))
                self._next_is_last = ends
                yield current  # type: ignore[misc]
                if ends:
                    return
                if not next_padding:
                    current, following = following, next(iterator, _END)
                padding = next_padding
        finally:
            self._next_is_last = False
            self.engine.uneven.padding = False

    def _ends_here(self, state: RankBatches) -> bool:
        return self._ddp is not None and self.engine.batch_starts(state, self._epoch, folded=False)

    def _window_before_forward(self, ddp: DistributedDataParallel) -> None:
        window = self.engine.window
        if window.steps == 1:
            return
        self._position = window.peek(is_last=self._next_is_last)
        if ddp.require_backward_grad_sync and not window.syncs(self._position, self.settings.static_graph):
            ddp.require_backward_grad_sync = False
            self._turned_sync_off = True

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        ddp = self._ddp
        if ddp is None:
            return super().backward(tensor, module, *args, **kwargs)
        tensor = self.engine.before_backward(ddp, tensor, post_forward=True)
        window = self.engine.window
        position = self._position or window.peek(is_last=self._next_is_last)
        scale = window.loss_scale(position, divided_by_steps=False) * self.engine.loss_weight()
        if scale != 1.0:
            tensor = tensor * scale
        synced = self.engine._forward_synced
        failed = False
        try:
            super().backward(tensor, module, *args, **kwargs)
        except RuntimeError as error:
            if not (synced and self.engine.recovers_from(error)):
                raise
            failed = True  # the guard completes the reduction, then raises DDPConflictError or skips the step
        finally:
            if self._turned_sync_off:
                ddp.require_backward_grad_sync = True
                self._turned_sync_off = False
        self.engine.after_backward(synced, failed=failed)
        if window.steps > 1:
            window.advance(position)
        self._last_position, self._position = position, None

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self._last_position is not None:
            scale_gradients(optimizer, self.engine.window.gradient_rescale(self._last_position))
        output = super().optimizer_step(optimizer, **kwargs)
        self.engine.after_optimizer_step()
        return output

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in REGISTERED_NAMES:
            strategy_registry.register(
                name,
                cls,
                description=f"DDP Plus strategy (Fabric) with `start_method` '{start_method}'",
                override=True,
                start_method=start_method,
            )
