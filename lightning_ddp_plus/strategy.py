"""``DDPPlusStrategy``: Lightning's ``DDPStrategy`` with every DDP knob typed, validated and settable from YAML."""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
import re
import time
import weakref
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.overrides.distributed import _sync_module_states, prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel.distributed import DistributedDataParallel, _DDPSink
from typing_extensions import override

import lightning.pytorch as pl
from lightning_ddp_plus._messages import describe_bad_value
from lightning_ddp_plus.accumulation import (
    SHORT_WINDOW_MODES,
    ShortWindow,
    SyncStats,
    WindowPosition,
    check_accumulation_steps,
    loss_scale,
    merge_accumulation_settings,
    window_position,
)
from lightning_ddp_plus.backend import normalize_backend, resolve_backend_for_device
from lightning_ddp_plus.errors import DDPConflictError
from lightning_ddp_plus.launcher import KillChildrenOnFailureLauncher, watch_parent
from lightning_ddp_plus.facts import ForwardProbe, ModelFacts, running_stat_buffers
from lightning_ddp_plus.replicas import verify_replicas
from lightning_ddp_plus.telemetry import DDPTelemetry, SyncTelemetry
from lightning_ddp_plus.rules import DDPView, Finding, evaluate, resolved_view, rule_for_torch_error
from lightning_ddp_plus.comm_hooks import CommHook, HookCallCounter, HookFunction, counted_hook, parse_comm_hook
from lightning_ddp_plus.settings import DDPSettings
from lightning_ddp_plus.timeout import DEFAULT_TIMEOUT, TimeoutLike, format_timeout, parse_timeout

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
ConflictMode = Literal["error", "warn", "resolve", "off"]
_CONFLICT_MODES = ("error", "warn", "resolve", "off")
_START_METHODS = ("popen", "spawn", "fork", "forkserver")

#: Registered names and their launchers, mirroring Lightning's ``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``.
REGISTERED_NAMES: tuple[tuple[str, StartMethod], ...] = (
    ("ddp_plus", "popen"),
    ("ddp_plus_spawn", "spawn"),
    ("ddp_plus_fork", "fork"),
    ("ddp_plus_notebook", "fork"),
)


class DDPPlusStrategy(DDPStrategy):
    """Multi-process data-parallel training with every DDP knob as an explicit, typed, validated argument.

    Bad values fail here, at construction, or (where the device matters) when the ``Trainer`` is built, always before
    any process is started.

    Args:
        accelerator: set by the ``Trainer``.
        parallel_devices: set by the ``Trainer``.
        cluster_environment: set by the ``Trainer`` unless given.
        checkpoint_io: checkpoint plugin, as in ``DDPStrategy``.
        precision_plugin: set by the ``Trainer`` unless given.
        process_group_backend: ``"nccl"``, ``"gloo"``, ``"mpi"``, ``"ucc"``, ``"xccl"``, ``"hccl"``, ``"cncl"``, or
            ``None``/``"auto"`` to follow the accelerator (cuda->nccl, cpu->gloo, xpu->xccl, hpu->hccl, mlu->cncl).
        timeout: how long a collective may wait before the job fails: seconds, a ``timedelta``, ``"90s"``, ``"30m"``,
            ``"2h"``, ``"1h30m"``, ``"1d"``, ``"0:30:00"`` or ``"1 day, 0:00:00"``. Default 30 minutes.
        find_unused_parameters: let DDP find parameters that get no gradient in an iteration.
        bucket_cap_mb: size of the gradient buckets in MiB.
        broadcast_buffers: keep buffers (e.g. BatchNorm statistics) equal to rank 0's at every forward. ``"auto"``:
            on when the model has buffers that training changes (BatchNorm-style running statistics), off otherwise.
        static_graph: promise DDP that the graph and the set of used parameters never change.
        gradient_as_bucket_view: make gradients views into the communication buckets (saves memory).
        ddp_comm_hook: ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"batched_powersgd"``, a dotted import path to a hook
            function, or a callable ``hook(state, bucket)``. Registered on every backend, gloo included.
        ddp_comm_state: state passed to the hook; PowerSGD gets a default state when this is ``None``.
        ddp_comm_wrapper: wrapper applied to the hook, e.g. torch's ``fp16_compress_wrapper``.
        model_averaging_period: period of model averaging for post-local SGD, as in ``DDPStrategy``.
        gradient_accumulation_steps: micro-batches per optimizer step; the gradient all-reduce runs only on the
            last one of each window, in automatic and manual optimization. The same as
            ``Trainer(accumulate_grad_batches=...)``: set either (they must agree if both are set).
        checkpointing_conflict: what to do when the DDP settings conflict with the model (gradient checkpointing,
            reused or unused parameters; see the README's rule table). The model is observed during the first
            training forward, before DDP wraps it: ``"error"`` (default) raises ``DDPConflictError`` before any
            gradient is all-reduced or any optimizer step runs; ``"warn"`` warns once per rule and carries on;
            ``"resolve"`` changes the settings to a working combination and logs what changed; ``"off"`` wraps the
            model at setup as stock Lightning does and checks nothing.
        verify_replicas_every_n_steps: every N optimizer steps, check that all ranks hold identical parameters (and
            buffers, when ``broadcast_buffers`` is on) by exchanging per-tensor fingerprints; a mismatch stops
            training with ``ReplicaDriftError`` naming the tensor, the ranks and the step. ``None`` (default): off.
        telemetry: record, per optimizer step, buckets all-reduced, bytes sent, synced and skipped backward passes
            and the wait for communication, logged under ``ddp/`` (adds the ``DDPTelemetry`` callback).
        short_window: how the short last window of an epoch is averaged. ``"mean"`` (default): the mean over the
            micro-batches it really had. ``"lightning"``: Lightning's rule, the sum divided by k.
        start_method: how processes are started: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"``,
            ``"forkserver"``.
        **kwargs: further ``DistributedDataParallel`` arguments, checked against its signature.

    Example:
        >>> import lightning_ddp_plus
        >>> strategy = lightning_ddp_plus.DDPPlusStrategy(process_group_backend="gloo", timeout="1h30m")
        >>> strategy.timeout
        datetime.timedelta(seconds=5400)
    """

    strategy_name = "ddp_plus"

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[TimeoutLike] = DEFAULT_TIMEOUT,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float = 25,
        broadcast_buffers: Union[bool, Literal["auto"]] = True,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        ddp_comm_hook: Union[str, Callable, None] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        model_averaging_period: Optional[int] = None,
        gradient_accumulation_steps: Optional[int] = None,
        short_window: ShortWindow = "mean",
        checkpointing_conflict: ConflictMode = "error",
        verify_replicas_every_n_steps: Optional[int] = None,
        telemetry: bool = False,
        start_method: StartMethod = "popen",
        **kwargs: Any,
    ) -> None:
        settings = DDPSettings(
            find_unused_parameters=find_unused_parameters,
            bucket_cap_mb=bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            extra=dict(kwargs),
        )
        requested_backend = normalize_backend(process_group_backend)
        parsed_timeout = parse_timeout(timeout)
        comm_hook = parse_comm_hook(ddp_comm_hook)
        accumulation_steps = check_accumulation_steps(gradient_accumulation_steps)
        if verify_replicas_every_n_steps is not None and (
            isinstance(verify_replicas_every_n_steps, bool) or not isinstance(verify_replicas_every_n_steps, int) or verify_replicas_every_n_steps < 1
        ):
            raise ValueError(
                describe_bad_value("verify_replicas_every_n_steps", verify_replicas_every_n_steps, "expected a positive integer or None (off).", "set e.g. `verify_replicas_every_n_steps=100`.")
            )
        if not isinstance(telemetry, bool):
            raise TypeError(describe_bad_value("telemetry", telemetry, "expected True or False.", "write `telemetry=True`."))
        if checkpointing_conflict not in _CONFLICT_MODES:
            raise ValueError(
                describe_bad_value("checkpointing_conflict", checkpointing_conflict, f"allowed: {', '.join(_CONFLICT_MODES)}.", "use 'error' (default), 'warn', 'resolve' or 'off'.")
            )
        if short_window not in SHORT_WINDOW_MODES:
            raise ValueError(
                describe_bad_value("short_window", short_window, f"allowed: {', '.join(SHORT_WINDOW_MODES)}.", "use 'mean' (average over the micro-batches the window had) or 'lightning' (divide by k).")
            )
        if start_method not in _START_METHODS:
            raise ValueError(
                describe_bad_value("start_method", start_method, f"allowed: {', '.join(_START_METHODS)}.", "use 'popen' for scripts and CLIs, 'spawn' inside notebooks or tests.")
            )
        if model_averaging_period is not None and (isinstance(model_averaging_period, bool) or not isinstance(model_averaging_period, int) or model_averaging_period < 1):
            raise ValueError(describe_bad_value("model_averaging_period", model_averaging_period, "expected a positive integer or None.", "set e.g. `model_averaging_period=4`."))
        if ddp_comm_wrapper is not None and comm_hook is None:
            raise ValueError(describe_bad_value("ddp_comm_wrapper", ddp_comm_wrapper, "a wrapper needs a hook to wrap, and `ddp_comm_hook` is None.", "set `ddp_comm_hook` too, or remove the wrapper."))
        if ddp_comm_wrapper is not None and not callable(ddp_comm_wrapper):
            raise TypeError(describe_bad_value("ddp_comm_wrapper", ddp_comm_wrapper, "expected a callable that wraps a hook.", "pass e.g. torch's `fp16_compress_wrapper`."))

        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=None,  # registered by ``_register_ddp_hooks`` below on every backend
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=requested_backend,
            timeout=parsed_timeout,
            start_method=start_method,
            **settings.resolve_auto(True).to_ddp_kwargs(),  # placeholder until the model is known
        )
        self.settings = settings
        self._requested_backend = requested_backend
        self._comm_hook: Union[CommHook, HookFunction, None] = comm_hook
        #: Calls of the registered communication hook (one per gradient bucket all-reduced) on this rank.
        self.comm_hook_counter = HookCallCounter()
        self._accumulation_setting = accumulation_steps
        #: Micro-batches per optimizer step in effect (resolved with the Trainer's setting when fitting starts).
        self.gradient_accumulation_steps = accumulation_steps or 1
        self._short_window: ShortWindow = short_window
        #: Synced and skipped backward passes and optimizer steps on this rank.
        self.sync_stats = SyncStats()
        self._synced_backward_seen = False
        self._backward_syncs = True
        self._warned_unsynced_step = False
        self._conflict_mode: ConflictMode = checkpointing_conflict
        self._ddp_deferred = False
        self._probe: Optional[ForwardProbe] = None
        #: What the conflict check found at the first training forward (empty before, or with ``"off"``).
        self.findings: list[Finding] = []
        self._buffers_auto = broadcast_buffers == "auto"
        self._verify_every = verify_replicas_every_n_steps
        self._replica_check_step: Optional[int] = None
        self._replica_hook: Optional[Any] = None
        #: Seconds each replica check took on this rank.
        self.replica_check_seconds: list[float] = []
        #: Per-step communication figures when ``telemetry=True``, else ``None``.
        self.telemetry: Optional[SyncTelemetry] = SyncTelemetry() if telemetry else None

    @property
    def timeout(self) -> timedelta:
        """The collective timeout the process group is created with."""
        assert self._timeout is not None
        return self._timeout

    @property
    def comm_hook(self) -> Union[CommHook, HookFunction, None]:
        return self._comm_hook

    @property
    def start_method(self) -> str:
        return self._start_method

    def _device_type(self) -> str:
        if self.parallel_devices:
            return self.parallel_devices[0].type
        return self.root_device.type

    @override
    def _configure_launcher(self) -> None:
        # The Trainer calls this once it has chosen the accelerator and devices, before anything is launched: the
        # earliest moment at which device-dependent settings can be judged.
        self._process_group_backend = resolve_backend_for_device(self._requested_backend, self._device_type())
        merge_accumulation_settings(self._accumulation_setting, _accumulate_grad_batches_of_trainer_being_built())
        super()._configure_launcher()
        if self._start_method == "popen":
            assert self.cluster_environment is not None
            self._launcher = KillChildrenOnFailureLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        watch_parent()
        super().setup_environment()
        # Lightning destroys only NCCL process groups at exit; a gloo group left to the interpreter's shutdown can
        # abort the process ("terminate called without an active exception") and turn a finished run into a failure.
        atexit.register(_destroy_dist_connection)

    @override
    def connect(self, model: "pl.LightningModule") -> None:
        super().connect(model)
        trainer = model._trainer
        if trainer is None:
            return
        steps = merge_accumulation_settings(self._accumulation_setting, trainer.accumulate_grad_batches)
        self._accumulation_setting = self.gradient_accumulation_steps = steps
        # The loop accumulates in automatic optimization; in manual optimization Lightning refuses
        # accumulate_grad_batches != 1 and the strategy does the accumulation itself.
        trainer.accumulate_grad_batches = steps if model.automatic_optimization else 1

    def _window_position(self) -> WindowPosition:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        batch_number = max(1, trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        return window_position(batch_number, self.gradient_accumulation_steps, trainer.num_training_batches)

    @property
    def sync_gradients(self) -> bool:
        """True while training on the micro-batch that closes an accumulation window: its backward all-reduces,
        and in manual optimization it is the one after which to call ``optimizer.step()``."""
        if self.gradient_accumulation_steps == 1 or self.lightning_module is None:
            return True
        return self._window_position().closes_window

    def _must_sync_first_backward(self) -> bool:
        # torch's reducer asserts (expect_autograd_hooks_) when the very first backward of a static graph runs under
        # no_sync (R3). So the first micro-batch all-reduces too; averaging is linear and that gradient is already
        # identical on every rank, so the window's result stays exact, at the cost of one extra all-reduce per run.
        return self.settings.static_graph and not self._synced_backward_seen

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator:
        if self._must_sync_first_backward():
            yield None
            return
        with super().block_backward_sync():
            yield None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if not self._ddp_deferred:
            return super().training_step(*args, **kwargs)
        assert self.lightning_module is not None
        self._probe = ForwardProbe(self.lightning_module).__enter__()
        try:
            with self.precision_plugin.train_step_context():
                return self.lightning_module.training_step(*args, **kwargs)
        finally:
            self._probe.stop()

    def _check_conflicts(self, loss: Tensor) -> None:
        """Evaluate the rules on the observed facts and act on them as ``checkpointing_conflict`` says."""
        assert self._probe is not None
        self._probe.stop()
        facts = self._agree_across_ranks(self._probe.facts(loss))
        view = DDPView(
            find_unused_parameters=self.settings.find_unused_parameters,
            static_graph=self.settings.static_graph,
            broadcast_buffers=self.settings.broadcast_buffers,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )
        self.findings = evaluate(view, facts)
        errors = [finding for finding in self.findings if finding.rule.level == "error"]
        for finding in self.findings:
            if finding.rule.level == "advice" or self._conflict_mode == "warn":
                rank_zero_warn(f"DDPPlusStrategy: {finding}")
        if not errors or self._conflict_mode == "warn":
            return
        if self._conflict_mode == "error":
            settings = ", ".join(f"{name}={getattr(view, name)}" for name in ("find_unused_parameters", "static_graph"))
            raise DDPConflictError(
                "DDPPlusStrategy found DDP settings that torch's reducer cannot train this model with (checked at the "
                "first training forward, before any gradient was all-reduced and before any optimizer step):\n"
                + "\n".join(f"  {finding}" for finding in errors)
                + f"\nSettings: {settings}. Or set `checkpointing_conflict='resolve'` to let the strategy change them.",
                errors,
            )
        resolved = resolved_view(view, errors)
        changed = {name: value for name, value in resolved.__dict__.items() if getattr(view, name) != value}
        self.settings = dataclasses.replace(self.settings, **{k: v for k, v in changed.items() if hasattr(self.settings, k)})
        reasons = "; ".join(f"[{finding.rule.id}] {finding.rule.title}" for finding in errors)
        changes = ", ".join(f"{name}: {getattr(view, name)} -> {value}" for name, value in changed.items())
        rank_zero_info(f"DDPPlusStrategy resolved conflicts ({reasons}) by setting {changes}.")

    def _agree_across_ranks(self, facts: ModelFacts) -> ModelFacts:
        # Every rank must take the same decision (raise, or wrap with the same settings), so facts are OR-ed.
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return facts
        assert self.lightning_module is not None
        params = [name for name, _ in self.lightning_module.named_parameters()]
        buffers = [name for name, _ in self.lightning_module.named_buffers()]
        kinds = sorted({"reentrant", "non_reentrant"})
        unused = set(facts.unused_parameters or ())
        flags = (
            [kind in facts.checkpointing for kind in kinds]
            + [name in facts.reused_in_checkpoint for name in params]
            + [name in unused for name in params]
            + [name in facts.mutable_buffers for name in buffers]
        )
        vector = torch.tensor(flags, dtype=torch.int32, device=self.root_device)
        torch.distributed.all_reduce(vector, op=torch.distributed.ReduceOp.MAX)
        agreed = vector.bool().tolist()
        n = len(params)
        return ModelFacts(
            checkpointing=frozenset(kind for kind, on in zip(kinds, agreed[:2]) if on),
            checkpoint_sources=facts.checkpoint_sources,
            reused_in_checkpoint=tuple(name for name, on in zip(params, agreed[2 : 2 + n]) if on),
            unused_parameters=tuple(name for name, on in zip(params, agreed[2 + n : 2 + 2 * n]) if on),
            mutable_buffers=tuple(name for name, on in zip(buffers, agreed[2 + 2 * n :]) if on),
        )

    def _first_backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """The first backward of a fit with the conflict check on: check, wrap with the final settings, and run the
        backward through the new DDP wrapper (whose forward the probe step bypassed)."""
        lightning_module = self.lightning_module
        assert lightning_module is not None
        self._check_conflicts(closure_loss)
        self._wrap_deferred_model()
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        steps = self.gradient_accumulation_steps
        position = self._window_position()
        scale = loss_scale(position, steps, self._short_window, lightning_module.automatic_optimization) if steps > 1 else 1.0
        if scale != 1.0:
            closure_loss = closure_loss * scale
        syncs = steps == 1 or position.closes_window or self._must_sync_first_backward()
        self._backward_syncs = syncs
        if syncs:
            prepare_for_backward(model, closure_loss)
            if model.static_graph:
                # DDP's forward (which the probe step bypassed) routes a static graph's first output through
                # _DDPSink, whose backward queues the reducer's delayed all-reduce; do the same.
                closure_loss = _DDPSink.apply(weakref.ref(model), closure_loss)[0]
                self._pl_static_graph_delay_done = True
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lightning_module)
        with self._counting_bytes(syncs):
            self.precision_plugin.backward(closure_loss, lightning_module, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, lightning_module)
        self._count_backward(syncs)
        return closure_loss

    def _counting_bytes(self, syncs: bool) -> Any:
        return self.telemetry.counting_bytes() if self.telemetry is not None and syncs else nullcontext()

    def _count_backward(self, syncs: bool) -> None:
        if self.telemetry is not None:
            self.telemetry.count_backward(syncs)
        if syncs:
            self.sync_stats.synced_backwards += 1
            self._synced_backward_seen = True
        else:
            self.sync_stats.skipped_backwards += 1

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._ddp_deferred:
            return self._first_backward(closure_loss, optimizer, *args, **kwargs)
        model = self.model
        if not isinstance(model, DistributedDataParallel):
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        automatic = self.lightning_module.automatic_optimization
        steps = self.gradient_accumulation_steps
        if steps > 1:
            position = self._window_position()
            scale = loss_scale(position, steps, self._short_window, automatic)
            if scale != 1.0:
                closure_loss = closure_loss * scale
            # Automatic: the loop has already entered no_sync for micro-batches that do not close a window.
            syncs = model.require_backward_grad_sync if automatic else (position.closes_window or self._must_sync_first_backward())
        else:
            syncs = model.require_backward_grad_sync or not automatic
        self._backward_syncs = syncs
        if not syncs:
            model.require_backward_grad_sync = False
        try:
            with self._counting_bytes(syncs):
                closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            if not automatic:
                model.require_backward_grad_sync = True
        self._count_backward(syncs)
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # Lightning's manual static-graph flush must only follow a backward that all-reduced.
        if self._backward_syncs:
            super().post_backward(closure_loss)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Optional[Union["pl.LightningModule", Module]] = None, **kwargs: Any) -> Any:
        lightning_module = self.lightning_module
        if (
            lightning_module is not None
            and not lightning_module.automatic_optimization
            and not self.sync_gradients
            and not self._warned_unsynced_step
        ):
            self._warned_unsynced_step = True
            rank_zero_warn(
                f"optimizer.step() was called on a micro-batch that does not close its accumulation window "
                f"(gradient_accumulation_steps={self.gradient_accumulation_steps}): its gradients were not all-reduced, "
                "so replicas will diverge. Fix: call it only when `self.trainer.strategy.sync_gradients` is True."
            )
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.sync_stats.optimizer_steps += 1
        if self.telemetry is not None:
            self.telemetry.end_step(self.sync_stats.optimizer_steps)
        if self._verify_every is not None and self.sync_stats.optimizer_steps % self._verify_every == 0:
            self._replica_check_step = self.sync_stats.optimizer_steps
        if lightning_module is not None:
            trainer = lightning_module.trainer
            if self.sync_stats.optimizer_steps % max(1, trainer.log_every_n_steps) == 0:
                self._log_sync_stats(trainer)
        return output

    def _log_sync_stats(self, trainer: "pl.Trainer") -> None:
        for logger in trainer.loggers:
            logger.log_metrics(self.sync_stats.as_metrics(), step=trainer.global_step)

    def _replica_tensors(self, with_buffers: bool) -> list[tuple[str, Tensor]]:
        assert self.lightning_module is not None
        tensors = list(self.lightning_module.named_parameters())
        if with_buffers and self.settings.broadcast_buffers:
            tensors += list(self.lightning_module.named_buffers())
        return tensors

    def _verify_pending(self, with_buffers: bool) -> None:
        step, self._replica_check_step = self._replica_check_step, None
        if step is None or not torch.distributed.is_initialized():
            return
        started = time.perf_counter()
        verify_replicas(self._replica_tensors(with_buffers), step)
        self.replica_check_seconds.append(time.perf_counter() - started)

    def _verify_before_forward(self, module: Module, args: Any) -> None:
        if module.training:
            self._verify_pending(with_buffers=True)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if self.telemetry is not None and not any(isinstance(c, DDPTelemetry) for c in trainer.callbacks):
            trainer.callbacks.append(DDPTelemetry())

    @override
    def on_train_end(self) -> None:
        # A check due after the last step: no forward follows, so parameters only (buffers are not broadcast yet).
        self._verify_pending(with_buffers=False)
        super().on_train_end()
        if self.lightning_module is not None:
            self._log_sync_stats(self.lightning_module.trainer)

    @override
    def _get_process_group_backend(self) -> str:
        return resolve_backend_for_device(self._requested_backend, self.root_device.type)

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        self._ddp_kwargs = self.settings.to_ddp_kwargs()
        if self._ddp_deferred:
            # Parameters and buffers were broadcast at setup; touching them again now would modify, in place,
            # tensors the first forward's autograd graph has saved.
            self._ddp_kwargs["init_sync"] = False
            return super()._setup_model(model)
        with self._keep_local_buffers(model):
            return super()._setup_model(model)

    @contextmanager
    def _keep_local_buffers(self, model: Module) -> Generator:
        # torch 2.13 always broadcasts buffers when wrapping once `forward_sync_buffers` is used; the old
        # `broadcast_buffers=False` kept them rank-local, so put each rank's own values back.
        local_buffers = None if self.settings.broadcast_buffers else [buffer.detach().clone() for buffer in model.buffers()]
        yield None
        if local_buffers is not None:
            with torch.no_grad():
                for buffer, local in zip(model.buffers(), local_buffers):
                    buffer.copy_(local)

    @override
    def _register_ddp_hooks(self) -> None:
        if self._comm_hook is None and self.telemetry is None:
            return
        assert isinstance(self.model, DistributedDataParallel)
        if self._comm_hook is None:
            # Telemetry needs a Python hook to see the buckets; torch's plain all-reduce is what DDP does anyway.
            hook, state = default_hooks.allreduce_hook, None
        elif isinstance(self._comm_hook, CommHook):
            hook = self._comm_hook.function
            state = self._ddp_comm_state if self._ddp_comm_state is not None else self._comm_hook.default_state()
        else:
            hook, state = self._comm_hook, self._ddp_comm_state
        if self._ddp_comm_wrapper is not None and self._comm_hook is not None:
            hook = self._ddp_comm_wrapper(hook)
        if self.telemetry is not None:
            hook = self.telemetry.timed_hook(hook)
        self.model.register_comm_hook(state=state, hook=counted_hook(hook, self.comm_hook_counter))

    @override
    def configure_ddp(self) -> None:
        # A new DDP wrapper (a new fit) starts a new reducer, whose first static-graph backward must sync again.
        self._synced_backward_seen = False
        assert isinstance(self.model, pl.LightningModule)
        if self._buffers_auto:
            self.settings = dataclasses.replace(self.settings, broadcast_buffers="auto").resolve_auto(bool(running_stat_buffers(self.model)))
        if self._conflict_mode == "off":
            super().configure_ddp()
            self._after_wrap()
            return
        # Wrapping waits for the first training forward, which shows the model facts the settings must fit; until
        # then the ranks only need what DDP's constructor would have done: start from rank 0's weights.
        assert isinstance(self.model, pl.LightningModule)
        with self._keep_local_buffers(self.model):
            _sync_module_states(self.model)
        self._ddp_deferred = True

    def _wrap_deferred_model(self) -> None:
        super().configure_ddp()
        self._ddp_deferred = False
        self._after_wrap()

    def _after_wrap(self) -> None:
        assert self.lightning_module is not None
        if self._verify_every is not None:
            # The check runs at the start of the forward after every N-th step: parameters are as the step left
            # them and buffers have just been broadcast, so both can be compared.
            self._replica_hook = self.lightning_module.register_forward_pre_hook(self._verify_before_forward)
        rank_zero_info(self.describe())

    def describe(self) -> str:
        """One compact line with the resolved settings, logged by rank 0 at setup."""
        settings = self.settings
        if isinstance(self._comm_hook, CommHook):
            hook = self._comm_hook.value
        elif self._comm_hook is not None:
            hook = getattr(self._comm_hook, "__qualname__", repr(self._comm_hook))
        else:
            hook = "none"
        backend = self._process_group_backend or (self._requested_backend or "auto")
        flags = ", ".join(f"{name}={getattr(settings, name)}" for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"))
        flags = f"broadcast_buffers={'auto->' if self._buffers_auto else ''}{settings.broadcast_buffers}, {flags}"
        extra = f", extra={settings.extra}" if settings.extra else ""
        return (
            f"DDPPlusStrategy: backend={backend}, timeout={format_timeout(self.timeout)}, world_size={self.world_size}, "
            f"start_method={self._start_method}, bucket_cap_mb={settings.bucket_cap_mb:g}{self._bucket_count()}, {flags}, "
            f"comm_hook={hook}, accumulation={self.gradient_accumulation_steps} (short_window={self._short_window}), "
            f"conflict_check={self._conflict_mode}, verify_replicas_every_n_steps={self._verify_every}, "
            f"telemetry={self.telemetry is not None}{extra}"
        )

    def _bucket_count(self) -> str:
        if not isinstance(self.model, DistributedDataParallel):
            return ""
        sizes = str(self.model._get_ddp_logging_data().get("bucket_sizes", ""))
        return f" ({len(sizes.split(','))} buckets)" if sizes else ""

    @override
    def teardown(self) -> None:
        if self._replica_hook is not None:
            self._replica_hook.remove()
            self._replica_hook = None
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Our own error already names the rule and the fix. For torch's reducer errors, keep torch's message (Lightning
        # would replace it) and add which rule it is and the fix.
        if isinstance(exception, DDPConflictError) or not exception.args or not isinstance(exception.args[0], str):
            return
        if _TIMEOUT_PATTERN.search(exception.args[0]):
            exception.args = (
                f"{exception.args[0]}\n\nlightning-ddp-plus: a collective waited longer than the process group's "
                f"timeout ({format_timeout(self.timeout)}, set by `DDPPlusStrategy(timeout=...)`): another rank is hung, "
                "crashed or much slower. Fix: find the rank that stopped (its own error or a stack dump); raise `timeout` "
                "only if that rank is legitimately slow (e.g. data preparation on rank 0).",
                *exception.args[1:],
            )
            return
        rule = rule_for_torch_error(exception.args[0])
        if rule is not None:
            exception.args = (
                f"{exception.args[0]}\n\nlightning-ddp-plus: this is rule {rule.id} ({rule.title}). Fix: {rule.fix} "
                "With `checkpointing_conflict='error'` (the default) DDPPlusStrategy reports it before the first "
                "optimizer step; 'resolve' changes the settings for you.",
                *exception.args[1:],
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in REGISTERED_NAMES:
            strategy_registry.register(
                name,
                cls,
                description=f"DDP Plus strategy with `start_method` '{start_method}'",
                override=True,
                start_method=start_method,
            )


_TIMEOUT_PATTERN = re.compile(r"timed out|timeout|Timeout", re.IGNORECASE)


def _accumulate_grad_batches_of_trainer_being_built() -> Optional[object]:
    """``accumulate_grad_batches`` of the ``Trainer.__init__`` that is configuring this strategy, if any.

    The Trainer stores that argument only after it has set up the strategy, but a mismatch must fail while the
    Trainer is being built, before anything is launched; the argument is already in the constructor's frame.
    """
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), pl.Trainer):
            return frame.f_locals.get("accumulate_grad_batches")
        frame = frame.f_back
    return None
