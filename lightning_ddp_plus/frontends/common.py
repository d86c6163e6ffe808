"""What the Trainer strategy and the Fabric strategy share: the engine built from the declared arguments, read-only
views of it, the backend's checks, the environment, wrapping and the registered names. A batch's backward runs
through ``engine.guarded_backward``, a batch in chunks through the engine's ``MicroBatchRunner``.

``DDPPlusFrontEnd`` comes first in each front end's bases, before Lightning's ``DDPStrategy`` of its framework; where
it overrides a method both frameworks have (``setup_environment``, ``teardown``, ``_get_process_group_backend``,
``register_strategies``), it adds what the package needs and calls Lightning's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.config.backend import has_default_backend, resolve_backend_for_device
from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.config.timeout import check_setup_timeout
from lightning_ddp_plus.conflicts.rules import Finding
from lightning_ddp_plus.diagnostics.phase_timings import PhaseTimes
from lightning_ddp_plus.diagnostics.telemetry import SyncTelemetry
from lightning_ddp_plus.engine.arguments import DDPPlusArguments, FrontEnd
from lightning_ddp_plus.engine.engine import DDPPlusEngine
from lightning_ddp_plus.engine.setup_line import describe_run
from lightning_ddp_plus.frontends.registry import register_names
from lightning_ddp_plus.private_apis.torch_ddp import logging_data
from lightning_ddp_plus.private_apis.torch_distributed import CAN_SET_GROUP_TIMEOUT, GROUP_TIMEOUT_BACKENDS
from lightning_ddp_plus.processes import reachability
from lightning_ddp_plus.processes.launcher import register_process_group_shutdown
from lightning_ddp_plus.sharding.optimizer import check_overlap_backend
from lightning_ddp_plus.sync.accumulation import SyncStats
from lightning_ddp_plus.sync.buckets import BucketChoice
from lightning_ddp_plus.sync.comm_hooks import CommHook, HookCallCounter, HookFunction
from lightning_ddp_plus.sync.wrapper import wrapping_stream


def _size(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size()) if isinstance(tensor, Tensor) else 0


class DDPPlusFrontEnd:
    """The part of a front end that does not depend on its framework."""

    #: The class name the messages use, and which declared arguments the front end takes.
    front_end: ClassVar[FrontEnd]
    #: How the registered names describe the front end.
    registry_label: ClassVar[str]
    engine: DDPPlusEngine
    _process_group_backend: str | None

    if TYPE_CHECKING:  # Lightning's DDPStrategy of either framework provides these

        @property
        def root_device(self) -> torch.device: ...

        @property
        def world_size(self) -> int: ...

        @property
        def global_rank(self) -> int: ...

    def _start_engine(self, keywords: Mapping[str, Any]) -> DDPPlusArguments:
        """Validate the front end's keywords against the declaration and build the engine on them."""
        self.engine = DDPPlusEngine(
            DDPPlusArguments.for_front_end(self.front_end, keywords), warn=rank_zero_warn, info=rank_zero_info
        )
        return self.engine.arguments

    # ------------------------------------------------------------------ read-only views of the engine

    @property
    def options(self) -> DDPPlusArguments:
        """The validated arguments (each normalized by its check)."""
        return self.engine.arguments

    @property
    def settings(self) -> DDPSettings:
        """The DDP settings in effect (``broadcast_buffers="auto"`` decided, ``"resolve"``'s changes applied)."""
        return self.engine.settings

    @property
    def timeout(self) -> timedelta:
        """The collective timeout of the training steps (``setup_timeout``, when given, covers what comes before)."""
        return self.engine.arguments.collective_timeout

    @property
    def phase_times(self) -> list[PhaseTimes]:
        """Every rank's median phase times at the last comparison (``find_stragglers_every_n_steps``)."""
        stragglers = self.engine.stragglers
        return stragglers.last_times if stragglers is not None else []

    @property
    def comm_hook(self) -> CommHook | HookFunction | None:
        """The communication hook, as ``ddp_comm_hook`` was parsed."""
        return self.engine.arguments.comm_hook

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step in effect (with the Trainer: settled with its setting when ``fit`` starts)."""
        return self.engine.window.steps

    @property
    def sync_stats(self) -> SyncStats:
        """Synced and skipped backward passes and optimizer steps on this rank."""
        return self.engine.window.stats

    @property
    def findings(self) -> list[Finding]:
        """What the conflict check found at the first training forward (empty before, or with ``"off"``)."""
        return self.engine.conflicts.findings

    @property
    def comm_hook_counter(self) -> HookCallCounter:
        """Calls of the registered communication hook (one per gradient bucket all-reduced) on this rank."""
        return self.engine.hooks.counter

    @property
    def telemetry(self) -> SyncTelemetry | None:
        """Per-step communication figures when ``telemetry=True``, else ``None``."""
        return self.engine.telemetry

    @property
    def bucket_choice(self) -> BucketChoice | None:
        """With ``bucket_cap_mb="auto"``: the sizes timed, their times and the one kept (``None`` until chosen)."""
        return self.engine.buckets.choice if self.engine.buckets is not None else None

    @property
    def replica_check_seconds(self) -> list[float]:
        """Seconds each replica check took on this rank."""
        return self.engine.replica_guard.check_seconds

    # ------------------------------------------------------------------ backend and environment

    def _judge_backend_before_launch(self, device_type: str) -> None:
        """Before anything is launched, once the device type is known: the backend must fit it, a backend the user
        named must exist in this torch (the automatic one is checked in each process, so that a faked accelerator
        behaves as with stock Lightning), and ``optimizer_sharding="overlap"`` must be allowed on it."""
        backend = self.engine.arguments.backend
        if backend is not None or has_default_backend(device_type):  # else Lightning's connector names the problem
            self._process_group_backend = resolve_backend_for_device(
                backend, device_type, check_available=backend is not None
            )
            check_overlap_backend(self.engine.arguments.optimizer_sharding, self._process_group_backend)
            self._check_setup_timeout(self._process_group_backend)

    def _check_backend_present(self) -> None:
        """In each process, before the process group is created: the backend exists in this torch."""
        self._check_setup_timeout(resolve_backend_for_device(self.engine.arguments.backend, self.root_device.type))

    def _check_setup_timeout(self, backend: str) -> None:
        arguments = self.engine.arguments
        if arguments.setup_timeout is not None:
            setup_timeout = arguments.process_group_timeout
            check_setup_timeout(setup_timeout, backend, CAN_SET_GROUP_TIMEOUT, GROUP_TIMEOUT_BACKENDS)

    def _get_process_group_backend(self) -> str:
        return resolve_backend_for_device(self.engine.arguments.backend, self.root_device.type, check_available=False)

    def setup_environment(self) -> None:
        self.engine.prepare_process_group(self._get_process_group_backend(), os.environ)
        super().setup_environment()  # type: ignore[misc]
        register_process_group_shutdown()
        reachability.publish_host()

    def teardown(self) -> None:
        self.engine.teardown()
        super().teardown()  # type: ignore[misc]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls, cls.registry_label)

    # ------------------------------------------------------------------ collectives, in the ledger

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self.engine.ledger.collective("barrier"):
            super().barrier(*args, **kwargs)  # type: ignore[misc]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self.engine.ledger.collective(f"broadcast from rank {src}"):
            return super().broadcast(obj, src)  # type: ignore[misc]

    def all_gather(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        with self.engine.ledger.collective("all_gather", _size(tensor)):
            return super().all_gather(tensor, *args, **kwargs)  # type: ignore[misc]

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's reduction (what ``self.log(..., sync_dist=True)`` calls), in the ledger."""
        with self.engine.ledger.collective("all_reduce", _size(tensor)):
            return super().reduce(tensor, *args, **kwargs)  # type: ignore[misc]

    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """Fabric's reduction (``fabric.all_reduce``), in the ledger."""
        with self.engine.ledger.collective("all_reduce", _size(tensor)):
            return super().all_reduce(tensor, *args, **kwargs)  # type: ignore[misc]

    def optimizer_state(self, optimizer: Any) -> Any:
        """The Trainer's optimizer state at a save: a sharded optimizer's is consolidated on rank 0, a collective."""
        with self._consolidation(optimizer):
            return super().optimizer_state(optimizer)  # type: ignore[misc]

    def get_optimizer_state(self, optimizer: Any) -> Any:
        """Fabric's optimizer state at a save, as ``optimizer_state``."""
        with self._consolidation(optimizer):
            return super().get_optimizer_state(optimizer)  # type: ignore[misc]

    def _consolidation(self, optimizer: Any) -> AbstractContextManager[Any]:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the Trainer's
        if not hasattr(inner, "consolidate_state_dict"):
            return nullcontext()
        return self.engine.ledger.collective("optimizer state consolidation", users_call=False)

    def on_validation_start(self) -> None:
        self.engine.ledger.enter_phase("validation")
        super().on_validation_start()  # type: ignore[misc]

    def on_validation_end(self) -> None:
        self.engine.ledger.enter_phase("data fetch")
        super().on_validation_end()  # type: ignore[misc]

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        ledger = self.engine.ledger
        phase = ledger.phase
        ledger.enter_phase("checkpoint save")
        try:
            super().save_checkpoint(*args, **kwargs)  # type: ignore[misc]
        finally:
            ledger.enter_phase(phase)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the wrapper and the backward

    def _wrap(self, module: Module, device_ids: list[int] | None) -> DistributedDataParallel:
        with wrapping_stream(self.root_device, device_ids):
            return self.engine.wrap(module, device_ids)

    def describe(self, ddp: DistributedDataParallel | None = None) -> str:
        """One compact line with every argument's value in effect, logged by rank 0 at setup."""
        backend = self._process_group_backend or (self.engine.arguments.backend or "auto")
        sizes = str(logging_data(ddp).get("bucket_sizes", "")) if ddp is not None else ""
        buckets = len(sizes.split(",")) if sizes else None
        return describe_run(self.engine, self.front_end, backend, self.world_size, buckets)
