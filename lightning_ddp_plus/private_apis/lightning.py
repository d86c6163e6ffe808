"""Lightning's private names that the package uses.

| what | Lightning names used | checked on | probe, and what happens without it |
|---|---|---|---|
| the launchers the front ends extend (``SubprocessScriptLauncher``, ``MultiProcessingLauncher``, ``FabricSubprocessScriptLauncher``) | ``lightning.pytorch.strategies.launchers._SubprocessScriptLauncher``, ``_MultiProcessingLauncher``, ``lightning.fabric.strategies.launchers.subprocess_script._SubprocessScriptLauncher`` | 2.5, 2.6 | none: Lightning has no public launcher to extend; the spawn/fork worker's end is ``_MultiProcessingLauncher._wrapping_function`` (overridden: a notice held for after the fit is passed on there, after the worker's results) |
| ending the process group at exit (``destroy_dist_connection``) | ``lightning.fabric.utilities.distributed._destroy_dist_connection`` | the same | none |
| loading a checkpoint file as Lightning does (``load_file``, ``PathLike``) | ``lightning.fabric.utilities.cloud_io._load``, ``lightning.fabric.utilities.types._PATH`` | the same | none |
| the async checkpoint IO's wrapper (``wrapping_checkpoint_io``, ``has_own_checkpoint_io``) | ``lightning.pytorch.plugins.io.wrapper._WrappingCheckpointIO``, ``_base_checkpoint_io_configured`` | the same | ``None`` where the class is missing: no async IO to give a default |
| Fabric's backward-sync control (``DDPBackwardSyncControl``) and its backward flag (``fabric_backward``) | ``lightning.fabric.strategies.ddp._DDPBackwardSyncControl``, ``lightning.fabric.wrappers._in_fabric_backward`` | the same | none |
| choosing the checkpoint to resume (``route_resume_start``, ``user_chose_checkpoint``, ``lightning_last_checkpoint``) | ``Trainer._checkpoint_connector``, its ``resume_start``, ``_user_managed``, ``_parse_ckpt_path`` | the same | none: Lightning resolves ``ckpt_path`` there, before any public hook runs. A patch (the instance's ``resume_start`` replaced); what would remove it: ``ckpt_path="last"`` resolved within the run's own logger version (no Lightning issue or PR found) |
| a loader with another sampler (``update_dataloader``) | ``lightning.pytorch.utilities.data._update_dataloader`` | the same | none: it re-instantiates a user's loader subclass as Lightning does |
| the training loaders of the running fit (``training_loaders``) and a module's Trainer (``trainer_of``) | ``FitLoop._combined_loader``, ``LightningModule._trainer`` | the same | ``[]`` / ``None`` before the fit has them |
| keeping Lightning's termination handling off the preemption signals (``leave_signals_to``) | ``Trainer._signal_connector``, its ``register_signal_handlers`` and ``_original_handlers``, ``_TrainingEpochLoop._broadcast_sigterm_tensor`` | the same | each part skipped where missing: Lightning's handler would then run beside the strategy's. Two patches (the instance's ``register_signal_handlers``, the epoch loop's ``_broadcast_sigterm_tensor``); what would remove them: a switch for Lightning's signal handling (asked in Lightning #5225, closed as won't fix) and no per-step broadcast (Lightning #21487; PR #21640 would broadcast every N steps, which still costs a host sync then) |
| telling that an error was raised inside Lightning's own signal handlers (``in_lightnings_signal_handler``) | ``SignalConnector._sigterm_notifier_fn``, ``_slurm_sigusr_handler_fn`` | the same | each missing one is not recognized: a death learnt there would be saved as the step before it |
| SLURM's requeue checkpoint (``slurm_requeue_checkpoint_path``) | ``Trainer._checkpoint_connector.hpc_save_path`` | the same | none |
| the step boundary: the point before a batch is fetched (``before_each_batch``; ``StepBoundaryLoops`` reads the loops' state there), after every hook of the batch before it, its validation, and an epoch's end and the next one's start | ``Trainer.fit_loop.epoch_loop.advance`` (``_TrainingEpochLoop``'s, wrapped on the instance) | the same | ``RuntimeError`` naming the missing method: no public hook runs before the next batch is counted. A patch (the instance's ``advance`` wrapped); what would remove it: a callback hook before the next batch is fetched (no Lightning issue or PR found) |
| ending the epoch after the running batch (``end_epoch_after_this_batch``, ``uneven_inputs="stop"``) | ``Trainer.fit_loop.epoch_loop.batch_progress.is_last_batch`` (written) | the same | none: returning -1 from ``on_train_batch_start`` skips the running batch instead of training it as the epoch's last (closing its accumulation window). A patch of the loop's state; what would remove it: a public way to end the epoch after the running batch (no Lightning issue or PR found) |
| a step boundary's loop state as Lightning's restore continues it (``resumable_at_boundary``) | the fit loop's ``state_dict`` keys (``epoch_progress``, ``epoch_loop.batch_progress``, ``epoch_loop.state_dict``'s ``_batches_that_stepped``) and ``_TrainingEpochLoop.update_restart_stage``'s rule | the same | none: Lightning restores no state saved between a batch's end and the next batch without running that batch's end again where validation is due |
| the fit loop's state as ``state_dict()`` gives it, in a few µs (``LoopState``) | ``lightning.pytorch.loops.loop._Loop``, ``lightning.pytorch.loops.progress._BaseProgress`` (their ``state_dict`` walk, redone), ``lightning.pytorch.loops._FitLoop`` (its own state is its stateful loaders') | the same | none |
| the generators' states, taken and given back (``collect_rng_states``, ``set_rng_states``) | ``lightning.fabric.utilities.seed._collect_rng_states``, ``_set_rng_states`` | the same | none |
| a checkpoint's contents without writing them (``trainer_checkpoint``) | ``Trainer._checkpoint_connector.dump_checkpoint`` | the same | none: ``Trainer.save_checkpoint`` writes from rank 0 only, behind a barrier |
| what ``fabric.save`` writes, built on any rank (``fabric_checkpoint``) | ``Strategy._convert_stateful_objects_in_state`` (Fabric's) | the same | none: ``fabric.save`` writes from rank 0 only, behind a barrier |
| starting the popen launcher's child ranks without Lightning's observer (``start_child_ranks``, ``set_threads_per_rank``) | ``_SubprocessScriptLauncher._call_children_scripts``, ``lightning.fabric.utilities.distributed._set_num_threads_if_needed`` | the same | none: the observer SIGKILLs every rank, the launching one included, within 5 s of a child's failure, before a survivor can save |
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from lightning.fabric import wrappers as fabric_wrappers
from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl as DDPBackwardSyncControl
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricSubprocessScriptLauncher,
)
from lightning.fabric.utilities.cloud_io import _load as load_file
from lightning.fabric.utilities.distributed import _destroy_dist_connection as destroy_dist_connection
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed as set_threads_per_rank
from lightning.fabric.utilities.seed import _collect_rng_states as collect_rng_states
from lightning.fabric.utilities.seed import _set_rng_states as set_rng_states
from lightning.fabric.utilities.types import _PATH as PathLike
from lightning.pytorch.loops import _FitLoop as FitLoop
from lightning.pytorch.loops.loop import _Loop as Loop
from lightning.pytorch.loops.progress import _BaseProgress as BaseProgress
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher as MultiProcessingLauncher
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher

__all__ = [
    "DDPBackwardSyncControl",
    "FabricSubprocessScriptLauncher",
    "LoopState",
    "MultiProcessingLauncher",
    "PathLike",
    "StepBoundaryLoops",
    "SubprocessScriptLauncher",
    "before_each_batch",
    "collect_rng_states",
    "destroy_dist_connection",
    "end_epoch_after_this_batch",
    "fabric_backward",
    "fabric_checkpoint",
    "has_own_checkpoint_io",
    "in_lightnings_signal_handler",
    "leave_signals_to",
    "lightning_last_checkpoint",
    "load_file",
    "resumable_at_boundary",
    "route_resume_start",
    "set_rng_states",
    "set_threads_per_rank",
    "slurm_requeue_checkpoint_path",
    "start_child_ranks",
    "trainer_checkpoint",
    "trainer_of",
    "training_loaders",
    "update_dataloader",
    "user_chose_checkpoint",
    "wrapping_checkpoint_io",
]


def wrapping_checkpoint_io() -> type | None:
    """Lightning's base of ``AsyncCheckpointIO`` (a checkpoint IO around another), where this Lightning has it."""
    try:
        from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    except ImportError:
        return None
    return _WrappingCheckpointIO


def has_own_checkpoint_io(wrapping_io: Any) -> bool:
    """Whether a wrapping checkpoint IO was given an IO of its own (else the strategy gives it its default)."""
    return bool(wrapping_io._base_checkpoint_io_configured)


@contextmanager
def fabric_backward(marked: bool) -> Generator[None, None, None]:
    """Mark the backward as ``fabric.backward`` marks it (Fabric's module refuses a backward it did not see), when
    ``marked``; a mark already set by Fabric stays."""
    if not marked:
        yield
        return
    fabric_wrappers._in_fabric_backward = True
    try:
        yield
    finally:
        fabric_wrappers._in_fabric_backward = False


def route_resume_start(trainer: Any, route: Callable[[Any], Any]) -> None:
    """Have the Trainer's checkpoint connector pass ``ckpt_path`` through ``route`` when the fit resolves it."""
    connector = trainer._checkpoint_connector
    resume_start = type(connector).resume_start.__get__(connector)

    def resume_start_routed(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        resume_start(route(checkpoint_path), *args, **kwargs)

    connector.resume_start = resume_start_routed


def user_chose_checkpoint(trainer: Any) -> bool:
    """Whether the user set the checkpoint through ``trainer.ckpt_path`` (Lightning's connector manages it then)."""
    return bool(trainer._checkpoint_connector._user_managed)


def lightning_last_checkpoint(trainer: Any) -> Any:
    """What Lightning makes of ``ckpt_path="last"`` for a fit."""
    from lightning.pytorch.trainer.states import TrainerFn

    return trainer._checkpoint_connector._parse_ckpt_path(
        TrainerFn.FITTING, "last", model_provided=True, model_connected=True
    )


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """``dataloader`` rebuilt with ``sampler``, as Lightning rebuilds a user's loader (its subclass and arguments)."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)


def training_loaders(trainer: Any) -> list[Any]:
    """The running fit's training loaders (empty before the fit loop has combined them)."""
    combined = trainer.fit_loop._combined_loader  # its len() fails on iterable loaders: test it against None
    return [] if combined is None else list(combined.flattened)


def end_epoch_after_this_batch(trainer: Any) -> None:
    """The loop ends the epoch after the running batch (and closes an accumulation window on it)."""
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


def trainer_of(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or ``None`` (its ``trainer`` property raises then)."""
    return getattr(module, "_trainer", None)


def leave_signals_to(trainer: Any, reinstall: Callable[[], None], previous: dict[int, Any], sigterm: bool) -> None:
    """Keep Lightning's own termination handling off the signals the strategy watches: its connector registers,
    at the start of every fit, a SIGTERM handler that broadcasts inside the handler (and SLURM's in-handler save);
    after it, ``reinstall`` puts the strategy's handlers back, and the handlers the connector restores at the end are
    those from before the strategy's (``previous``). With ``sigterm``, the flag broadcast Lightning's epoch loop runs
    before every training batch (a collective per step, for a flag only its handler sets) is skipped."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(type(connector), "register_signal_handlers"):
        return

    def register_then_reinstall() -> None:
        type(connector).register_signal_handlers(connector)
        originals = getattr(connector, "_original_handlers", None)
        if isinstance(originals, dict):
            originals.update(previous)
        reinstall()

    connector.register_signal_handlers = register_then_reinstall
    epoch_loop = trainer.fit_loop.epoch_loop
    if sigterm and hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        epoch_loop._broadcast_sigterm_tensor = lambda: None


def in_lightnings_signal_handler(error: BaseException) -> str | None:
    """The name of Lightning's signal handler that ``error`` was raised in (its SIGTERM handler broadcasts there,
    SLURM's requeue handler saves a checkpoint there), or ``None``. Python runs a handler at whatever line the main
    thread is on, so what the handler raised leaves that line half done."""
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    handlers = {
        getattr(_SignalConnector, name).__code__: name
        for name in ("_sigterm_notifier_fn", "_slurm_sigusr_handler_fn")
        if hasattr(_SignalConnector, name)
    }
    traceback = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code in handlers:
            return handlers[traceback.tb_frame.f_code]
        traceback = traceback.tb_next
    return None


def slurm_requeue_checkpoint_path(trainer: Any) -> str:
    """Where Lightning's SLURM ``auto_requeue`` saves, and where a requeued job's ``fit`` resumes from by itself
    (``hpc_ckpt_N.ckpt`` in ``default_root_dir``)."""
    return str(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def before_each_batch(trainer: Any, call: Callable[[], None]) -> Callable[[], None]:
    """``call()`` before each training batch is fetched and counted (the start of the epoch loop's ``advance``):
    the loop's state then is the one after the previous batch and everything that followed it (its validation, an
    epoch's end and the next one's start). Returns what undoes it."""
    loop: Any = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    original = getattr(loop, "advance", None)
    if original is None:
        raise RuntimeError(
            "lightning-ddp-plus: this Lightning's training epoch loop has no `advance`, where the strategy keeps "
            "every save a whole step. Use Lightning 2.5 or 2.6."
        )
    wrapper = original if isinstance(original, _CallsBefore) else _CallsBefore(original)
    loop.advance = wrapper
    wrapper.calls.append(call)

    def undo() -> None:
        if call in wrapper.calls:
            wrapper.calls.remove(call)
        if not wrapper.calls and vars(loop).get("advance") is wrapper:
            del loop.advance  # the class's method again

    return undo


class _CallsBefore:
    """A loop method, with the calls before it (several callers share one wrapper)."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.calls: list[Callable[[], None]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for call in list(self.calls):
            call()
        return self.method(*args, **kwargs)


class LoopState:
    """``loop.state_dict()`` of one fit's loop, read again in a few µs: the loops and progress records are found once
    (Lightning keeps them for the fit), and each record is copied field by field, where Lightning's
    ``dataclasses.asdict`` takes about 12 µs a record (90 µs for the fit loop's 7); so it can run at every step."""

    def __init__(self, loop: Any) -> None:
        self.loops: list[tuple[str, Any]] = []
        self.records: list[tuple[str, Any]] = []
        self._find(loop, "")
        # The fit loop's own state is its loaders' (``combined_loader``), there only for stateful loaders, and
        # asking costs 20 µs of protocol checks: without one, it stays empty for the fit.
        self.empty = {key for key, each in self.loops if isinstance(each, FitLoop) and not each.on_save_checkpoint()}

    def _find(self, loop: Any, prefix: str) -> None:
        self.loops.append((prefix + "state_dict", loop))
        for name, value in vars(loop).items():
            if isinstance(value, BaseProgress):
                self.records.append((prefix + name, value))
            elif isinstance(value, Loop):
                self._find(value, f"{prefix}{name}.")

    def __call__(self) -> dict[str, Any]:
        state = {key: {} if key in self.empty else loop.on_save_checkpoint() for key, loop in self.loops}
        for key, record in self.records:
            state[key] = _fields(record)
        return state


def resumable_at_boundary(fit_loop: dict[str, Any]) -> dict[str, Any]:
    """``fit_loop`` (a ``state_dict``) saved at a step boundary inside an epoch (after a batch's end and its
    validation, before the next batch, or at the next epoch's start), as Lightning's restore continues it exactly.

    As it is, every batch counter is equal, which the restore takes for a save made during that batch's validation
    (``RESTARTED_ON_LAST``): where validation is due at the batch (an epoch's last, ``val_check_interval``'s), it
    runs the rest of the batch's end again, counting ``_batches_that_stepped`` twice and stepping a step-interval
    ``ReduceLROnPlateau`` again, before any metric is logged (an error). Given as saved in the batch's own
    ``on_train_batch_end`` (completed and ``_batches_that_stepped`` one back), the restore counts the batch's end
    once and goes on with the next batch, whether validation is due or not. A state outside an epoch (the fit's end)
    is returned as it is: its restore runs no batch."""
    epochs, progress = fit_loop["epoch_progress"]["current"], fit_loop["epoch_loop.batch_progress"]
    total = progress["total"]
    inside_an_epoch = any(epochs[name] != epochs["processed"] for name in ("ready", "started"))
    if not inside_an_epoch or len(set(total.values())) != 1 or total["completed"] == 0:
        return fit_loop
    counters = fit_loop["epoch_loop.state_dict"]
    return {
        **fit_loop,
        "epoch_loop.batch_progress": {
            **progress,
            "total": {**total, "completed": total["completed"] - 1},
            "current": {**progress["current"], "completed": progress["current"]["completed"] - 1},
        },
        "epoch_loop.state_dict": {**counters, "_batches_that_stepped": counters["_batches_that_stepped"] - 1},
    }


class StepBoundaryLoops:
    """``call(loops)`` before each training batch that ``due()`` says starts an optimizer step: ``loops`` is the fit
    loop's state then, as Lightning's restore continues it (``resumable_at_boundary``). Read here, where the epoch
    loop's ``advance`` is wrapped (``before_each_batch``), so that the caller reads nothing of Lightning's loops
    itself; ``new_fit()`` forgets the loops found for the last fit (a restore replaces their records)."""

    def __init__(self, trainer: Any, call: Callable[[dict[str, Any]], None], due: Callable[[], bool]) -> None:
        self._trainer, self._call, self._due = trainer, call, due
        self._state: LoopState | None = None
        self.undo = before_each_batch(trainer, self._batch_starts)

    def new_fit(self) -> None:
        self._state = None

    def read(self) -> dict[str, Any]:
        """The fit loop's state now, as Lightning's restore continues it."""
        if self._state is None:  # the loops as this fit runs them (after a checkpoint's restore)
            self._state = LoopState(self._trainer.fit_loop)
        return resumable_at_boundary(self._state())

    def _batch_starts(self) -> None:
        if self._due():
            self._call(self.read())


def _fields(record: Any) -> dict[str, Any]:
    return {name: _fields(value) if isinstance(value, BaseProgress) else value for name, value in vars(record).items()}


def trainer_checkpoint(trainer: Any) -> dict[str, Any]:
    """What ``trainer.save_checkpoint`` would write, built on this rank alone (no barrier, no write)."""
    checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return checkpoint


def fabric_checkpoint(strategy: Any, state: dict[str, Any]) -> dict[str, Any]:
    """What ``fabric.save(path, state)`` would write (modules and optimizers as their state), built on this rank
    alone (no barrier, no write)."""
    checkpoint: dict[str, Any] = strategy._convert_stateful_objects_in_state(state, filter={})
    return checkpoint


def start_child_ranks(launcher: Any) -> list[Any]:
    """The popen launcher's child ranks started (Lightning's settings check first), without Lightning's observer;
    returns their processes."""
    launcher.cluster_environment.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    launcher._call_children_scripts()
    return list(launcher.procs)
