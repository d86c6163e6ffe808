"""``DDPPlusStrategy``: Lightning's ``DDPStrategy`` with every DDP knob typed, validated and settable from YAML. It
translates Lightning's hooks into calls of the shared engine (``engine/engine.py``); the Trainer's loop is read in
``trainer_loop.py``, chunks in ``trainer_chunks.py``, resume in ``persistence/resume.py``.

``trainer.strategy.model`` is the ``DistributedDataParallel`` wrapper from ``configure_ddp`` on, as with stock
``DDPStrategy``, and is never replaced during a fit (``checkpointing_conflict="resolve"`` rebuilds its reducer in
place, with the communication hooks registered again)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel.distributed import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_ddp_plus.config.training_arguments import port_training_arguments
from lightning_ddp_plus.engine.arguments import takes_declared_arguments
from lightning_ddp_plus.engine.keywords import DDPPlusStrategyKeywords
from lightning_ddp_plus.frontends.common import DDPPlusFrontEnd
from lightning_ddp_plus.frontends.framework_io import atomic_checkpoint_io, recorded_collective
from lightning_ddp_plus.frontends.registry import register_names
from lightning_ddp_plus.frontends.trainer_after_death import save_after_rank_death
from lightning_ddp_plus.frontends.trainer_chunks import TrainerChunks
from lightning_ddp_plus.frontends.trainer_loop import (
    add_strategy_callbacks,
    backward_in_window,
    flush_manual_static_graph,
    log_sync_stats,
    log_sync_stats_every_n_steps,
    position_in_window,
    rank_batches,
    rescaling_closure,
    settle_accumulation,
    training_dataloader,
)
from lightning_ddp_plus.frontends.trainer_preemption import pass_on_held_notice, watch_for_notices
from lightning_ddp_plus.persistence.resume import ResumeCoordinator
from lightning_ddp_plus.private_apis.lightning import end_epoch_after_this_batch, trainer_of, training_loaders
from lightning_ddp_plus.processes.launcher import (
    KillChildrenOnFailureLauncher,
    ResultsReturningLauncher,
    nodes_of_this_attempt,
    remove_leftover_forward_redirection,
    watch_parent,
)
from lightning_ddp_plus.processes.restart import init_process_group, under_torchrun
from lightning_ddp_plus.sync.accumulation import WindowPosition
from lightning_ddp_plus.sync.wrapper import ddp_kwargs


class DDPPlusStrategy(DDPPlusFrontEnd, DDPStrategy):
    """Multi-process data-parallel training with every DDP knob as an explicit, typed, validated argument.

    Bad values fail here, or (where the device matters) when the ``Trainer`` is built, before any process starts;
    ``help(DDPPlusStrategy.__init__)`` lists every argument (declared once, in ``engine/arguments.py``).

    >>> import lightning_ddp_plus
    >>> lightning_ddp_plus.DDPPlusStrategy(process_group_backend="gloo", timeout="1h30m").timeout
    datetime.timedelta(seconds=5400)
    """

    strategy_name = "ddp_plus"
    front_end = "DDPPlusStrategy"
    registry_label = "DDP Plus strategy"

    # overrides that read the same in both front ends, each from its framework's own method (framework_io.py)
    checkpoint_io = atomic_checkpoint_io(DDPStrategy)
    barrier = recorded_collective(DDPStrategy.barrier)
    broadcast = recorded_collective(DDPStrategy.broadcast)
    all_gather = recorded_collective(DDPStrategy.all_gather)
    reduce = recorded_collective(DDPStrategy.reduce, "all_reduce")  # what self.log(..., sync_dist=True) calls
    _get_process_group_backend = DDPPlusFrontEnd._backend_for_device
    register_strategies = classmethod(register_names)

    @takes_declared_arguments("DDPPlusStrategy")
    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **arguments: Unpack[DDPPlusStrategyKeywords],
    ) -> None:
        """Lightning's plumbing, then every argument ``DDPPlusArguments`` declares.

        Args:
            accelerator: set by the ``Trainer``.
            parallel_devices: set by the ``Trainer``.
            cluster_environment: set by the ``Trainer`` unless given.
            checkpoint_io: checkpoint plugin, as in ``DDPStrategy``; kept as passed (see ``atomic_checkpoints``).
            precision_plugin: set by the ``Trainer`` unless given.
        """
        declared = self._start_engine(arguments)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=declared.ddp_comm_state,
            ddp_comm_hook=None,  # the engine registers hooks on every backend
            ddp_comm_wrapper=declared.ddp_comm_wrapper,
            model_averaging_period=declared.model_averaging_period,
            process_group_backend=declared.backend,
            timeout=declared.process_group_timeout,  # the engine sets `timeout` at the first training step
            start_method=declared.start_method,
            **ddp_kwargs(self.engine.settings),
        )
        self.resume = ResumeCoordinator(
            declared, self, rank_zero_warn, rank_zero_info, self.engine.resume_with_accumulation
        )
        self._backward_syncs, self._static_graph_flushed = True, False
        #: ``chunk_size``'s side of the Trainer (``None``: off, nothing of it is called in a step).
        self._chunks = TrainerChunks(self.engine) if declared.chunk_size is not None else None
        self._batch: Any = None  # the training batch running now: an out-of-memory error names its rows

    @classmethod
    def from_training_arguments(
        cls, args: Any, model: Any | None = None, **overrides: Unpack[DDPPlusStrategyKeywords]
    ) -> tuple[DDPPlusStrategy, dict[str, Any]]:
        """Port Hugging Face ``TrainingArguments`` (or an object / mapping with its ``ddp_*`` names): returns the
        strategy with the same meaning and the ``Trainer`` arguments it implies (see ``lightning_ddp_plus.frontends.hf``).

        >>> strategy, trainer_kwargs = DDPPlusStrategy.from_training_arguments({"gradient_accumulation_steps": 2, "ddp_timeout": 600})
        >>> strategy.timeout.total_seconds(), strategy.gradient_accumulation_steps, trainer_kwargs
        (600.0, 2, {'accumulate_grad_batches': 2})
        """
        port = port_training_arguments(args, model)
        return cls(**{**port.strategy_kwargs, **overrides}), dict(port.trainer_kwargs)

    @override
    def _configure_launcher(self) -> None:
        # The Trainer calls this once it has chosen the accelerator and devices, before anything is launched: the
        # earliest moment at which device-dependent settings can be judged.
        self._judge_backend_before_launch((self.parallel_devices or [self.root_device])[0].type)
        assert self.cluster_environment is not None
        self.num_nodes, changed = nodes_of_this_attempt(self.cluster_environment, self.num_processes, self.num_nodes)
        if changed:  # an elastic job on fewer or more nodes than the Trainer says
            rank_zero_info(changed)
        if self._start_method == "popen":
            after_failure = save_after_rank_death if self.engine.arguments.save_on_rank_death else None
            self._launcher = KillChildrenOnFailureLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, after_failure
            )
        else:
            self._launcher = ResultsReturningLauncher(self, start_method=self._start_method)
        self._launcher.before_launch, self._launcher.after_fit = self._before_launch, pass_on_held_notice

    def _before_launch(
        self, trainer: pl.Trainer, function: Callable[..., Any], args: tuple[Any, ...]
    ) -> tuple[Any, ...]:  # in every process, before anything starts: k, micro-batches, the resume request
        settle_accumulation(self.engine, self._lightning_module, trainer)
        return self.resume.before_launch(trainer, function, args)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        loaded = self.resume.load_checkpoint(checkpoint_path, super().load_checkpoint, *args, **kwargs)
        return self.engine.load_chunk_size(loaded)

    def with_run_state(self, checkpoint: dict[str, Any], gather_generators: bool = True) -> dict[str, Any]:
        """``checkpoint`` with the data layout, the micro-batch size and (a gather) every rank's generators."""
        sizes = self.gradient_accumulation_steps, self.engine.chunk_size
        self.resume.saving(checkpoint, self.lightning_module, *sizes, gather_generators=gather_generators)
        return self.engine.save_chunk_size(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self.io.save(self.checkpoint_io, super().save_checkpoint, self.with_run_state(checkpoint), *args, **kwargs)

    @override
    def setup_environment(self) -> None:
        watch_parent()
        watch_for_notices(self.engine, trainer_of(self.lightning_module))
        super().setup_environment()
        self._environment_ready()

    @override
    def setup_distributed(self) -> None:
        self._prepare_environment()
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
        return training_dataloader(dataloader, self.lightning_module, self.engine, self.resume)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        with self.resume.loop_not_restored():  # `estimated_stepping_batches` builds the loader in here
            super().setup(trainer)
        if trainer.training and self.lightning_module is not None:
            self.engine.chunks_from_plan(trainer.default_root_dir, self.lightning_module, trainer.world_size)
        add_strategy_callbacks(trainer, self.engine)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        clipping = f"`Trainer(gradient_clip_val={trainer.gradient_clip_val})`" if trainer.gradient_clip_val else None
        sharded = self.engine.shard_optimizers(self.optimizers, clipping, self.precision_plugin)
        if sharded is not self.optimizers:
            self.optimizers = sharded

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        ddp = self._wrap(model, self.determine_ddp_device_ids())
        self._ddp_kwargs = ddp_kwargs(self.engine.settings)
        self._static_graph_flushed = False
        return ddp

    @override
    def _register_ddp_hooks(self) -> None:
        pass  # the engine registered the communication hook when wrapping, on every backend

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        rank_zero_info(self.describe())

    @override
    def describe(self, ddp: DistributedDataParallel | None = None) -> str:
        """One compact line with every argument's value in effect, logged by rank 0 at setup."""
        return super().describe(self.model if isinstance(self.model, DistributedDataParallel) else None)

    @override
    def teardown(self) -> None:
        remove_leftover_forward_redirection(self.lightning_module)
        self.engine.end_notices(hold=True)  # passed on after the fit (the launcher), not amid Lightning's teardown
        self.engine.teardown()
        self.engine.release_environment()
        super().teardown()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        with self._consolidation(optimizer):
            return super().optimizer_state(optimizer)

    @override
    def on_validation_start(self) -> None:
        self.engine.enter_phase("validation")
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        self.engine.enter_phase("data fetch")
        super().on_validation_end()

    def _position(self) -> WindowPosition:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        forced = self.engine.forced_epoch_length(trainer.current_epoch)
        return position_in_window(trainer, self.gradient_accumulation_steps, forced)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.resume.saved_generators is not None:  # after a resume: where the uninterrupted run's stood
            self.resume.give_generators_back(self.global_rank, self.world_size)
        # Every rank says whether this batch is its epoch's last (Lightning knows one batch ahead): uneven_inputs.
        module = self.lightning_module
        if module is None or not isinstance(self.model, DistributedDataParallel):
            return
        trainer = module.trainer
        one_synced_backward = module.automatic_optimization and self.gradient_accumulation_steps == 1
        loaders = functools.partial(training_loaders, trainer)  # asked once per epoch
        if self.engine.batch_starts(rank_batches(trainer), trainer.current_epoch, one_synced_backward, loaders):
            end_epoch_after_this_batch(trainer)

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
        if self.engine.must_sync_first_backward():
            yield None
            return
        with super().block_backward_sync():
            yield None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._batch = args[0] if args else None
        with self.engine.out_of_memory_explained(self._batch, self.global_rank, self.world_size):
            ddp, module = self.model, self.lightning_module
            if not (self._chunks and isinstance(ddp, DistributedDataParallel) and module):
                output = super().training_step(*args, **kwargs)  # its `num_items` go to its backward
                return self.items_of_training_step(output) if module and module.automatic_optimization else output
            optimizer = module.trainer.optimizers[0] if module.trainer.optimizers else None
            step = lambda chunk: DDPStrategy.training_step(self, chunk, *args[1:], **kwargs)
            backward = lambda loss: DDPStrategy.backward(self, loss, optimizer)
            # Lightning's step and backward, past this class's overrides, for each chunk
            return self._chunks.run_training_step(
                ddp, module, args[0], self._position(), step, backward, self.global_rank
            )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        self.give_num_items(kwargs)  # `self.manual_backward(loss, num_items=n)`
        if self._chunks and self._chunks.restore_gradients():  # the chunks ran their backwards in training_step
            return closure_loss
        ddp, module = self.model, self.lightning_module
        if not isinstance(ddp, DistributedDataParallel) or module is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with backward_in_window(self.engine, ddp, module, self._position(), closure_loss) as backward:
            backward.result = super().backward(backward.loss, optimizer, *args, **kwargs)
        self._backward_syncs = backward.synced
        result: Tensor = backward.result
        return result

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if not self._static_graph_flushed:  # once per wrapper, after a backward that synced
            self._static_graph_flushed = flush_manual_static_graph(
                self.model, self.lightning_module, self._backward_syncs
            )

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
                rank_zero_warn(self.engine.step_mid_window_warning())
            rescale = lambda: self.engine.gradient_rescale(self._position())
            closure = rescaling_closure(closure, optimizer, rescale)
        explained = self.engine.out_of_memory_explained(self._batch, self.global_rank, self.world_size)
        with explained:  # the closure runs the training step and the backward
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        step = self.engine.step_done()
        if lightning_module is not None:
            log_sync_stats_every_n_steps(lightning_module.trainer, step, self.sync_stats)
        return output

    @override
    def on_train_end(self) -> None:
        self.engine.end_of_training()
        super().on_train_end()
        if self.lightning_module is not None:
            log_sync_stats(self.lightning_module.trainer, self.sync_stats)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.engine.explain(exception)  # torch's message kept (Lightning would replace it), the rule or timeout added
