"""``DDPPlusStrategy``: Lightning's ``DDPStrategy`` with every DDP knob typed, validated and settable from YAML.

The class translates Lightning's hooks into calls of the shared engine (``engine.py``); the decisions live in the
components the engine owns.

What a callback may rely on: ``trainer.strategy.model`` is the ``DistributedDataParallel`` wrapper from
``configure_ddp`` on (in ``setup`` of callbacks that run after the strategy's, ``on_fit_start``,
``on_train_start``), as with stock ``DDPStrategy``, whatever ``checkpointing_conflict`` is. The wrapper object is
never replaced during a fit: when ``checkpointing_conflict="resolve"`` changes ``find_unused_parameters`` or
``static_graph``, it happens at the first training backward by rebuilding the wrapper's reducer in place, and
communication hooks registered on the wrapper before that are registered again on the new reducer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel.distributed import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_plus.config.backend import has_default_backend, resolve_backend_for_device
from lightning_ddp_plus.config.timeout import DEFAULT_TIMEOUT, TimeoutLike
from lightning_ddp_plus.config.training_arguments import port_training_arguments
from lightning_ddp_plus.diagnostics.telemetry import DDPTelemetry
from lightning_ddp_plus.engine.engine import DDPPlusEngine, EngineViews
from lightning_ddp_plus.engine.options import ConflictMode, DDPPlusOptions, StartMethod
from lightning_ddp_plus.persistence import resume
from lightning_ddp_plus.persistence.io import AtomicCheckpoints
from lightning_ddp_plus.processes import reachability
from lightning_ddp_plus.processes.launcher import (
    KillChildrenOnFailureLauncher,
    ResultsReturningLauncher,
    register_process_group_shutdown,
    watch_parent,
)
from lightning_ddp_plus.processes.restart import (
    ResumeMode,
    init_process_group,
    restart_attempt,
    resume_dataloader,
    should_resume,
    under_torchrun,
)
from lightning_ddp_plus.sharding.optimizer import OptimizerSharding, check_overlap_backend
from lightning_ddp_plus.sync.accumulation import ShortWindow, WindowPosition, scale_gradients, window_position
from lightning_ddp_plus.sync.comm_hooks import CommHook, HookFunction
from lightning_ddp_plus.sync.uneven import PaddedBatches, RankBatches, UnevenInputs, even_by_construction
from lightning_ddp_plus.sync.wrapper import ddp_kwargs, wrapping_stream

#: Registered names and their launchers, mirroring Lightning's ``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``.
REGISTERED_NAMES: tuple[tuple[str, StartMethod], ...] = (
    ("ddp_plus", "popen"),
    ("ddp_plus_spawn", "spawn"),
    ("ddp_plus_fork", "fork"),
    ("ddp_plus_notebook", "fork"),
)


class DDPPlusStrategy(AtomicCheckpoints, EngineViews, DDPStrategy):
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
        bucket_cap_mb: size of the gradient buckets in MiB. ``None`` (default): torch's default, 25 MiB with a
            1 MiB first bucket, as stock ``DDPStrategy``. A number: every bucket that size. ``"auto"``: time 25 (the
            default), 1, 5 and 100 MiB for 3 optimizer steps each, keep the fastest for the rest of the fit and log
            the choice (``bucket_choice``); not with PowerSGD hooks, whose state is per bucket.
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
            ``Trainer(accumulate_grad_batches=...)``: set either (they must agree if both are set; checked when
            ``fit`` starts, before any process is launched).
        checkpointing_conflict: what to do when the DDP settings conflict with the model (gradient checkpointing,
            reused or unused parameters; see the rule table in the docs' conflict checks guide). The first training forward is observed and
            the decision taken at the first backward: ``"error"`` (default) raises ``DDPConflictError`` before any
            gradient is all-reduced or any optimizer step runs; ``"warn"`` warns once per rule and trains as stock
            DDP would; ``"resolve"`` changes the settings (and, for rule R5, the model's input grads) to a working
            combination and logs what changed; ``"off"`` checks nothing at the first forward. For what the
            per-step guard finds later (rule R6), ``"resolve"`` and ``"warn"`` switch ``find_unused_parameters`` on
            and train on with that step's gradients averaged; ``"error"`` and ``"off"`` raise.
        verify_replicas_every_n_steps: every N optimizer steps, check that all ranks hold identical parameters (and
            buffers, when ``broadcast_buffers`` is on); a mismatch stops training with ``ReplicaDriftError`` naming
            the tensor, the ranks and the step. ``None`` (default): off.
        telemetry: record, per optimizer step, buckets all-reduced, bytes sent, synced and skipped backward passes
            and torch's timings of forward, backward compute, communication and overlap, logged under ``ddp/``
            (adds the ``DDPTelemetry`` callback).
        short_window: how the short last window of an epoch is averaged. ``"mean"`` (default): the mean over the
            micro-batches it really had. ``"lightning"``: Lightning's rule, the sum divided by k.
        start_method: how processes are started: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"``,
            ``"forkserver"``.
        resume_from_last: resume ``fit`` from the last checkpoint (``ModelCheckpoint(save_last=True)``) when one
            exists: ``"on_restart"`` (default) in an attempt that torchrun restarted after a failure, ``"always"``,
            or ``"never"``. A ``ckpt_path`` you set yourself wins. Under torchrun the process group of each attempt
            is created on a store of its own, and a mid-epoch checkpoint resumes at the batch where it was taken.
        sync_guard: after every backward that should synchronize, check on every rank that torch's reducer
            all-reduced every bucket, and act before the optimizer step (rule R6): no optimizer step is ever applied
            with gradients that were not all-reduced, and a parameter unused on some ranks only ends the step with
            an error instead of a hang. The ranks agree through the job's store on gloo (one look-up per step),
            and with one all-reduce of a few integers per step on a small gloo group of their own on other
            backends. Default on.
        uneven_inputs: ranks whose shards hold different numbers of batches (an ``IterableDataset`` split by rank,
            ``use_distributed_sampler=False``): ``"error"`` (default) raises ``UnevenInputsError`` on every rank at
            the first batch that is one rank's last and not another's, naming the counts; ``"stop"`` ends the epoch
            on every rank there and reports, once per epoch, the batches left untrained; ``"join"`` lets the longer
            ranks train on while the others repeat their last batch with weight 0, the gradient being the mean over
            the batches really trained. Nothing is compared when every training loader has a ``DistributedSampler``
            (even by construction).
        atomic_checkpoints: write every checkpoint to a temporary file beside its target, fsync it, rename it over
            the target and fsync the directory, so a kill, a full disk or a node crash during a save leaves the
            previous file whole; a checkpoint IO you pass is wrapped (see ``lightning_ddp_plus.persistence.io``).
            Default on.
        optimizer_sharding: ZeRO stage 1 (``lightning_ddp_plus.sharding.optimizer``): ``True`` wraps every optimizer
            in torch's ``ZeroRedundancyOptimizer`` with its class, hyperparameters and parameter groups, so each rank
            keeps the optimizer state of about 1/N of the parameters (whole parameters, so unevenly on small models)
            and the updated parameters are broadcast after each step; exact, on every backend. ``"overlap"`` runs the
            step inside the backward with torch's ``hook_with_zero_step`` (NCCL/HCCL only: refused on gloo before
            launch; torch applies no update in the first 2 steps, 3 with ``static_graph``; refused with a comm hook,
            accumulation, ``bucket_cap_mb="auto"``, ``sync_guard``, ``uneven_inputs="join"`` and gradient clipping).
            Checkpoints hold the consolidated, plain optimizer state (gathered on rank 0 at each save). Default
            ``False``.
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
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
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
        model_averaging_period: int | None = None,
        gradient_accumulation_steps: int | None = None,
        short_window: ShortWindow = "mean",
        checkpointing_conflict: ConflictMode = "error",
        verify_replicas_every_n_steps: int | None = None,
        telemetry: bool = False,
        start_method: StartMethod = "popen",
        resume_from_last: ResumeMode = "on_restart",
        sync_guard: bool = True,
        uneven_inputs: UnevenInputs = "error",
        atomic_checkpoints: bool = True,
        optimizer_sharding: OptimizerSharding = False,
        **kwargs: Any,
    ) -> None:
        options = DDPPlusOptions.from_arguments(locals(), ddp_kwargs=kwargs)
        self.engine = DDPPlusEngine(options, warn=rank_zero_warn, info=rank_zero_info)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=None,  # the engine registers hooks on every backend
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=options.backend,
            timeout=options.timeout,
            start_method=start_method,
            **ddp_kwargs(self.engine.settings),
        )
        self._backward_syncs = True
        self._resume_request = "never"
        self._resume_path: str | None = None
        self._static_graph_flushed = False
        self._even_shards: tuple[int, bool] = (-1, False)  # (epoch, every loader has a DistributedSampler)

    @classmethod
    def from_training_arguments(
        cls, args: Any, model: Any | None = None, **overrides: Any
    ) -> tuple[DDPPlusStrategy, dict[str, Any]]:
        """Port Hugging Face ``TrainingArguments`` (or an object / mapping with its ``ddp_*`` names): returns the
        strategy with the same meaning and the ``Trainer`` arguments it implies (see ``lightning_ddp_plus.frontends.hf``).

        >>> strategy, trainer_kwargs = DDPPlusStrategy.from_training_arguments({"gradient_accumulation_steps": 2, "ddp_timeout": 600})
        >>> strategy.timeout.total_seconds(), strategy.gradient_accumulation_steps, trainer_kwargs
        (600.0, 2, {'accumulate_grad_batches': 2})
        """
        port = port_training_arguments(args, model)
        return cls(**{**port.strategy_kwargs, **overrides}), dict(port.trainer_kwargs)

    # ------------------------------------------------------------------ read-only views of the engine

    @property
    def comm_hook(self) -> CommHook | HookFunction | None:
        return self.options.comm_hook

    @property
    def start_method(self) -> str:
        return self._start_method

    # ------------------------------------------------------------------ launching and process group

    def _device_type(self) -> str:
        if self.parallel_devices:
            return self.parallel_devices[0].type
        return self.root_device.type

    @override
    def _configure_launcher(self) -> None:
        # The Trainer calls this once it has chosen the accelerator and devices, before anything is launched: the
        # earliest moment at which device-dependent settings can be judged. A backend the user named must also exist
        # in this torch; the automatic one is checked for that in each process before the group is created, so that
        # a faked accelerator (Lightning's own tests fake CUDA on CPU builds) behaves as with stock Lightning.
        device = self._device_type()
        if self.options.backend is not None or has_default_backend(device):  # else the connector names the problem
            self._process_group_backend = resolve_backend_for_device(
                self.options.backend, device, check_available=self.options.backend is not None
            )
            check_overlap_backend(self.options.optimizer_sharding, self._process_group_backend)
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = KillChildrenOnFailureLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, before_launch=self._settle_with_trainer
            )
        else:
            self._launcher = ResultsReturningLauncher(
                self, start_method=self._start_method, before_launch=self._settle_with_trainer
            )

    def _settle_with_trainer(
        self, trainer: pl.Trainer, function: Callable[..., Any], args: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """The launcher's ``launch`` calls this in every process before anything starts: k is settled once with the
        Trainer's ``accumulate_grad_batches``, which then says what Lightning's loop must do (k in automatic
        optimization, where the loop accumulates; 1 in manual, where Lightning refuses it and the engine accumulates);
        and a fit that should resume (``resume_from_last``) gets ``ckpt_path="last"`` unless it has a path."""
        steps = self.engine.window.reconcile(trainer.accumulate_grad_batches)
        module = self._lightning_module
        manual = module is not None and not module.automatic_optimization
        trainer.accumulate_grad_batches = 1 if manual else steps
        return self._resume_arguments(trainer, function, args)

    def _resume_arguments(
        self, trainer: pl.Trainer, function: Callable[..., Any], args: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """A resume (``resume_from_last``, or the user's ``ckpt_path="last"``) becomes ``NEWEST_READABLE``, which
        ``resume_start`` resolves on all ranks together (see ``lightning_ddp_plus.persistence.resume``)."""
        if trainer.state.fn != TrainerFn.FITTING:
            return args
        parameters = list(inspect.signature(function).parameters)
        index = parameters.index("ckpt_path") if "ckpt_path" in parameters else None
        if index is None or index >= len(args) or trainer._checkpoint_connector._user_managed:
            return args
        if args[index] == "last":
            request = "last"
        elif args[index] is None and should_resume(self.options.resume_from_last, self.timeout):
            request = self.options.resume_from_last
            rank_zero_info(f"DDPPlusStrategy: attempt {restart_attempt()} resumes from the newest readable checkpoint.")
        else:
            return args
        self._resume_request = request
        self._install_resume_choice(trainer)
        return (*args[:index], resume.NEWEST_READABLE, *args[index + 1 :])

    def _install_resume_choice(self, trainer: pl.Trainer) -> None:
        connector = trainer._checkpoint_connector
        resume_start = type(connector).resume_start.__get__(connector)

        def resume_start_with_choice(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
            if checkpoint_path == resume.NEWEST_READABLE:
                checkpoint_path = self._choose_resume(trainer)
            resume_start(checkpoint_path, *args, **kwargs)

        connector.resume_start = resume_start_with_choice  # type: ignore[method-assign]

    def _choose_resume(self, trainer: pl.Trainer) -> Any:
        choice = resume.choose(trainer, self.checkpoint_io) if self.is_global_zero else None
        choice = self.broadcast(choice)  # one rank decides, so every rank loads the same file

        def lightning_last() -> Any:
            return trainer._checkpoint_connector._parse_ckpt_path(
                TrainerFn.FITTING, "last", model_provided=True, model_connected=True
            )

        directories, _ = resume.checkpoint_directories(trainer)
        path = resume.resolve(choice, self._resume_request, directories, lightning_last, rank_zero_warn, rank_zero_info)
        self._resume_path = None if path is None else str(path)
        return path

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        chosen_here = self._resume_path is not None and str(checkpoint_path) == self._resume_path
        if not chosen_here or args or kwargs.get("weights_only") is not None:  # a weights_only you set wins
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)
        torch.cuda.empty_cache()
        return resume.load(self.checkpoint_io, str(checkpoint_path), rank_zero_warn)

    @override
    def setup_environment(self) -> None:
        watch_parent()
        super().setup_environment()
        register_process_group_shutdown()
        reachability.publish_host()

    @override
    def _get_process_group_backend(self) -> str:
        return resolve_backend_for_device(self.options.backend, self.root_device.type, check_available=False)

    @override
    def setup_distributed(self) -> None:
        resolve_backend_for_device(self.options.backend, self.root_device.type)  # present in this torch?
        if not under_torchrun():
            super().setup_distributed()
            return
        # under torchrun: a store of its own per attempt (see restart.py), else Lightning's setup
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        init_process_group(self.cluster_environment, self._process_group_backend, self.timeout, device_id)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        module = self.lightning_module
        if module is not None and module._trainer is not None and module.trainer.state.stage == RunningStage.TRAINING:
            dataloader = resume_dataloader(dataloader, module.trainer)
            if self.options.uneven_inputs == "join" and not even_by_construction([dataloader]):
                dataloader = PaddedBatches(dataloader, self.engine.uneven.padding_state)
        return dataloader

    # ------------------------------------------------------------------ the wrapper

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if self.telemetry is not None and not any(isinstance(c, DDPTelemetry) for c in callbacks):
            callbacks.append(DDPTelemetry())

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.options.optimizer_sharding == "overlap" and trainer.gradient_clip_val:
            raise ValueError(
                f"`optimizer_sharding='overlap'` with `Trainer(gradient_clip_val={trainer.gradient_clip_val})`: the "
                "overlapped step runs inside the backward, before Lightning clips. Fix: use `optimizer_sharding=True`."
            )
        sharded = self.engine.shard_optimizers(self.optimizers)
        if sharded is not self.optimizers:
            self.optimizers = sharded

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        with wrapping_stream(self.root_device, device_ids):
            ddp = self.engine.wrap(model, device_ids)
        self._ddp_kwargs = ddp_kwargs(self.engine.settings)
        self._static_graph_flushed = False
        self._even_shards = (-1, False)
        return ddp

    @override
    def _register_ddp_hooks(self) -> None:
        pass  # the engine registered the communication hook when wrapping, on every backend

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        rank_zero_info(self.describe())

    def describe(self) -> str:
        """One compact line with the resolved settings, logged by rank 0 at setup."""
        backend = self._process_group_backend or (self.options.backend or "auto")
        buckets = None
        if isinstance(self.model, DistributedDataParallel):
            sizes = str(self.model._get_ddp_logging_data().get("bucket_sizes", ""))
            buckets = len(sizes.split(",")) if sizes else None
        return self.engine.describe(backend, self.world_size, self._start_method, buckets)

    @override
    def teardown(self) -> None:
        self.engine.teardown()
        _remove_leftover_forward_redirection(self.lightning_module)
        super().teardown()

    # ------------------------------------------------------------------ accumulation and backward

    def _position(self) -> WindowPosition:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        progress = trainer.fit_loop.epoch_loop.batch_progress
        forced = self.engine.uneven.forced_length(trainer.current_epoch)
        return window_position(
            max(1, progress.current.ready),
            self.gradient_accumulation_steps,
            trainer.num_training_batches if forced is None else forced,
            progress.is_last_batch,
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Every rank says whether this batch is its epoch's last (Lightning knows one batch ahead): uneven_inputs.
        module = self.lightning_module
        if module is None or not isinstance(self.model, DistributedDataParallel):
            return
        trainer = module.trainer
        if self._shards_even(trainer):
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress
        length = trainer.num_training_batches
        state = RankBatches(
            number=progress.current.ready,
            last=bool(progress.is_last_batch),
            length=int(length) if length != float("inf") else None,
        )
        folded = module.automatic_optimization and self.gradient_accumulation_steps == 1
        if self.engine.batch_starts(state, trainer.current_epoch, folded):
            self._end_epoch_here()

    def _shards_even(self, trainer: pl.Trainer) -> bool:
        epoch = trainer.current_epoch
        if self._even_shards[0] != epoch:
            combined = trainer.fit_loop._combined_loader
            self._even_shards = (epoch, even_by_construction(combined.flattened if combined is not None else []))
        return self._even_shards[1]

    def _end_epoch_here(self) -> None:
        assert self.lightning_module is not None
        # the loop ends the epoch after this batch (and closes an accumulation window on it)
        self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True

    @property
    def sync_gradients(self) -> bool:
        """True while training on the micro-batch that closes an accumulation window: its backward all-reduces,
        and in manual optimization it is the one after which to call ``optimizer.step()``."""
        if self.gradient_accumulation_steps == 1 or self.lightning_module is None:
            return True
        return self._position().closes_window

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[Any, None, None]:
        if self.engine.window.must_sync_first_backward(self.settings.static_graph):
            yield None
            return
        with super().block_backward_sync():
            yield None

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        ddp = self.model
        if not isinstance(ddp, DistributedDataParallel):
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        automatic = self.lightning_module.automatic_optimization
        closure_loss = self.engine.before_backward(ddp, closure_loss, post_forward=automatic)
        window = self.engine.window
        position = self._position()
        scale = window.loss_scale(position, divided_by_steps=automatic) * self.engine.loss_weight()
        if scale != 1.0:
            closure_loss = closure_loss * scale
        # Automatic: the loop decided (block_backward_sync) before the forward; manual: decided now, before Lightning's
        # pre_backward prepares the reducer.
        syncs = ddp.require_backward_grad_sync if automatic else window.syncs(position, self.settings.static_graph)
        self._backward_syncs = syncs
        if not syncs:
            ddp.require_backward_grad_sync = False
        failed = False
        try:
            closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        except RuntimeError as error:
            if not (syncs and self.engine.recovers_from(error)):
                raise
            failed = True  # the guard completes the reduction, then raises DDPConflictError or skips the step
        finally:
            if not automatic:
                ddp.require_backward_grad_sync = True
        if self.engine.after_backward(syncs, failed=failed):
            self._end_epoch_here()
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # Manual optimization with a static graph: the loss never passes through DDP's _DDPSink (the backward runs
        # inside the wrapper's forward), so nothing queues the first synced backward's delayed all-reduce; without it
        # torch never reduces a gradient. Lightning 2.6 does this in its post_backward, 2.5 does not: do it here, once
        # per wrapper, after a backward that synced.
        ddp = self.model
        lightning_module = self.lightning_module
        if (
            self._backward_syncs
            and not self._static_graph_flushed
            and isinstance(ddp, DistributedDataParallel)
            and ddp.static_graph
            and lightning_module is not None
            and not lightning_module.automatic_optimization
        ):
            ddp.reducer._delay_all_reduce()  # type: ignore[attr-defined]
            self._static_graph_flushed = True

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        lightning_module = self.lightning_module
        if lightning_module is not None and self.gradient_accumulation_steps > 1:
            if not lightning_module.automatic_optimization and not self.sync_gradients:
                rank_zero_warn(
                    f"optimizer.step() was called on a micro-batch that does not close its accumulation window "
                    f"(gradient_accumulation_steps={self.gradient_accumulation_steps}): its gradients were not all-reduced, "
                    "so replicas will diverge. Fix: call it only when `self.trainer.strategy.sync_gradients` is True."
                )
            closure = self._rescaling_closure(closure, optimizer)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        step = self.engine.after_optimizer_step()
        if lightning_module is not None:
            trainer = lightning_module.trainer
            if step % max(1, trainer.log_every_n_steps) == 0:  # type: ignore[attr-defined]
                self._log_sync_stats(trainer)
        return output

    def _rescaling_closure(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        """A window that closed early on an epoch of unknown length: its gradients need k/length (``"mean"``)."""

        def closure_then_rescale() -> Any:
            result = closure()
            scale_gradients(optimizer, self.engine.window.gradient_rescale(self._position()))
            return result

        return closure_then_rescale

    def _log_sync_stats(self, trainer: pl.Trainer) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(self.sync_stats.as_metrics(), step=trainer.global_step)

    @override
    def on_train_end(self) -> None:
        self.engine.end_of_training()
        super().on_train_end()
        if self.lightning_module is not None:
            self._log_sync_stats(self.lightning_module.trainer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Our own errors already name the rule and the fix. For torch's errors, keep torch's message (Lightning would
        # replace it) and add which rule it is and the fix, or what a collective timeout means.
        self.engine.explain(exception)

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


def _remove_leftover_forward_redirection(module: Module | None) -> None:
    """Undo the ``forward`` patch Lightning's forward redirection leaves behind when DDP's forward raises before the
    redirected step runs (e.g. torch's "Expected to have finished reduction" in ``_pre_forward``).

    The patch is a closure holding the DDP wrapper, so the wrapper, its reducer and the process group the reducer
    references outlive the fit in a reference cycle and are destroyed during interpreter shutdown, after
    ``destroy_process_group``, where gloo can abort the process ("terminate called without an active exception")
    and turn a clean error into a C++ crash. It would also make ``model(x)`` run ``training_step``.
    """
    patched = module.__dict__.get("forward") if module is not None else None
    if patched is not None and "_ForwardRedirection" in getattr(patched, "__qualname__", ""):
        del module.__dict__["forward"]
