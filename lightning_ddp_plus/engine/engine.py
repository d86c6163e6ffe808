"""The engine both front ends share: the components of a DDP run in one ordered list (``StepPipeline``), called in
that order at every point of a fit, and the actions the front ends call: ``wrap``, ``shard_optimizers``,
``batch_starts``, ``backward``, ``run_chunks``, ``step_done``, ``end_of_epoch``, ``end_of_training`` and
``teardown``; ``components.py`` builds the components, with what a front end reads of them and asks of them outside
the step (collectives in the ledger, a save's phase, the window's position, clipping, the notices)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.conflicts.check import recovers_in_backward
from lightning_ddp_plus.engine.arguments import DDPPlusArguments
from lightning_ddp_plus.engine.components import EngineComponents
from lightning_ddp_plus.pipeline.component import (
    AgreedStep,
    BackwardEnd,
    BackwardStart,
    EpochEnd,
    FitStart,
    ForwardStart,
    StepPipeline,
)
from lightning_ddp_plus.sync.accumulation import WindowPosition
from lightning_ddp_plus.sync.step_agreement import StepAgreed
from lightning_ddp_plus.sync.uneven import RankBatches
from lightning_ddp_plus.sync.wrapper import wrap_module


@dataclass
class BackwardRun:
    """One backward through the engine (``with engine.backward(...) as backward``): the front end runs its backward on
    ``loss`` inside the block and keeps what it returned in ``result``; after the block, ``agreed`` is what the ranks
    agreed after it (``synced``: whether this backward all-reduces)."""

    loss: Tensor
    synced: bool
    result: Any = None
    agreed: StepAgreed | None = None

    @property
    def ends_epoch(self) -> bool:
        """A held uneven-inputs flag decided that this batch ends the epoch on every rank."""
        return self.agreed is not None and self.agreed.ends_epoch


class DDPPlusEngine(EngineComponents):
    """One DDP run for the validated ``arguments``: its components (``EngineComponents``, each an attribute) in the
    pipeline's order, and the step's walk; ``warn`` and ``info`` are how warnings and one-line reports reach the
    user (rank 0 only)."""

    def __init__(self, arguments: DDPPlusArguments, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
        super().__init__(arguments, warn, info, engine=self)
        # The order of a step, written once: each point of a fit calls these in this order (the end of a fit in the
        # reverse one). A feature is one line here (``docs/development.md``).
        self.pipeline = StepPipeline(
            [
                self.timeouts.switching,  # setup_timeout: the group's until the first training forward
                self.window,  # the accumulation window: backwards and steps counted
                self.ledger,  # the phase and step this rank is in (stall reports, straggler timing)
                self.channel,  # the side channel the agreement runs on: opened first, closed last
                self.stall_watchdog,  # a stuck or out-of-step rank named with its line
                self.sync_guard,  # the per-step guard: every bucket all-reduced on every rank
                self.sharding,  # optimizer_sharding=True on gloo: the reduce-scatter's own group
                self.hooks,  # the communication hook, on every backend
                self.buffer_broadcast,  # DDP's buffer broadcast, in the ledger
                self.conflicts,  # the conflict check: observes the first training forward
                self.left_out,  # parameters DDP left out (frozen at the wrap), averaged once unfrozen
                self.items,  # per-item averaging: the window's items divide its gradient
                self.uneven,  # uneven inputs: a held flag in the agreement, "join"'s rescale
                self.chunks,  # chunks: the out-of-memory flag in the agreement
                self.chunk_runner,  # a batch's chunks: the buffers it changes, learnt per fit
                self.preemption,  # a termination notice: the stop flag and the decision
                self.stragglers,  # phase medians compared every N steps
                self.replica_guard.on,  # replicas compared every N steps, and at the end of training
                self.telemetry,  # per-step sync figures
                self.buckets,  # bucket_cap_mb="auto": sizes timed, the fastest kept
            ]
        )
        #: Called at the start of every training forward, before its sync state is read (Fabric's window uses it).
        self.before_training_forward: Callable[[DistributedDataParallel], None] | None = None
        self.ddp: DistributedDataParallel | None = None
        self.forward_synced, self.failed = True, False  # the last training forward synced; the fit failed
        self.gradient_bytes = 0  # what a synced backward sends
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ a fit

    def wrap(self, module: Module, device_ids: list[int] | None) -> DistributedDataParallel:
        """Wrap ``module`` in ``DistributedDataParallel`` with the settings, and start a fit on it."""
        settings = self.in_effect.for_module(module)
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        self.ledger.follow_device(next(module.parameters()).device)  # on CUDA, records end when the stream's work does
        ddp = wrap_module(module, settings, device_ids)
        self.start_fit(ddp, module)
        return ddp

    def start_fit(self, ddp: DistributedDataParallel, module: Module) -> None:
        """Attach every component to a new wrapper; counters and cadences restart."""
        self.teardown()
        self.failed = False
        self.pipeline.fit_starts(
            FitStart(ddp=ddp, module=module, broadcast_buffers=bool(self.settings.broadcast_buffers))
        )
        self._handles = [ddp.register_forward_pre_hook(self._forward_starts)]
        self.ddp = self.agreement.ddp = ddp

    def teardown(self) -> None:
        """The fit ends: every component detached, in the reverse order (nothing to end before a fit started)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.ddp is not None:
            self.pipeline.fit_ends(self.failed)
        self.ddp = self.agreement.ddp = None

    def _forward_starts(self, ddp: DistributedDataParallel, args: Any) -> None:
        # as DDP tells it, by grad mode: Lightning's validation leaves the wrapper in eval mode (it gives the
        # train mode back to the LightningModule only), so `ddp.training` says nothing after one
        training = torch.is_grad_enabled()
        if training and self.before_training_forward is not None:
            self.before_training_forward(ddp)
        if training:
            self.pipeline.count_step()  # the loop counted the last step: its collectives run
            self.forward_synced = ddp.require_backward_grad_sync
        self.pipeline.forward_starts(ForwardStart(ddp=ddp, training=training, step=self.window.stats.optimizer_steps))

    # ------------------------------------------------------------------ a step

    def shard_optimizers(self, optimizers: list[Optimizer], clipping: str | None, precision: Any) -> list[Optimizer]:
        """With ``optimizer_sharding``: each optimizer sharded (ZeRO-1); see ``ZeroSharding.shard``. The precision's
        gradient scaler is noted for per-item averaging (``ItemAveraging.uses_gradient_scaler``)."""
        self.items.uses_gradient_scaler(getattr(precision, "scaler", None) is not None)
        return self.sharding.shard(optimizers, self.ddp, self.settings.static_graph, clipping, precision)

    def batch_starts(self, state: RankBatches, epoch: int, one_synced: bool, loaders: Callable[[], Any] | None) -> bool:
        """Before a training batch, on every rank: ``uneven_inputs`` decides whether this batch must be this rank's
        epoch's last (``loaders()``: the epoch's training loaders, asked once per epoch; even shards compare nothing)."""
        if loaders is not None and self.uneven.even_by_construction(epoch, loaders):
            return False
        return self.agreement.batch_starts(state, epoch, one_synced)

    @contextmanager
    def backward(
        self,
        ddp: DistributedDataParallel,
        loss: Tensor,
        position: WindowPosition,
        synced: bool,
        *,
        divided_by_steps: bool,
        post_forward: bool,
        last_chunk: bool = True,
    ) -> Iterator[BackwardRun]:
        """The backward of ``loss`` at ``position`` of the window, as a ``with`` block: the front end runs its own
        backward on ``backward.loss`` inside it (in its own frame: the engine calls nothing of the front end's), and
        reads ``backward.agreed`` after it (``divided_by_steps``: Lightning already divided the loss by k;
        ``post_forward``: DDP's forward had finished, not so in Lightning's manual optimization; ``last_chunk``: no
        chunk of the batch follows). A backward that raised what the per-step guard takes over is completed by the
        guard: the block's error ends there."""
        closes = synced and last_chunk and position.closes_window
        self.pipeline.before_backward(
            BackwardStart(ddp=ddp, loss=loss, synced=synced, forward_synced=self.forward_synced, closes_window=closes)
        )
        decided = (
            self.in_effect.at_first_backward(
                self.conflicts, ddp, loss, self.window.steps, self.forward_synced, post_forward
            )
            if self.conflicts.pending
            else loss
        )
        assert decided is not None
        scaled = self.scaled_loss(ddp, decided, position, divided_by_steps, closes)
        backward, failed = BackwardRun(loss=scaled, synced=synced, result=scaled), False
        try:
            # with the loss divided by k, Lightning's loop called the backward: the user's line would be trainer.fit
            with self.in_ledger(synced, users_call=not divided_by_steps):
                yield backward
        except RuntimeError as error:
            if not (synced and self.sync_guard.active and recovers_in_backward(error)):
                raise
            failed = True
        self.pipeline.after_backward(BackwardEnd(ddp=ddp, synced=synced, failed=failed))
        if not synced:
            backward.agreed = StepAgreed(flags=self.pipeline.flags.zeros())
            return
        agreed = self.agreement.after_synced_backward(ddp, failed)
        step = self.window.stats.optimizer_steps + 1
        oom, skipped = bool(agreed.out_of_memory), agreed.skipped
        self.pipeline.agreed(AgreedStep(flags=agreed.flags, step=step, out_of_memory=oom, skipped=skipped))
        backward.agreed = agreed

    def scaled_loss(
        self, ddp: DistributedDataParallel, loss: Tensor, position: WindowPosition, divided_by_steps: bool, closes: bool
    ) -> Tensor:
        """The loss a backward runs on: the window's scale, or with ``num_items`` the items' (the window's end divides
        by its items, ``sync.item_averaging``); a padding batch (``uneven_inputs="join"``) counts 0."""
        padding, count = self.uneven.padding, self.items.take()
        if count is None:
            if closes:  # the others' counts may be all-reduced before this backward: joined, with none
                self.items.closing_without_counts(ddp)
            scale: Tensor | float = self.window.loss_scale(position, divided_by_steps) * (0.0 if padding else 1.0)
        else:
            undo, count = (self.window.steps if divided_by_steps else 1), (0 if padding else count)
            self.items.recorded(count, loss * undo)
            if closes:
                self.items.before_closing_backward(
                    [p for p in ddp.module.parameters() if p.requires_grad], ddp.process_group
                )
            scale = undo * self.items.loss_factor(count)
        return loss * scale if not isinstance(scale, float) or scale != 1.0 else loss

    def in_ledger(self, synced: bool, users_call: bool) -> Any:
        """Around a backward: a synced one is the gradient all-reduce of its step, in the ledger (``users_call``: the
        user called the backward, as ``manual_backward`` or ``fabric.backward``, so the user's line is named)."""
        if not synced:
            return nullcontext()
        # the backward computes inside the block too: the clock is switched to waiting when the gradients are computed
        return self.ledger.collective("gradient all_reduce", self.gradient_bytes, users_call=users_call, waits=False)

    @property
    def optimizer_steps(self) -> int:
        """The optimizer steps this rank applied in this fit."""
        return self.window.stats.optimizer_steps

    def step_done(self) -> int:
        """After every optimizer step, on every rank: returns the steps applied in this fit. No collective runs
        before the loop counts the step (``StepPipeline.count_step``, at the next training forward or epoch end)."""
        step = self.window.record_optimizer_step()
        self.pipeline.step_done(step)
        return step

    def end_of_epoch(self) -> None:  # the steps since the last straggler comparison, on every rank (a collective)
        self.pipeline.epoch_ends(EpochEnd(step=self.window.stats.optimizer_steps))

    def end_of_training(self) -> None:
        self.pipeline.epoch_ends(EpochEnd(step=self.window.stats.optimizer_steps, training_ends=True))

    def decide_pending_conflicts(self, ddp: DistributedDataParallel) -> None:  # the agreement asks it of a failed rank
        if self.conflicts.pending:  # the others' first backward decides the conflict check with a collective
            self.in_effect.at_first_backward(self.conflicts, ddp, None, self.window.steps, self.forward_synced, True)
