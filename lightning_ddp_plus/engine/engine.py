"""The engine both front ends share: one object per strategy that owns the components of a DDP run.

- ``AccumulationWindow``: k, where a micro-batch sits, its loss scale, whether its backward syncs;
- ``ConflictCheck``: observe the first training forward, decide at the first backward;
- ``HookAssembly``: the communication hook, its state, wrapper and counter;
- ``ReplicaGuard``: the periodic replica check;
- ``SyncTelemetry``: per-step communication figures;
- ``BucketTuner``: ``bucket_cap_mb="auto"``, timing bucket sizes during the first optimizer steps;
- ``SyncGuard``: after every synced backward, that every rank's reducer all-reduced every bucket;
- ``UnevenInputsCheck``: ranks whose shards hold different numbers of batches;
- ``optimizer_sharding``: the optimizers wrapped in ``ZeroRedundancyOptimizer`` (``shard_optimizers``).

The guard and the uneven-inputs check share one small gloo group (``SideChannel``) and, where they can, the guard's
per-step agreement (a store look-up on gloo).

The Trainer strategy (``strategy.py``) and the Fabric strategy (``fabric.py``) translate their framework's hooks into
the few calls below: ``wrap`` at setup, ``shard_optimizers`` once the optimizers exist, ``batch_starts`` before each
training batch, ``before_backward``/``after_backward`` around each backward, ``after_optimizer_step``, ``teardown``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.config.timeout import format_timeout
from lightning_ddp_plus.conflicts.check import (
    ConflictCheck,
    agree_across_ranks,
    conflict_error,
    explain_torch_error,
    finding_records,
    findings_from_records,
)
from lightning_ddp_plus.conflicts.errors import DDPConflictError
from lightning_ddp_plus.conflicts.facts import ModelFacts, running_stat_buffers
from lightning_ddp_plus.conflicts.rules import DDPView, Finding, evaluate
from lightning_ddp_plus.conflicts.sync_guard import SideChannel, SyncFault, SyncGuard
from lightning_ddp_plus.diagnostics.replicas import ReplicaGuard
from lightning_ddp_plus.diagnostics.telemetry import SyncTelemetry
from lightning_ddp_plus.engine.options import DDPPlusOptions
from lightning_ddp_plus.processes import reachability
from lightning_ddp_plus.sharding import optimizer as sharding
from lightning_ddp_plus.sync.accumulation import AccumulationWindow, SyncStats, scale_gradients
from lightning_ddp_plus.sync.buckets import BucketChoice, BucketTuner
from lightning_ddp_plus.sync.comm_hooks import HookAssembly, HookCallCounter
from lightning_ddp_plus.sync.uneven import RankBatches, UnevenInputsCheck, uneven_flags
from lightning_ddp_plus.sync.wrapper import rebuild_reducer, replay_forward, wrap_module

# Messages of collective timeouts (gloo, NCCL, the c10d store), not of other timeouts such as a DataLoader's.
_COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ ?ms for (recv|send)|Watchdog caught collective operation timeout|"
    r"ran for \d+ milliseconds before timing out|Socket Timeout|wait timeout after \d+ ?ms|"
    r"(gloo|nccl|c10d|ProcessGroup)\S*.*(timed out|timeout)|Application timeout caused pair closure",
    re.IGNORECASE,
)
# A peer's connection ended: that process is gone (an error of its own, a kill) or its node went down.
_PEER_CLOSED = re.compile(r"Connection (closed|reset) by peer|Broken pipe", re.IGNORECASE)


# torch's reducer, inside a backward, when a static graph uses a parameter its first iteration did not.
_GRAPH_GREW = re.compile(r"Your training graph has changed in this iteration")


class DDPPlusEngine:
    """The components of a DDP run and the order in which they act.

    Args:
        options: the validated strategy arguments.
        warn: how warnings reach the user (rank 0 only).
        info: how one-line reports reach the user (rank 0 only).
    """

    def __init__(self, options: DDPPlusOptions, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
        self.options = options
        #: The settings in effect: ``broadcast_buffers="auto"`` decided, and what ``"resolve"`` changed.
        self.settings: DDPSettings = (
            options.settings.resolve_auto(True) if options.settings.broadcast_buffers == "auto" else options.settings
        )
        self.window = AccumulationWindow(options.gradient_accumulation_steps, options.short_window)
        self.conflicts = ConflictCheck(options.checkpointing_conflict, warn=warn, info=info)
        self.hooks = HookAssembly(options.comm_hook, options.comm_state, options.comm_wrapper)
        self.guard = ReplicaGuard(options.verify_replicas_every_n_steps)
        self.channel = SideChannel()
        self.sync_guard = SyncGuard(options.sync_guard, self.channel, warn=warn)
        self.uneven = UnevenInputsCheck(options.uneven_inputs, info=info)
        self._warn, self._info = warn, info
        self.telemetry: SyncTelemetry | None = SyncTelemetry() if options.telemetry else None
        self.buckets: BucketTuner | None = (
            BucketTuner(on_rebuilt=self._reducer_rebuilt, info=info)
            if options.settings.bucket_cap_mb == "auto"
            else None
        )
        self._ddp: DistributedDataParallel | None = None
        #: Called at the start of every training forward, before its sync state is read (Fabric's window uses it).
        self.before_training_forward: Callable[[DistributedDataParallel], None] | None = None
        self._forward_synced = True
        self._handle: Any = None
        self._epoch = 0

    # ------------------------------------------------------------------ setup and teardown

    def wrap(self, module: Module, device_ids: list[int] | None) -> DistributedDataParallel:
        """Wrap ``module`` in ``DistributedDataParallel`` with the settings, and start a fit on it."""
        settings = self.options.settings
        self.settings = settings.resolve_auto(bool(running_stat_buffers(module)))
        ddp = wrap_module(module, self.settings, device_ids)
        self.start_fit(ddp, module)
        return ddp

    def start_fit(self, ddp: DistributedDataParallel, module: Module) -> None:
        """Attach every component to a new wrapper; counters and cadences restart."""
        self.teardown()
        self.window.reset()
        self.uneven.reset()
        self.channel.start(self.options.timeout)
        self.sync_guard.attach(ddp)
        self.hooks.register(ddp)
        self._handle = ddp.register_forward_pre_hook(self._training_forward_starts)
        self.conflicts.attach(ddp, module)
        self.guard.attach(ddp, module, with_buffers=bool(self.settings.broadcast_buffers))
        if self.telemetry is not None:
            self.telemetry.attach(ddp, self.hooks)
        if self.buckets is not None:
            self.buckets.attach()
        self._ddp = ddp

    def _reducer_rebuilt(self, ddp: DistributedDataParallel) -> None:
        if self.telemetry is not None:
            self.telemetry.reducer_rebuilt(ddp)

    def teardown(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.conflicts.detach()
        self.guard.detach()
        self.sync_guard.detach()
        self.channel.stop()
        if self.buckets is not None:
            self.buckets.stop()
        self._ddp = None

    def _training_forward_starts(self, ddp: DistributedDataParallel, args: Any) -> None:
        if ddp.training and torch.is_grad_enabled():
            if self.before_training_forward is not None:
                self.before_training_forward(ddp)
            self._forward_synced = ddp.require_backward_grad_sync

    def shard_optimizers(self, optimizers: list[Optimizer]) -> list[Optimizer]:
        """With ``optimizer_sharding``: each optimizer as a ``ShardedOptimizer`` (ZeRO-1), with the overlap hook
        registered for ``"overlap"``; else the optimizers unchanged."""
        mode = self.options.optimizer_sharding
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

    def view(self) -> DDPView:
        return DDPView(
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
        if not self.conflicts.pending:
            return loss
        view = self.view()
        module = ddp.module
        device = next(module.parameters()).device
        resolved = self.conflicts.decide(loss, view, lambda facts: self._agree(facts, module, device))
        if (resolved.find_unused_parameters, resolved.static_graph) == (view.find_unused_parameters, view.static_graph):
            return loss
        self.settings = dataclasses.replace(
            self.settings, find_unused_parameters=resolved.find_unused_parameters, static_graph=resolved.static_graph
        )
        rebuild_reducer(ddp, resolved.find_unused_parameters, resolved.static_graph)
        return replay_forward(ddp, loss, self._forward_synced, post_forward)

    @staticmethod
    def _agree(facts: ModelFacts, module: Module, device: torch.device) -> ModelFacts:
        return agree_across_ranks(facts, module, device)

    def batch_starts(self, state: RankBatches, epoch: int, folded: bool) -> bool:
        """Before a training batch, on every rank: the uneven-inputs decision. Returns True when this rank must make
        this batch its epoch's last (``uneven_inputs="stop"``); raises ``UnevenInputsError`` (``"error"``).

        ``folded``: this batch ends with exactly one synced backward on every rank (automatic optimization, k=1),
        so its flag can travel in the guard's all-reduce after that backward, and ``after_backward`` decides.
        """
        if not self.channel.open:
            return False
        if self.uneven.mode == "join":
            return self.uneven.join_batch_starts(self.channel.total, self.channel.gather, epoch, self.channel.size)
        if folded and self.sync_guard.active:
            self.uneven.hold(state)
            self._epoch = epoch
            if state.last:
                self.sync_guard.announce()
            return False
        return self.uneven.decide(state, self.channel.maximum(uneven_flags(state.last)), self.channel.gather, epoch)

    def loss_weight(self) -> float:
        """1, or 0 for a padding batch of ``uneven_inputs="join"`` (a rank that ran out repeats its last batch)."""
        return 0.0 if self.uneven.padding else 1.0

    def recovers_from(self, error: BaseException) -> bool:
        """Whether the guard takes over a backward that raised this (a static graph that gained a parameter): the
        front end then calls ``after_backward(..., failed=True)`` instead of re-raising."""
        return self.sync_guard.active and bool(_GRAPH_GREW.search(str(error)))

    def after_backward(self, synced: bool, failed: bool = False) -> bool:
        """After every backward. A synced one is checked by the guard (raises ``DDPConflictError``, or resolves);
        returns True when a held uneven-inputs flag decided that this batch ends the epoch (see ``batch_starts``).
        ``failed``: the backward raised an error that ``recovers_from`` accepted."""
        self.window.record_backward(synced)
        if self.telemetry is not None:
            self.telemetry.after_backward(synced)
        if not synced or self._ddp is None:
            return False
        stop = self._guard_synced_backward(self._ddp, failed) if self.sync_guard.active else False
        if self.uneven.mode == "join":
            scale_gradients(self._ddp.module.parameters(), self.uneven.take_rescale())
        return stop

    def _guard_synced_backward(self, ddp: DistributedDataParallel, failed: bool) -> bool:
        held = self.uneven.take_held()
        step = self.window.stats.optimizer_steps + 1
        flags = uneven_flags(held.last) if held else [0, 0]
        fault, maximums = self.sync_guard.check(ddp, step, flags, aborted=failed)
        if fault is not None:
            self._sync_fault(ddp, fault)
        if held is None:
            return False
        return self.uneven.decide(held, maximums, self.channel.gather, self._epoch)

    def _sync_fault(self, ddp: DistributedDataParallel, fault: SyncFault) -> None:
        """Some rank's reducer did not all-reduce every bucket (now completed on every rank): rule R6."""
        view = self.view()
        facts = ModelFacts(
            observed=True, late_step=fault.step, late_unused_by_rank=fault.unused, late_graph_grew=fault.aborted
        )
        findings = [finding for finding in evaluate(view, facts) if finding.rule.id == "R6"]
        mode = self.options.checkpointing_conflict
        if mode not in ("resolve", "warn"):
            raise conflict_error(
                findings,
                view,
                when=f"at optimizer step {fault.step}, after its backward and before its optimizer step",
                note="Or set `checkpointing_conflict='resolve'` to switch find_unused_parameters on and train on.",
            )
        self.conflicts.findings.append(findings[0])
        self.settings = dataclasses.replace(self.settings, find_unused_parameters=True, static_graph=False)
        rebuild_reducer(ddp, find_unused_parameters=True, static_graph=False)
        self._reducer_rebuilt(ddp)
        if fault.skipped:
            what = (
                "This step's gradients could not be made exact (a backward failed, or bucket views were reduced in "
                "place), so they were dropped on every rank: the optimizer step skips it (the batch is not trained)."
            )
        else:
            what = "This step's gradients were averaged on every rank as find_unused_parameters=True averages them."
        report = self._warn if mode == "warn" else self._info
        report(
            "DDPPlusStrategy resolved [R6] parameters unused on some steps ("
            + ("the graph gained a parameter" if fault.aborted else fault.describe())
            + f") at optimizer step {fault.step} by setting find_unused_parameters: {view.find_unused_parameters} -> "
            "True" + (", static_graph: True -> False" if view.static_graph else "") + f". {what}"
        )

    def after_optimizer_step(self) -> int:
        step = self.window.record_optimizer_step()
        if self.telemetry is not None:
            self.telemetry.end_step(step)
        self.guard.step_done(step)
        if self.buckets is not None and self._ddp is not None:
            self.buckets.step_done(self._ddp)
        return step

    def end_of_training(self) -> None:
        # A check due after the last step: no forward follows, so parameters only (buffers are not broadcast yet).
        self.guard.check_due(with_buffers=False)

    # ------------------------------------------------------------------ reporting

    @property
    def sync_stats(self) -> SyncStats:
        return self.window.stats

    def describe(self, backend: str, world_size: int, start_method: str, buckets: int | None) -> str:
        """One compact line with the settings in effect, logged by rank 0 at setup."""
        settings = self.settings
        options = self.options
        auto = "auto->" if options.settings.broadcast_buffers == "auto" else ""
        flags = ", ".join(
            f"{name}={getattr(settings, name)}"
            for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")
        )
        extra = f", extra={settings.extra}" if settings.extra else ""
        bucket_text = f" ({buckets} buckets)" if buckets else ""
        if settings.bucket_cap_mb is None:
            bucket_cap = "25 (torch default, 1 MiB first bucket)"
        else:
            bucket_cap = "auto" if settings.bucket_cap_mb == "auto" else f"{settings.bucket_cap_mb:g}"
        return (
            f"DDPPlusStrategy: backend={backend}, timeout={format_timeout(options.timeout)}, world_size={world_size}, "
            f"start_method={start_method}, bucket_cap_mb={bucket_cap}{bucket_text}, "
            f"broadcast_buffers={auto}{settings.broadcast_buffers}, {flags}, comm_hook={self.hooks.name}, "
            f"accumulation={self.window.steps} (short_window={self.window.short_window}), "
            f"conflict_check={options.checkpointing_conflict}, verify_replicas_every_n_steps={options.verify_replicas_every_n_steps}, "
            f"telemetry={self.telemetry is not None}, resume_from_last={options.resume_from_last}, "
            f"sync_guard={self._guard_description()}, uneven_inputs={options.uneven_inputs}, "
            f"optimizer_sharding={options.optimizer_sharding}{extra}"
        )

    def _guard_description(self) -> str:
        if not self.sync_guard.active:
            return "off"
        return "on (store)" if self.sync_guard.agrees_through_store else "on (all-reduce per step)"

    def explain(self, exception: BaseException) -> None:
        """Append to a torch error which rule it is and the fix, or what a collective timeout means."""
        if isinstance(exception, DDPConflictError) or not exception.args or not isinstance(exception.args[0], str):
            return
        message = exception.args[0]
        diagnose = False
        if _COLLECTIVE_TIMEOUT.search(message):
            note: str | None = (
                f"lightning-ddp-plus: a collective waited longer than the process group's timeout "
                f"({format_timeout(self.options.timeout)}, set by `DDPPlusStrategy(timeout=...)`): another rank is hung, "
                "crashed or much slower, or cut off. Fix: find the rank that stopped (its own error or a stack dump); "
                "raise `timeout` only if that rank is legitimately slow (e.g. data preparation on rank 0)."
            )
            diagnose = True
        elif _PEER_CLOSED.search(message):
            note = (
                "lightning-ddp-plus: a peer closed its connection, so that process ended (an error of its own, a kill "
                "or its node going down); its log holds the cause. This rank stops too, so the job ends."
            )
            diagnose = True
        else:
            note = explain_torch_error(message)
        if note is not None:
            exception.args = (f"{message}\n\n{note}", *exception.args[1:])
        # the probes take up to 2 s, so the note above is in place first, whatever happens to them
        where = reachability.diagnose() if diagnose else None
        if where:
            exception.args = (f"{exception.args[0]}\n{where}", *exception.args[1:])

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
            "replica_check_seconds": list(self.guard.check_seconds),
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
        self.guard.check_seconds = results["replica_check_seconds"]
        self.hooks.counter.calls = results["hook_calls"]
        if self.buckets is not None:
            self.buckets.choice = results["bucket_choice"]


class EngineViews:
    """Read-only views of a front end's ``engine``, the same on the Trainer and the Fabric strategy."""

    engine: DDPPlusEngine

    @property
    def options(self) -> DDPPlusOptions:
        return self.engine.options

    @property
    def settings(self) -> DDPSettings:
        """The DDP settings in effect (``broadcast_buffers="auto"`` decided, ``"resolve"``'s changes applied)."""
        return self.engine.settings

    @property
    def timeout(self) -> timedelta:
        """The collective timeout the process group is created with."""
        return self.engine.options.timeout

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step in effect (with the Trainer: settled with its setting when ``fit`` starts)."""
        return self.engine.window.steps

    @property
    def sync_stats(self) -> SyncStats:
        """Synced and skipped backward passes and optimizer steps on this rank."""
        return self.engine.sync_stats

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
        return self.engine.guard.check_seconds
