"""What the Trainer strategy and the Fabric strategy share, without taking part in Lightning's overrides: the engine
built from the declared arguments, read-only views of it, the backend's checks, wrapping and the setup line.

``DDPPlusFrontEnd`` defines no method that Lightning's strategies define, and calls no ``super()``: each front end
subclasses its framework's ``DDPStrategy`` and overrides Lightning's hooks itself, thinly, calling the engine's
actions (``engine.backward``, ``engine.run_chunks``, ``engine.step_done``, ...). What both do around
Lightning's collectives and checkpoint IO is written once in ``framework_io.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
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
from lightning_ddp_plus.frontends.framework_io import FrontEndIO
from lightning_ddp_plus.preemption.report import PreemptionReport, raise_preempted
from lightning_ddp_plus.preemption.stop import StopDecision
from lightning_ddp_plus.private_apis.torch_ddp import logging_data
from lightning_ddp_plus.private_apis.torch_distributed import CAN_SET_GROUP_TIMEOUT, GROUP_TIMEOUT_BACKENDS
from lightning_ddp_plus.processes import reachability
from lightning_ddp_plus.processes.launcher import abort_collectives_on_a_death, register_process_group_shutdown
from lightning_ddp_plus.sharding.optimizer import check_overlap_backend
from lightning_ddp_plus.sync.accumulation import SyncStats
from lightning_ddp_plus.sync.buckets import BucketChoice
from lightning_ddp_plus.sync.comm_hooks import CommHook, HookCallCounter, HookFunction
from lightning_ddp_plus.sync.wrapper import wrapping_stream


class DDPPlusFrontEnd:
    """The part of a front end that does not depend on its framework (see the module's docstring)."""

    #: The class name the messages use, and which declared arguments the front end takes.
    front_end: ClassVar[FrontEnd]
    #: How the registered names describe the front end.
    registry_label: ClassVar[str]
    engine: DDPPlusEngine
    io: FrontEndIO
    _process_group_backend: str | None

    if TYPE_CHECKING:  # Lightning's DDPStrategy of either framework provides these

        @property
        def root_device(self) -> torch.device: ...

        @property
        def world_size(self) -> int: ...

        @property
        def global_rank(self) -> int: ...

    def _start_engine(self, keywords: Mapping[str, Any]) -> DDPPlusArguments:
        """Validate the front end's keywords against the declaration and build the engine, and the atomic saves, on
        them."""
        self.engine = DDPPlusEngine(
            DDPPlusArguments.for_front_end(self.front_end, keywords), warn=rank_zero_warn, info=rank_zero_info
        )
        self.io = FrontEndIO(self.engine, self.engine.arguments.atomic_checkpoints)
        return self.engine.arguments

    # ------------------------------------------------------------------ read-only views of the engine

    @property
    def arguments(self) -> DDPPlusArguments:
        """The validated arguments (each normalized by its check)."""
        return self.engine.arguments

    @property
    def settings(self) -> DDPSettings:
        """The DDP settings in effect (``broadcast_buffers="auto"`` decided, ``"resolve"``'s changes applied)."""
        return self.engine.settings

    @property
    def start_method(self) -> str:
        """How the processes are started (``start_method``)."""
        return self.engine.arguments.start_method

    @property
    def timeout(self) -> timedelta:
        """The collective timeout of the training steps (``setup_timeout``, when given, covers what comes before)."""
        return self.engine.arguments.timeout_in_effect

    @property
    def phase_times(self) -> list[PhaseTimes]:
        """Every rank's median phase times at the last comparison (``find_stragglers_every_n_steps``)."""
        return self.engine.phase_times

    @property
    def comm_hook(self) -> CommHook | HookFunction | None:
        """The communication hook, as ``ddp_comm_hook`` was parsed."""
        return self.engine.arguments.comm_hook

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step in effect (with the Trainer: settled with its setting when ``fit`` starts)."""
        return self.engine.accumulation_steps

    @property
    def loss_per_item(self) -> float | None:
        """With ``num_items``: the last optimizer step's loss per item over its whole window on every rank (the
        number one device training the global batch would print); ``None`` before a step, or without counts."""
        return self.engine.loss_per_item

    def give_num_items(self, backward_keywords: dict[str, Any]) -> None:
        """``manual_backward(loss, num_items=n)``, ``fabric.backward(loss, num_items=n)``: the count of the items the
        loss is a mean over, for that backward (taken out of the keywords torch's backward gets)."""
        if "num_items" in backward_keywords:
            self.engine.give_num_items(backward_keywords.pop("num_items"))

    def items_of_training_step(self, output: Any) -> Any:
        """A training step's output in automatic optimization: its ``num_items``, if any, for its backward."""
        self.engine.give_num_items(output.get("num_items") if isinstance(output, dict) else None)
        return output

    @property
    def sync_stats(self) -> SyncStats:
        """Synced and skipped backward passes and optimizer steps on this rank."""
        return self.engine.sync_stats

    @property
    def findings(self) -> list[Finding]:
        """What the conflict check found at the first training forward (empty before, or with ``"off"``)."""
        return self.engine.findings

    @property
    def comm_hook_counter(self) -> HookCallCounter:
        """Calls of the registered communication hook (one per gradient bucket all-reduced) on this rank."""
        return self.engine.comm_hook_counter

    @property
    def telemetry(self) -> SyncTelemetry | None:
        """Per-step communication figures when ``telemetry=True``, else ``None``."""
        return self.engine.telemetry

    @property
    def bucket_choice(self) -> BucketChoice | None:
        """With ``bucket_cap_mb="auto"``: the sizes timed, their times and the one kept (``None`` until chosen)."""
        return self.engine.bucket_choice

    @property
    def replica_check_seconds(self) -> list[float]:
        """Seconds each replica check took on this rank."""
        return self.engine.replica_check_seconds

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

    def _backend_for_device(self) -> str:
        """The backend the process group is created with (the framework's ``_get_process_group_backend``)."""
        return resolve_backend_for_device(self.engine.arguments.backend, self.root_device.type, check_available=False)

    def _prepare_environment(self) -> None:
        """First in ``setup_distributed``, right before the process group is created: the backend exists in this
        torch, then what the engine sets in this process's environment for it (taken back at ``teardown``)."""
        self._check_backend_present()
        self.engine.prepare_process_group(self._backend_for_device(), os.environ)

    @staticmethod
    def _environment_ready() -> None:
        """After the process group exists: it is destroyed at exit on the main thread, and this host is published
        for the reachability report."""
        register_process_group_shutdown()
        abort_collectives_on_a_death()
        reachability.publish_host()

    def _consolidation(self, optimizer: Any) -> AbstractContextManager[Any]:
        """Around an optimizer's state at a save: a sharded optimizer's is consolidated on rank 0, a collective."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the Trainer's
        if not hasattr(inner, "consolidate_state_dict"):
            return nullcontext()
        return self.engine.collective("optimizer state consolidation", users_call=False)

    # ------------------------------------------------------------------ preemption

    @property
    def preemption_agreed(self) -> StopDecision | None:
        """Set when every rank agreed to stop for a termination notice (``preemption_signals``), once the step to
        stop after is applied (the agreement at a synced backward waits for the next optimizer step). The Trainer
        saves and ends by itself; a Fabric loop checks it after its optimizer step, saves, and calls
        ``end_preempted`` (the preemption guide shows the loop)."""
        return self.engine.preemption_agreed

    def end_preempted(self, saved: str | None = None, save_seconds: float = 0.0) -> NoReturn:
        """On every rank, after the agreed step was saved at ``saved``: rank 0 prints the one line, and
        ``Preempted`` (exit code 128 + the signal's number) ends the loop."""
        decision = self.engine.preemption_agreed
        if decision is None:
            raise RuntimeError("end_preempted: no preemption was agreed; check `strategy.preemption_agreed` first.")
        self.engine.stop_spent()
        raise_preempted(
            PreemptionReport(decision, saved, save_seconds, "load it and continue from its step"), self.global_rank == 0
        )

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
