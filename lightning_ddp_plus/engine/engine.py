"""The engine both front ends share: one object per strategy that owns the components of a DDP run.

- ``AccumulationWindow``: k, where a micro-batch sits, its loss scale, whether its backward syncs;
- ``ConflictCheck``: observe the first training forward, decide at the first backward;
- ``HookAssembly``: the communication hook, its state, wrapper and counter;
- ``ReplicaGuard``: the periodic replica check (``replica_guard``);
- ``SyncTelemetry``: per-step communication figures;
- ``BucketTuner``: ``bucket_cap_mb="auto"``, timing bucket sizes during the first optimizer steps;
- ``SyncGuard``: after every synced backward, that every rank's reducer all-reduced every bucket (``sync_guard``);
- ``UnevenInputsCheck``: ranks whose shards hold different numbers of batches;
- ``optimizer_sharding``: the optimizers wrapped in ``ZeroRedundancyOptimizer`` (``shard_optimizers``);
- ``MicroBatchSizer``: ``micro_batch_size``, and what every rank does after an out-of-memory error on one.

The sync guard and the uneven-inputs check share one small gloo group (``SideChannel``) and, where they can, the
guard's per-step agreement (a store look-up on gloo). The engine decides nothing itself: the rules decide
(``conflicts``), the components act, and the engine applies their answers in order.

The Trainer strategy and the Fabric strategy translate their framework's hooks into the few calls below: ``wrap`` at
setup, ``shard_optimizers`` once the optimizers exist, ``batch_starts`` before each training batch,
``before_backward``/``after_backward`` around each backward, ``after_optimizer_step``, ``teardown``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.conflicts.check import (
    ConflictCheck,
    agree_across_ranks,
    decide_late_fault,
    finding_records,
    findings_from_records,
    recovers_in_backward,
)
from lightning_ddp_plus.conflicts.facts import ModelFacts, running_stat_buffers
from lightning_ddp_plus.conflicts.rules import CheckedSettings
from lightning_ddp_plus.diagnostics import torch_errors
from lightning_ddp_plus.diagnostics.collective_ledger import CollectiveLedger
from lightning_ddp_plus.diagnostics.flight_recorder import FlightRecorder, turn_on_flight_recorder
from lightning_ddp_plus.diagnostics.phase_timings import StragglerWatch
from lightning_ddp_plus.diagnostics.replicas import ReplicaGuard
from lightning_ddp_plus.diagnostics.stall_watchdog import StallWatchdog
from lightning_ddp_plus.diagnostics.telemetry import SyncTelemetry
from lightning_ddp_plus.diagnostics.torch_errors import TimeoutContext
from lightning_ddp_plus.engine.arguments import DDPPlusArguments, FrontEnd
from lightning_ddp_plus.engine.setup_line import InEffect, setup_line
from lightning_ddp_plus.memory.suggestion import SUGGESTION_FILE, parameter_count, read_suggestion, starting_size
from lightning_ddp_plus.processes.restart import restart_attempt, store_client
from lightning_ddp_plus.sharding import optimizer as sharding
from lightning_ddp_plus.sync.accumulation import AccumulationWindow, SyncStats, scale_gradients
from lightning_ddp_plus.sync.buckets import BucketTuner
from lightning_ddp_plus.sync.comm_hooks import HookAssembly
from lightning_ddp_plus.sync.ddp_internals import (
    default_store,
    queue_backward_callback,
    rebuild_reducer,
    replay_forward,
    set_group_timeout,
)
from lightning_ddp_plus.sync.micro_batches import (
    PHASES,
    BatchOutOfMemory,
    MicroBatchSizer,
    OutOfMemory,
    free_memory,
)
from lightning_ddp_plus.sync.side_channel import SideChannel
from lightning_ddp_plus.sync.step_guard import SyncFault, SyncGuard
from lightning_ddp_plus.sync.uneven import RankBatches, UnevenInputsCheck, uneven_flags
from lightning_ddp_plus.sync.wrapper import wrap_module

#: Fits in this process, for the stall watchdog's keys in the job's store.
_FIT_NUMBERS = itertools.count(1)
#: How long the stall watchdog's store client waits for the store (a cut link must not hold up the job's end).
STORE_TIMEOUT = timedelta(seconds=5)
#: How long a rank's error waits for the job's store to say whether a peer ran out of memory.
REPORT_STORE_TIMEOUT = timedelta(seconds=2)


def _report_store() -> Any:
    """A client of the job's store for a report on an error path, of its own on every rank: it gives up within
    ``REPORT_STORE_TIMEOUT`` (on a cut link the default group's client would wait for the whole collective timeout),
    and every rank reads and writes the same keys (the default group's store adds a prefix of its own)."""
    return store_client(REPORT_STORE_TIMEOUT)


def _out_of_memory_key(rank: int) -> str:
    return f"ddp_plus/out_of_memory/attempt_{restart_attempt() or 0}/rank_{rank}"


class DDPPlusEngine:
    """The components of a DDP run and the order in which they act.

    Args:
        arguments: the validated strategy arguments.
        warn: how warnings reach the user (rank 0 only).
        info: how one-line reports reach the user (rank 0 only).
    """

    def __init__(self, arguments: DDPPlusArguments, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
        self.arguments = arguments
        given = arguments.settings
        #: The settings in effect: ``broadcast_buffers="auto"`` decided, and what ``"resolve"`` changed.
        self.settings: DDPSettings = given.resolve_auto(True) if given.broadcast_buffers == "auto" else given
        self.window = AccumulationWindow(arguments.gradient_accumulation_steps, arguments.short_window)
        self.conflicts = ConflictCheck(arguments.checkpointing_conflict, warn=warn, info=info)
        self.hooks = HookAssembly(arguments.comm_hook, arguments.ddp_comm_state, arguments.ddp_comm_wrapper)
        self.replica_guard = ReplicaGuard(arguments.verify_replicas_every_n_steps)
        every = arguments.find_stragglers_every_n_steps
        #: Straggler attribution: this rank's phase timings, compared across ranks every N steps.
        self.stragglers = StragglerWatch(every, warn) if every is not None else None
        #: The last collectives of this rank (``stall_report_after``): what the stall watchdog compares. It also
        #: tells the phase clock of every phase and collective.
        self.ledger = CollectiveLedger(
            arguments.ledger_length, clock=self.stragglers.clock if self.stragglers is not None else None
        )
        threshold = arguments.stall_threshold
        self.stall_watchdog = StallWatchdog(self.ledger, threshold) if threshold is not None else None
        #: Whether fits start the watchdog: a front end sets it when it stops the engine at the end of every fit
        #: (the Trainer's ``teardown``), before the process group and the store it asks can go away.
        self.watch_stalls = False
        self._failed = False
        #: Bytes of the gradients a synced backward all-reduces (set when wrapping).
        self.gradient_bytes = 0
        self.channel = SideChannel(record=self.ledger.collective)
        self.sync_guard = SyncGuard(arguments.sync_guard, self.channel, warn=warn)
        self.uneven = UnevenInputsCheck(arguments.uneven_inputs, info=info)
        self.micro_batches = MicroBatchSizer(arguments.micro_batch_size, info=info)
        self._warn, self._info = warn, info
        self.telemetry: SyncTelemetry | None = SyncTelemetry() if arguments.telemetry else None
        self.buckets: BucketTuner | None = (
            BucketTuner(on_rebuilt=self._reducer_rebuilt, info=info) if given.bucket_cap_mb == "auto" else None
        )
        self._ddp: DistributedDataParallel | None = None
        #: Called at the start of every training forward, before its sync state is read (Fabric's window uses it).
        self.before_training_forward: Callable[[DistributedDataParallel], None] | None = None
        self._forward_synced = True
        self._handles: list[Any] = []
        self._broadcasts_buffers = False
        self._buffer_broadcast = ExitStack()
        self._steps_started = False
        #: NCCL's flight recorder in effect, where ``prepare_process_group`` turned it on.
        self.flight_recorder: FlightRecorder | None = None
        self._epoch = 0

    # ------------------------------------------------------------------ setup and teardown

    def wrap(self, module: Module, device_ids: list[int] | None) -> DistributedDataParallel:
        """Wrap ``module`` in ``DistributedDataParallel`` with the settings, and start a fit on it."""
        self.settings = self.arguments.settings.resolve_auto(bool(running_stat_buffers(module)))
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in trainable)
        ddp = wrap_module(module, self.settings, device_ids)
        self.start_fit(ddp, module)
        return ddp

    def micro_batches_from_plan(self, folder: str, module: Module, world_size: int) -> None:
        """``micro_batch_size="auto"``: start from the suggestion ``ddp-plus check`` left in ``folder`` (the run's
        ``default_root_dir``) where it was made for this model and world size; say which, on rank 0."""
        sizer = self.micro_batches
        if not sizer.auto or sizer.size is not None:
            return
        where = str(Path(folder) / SUGGESTION_FILE)
        size, message = starting_size(read_suggestion(folder), parameter_count(module), world_size, where)
        sizer.start_from(size)
        if message is not None:
            self._info(message)

    def start_fit(self, ddp: DistributedDataParallel, module: Module) -> None:
        """Attach every component to a new wrapper; counters and cadences restart."""
        self.teardown()
        self.window.reset()
        self.uneven.reset()
        self.channel.start(self.arguments.collective_timeout)
        self._failed = False
        self._start_stall_watchdog()
        self.sync_guard.attach(ddp)
        self.hooks.register(ddp)
        self._handles = [ddp.register_forward_pre_hook(self._forward_starts)]
        self._broadcasts_buffers = bool(self.settings.broadcast_buffers) and any(True for _ in module.buffers())
        if self._broadcasts_buffers:
            # DDP broadcasts the buffers between its own forward pre-hooks and the module's: a collective
            self._handles.append(module.register_forward_pre_hook(self._buffers_broadcast))
        if self.stragglers is not None:
            self.stragglers.reset()
        self.conflicts.attach(ddp, module)
        self.replica_guard.attach(ddp, module, with_buffers=bool(self.settings.broadcast_buffers))
        if self.telemetry is not None:
            self.telemetry.attach(ddp, self.hooks)
        if self.buckets is not None:
            self.buckets.attach()
        self._ddp = ddp

    def _start_stall_watchdog(self) -> None:
        """The watchdog of this fit, on every rank (a collective: every rank counts its fits alike)."""
        if not self.watch_stalls or self.stall_watchdog is None:
            return
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return
        store = store_client(STORE_TIMEOUT)  # fails fast on a cut link, rather than at the collective timeout
        if store is None:
            self._warn("DDPPlusStrategy: no client of the job's store could be made, so stalls are not explained.")
            return
        # every rank runs the same fits in the same order, so the numbers agree; keys of earlier fits stay apart
        prefix = f"ddp_plus/stalls/attempt_{restart_attempt() or 0}/fit_{next(_FIT_NUMBERS)}"
        rank = dist.get_rank()
        server = default_store() if rank == 0 else None
        self.stall_watchdog.start(store, rank, dist.get_world_size(), prefix, server=server)

    def _set_timeout(self, timeout: timedelta) -> None:
        """The default group's timeout, where ``setup_timeout`` made the two differ (checked before launch)."""
        if self.arguments.setup_timeout is not None and dist.is_available() and dist.is_initialized():
            set_group_timeout(timeout)

    def synced_backward(self, synced: bool, users_call: bool) -> AbstractContextManager[Any]:
        """Around a backward: a synced one is the gradient all-reduce of its step, in the ledger (``users_call``: the
        user called the backward, as ``manual_backward`` or ``fabric.backward``, so the user's line is named)."""
        if not synced:
            return nullcontext()
        # the backward computes inside the block too: the clock is switched to waiting when the gradients are computed
        return self.ledger.collective("gradient all_reduce", self.gradient_bytes, users_call=users_call, waits=False)

    def _reducer_rebuilt(self, ddp: DistributedDataParallel) -> None:
        if self.telemetry is not None:
            self.telemetry.reducer_rebuilt(ddp)

    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._buffer_broadcast.close()
        if self._steps_started:
            self._steps_started = False
            self._set_timeout(self.arguments.process_group_timeout)  # what comes next (another fit) sets up again
        self.conflicts.detach()
        self.replica_guard.detach()
        self.sync_guard.detach()
        self.channel.stop()
        if self.stall_watchdog is not None:
            self.stall_watchdog.stop(orderly=not self._failed)
        if self.buckets is not None:
            self.buckets.stop()
        self._ddp = None

    def _forward_starts(self, ddp: DistributedDataParallel, args: Any) -> None:
        if ddp.training and torch.is_grad_enabled():
            if not self._steps_started:
                self._steps_started = True
                self._set_timeout(self.arguments.collective_timeout)  # setup is over: a step waits `timeout`
            self.ledger.enter_phase("forward", step=self.window.stats.optimizer_steps)  # as trainer.global_step
            if self.before_training_forward is not None:
                self.before_training_forward(ddp)
            self._forward_synced = ddp.require_backward_grad_sync
        if self._broadcasts_buffers and ddp.require_forward_param_sync:  # DDP's condition to broadcast buffers
            self._buffer_broadcast.enter_context(self.ledger.collective("buffer broadcast", users_call=False))

    def _buffers_broadcast(self, module: Module, args: Any) -> None:
        self._buffer_broadcast.close()

    @property
    def forward_synced(self) -> bool:
        """The last training forward ran with gradient sync on (its backward all-reduces)."""
        return self._forward_synced

    def shard_optimizers(self, optimizers: list[Optimizer]) -> list[Optimizer]:
        """With ``optimizer_sharding``: each optimizer as a ``ShardedOptimizer`` (ZeRO-1), with the overlap hook
        registered for ``"overlap"``; else the optimizers unchanged."""
        mode = self.arguments.optimizer_sharding
        if not mode:
            return optimizers
        overlap = mode == "overlap"
        if overlap and len(optimizers) != 1:
            raise ValueError(
                f"`optimizer_sharding='overlap'` runs one optimizer inside DDP's backward, and {len(optimizers)} were "
                "given. Fix: use `optimizer_sharding=True` with several optimizers."
            )
        sharded = [sharding.shard(optimizer, overlap=overlap) for optimizer in optimizers]
        if overlap:
            if self._ddp is None:  # the step would then run nowhere: ShardedOptimizer.step only runs the closure
                raise RuntimeError(
                    "optimizer_sharding='overlap' needs the module wrapped before its optimizer: set up the module "
                    "first (`fabric.setup(model, optimizer)`, or `fabric.setup_module` before `setup_optimizers`)."
                )
            sharding.register_overlap(self._ddp, sharded[0])
            self._info(
                "DDPPlusStrategy: optimizer_sharding='overlap': torch applies no parameter update in the first "
                f"{sharding.OVERLAP_WARMUP_STEPS[self.settings.static_graph]} optimizer steps, while it learns DDP's "
                "gradient buckets."
            )
        return list(sharded)

    # ------------------------------------------------------------------ per micro-batch

    def checked_settings(self) -> CheckedSettings:
        """The settings in effect, as the conflict rules look at them."""
        return CheckedSettings(
            find_unused_parameters=self.settings.find_unused_parameters,
            static_graph=self.settings.static_graph,
            broadcast_buffers=bool(self.settings.broadcast_buffers),
            gradient_accumulation_steps=self.window.steps,
        )

    def before_backward(self, ddp: DistributedDataParallel, loss: Tensor, post_forward: bool) -> Tensor:
        """At the first backward of a fit, the conflict check decides (and may rebuild the reducer with resolved
        settings); returns the loss to run backward on.

        ``post_forward``: DDP's forward had finished (automatic optimization, Fabric), rather than still running
        around this backward (Lightning's manual optimization).
        """
        self.ledger.enter_phase("backward")
        if self.stragglers is not None and self._forward_synced and loss.grad_fn is not None:
            loss.grad_fn.register_prehook(self._backward_starts)
        if not self.conflicts.pending:
            return loss
        decided: Tensor = self._decide_conflicts(ddp, loss, post_forward)
        return decided

    def _decide_conflicts(self, ddp: DistributedDataParallel, loss: Any, post_forward: bool) -> Any:
        view = self.checked_settings()
        module = ddp.module
        device = next(module.parameters()).device
        resolved = self.conflicts.decide(loss, view, lambda facts: self._agree(facts, module, device))
        if (resolved.find_unused_parameters, resolved.static_graph) == (view.find_unused_parameters, view.static_graph):
            return loss
        self.settings = dataclasses.replace(
            self.settings, find_unused_parameters=resolved.find_unused_parameters, static_graph=resolved.static_graph
        )
        rebuild_reducer(ddp, resolved.find_unused_parameters, resolved.static_graph)
        return loss if loss is None else replay_forward(ddp, loss, self._forward_synced, post_forward)

    def _backward_starts(self, grad_outputs: Any) -> None:
        queue_backward_callback(self._gradients_computed)

    def _gradients_computed(self) -> None:
        """This rank's backward has computed every gradient: from here to the backward's end it waits for the
        gradient all-reduce (the reducer's own callback, queued after this one, waits for it)."""
        if self.stragglers is not None:
            self.stragglers.clock.switch("collective wait")

    @staticmethod
    def _agree(facts: ModelFacts, module: Module, device: torch.device) -> ModelFacts:
        return agree_across_ranks(facts, module, device)

    def batch_starts(self, state: RankBatches, epoch: int, one_synced_backward: bool) -> bool:
        """Before a training batch, on every rank: the uneven-inputs decision. Returns True when this rank must make
        this batch its epoch's last (``uneven_inputs="stop"``); raises ``UnevenInputsError`` (``"error"``).

        ``one_synced_backward``: this batch ends with exactly one synced backward on every rank (automatic
        optimization, k=1), so its flag can travel in the sync guard's agreement after that backward, and
        ``after_backward`` decides.
        """
        if self.uneven.mode == "join" and not self.channel.open:  # one rank: its own loader's end ends the epoch
            return self.uneven.join_batch_starts(lambda values: values, lambda values: [values], epoch, 1)
        if not self.channel.open:
            return False
        if self.uneven.mode == "join":
            return self.uneven.join_batch_starts(self.channel.total, self.channel.gather, epoch, self.channel.size)
        if one_synced_backward and self.sync_guard.active:
            self.uneven.defer_to_step_check(state)
            self._epoch = epoch
            if state.last:
                self.sync_guard.request_agreement()
            return False
        return self.uneven.decide(state, self.channel.maximum(uneven_flags(state.last)), self.channel.gather, epoch)

    def loss_weight(self) -> float:
        """1, or 0 for a padding batch of ``uneven_inputs="join"`` (a rank that ran out repeats its last batch)."""
        return 0.0 if self.uneven.padding else 1.0

    def recovers_from(self, error: BaseException) -> bool:
        """Whether the guard takes over a backward that raised this (a static graph that gained a parameter): the
        front end then calls ``after_backward(..., failed=True)`` instead of re-raising."""
        return self.sync_guard.active and recovers_in_backward(error)

    def after_backward(self, synced: bool, failed: bool = False) -> bool:
        """After every backward. A synced one is checked by the guard (raises ``DDPConflictError``, or resolves);
        returns True when a held uneven-inputs flag decided that this batch ends the epoch (see ``batch_starts``).
        ``failed``: the backward raised an error that ``recovers_from`` accepted."""
        self.window.record_backward(synced)
        self.ledger.enter_phase("optimizer step" if synced else "data fetch")
        if self.telemetry is not None:
            self.telemetry.after_backward(synced)
        if not synced or self._ddp is None:
            return False
        stop = self._guard_synced_backward(self._ddp, failed) if self.sync_guard.active else False
        if self.uneven.mode == "join":
            scale_gradients(self._ddp.module.parameters(), self.uneven.take_rescale())
        return stop

    def _guard_synced_backward(
        self,
        ddp: DistributedDataParallel,
        failed: bool,
        out_of_memory: OutOfMemory | None = None,
        started: bool = True,
    ) -> bool:
        deferred = self.uneven.take_deferred()
        step = self.window.stats.optimizer_steps + 1
        flags = uneven_flags(deferred.last) if deferred else [0, 0]
        if self.micro_batches.auto:  # every rank's flags have the same length: the setting is the same everywhere
            flags.append(int(out_of_memory is not None))
        never_started = out_of_memory is not None and not started
        outcome = self.sync_guard.check(
            ddp, step, flags, aborted=failed or out_of_memory is not None, never_started=never_started
        )
        if self.micro_batches.auto and outcome.flag_maximums[-1]:
            if deferred is not None:  # the batch runs again, and its uneven-inputs flag with it
                self.uneven.defer_to_step_check(deferred)
                if deferred.last:
                    self.sync_guard.request_agreement()
            raise BatchOutOfMemory(self._out_of_memory_everywhere(out_of_memory))
        if outcome.fault is not None:
            self._sync_fault(ddp, outcome.fault)
        if deferred is None:
            return False
        return self.uneven.decide(deferred, outcome.flag_maximums, self.channel.gather, self._epoch)

    # ------------------------------------------------------------------ out of memory (micro_batch_size)

    def out_of_memory(self, failure: OutOfMemory, synced_backward_started: bool) -> None:
        """On a rank whose attempt at a batch ran out of memory (``micro_batch_size="auto"``), in place of its synced
        backward: issue the bucket all-reduces the other ranks' backward waits for and agree with them. Raises
        ``BatchOutOfMemory`` on every rank (the others raise it from their ``after_backward``)."""
        assert self._ddp is not None and self.sync_guard.active
        if self.conflicts.pending:  # the others' first backward decides the conflict check with a collective
            self._decide_conflicts(self._ddp, None, post_forward=True)
        self._guard_synced_backward(self._ddp, failed=True, out_of_memory=failure, started=synced_backward_started)
        raise AssertionError("the agreement after an out-of-memory error did not see it")  # pragma: no cover

    def _out_of_memory_everywhere(self, local: OutOfMemory | None) -> list[OutOfMemory]:
        """Every rank's failure in this attempt (one gather, only after one)."""
        mine = [1, PHASES.index(local.phase), local.rows, local.batch_rows] if local is not None else [0, 0, 0, 0]
        rows = self.channel.gather(mine)
        return [
            OutOfMemory(rank=rank, phase=PHASES[row[1]], rows=row[2], batch_rows=row[3])
            for rank, row in enumerate(rows)
            if row[0]
        ]

    def recover_from_out_of_memory(self, failures: list[OutOfMemory], device: torch.device, started: float) -> None:
        """Every rank, after the agreement: free what the attempt held, give the wrapper a new reducer (a backward
        that failed half way leaves the old one expecting hooks and, on the first step, bucket orders that differ
        between ranks), and halve the size (raises when a single row did not fit)."""
        free_memory(device)
        if self._ddp is not None:
            rebuild_reducer(self._ddp, self.settings.find_unused_parameters, self.settings.static_graph)
            self._reducer_rebuilt(self._ddp)
        self.micro_batches.shrink(failures, time.perf_counter() - started)

    def publish_out_of_memory(self, failure: OutOfMemory, message: str) -> None:
        """Where ``micro_batch_size`` is not ``"auto"``: leave in the job's store why this rank is about to fail, so
        that the ranks whose collective then breaks say that instead of the transport's error."""
        store = _report_store()
        if store is None:
            return
        try:
            store.set(_out_of_memory_key(failure.rank), message)
        except (RuntimeError, ValueError):
            pass

    def peer_out_of_memory(self, world_size: int) -> str | None:
        """What a rank that ran out of memory left in the job's store (``publish_out_of_memory``), if one did."""
        store = _report_store()
        if store is None:
            return None
        for rank in range(world_size):
            key = _out_of_memory_key(rank)
            try:
                if store.check([key]):
                    return bytes(store.get(key)).decode()
            except (RuntimeError, ValueError):
                return None
        return None

    def _sync_fault(self, ddp: DistributedDataParallel, fault: SyncFault) -> None:
        """Some rank's reducer did not all-reduce every bucket (now completed on every rank): rule R6 decides."""
        facts = ModelFacts(
            observed=True, late_step=fault.step, late_unused_by_rank=fault.unused, late_graph_grew=fault.aborted
        )
        mode = self.arguments.checkpointing_conflict
        decision = decide_late_fault(self.checked_settings(), facts, mode, fault.describe(), fault.skipped)
        if decision.error is not None:
            raise decision.error
        assert decision.resolved is not None
        self.conflicts.findings.append(decision.finding)
        resolved = decision.resolved
        self.settings = dataclasses.replace(
            self.settings, find_unused_parameters=resolved.find_unused_parameters, static_graph=resolved.static_graph
        )
        rebuild_reducer(ddp, resolved.find_unused_parameters, resolved.static_graph)
        self._reducer_rebuilt(ddp)
        (self._warn if decision.warn else self._info)(decision.report)

    def after_optimizer_step(self) -> int:
        step = self.window.record_optimizer_step()
        self.ledger.enter_phase("data fetch", step=step)
        if self.stragglers is not None:
            self.stragglers.step_done(step, self.channel.rank, self.channel.gather)
        if self.telemetry is not None:
            self.telemetry.end_step(step)
        self.replica_guard.step_done(step)
        if self.buckets is not None and self._ddp is not None:
            self.buckets.step_done(self._ddp)
        return step

    def end_of_training(self) -> None:
        # A check due after the last step: no forward follows, so parameters only (buffers are not broadcast yet).
        self.replica_guard.check_due(with_buffers=False)

    # ------------------------------------------------------------------ reporting

    @property
    def sync_stats(self) -> SyncStats:
        return self.window.stats

    def describe(self, front_end: FrontEnd, backend: str, world_size: int, buckets: int | None) -> str:
        """The setup line: every argument with the value in effect, logged by rank 0 at setup."""
        if not self.sync_guard.active:
            guard = "on (checked once the wrapper is built)" if self.arguments.sync_guard else "off"
        else:
            guard = "on (store)" if self.sync_guard.agrees_through_store else "on (all-reduce per step)"
        effect = InEffect(self.settings, self.hooks.name, self.window.steps, self.window.short_window, guard, buckets)
        return setup_line(front_end, self.arguments, effect, backend, world_size)

    def explain(self, exception: BaseException) -> None:
        """Append to a torch error which rule it is and the fix, or what a collective timeout means."""
        self._failed = True
        report = self.stall_watchdog.last_report if self.stall_watchdog is not None else None
        recorder = self.flight_recorder.describe() if self.flight_recorder is not None else None
        if self._steps_started or self.arguments.setup_timeout is None:
            context = TimeoutContext(self.arguments.collective_timeout, "timeout", report, recorder)
        else:
            context = TimeoutContext(self.arguments.process_group_timeout, "setup_timeout", report, recorder)
        torch_errors.explain(exception, context)

    def prepare_process_group(self, backend: str, environ: MutableMapping[str, str]) -> None:
        """Before the process group is created, in each process: on NCCL, with the stall report on, NCCL's flight
        recorder (the variables the user has not set); rank 0 says where its dumps go."""
        if backend == "nccl" and self.stall_watchdog is not None:
            self.flight_recorder = turn_on_flight_recorder(environ)
            self._info(f"lightning-ddp-plus: {self.flight_recorder.describe()}")

    # ------------------------------------------------------------------ results across processes

    def results(self) -> dict[str, Any]:
        """What a worker process found and counted, as plain data for the process that launched it."""
        return {
            "findings": finding_records(self.conflicts.findings),
            "model_fixes": list(self.conflicts.model_fixes),
            "settings": self.settings,
            "sync_stats": dataclasses.asdict(self.window.stats),
            "steps": self.window.steps,
            "telemetry_totals": dataclasses.asdict(self.telemetry.totals) if self.telemetry is not None else None,
            "replica_check_seconds": list(self.replica_guard.check_seconds),
            "hook_calls": self.hooks.counter.calls,
            "bucket_choice": self.buckets.choice if self.buckets is not None else None,
        }

    def apply_results(self, results: dict[str, Any]) -> None:
        self.conflicts.findings = findings_from_records(results["findings"])
        self.conflicts.model_fixes = results["model_fixes"]
        self.settings = results["settings"]
        self.window.steps = results["steps"]
        self.window.stats = SyncStats(**results["sync_stats"])
        if self.telemetry is not None and results["telemetry_totals"] is not None:
            self.telemetry.totals = dataclasses.replace(self.telemetry.totals, **results["telemetry_totals"])
        self.replica_guard.check_seconds = results["replica_check_seconds"]
        self.hooks.counter.calls = results["hook_calls"]
        if self.buckets is not None:
            self.buckets.choice = results["bucket_choice"]
