"""``EngineComponents``: the parts of one DDP run, built from the validated arguments (each in the room its name says),
what the front ends read of them (read-only properties) and what they ask of them outside the training step (a
collective or a save in the ledger, clipping, the window's position, the notices). ``DDPPlusEngine`` adds the
pipeline's order and the step's walk."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.config.timeout import GroupTimeouts
from lightning_ddp_plus.conflicts.check import ConflictCheck
from lightning_ddp_plus.conflicts.rules import Finding
from lightning_ddp_plus.conflicts.settings_in_effect import SettingsInEffect
from lightning_ddp_plus.diagnostics.collective_ledger import BufferBroadcastRecord, CollectiveLedger, Phase
from lightning_ddp_plus.diagnostics.flight_recorder import FlightRecorder, flight_recorder_for
from lightning_ddp_plus.diagnostics.out_of_memory_reports import OutOfMemoryReports
from lightning_ddp_plus.diagnostics.phase_timings import PhaseTimes, StragglerWatch
from lightning_ddp_plus.diagnostics.replicas import ReplicaGuard
from lightning_ddp_plus.diagnostics.stall_watchdog import StallWatchdog
from lightning_ddp_plus.diagnostics.telemetry import SyncTelemetry
from lightning_ddp_plus.diagnostics.torch_errors import TimeoutContext
from lightning_ddp_plus.diagnostics.torch_errors import explain as explain_error
from lightning_ddp_plus.engine.arguments import DDPPlusArguments
from lightning_ddp_plus.engine.results import WorkerResults
from lightning_ddp_plus.memory.suggestion import starting_size_in_folder
from lightning_ddp_plus.preemption.notice import NoticeWatch
from lightning_ddp_plus.preemption.report import Preempted
from lightning_ddp_plus.preemption.stop import PreemptionStop, StopDecision
from lightning_ddp_plus.sharding.zero import ZeroSharding
from lightning_ddp_plus.sync.accumulation import AccumulationWindow, SyncStats, WindowPosition
from lightning_ddp_plus.sync.buckets import BucketChoice, BucketTuner
from lightning_ddp_plus.sync.chunk_runner import ChunkRunner
from lightning_ddp_plus.sync.chunks import CHECKPOINT_KEY, ChunkSizer
from lightning_ddp_plus.sync.comm_hooks import HookAssembly, HookCallCounter
from lightning_ddp_plus.sync.flag_carrier import FlagCarrier
from lightning_ddp_plus.sync.item_averaging import ITEM_SUMS, ItemAveraging
from lightning_ddp_plus.sync.left_out import LeftOutGradients
from lightning_ddp_plus.sync.side_channel import SideChannel
from lightning_ddp_plus.sync.step_agreement import AgreementEngine, StepAgreement
from lightning_ddp_plus.sync.step_guard import SyncFault, SyncGuard
from lightning_ddp_plus.sync.uneven import PaddedBatches, UnevenInputsCheck


class EngineComponents:
    """The components of a run (see the module's docstring), each built from ``arguments``."""

    arguments: DDPPlusArguments
    in_effect: SettingsInEffect
    timeouts: GroupTimeouts
    window: AccumulationWindow
    conflicts: ConflictCheck
    sharding: ZeroSharding
    hooks: HookAssembly
    carrier: FlagCarrier
    replica_guard: ReplicaGuard
    channel: SideChannel
    stragglers: StragglerWatch | None
    ledger: CollectiveLedger
    stall_watchdog: StallWatchdog | None
    left_out: LeftOutGradients
    items: ItemAveraging
    sync_guard: SyncGuard
    uneven: UnevenInputsCheck
    chunks: ChunkSizer
    preemption: PreemptionStop
    agreement: StepAgreement
    chunk_runner: ChunkRunner
    out_of_memory_reports: OutOfMemoryReports
    buckets: BucketTuner | None
    telemetry: SyncTelemetry | None
    buffer_broadcast: BufferBroadcastRecord
    flight_recorder: FlightRecorder | None
    failed: bool

    def __init__(
        self,
        arguments: DDPPlusArguments,
        warn: Callable[[str], None],
        info: Callable[[str], None],
        engine: AgreementEngine,
    ) -> None:
        """Each component from its arguments (``engine``: the engine the agreement asks, see ``AgreementEngine``)."""
        self.arguments, self._warn, self._info = arguments, warn, info
        self.in_effect = SettingsInEffect(arguments.settings, on_rebuilt=self._reducer_rebuilt)
        self.timeouts = GroupTimeouts(arguments.timeout_in_effect, arguments.setup_timeout_in_effect)
        self.window = AccumulationWindow(arguments.gradient_accumulation_steps, arguments.short_window)
        self.conflicts = ConflictCheck(arguments.checkpointing_conflict, warn=warn, info=info)
        self.sharding = ZeroSharding(arguments.optimizer_sharding, info=info, timeout=arguments.timeout_in_effect)
        #: The step's flags in the last gradient bucket, where they can ride (``sync.flag_carrier``).
        self.carrier = FlagCarrier(self._carried_flags, self._carried_sums, ITEM_SUMS)
        if self.sharding.shards is not None:  # the flags ride in the last bucket's reduce-scatter
            self.sharding.shards.carrier = self.carrier
        hook, state = self.sharding.hook(arguments.comm_hook, arguments.ddp_comm_state)
        overlap = arguments.optimizer_sharding == "overlap"
        self.hooks = HookAssembly(hook, state, arguments.ddp_comm_wrapper, self.carrier, own_hook_later=overlap)
        self.replica_guard = ReplicaGuard(arguments.verify_replicas_every_n_steps)
        self.channel = SideChannel(timeout=arguments.timeout_in_effect)
        every = arguments.find_stragglers_every_n_steps
        self.stragglers = None if every is None else StragglerWatch(every, warn, channel=self.channel)
        clock = self.stragglers.clock if self.stragglers is not None else None
        self.ledger = CollectiveLedger(arguments.ledger_length, clock=clock)
        self.channel.record = self.ledger.collective  # the flag exchanges in the ledger too
        after = arguments.stall_report_after_in_effect
        self.stall_watchdog = None if after is None else StallWatchdog(self.ledger, after, warn=warn)
        self.left_out = LeftOutGradients(record=self.ledger.collective, info=info)
        self.items = ItemAveraging.for_arguments(
            arguments, self.window, record=self.ledger.collective, info=info, carried=self._summed_items
        )
        own_chunks = self.sharding.shards.received_into_grads if self.sharding.shards is not None else None
        self.sync_guard = SyncGuard(arguments.sync_guard, self.channel, warn, own_chunks, self.carrier)
        self.uneven = UnevenInputsCheck(arguments.uneven_inputs, info=info, window=self.window)
        self.chunks = ChunkSizer(arguments.chunk_size, info=info)
        self.preemption = PreemptionStop(arguments.preemption_signals, self.channel)
        self.agreement = StepAgreement(engine, self.sync_guard, self.uneven, self.chunks, self.channel, self.window)
        must_sync = self.must_sync_first_backward
        self.chunk_runner = ChunkRunner(self.chunks, self.agreement, self.items, must_sync)
        #: A front end's batch in chunks of ``chunk_size`` (see ``ChunkRunner.run``): an engine action.
        self.run_chunks = self.chunk_runner.run
        self.out_of_memory_reports = OutOfMemoryReports(arguments.chunk_size, self.ledger, self.chunks)
        auto_buckets = arguments.settings.bucket_cap_mb == "auto"
        self.buckets = BucketTuner(on_rebuilt=self._reducer_rebuilt, info=info) if auto_buckets else None
        self.telemetry = SyncTelemetry(self.hooks) if arguments.telemetry else None
        self.buffer_broadcast = BufferBroadcastRecord(self.ledger)
        self.flight_recorder = None  # NCCL's, where prepare_process_group turned it on
        self._environ: MutableMapping[str, str] = {}  # where prepare_process_group set it

    def _carried_flags(self) -> list[int]:  # a method, not a lambda: a spawned strategy is pickled
        return self.agreement.flags_now()

    def _carried_sums(self, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        return self.items.sums_now(dtype, device)

    def _summed_items(self) -> Tensor | None:
        return self.carrier.summed

    def _reducer_rebuilt(self, ddp: DistributedDataParallel) -> None:  # telemetry reads the buckets again
        if self.telemetry is not None:
            self.telemetry.reducer_rebuilt(ddp)

    # ------------------------------------------------------------------ what the agreement asks of the run

    def sync_fault(self, ddp: DistributedDataParallel, fault: SyncFault) -> None:
        """Some rank's reducer did not all-reduce every bucket (now completed on every rank): rule R6 decides."""
        self.in_effect.after_late_fault(self.conflicts, ddp, fault, self.window.steps, self._warn, self._info)

    def rebuild_reducer(self, ddp: DistributedDataParallel) -> None:
        self.sharding.rebuilding(self.in_effect.rebuild)(ddp)

    # ------------------------------------------------------------------ what the front ends read

    @property
    def settings(self) -> DDPSettings:
        """The settings in effect: ``broadcast_buffers="auto"`` decided, and what ``"resolve"`` changed."""
        return self.in_effect.current

    @property
    def accumulation_steps(self) -> int:
        """k in effect (with the Trainer: settled with its setting when ``fit`` starts)."""
        return self.window.steps

    @property
    def sync_stats(self) -> SyncStats:
        return self.window.stats

    @property
    def findings(self) -> list[Finding]:
        return self.conflicts.findings

    @property
    def loss_per_item(self) -> float | None:
        return self.items.loss_per_item

    @property
    def bucket_choice(self) -> BucketChoice | None:
        return self.buckets.choice if self.buckets is not None else None

    @property
    def comm_hook_counter(self) -> HookCallCounter:
        return self.hooks.counter

    @property
    def replica_check_seconds(self) -> list[float]:
        return self.replica_guard.check_seconds

    @property
    def phase_times(self) -> list[PhaseTimes]:
        return self.stragglers.last_times if self.stragglers is not None else []

    @property
    def preemption_agreed(self) -> StopDecision | None:
        """Set once every rank agreed to stop for a termination notice."""
        return self.preemption.decision

    def stop_spent(self) -> None:
        """The loop ended for the agreed stop (``end_preempted``): a later loop in the same process starts afresh."""
        self.preemption.decision = None

    @property
    def chunk_size(self) -> int | None:
        """Rows per chunk in effect (``None``: the whole batch)."""
        return self.chunks.size

    # ------------------------------------------------------------------ what the front ends ask outside the step

    def give_num_items(self, count: Any) -> None:
        """The count of the items the next backward's loss is a mean over (``None``: none)."""
        self.items.pending = count

    def must_sync_first_backward(self) -> bool:  # the run's first backward of a static graph all-reduces (rule R3)
        return self.window.must_sync_first_backward(self.settings.static_graph)

    def syncs(self, position: WindowPosition) -> bool:
        """Whether the micro-batch at ``position`` all-reduces: it closes its window, or rule R3 needs it."""
        return self.window.syncs(position, self.settings.static_graph)

    def next_position(self, is_last: bool) -> WindowPosition:
        """For a front end that counts micro-batches itself (Fabric): the position of the one about to run."""
        return self.window.peek(is_last=is_last)

    def moved_on(self, position: WindowPosition) -> None:
        """The micro-batch at ``position`` ran its backward (a front end that counts micro-batches itself)."""
        if self.window.steps > 1:
            self.window.advance(position)

    def settle_accumulation(self, trainer_steps: object) -> int:
        """k settled once with the Trainer's ``accumulate_grad_batches`` (before anything is launched)."""
        return self.window.reconcile(trainer_steps)

    def resume_with_accumulation(self, steps: int) -> None:
        """A resume on another number of ranks changed k (``on_world_size_change="keep_global_batch"``)."""
        self.window.set_steps(steps)

    def step_mid_window_warning(self) -> str:
        return self.window.step_mid_window_warning()

    def forced_epoch_length(self, epoch: int) -> int | None:
        """The number of batches ``uneven_inputs`` gave ``epoch``, once decided."""
        return self.uneven.forced_length(epoch)

    def gradient_rescale(self, position: WindowPosition) -> float:
        """A window that closed early (at ``position``): the factor its gradients need (``short_window``)."""
        return self.window.gradient_rescale(position)

    def padded(self, loader: Any) -> Any:
        """``uneven_inputs="join"``: ``loader`` repeating its last batch (its loss counted 0) once it runs out."""
        return PaddedBatches(loader, self.uneven.padding_state) if self.uneven.mode == "join" else loader

    def padding_ends(self) -> None:
        """An epoch's items are over: what follows is no padding."""
        self.uneven.padding = False

    def collective(self, op: str, size_bytes: int = 0, users_call: bool = True) -> AbstractContextManager[Any]:
        """A collective a front end issues, in the ledger (``users_call=False``: Lightning's loop issued it)."""
        return self.ledger.collective(op, size_bytes, users_call=users_call)

    def in_phase(self, phase: Phase) -> AbstractContextManager[None]:
        """``phase`` for a ``with`` block (a checkpoint save), then the phase before."""
        return self.ledger.in_phase(phase)

    def enter_phase(self, phase: Phase) -> None:
        self.ledger.enter_phase(phase)

    def out_of_memory_explained(self, batch: Any, rank: int, world_size: int) -> AbstractContextManager[None]:
        """Around a training batch: an out-of-memory error named on every rank (``OutOfMemoryReports``)."""
        return self.out_of_memory_reports.explained(batch, rank, world_size)

    def chunks_from_plan(self, folder: str, module: Module, world_size: int) -> None:
        """``chunk_size="auto"``: start from ``ddp-plus check``'s suggestion in ``folder``, if it has one."""
        self.chunks.start_from(*starting_size_in_folder(folder, module, world_size))

    def save_chunk_size(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint with the size in effect, so that a resume starts from it."""
        if self.chunks.active:
            checkpoint[CHECKPOINT_KEY] = self.chunks.state_dict()
        return checkpoint

    def load_chunk_size(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        self.chunks.load_state_dict(checkpoint.get(CHECKPOINT_KEY, {}))
        return checkpoint

    def clip_norm(
        self, clipping: str, precision: Any, optimizer: Optimizer, *args: Any, **kwargs: Any
    ) -> Tensor | None:
        """Clipping by norm under ``optimizer_sharding`` (``None``: the plain clipping applies)."""
        return self.sharding.clip_norm(clipping, precision, optimizer, *args, **kwargs)

    def refuse_clipping(self, clipping: str) -> None:
        self.sharding.refuse_clipping(clipping)

    def watch_notices(self, also: str | None = None) -> NoticeWatch | None:
        """The notice handlers on (``preemption_signals``, and ``also``: SLURM's requeue signal where notices are
        on), until ``end_notices``; returns the installed watch, whose handlers a framework must leave alone (``None``:
        notices are off)."""
        if also is not None and self.preemption.on:
            self.preemption.add_signal(also)
        self.preemption.start()
        return self.preemption.watch if self.preemption.watch.installed else None

    def notice_before_first_step(self) -> StopDecision | None:
        """At the start of training: whether some rank got a notice during setup (one all-reduce of one integer)."""
        return self.preemption.before_first_step()

    def end_notices(self, hold: bool = False) -> None:
        """At the fit's end: the handlers from before it (a notice no step took is passed on, unless it failed;
        ``hold``: at ``pass_on_held_notice``, once the fit is over)."""
        self.preemption.end(pass_on=not self.failed, hold=hold)

    def pass_on_held_notice(self) -> None:
        """After the fit, every hook of it run: the notice ``end_notices`` held, to the handlers from before."""
        self.preemption.pass_on_held()

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
        self._environ = environ

    def release_environment(self) -> None:
        """At the front end's teardown: the variables ``prepare_process_group`` set are taken back (rank 0 is the
        user's own process; what the user had set stays)."""
        if self.flight_recorder is not None:
            for name in self.flight_recorder.set_here:
                self._environ.pop(name, None)

    def results(self) -> WorkerResults:  # what a worker found and counted, for the process that launched it
        return WorkerResults.of(self)
