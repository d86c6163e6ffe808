"""The engine both front ends share: it builds the components of a DDP run and calls them in order; each acts in the
room its name says. The front ends call ``wrap``, ``shard_optimizers``, ``agreement.batch_starts``, ``guarded_backward``
(``before_backward``, ``after_backward``), ``micro_batch_runner.run``, ``after_optimizer_step`` and ``teardown``."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.config.timeout import GroupTimeouts
from lightning_ddp_plus.conflicts.check import ConflictCheck
from lightning_ddp_plus.conflicts.settings_in_effect import SettingsInEffect
from lightning_ddp_plus.diagnostics.collective_ledger import BufferBroadcastRecord, CollectiveLedger
from lightning_ddp_plus.diagnostics.flight_recorder import FlightRecorder, flight_recorder_for
from lightning_ddp_plus.diagnostics.out_of_memory_reports import OutOfMemoryReports
from lightning_ddp_plus.diagnostics.phase_timings import StragglerWatch
from lightning_ddp_plus.diagnostics.replicas import ReplicaGuard
from lightning_ddp_plus.diagnostics.stall_watchdog import StallWatchdog, start_for_fit
from lightning_ddp_plus.diagnostics.telemetry import SyncTelemetry
from lightning_ddp_plus.diagnostics.torch_errors import TimeoutContext
from lightning_ddp_plus.diagnostics.torch_errors import explain as explain_error
from lightning_ddp_plus.engine.arguments import DDPPlusArguments
from lightning_ddp_plus.engine.results import WorkerResults
from lightning_ddp_plus.memory.suggestion import starting_size_in_folder
from lightning_ddp_plus.preemption.report import Preempted
from lightning_ddp_plus.preemption.stop import PreemptionStop
from lightning_ddp_plus.sharding.zero import ZeroSharding
from lightning_ddp_plus.sync.accumulation import AccumulationWindow, scale_gradients
from lightning_ddp_plus.sync.buckets import BucketTuner
from lightning_ddp_plus.sync.comm_hooks import HookAssembly
from lightning_ddp_plus.sync.item_averaging import ItemAveraging
from lightning_ddp_plus.sync.micro_batch_runner import MicroBatchRunner
from lightning_ddp_plus.sync.micro_batches import MicroBatchSizer
from lightning_ddp_plus.sync.side_channel import SideChannel
from lightning_ddp_plus.sync.step_agreement import StepAgreed, StepAgreement
from lightning_ddp_plus.sync.step_guard import SyncFault, SyncGuard
from lightning_ddp_plus.sync.uneven import UnevenInputsCheck
from lightning_ddp_plus.sync.wrapper import wrap_module


class DDPPlusEngine:
    """The components of a DDP run and the order in which they act, for the validated ``arguments``; ``warn`` and
    ``info`` are how warnings and one-line reports reach the user (rank 0 only)."""

    def __init__(self, arguments: DDPPlusArguments, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
        self.arguments, self._warn, self._info = arguments, warn, info
        self.telemetry: SyncTelemetry | None = SyncTelemetry() if arguments.telemetry else None
        self.in_effect = SettingsInEffect(arguments.settings, on_rebuilt=self._reducer_rebuilt)
        self.window = AccumulationWindow(arguments.gradient_accumulation_steps, arguments.short_window)
        self.conflicts = ConflictCheck(arguments.checkpointing_conflict, warn=warn, info=info)
        self.sharding = ZeroSharding(arguments.optimizer_sharding, info=info)
        hook = self.sharding.hook(arguments.comm_hook, arguments.ddp_comm_state)
        self.hooks = HookAssembly(*hook, arguments.ddp_comm_wrapper)
        self.replica_guard = ReplicaGuard(arguments.verify_replicas_every_n_steps)
        every = arguments.find_stragglers_every_n_steps
        self.stragglers = None if every is None else StragglerWatch(every, warn)
        clock = self.stragglers.clock if self.stragglers is not None else None
        self.ledger = CollectiveLedger(arguments.ledger_length, clock=clock)
        threshold = arguments.stall_threshold
        self.stall_watchdog = None if threshold is None else StallWatchdog(self.ledger, threshold)
        self.items = ItemAveraging.for_arguments(arguments, self.window, record=self.ledger.collective, info=info)
        #: Whether fits start the watchdog: a front end sets it when it stops the engine at the end of every fit.
        self.watch_stalls = self.failed = False
        self.timeouts = GroupTimeouts(arguments.collective_timeout, arguments.setup_collective_timeout)
        self.channel = SideChannel(record=self.ledger.collective)
        self.sync_guard = SyncGuard(arguments.sync_guard, self.channel, warn=warn)
        self.uneven = UnevenInputsCheck(arguments.uneven_inputs, info=info)
        self.micro_batches = MicroBatchSizer(arguments.micro_batch_size, info=info)
        self.preemption = PreemptionStop(arguments.preemption_signals, self.sync_guard, self.channel)
        self.agreement = StepAgreement(
            self.sync_guard,
            self.uneven,
            self.channel,
            self.window,
            self.micro_batches.auto,
            on_fault=self._sync_fault,
            before_failure_agreement=self._decide_pending_conflicts,
            rebuild_reducer=self.sharding.rebuilding(self.in_effect.rebuild),
            stop_requested=self.preemption.requested,
        )
        self.micro_batch_runner = MicroBatchRunner(self.micro_batches, self.agreement, self.items, self._must_sync)
        self.out_of_memory_reports = OutOfMemoryReports(arguments.micro_batch_size, self.ledger, self.micro_batches)
        auto_buckets = arguments.settings.bucket_cap_mb == "auto"
        self.buckets = BucketTuner(on_rebuilt=self._reducer_rebuilt, info=info) if auto_buckets else None
        self.buffer_broadcast = BufferBroadcastRecord(self.ledger)
        #: Called at the start of every training forward, before its sync state is read (Fabric's window uses it).
        self.before_training_forward: Callable[[DistributedDataParallel], None] | None = None
        self.flight_recorder: FlightRecorder | None = None  # NCCL's, where prepare_process_group turned it on
        self.ddp: DistributedDataParallel | None = None
        self.forward_synced, self.gradient_bytes = True, 0  # the last training forward synced; what a backward sends
        self._handles: list[Any] = []

    @property
    def settings(self) -> DDPSettings:
        """The settings in effect: ``broadcast_buffers="auto"`` decided, and what ``"resolve"`` changed."""
        return self.in_effect.current

    def wrap(self, module: Module, device_ids: list[int] | None) -> DistributedDataParallel:
        """Wrap ``module`` in ``DistributedDataParallel`` with the settings, and start a fit on it."""
        settings = self.in_effect.for_module(module)
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        self.ledger.follow_device(next(module.parameters()).device)  # on CUDA, records end when the stream's work does
        ddp = wrap_module(module, settings, device_ids)
        self.start_fit(ddp, module)
        return ddp

    def micro_batches_from_plan(self, folder: str, module: Module, world_size: int) -> None:
        """``micro_batch_size="auto"``: start from ``ddp-plus check``'s suggestion in ``folder``, if it has one."""
        self.micro_batches.start_from(*starting_size_in_folder(folder, module, world_size))

    def start_fit(self, ddp: DistributedDataParallel, module: Module) -> None:
        """Attach every component to a new wrapper; counters and cadences restart."""
        self.teardown()
        self.window.reset()
        self.items.reset()
        self.uneven.reset()
        self.micro_batch_runner.reset()
        self.channel.start(self.arguments.collective_timeout)
        self.failed = False
        if self.watch_stalls and self.stall_watchdog is not None:
            start_for_fit(self.stall_watchdog, self._warn)
        self.sync_guard.attach(ddp)
        self.hooks.register(ddp)
        self._handles = [ddp.register_forward_pre_hook(self._forward_starts)]
        self._handles += self.buffer_broadcast.attach(ddp, module, bool(self.settings.broadcast_buffers))
        if self.stragglers is not None:
            self.stragglers.reset()
        self.conflicts.attach(ddp, module)
        self.replica_guard.attach(ddp, module, with_buffers=bool(self.settings.broadcast_buffers))
        if self.telemetry is not None:
            self.telemetry.attach(ddp, self.hooks)
        if self.buckets is not None:
            self.buckets.attach()
        self.ddp = self.agreement.ddp = ddp

    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.buffer_broadcast.close()
        self.timeouts.fit_ended()  # what comes next (another fit) sets up again
        self.conflicts.detach()
        self.replica_guard.detach()
        self.sync_guard.detach()
        self.channel.stop()
        if self.stall_watchdog is not None:
            self.stall_watchdog.stop(orderly=not self.failed)
        if self.buckets is not None:
            self.buckets.stop()
        self.ddp = self.agreement.ddp = None

    def shard_optimizers(self, optimizers: list[Optimizer], clipping: str | None, precision: Any) -> list[Optimizer]:
        """With ``optimizer_sharding``: each optimizer sharded (ZeRO-1); see ``ZeroSharding.shard``."""
        return self.sharding.shard(optimizers, self.ddp, self.settings.static_graph, clipping, precision)

    def _forward_starts(self, ddp: DistributedDataParallel, args: Any) -> None:
        if ddp.training and torch.is_grad_enabled():
            self.timeouts.first_step()  # setup is over: a step waits `timeout`
            self.ledger.enter_phase("forward", step=self.window.stats.optimizer_steps)  # as trainer.global_step
            if self.before_training_forward is not None:
                self.before_training_forward(ddp)
            self.forward_synced = ddp.require_backward_grad_sync
        self.buffer_broadcast.forward_starts(ddp)

    def before_backward(self, ddp: DistributedDataParallel, loss: Tensor | None, post_forward: bool) -> Tensor | None:
        """At the first backward of a fit, the conflict check decides (and may rebuild the reducer); returns the loss
        to run backward on (``None``: this rank's attempt failed before; ``post_forward``: DDP's forward finished)."""
        self.ledger.enter_phase("backward")
        if self.stragglers is not None and self.forward_synced:
            self.stragglers.backward_starts(loss)
        if not self.conflicts.pending:
            return loss
        steps, synced = self.window.steps, self.forward_synced
        return self.in_effect.at_first_backward(self.conflicts, ddp, loss, steps, synced, post_forward)

    def after_backward(self, synced: bool, failed: bool = False) -> StepAgreed:
        """After every backward; a synced one ends in the ranks' agreement (``failed``: it raised what the guard takes)."""
        self.window.record_backward(synced)
        self.ledger.enter_phase("optimizer step" if synced else "data fetch")
        if self.telemetry is not None:
            self.telemetry.after_backward(synced)
        if not synced or self.ddp is None:
            return StepAgreed()
        agreed = self.agreement.after_synced_backward(self.ddp, failed)
        if self.uneven.mode == "join" and not agreed.out_of_memory:
            scale_gradients(self.ddp.module.parameters(), self.uneven.take_rescale(self.window.per_item))
        if agreed.stop:  # a termination notice: every rank stops after this step (the front end saves it)
            self.preemption.agreed(stop_after=self.window.stats.optimizer_steps + 1)
        return agreed

    def _must_sync(self) -> bool:  # the run's first backward of a static graph all-reduces (rule R3)
        return self.window.must_sync_first_backward(self.settings.static_graph)

    def _reducer_rebuilt(self, ddp: DistributedDataParallel) -> None:  # telemetry reads the buckets again
        if self.telemetry is not None:
            self.telemetry.reducer_rebuilt(ddp)

    def _decide_pending_conflicts(self, ddp: DistributedDataParallel) -> None:
        if self.conflicts.pending:  # the others' first backward decides the conflict check with a collective
            self.before_backward(ddp, None, post_forward=True)

    def _sync_fault(self, ddp: DistributedDataParallel, fault: SyncFault) -> None:
        """Some rank's reducer did not all-reduce every bucket (now completed on every rank): rule R6 decides."""
        self.in_effect.after_late_fault(self.conflicts, ddp, fault, self.window.steps, self._warn, self._info)

    def after_optimizer_step(self) -> int:
        step = self.window.record_optimizer_step()
        self.ledger.enter_phase("data fetch", step=step)
        self.preemption.step_done(step)
        if self.stragglers is not None:
            self.stragglers.step_done(step, self.channel.rank, self.channel.gather)
        if self.telemetry is not None:
            self.telemetry.end_step(step)
        self.replica_guard.step_done(step)
        if self.buckets is not None and self.ddp is not None:
            self.buckets.step_done(self.ddp)
        return step

    def end_of_training(self) -> None:  # no forward follows: parameters only (buffers are not broadcast yet)
        self.replica_guard.check_due(with_buffers=False)
        self.end_of_epoch()

    def end_of_epoch(self) -> None:  # the steps since the last straggler comparison, on every rank (a collective)
        if self.stragglers is not None:
            self.stragglers.compare_since_last(
                self.window.stats.optimizer_steps, self.channel.rank, self.channel.gather
            )

    def explain(self, exception: BaseException) -> None:
        """Append to a torch error which rule it is and the fix, or what a collective timeout means."""
        if isinstance(exception, Preempted):  # an orderly end: the agreed step was saved
            return
        self.failed = True
        report = self.stall_watchdog.last_report if self.stall_watchdog is not None else None
        recorder = self.flight_recorder.describe() if self.flight_recorder is not None else None
        explain_error(exception, TimeoutContext(*self.timeouts.in_effect(), report, recorder))

    def prepare_process_group(self, backend: str, environ: MutableMapping[str, str]) -> None:
        """Before the process group exists: on NCCL, with the stall report on, NCCL's flight recorder."""
        self.flight_recorder = flight_recorder_for(backend, self.stall_watchdog is not None, environ, self._info)

    def results(self) -> WorkerResults:  # what a worker found and counted, for the process that launched it
        return WorkerResults.of(self)
