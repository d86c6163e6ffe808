"""Process plumbing: settle Trainer settings before anything launches, end the whole job when a rank fails, and
bring spawned workers' results back to the caller.

Lightning's popen launcher kills everything within 5 s when a *child* rank exits with an error, the launching
process included, and leaves the children waiting in a collective until the timeout when the launching process (rank
0) fails or is killed. The popen launcher below kills its children when rank 0 fails, and children it starts watch
their parent and exit when it is gone. Neither end comes before a survivor that is saving after a rank's death
(``save_on_rank_death``) has saved: ``AFTER_DEATH`` says whether the main thread is at it, and the threads that end
the process wait for it, within a bound (``after_death_window.AfterDeathWindow``).

A launcher's ``launch`` is the one point of Lightning's flow that has the Trainer, after all its settings are known
and before any process is started, in every process of the job: that is where ``before_launch`` runs.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_ddp_plus.private_apis.lightning import (
    FabricSubprocessScriptLauncher,
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    destroy_dist_connection,
    set_threads_per_rank,
    start_child_ranks,
)
from lightning_ddp_plus.private_apis.torch_distributed import default_group
from lightning_ddp_plus.processes.after_death_window import AFTER_DEATH, AfterDeathWindow

#: How the ranks are started (Lightning's launchers): ``popen`` re-runs the script, the others start workers.
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
PARENT_PID_VARIABLE = "DDP_PLUS_LAUNCHER_PID"

#: ``before_launch(trainer, function, args) -> args``: may settle Trainer settings and adjust the launched call.
BeforeLaunch = Callable[[Any, Callable[..., Any], tuple[Any, ...]], tuple[Any, ...]]
#: ``after_failure(trainer, error) -> error``: in every process, as an error leaves the launched function; returns
#: the error to raise instead (``None``: the error itself).
AfterFailure = Callable[[Any, BaseException], BaseException | None]


def nodes_of_this_attempt(
    environment: Any, devices: int, num_nodes: int, front_end: str = "Trainer"
) -> tuple[int, str | None]:
    """The number of nodes the job has now, and a line saying why it is not ``num_nodes``.

    Under torchrun, torchrun's membership decides: an elastic job (``--nnodes=MIN:MAX``) restarts on the nodes that
    are there, so an attempt may have fewer or more than ``Trainer(num_nodes=...)`` (``front_end``) says, and Lightning would refuse
    it ("the product does not match the world size"). Elsewhere, or when the devices per node differ from what
    torchrun started, ``num_nodes`` stays (and Lightning's own check speaks).

    >>> nodes_of_this_attempt(None, devices=1, num_nodes=2)
    (2, None)
    """
    if not isinstance(environment, TorchElasticEnvironment):
        return num_nodes, None
    world = environment.world_size()
    started_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", devices))
    if devices * num_nodes == world or started_per_node != devices or world % devices:
        return num_nodes, None
    nodes = world // devices
    return nodes, (
        f"DDPPlusStrategy: torchrun started this attempt on {nodes} node(s) of {devices} rank(s) each, where "
        f"`{front_end}(num_nodes={num_nodes})` says {num_nodes}: training on the {world} rank(s) torchrun started "
        "(an elastic job's membership decides)."
    )


class ParentWatchedFabricLauncher(FabricSubprocessScriptLauncher):
    """Fabric's popen launcher, plus: the child ranks it starts exit as soon as the launching process is gone
    (``watch_parent``). ``fabric.launch()`` returns to the user's script in rank 0, so a failure there never passes
    through the launcher, and without this the children would wait in their next collective until the timeout.
    A child's failure ends the job as Lightning's observer ends it, but after a survivor's save when the user's loop
    is in ``fabric.strategy.save_after_rank_death`` (``ChildObserver``)."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        AFTER_DEATH.reset(enabled=False)  # the user's `save_after_rank_death` block turns it on
        if not self.cluster_environment.creates_processes_externally:
            first_child = self.cluster_environment.node_rank() * self.num_processes + 1
            ChildObserver(start_children_knowing_their_parent(self), first_child).start()
        set_threads_per_rank(num_processes=self.num_processes)
        return function(*args, **kwargs)


class _SettlesBeforeLaunch:
    """Calls ``before_launch`` at the start of ``launch``, in every process, before anything is started; and
    ``after_fit`` in every process once the launched function returned (a notice held for after the fit). The
    front end sets both on the launcher it builds."""

    before_launch: BeforeLaunch | None = None
    after_fit: Callable[[Any], None] | None = None

    def _fit_over(self, trainer: Any | None) -> None:
        if self.after_fit is not None:
            self.after_fit(trainer)

    def _settle(self, trainer: Any | None, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
        if trainer is not None and self.before_launch is not None:
            return self.before_launch(trainer, function, args)
        return args


def start_children_knowing_their_parent(launcher: Any) -> list[Any]:
    """The popen launcher's children, started with this process's id in their environment (``watch_parent``); this
    process's own environment is left as it was (a later job started from it must not inherit the id)."""
    before = os.environ.get(PARENT_PID_VARIABLE)
    os.environ[PARENT_PID_VARIABLE] = str(os.getpid())
    try:
        return start_child_ranks(launcher)
    finally:
        if before is None:
            del os.environ[PARENT_PID_VARIABLE]
        else:
            os.environ[PARENT_PID_VARIABLE] = before


def failure_handled(
    function: Callable[..., Any], trainer: Any | None, after_failure: AfterFailure | None
) -> Callable[..., Any]:
    """``function``, whose error first goes through ``after_failure`` (inside ``AFTER_DEATH.saving``), in the
    process that raised it, before any launcher kills a rank."""
    if after_failure is None:
        return function

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            with AFTER_DEATH.saving():
                instead = after_failure(trainer, error)
            if instead is not None and instead is not error:
                raise instead from error
            raise

    return run


class KillChildrenOnFailureLauncher(_SettlesBeforeLaunch, SubprocessScriptLauncher):
    """Lightning's popen launcher, plus: if rank 0 fails, its child ranks are killed before the error propagates;
    a child's failure ends the job after rank 0's save (``ChildObserver``) instead of within 5 s."""

    def __init__(
        self, cluster_environment: Any, num_processes: int, num_nodes: int, after_failure: AfterFailure | None = None
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.after_failure = after_failure

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any | None = None, **kwargs: Any) -> Any:
        args = self._settle(trainer, function, args)
        AFTER_DEATH.reset(enabled=self.after_failure is not None)
        function = failure_handled(function, trainer, self.after_failure)
        try:
            if not self.cluster_environment.creates_processes_externally:
                first_child = self.cluster_environment.node_rank() * self.num_processes + 1
                ChildObserver(start_children_knowing_their_parent(self), first_child).start()
            set_threads_per_rank(num_processes=self.num_processes)
            result = function(*args, **kwargs)
        except BaseException as error:
            # a preemption (every rank saved the same step) or a death the survivors saved after (each raises the
            # same error once the save is over): the others end on their own
            if isinstance(error, SIGTERMException) or getattr(error, "ends_every_survivor", False):
                wait_for_children(getattr(self, "procs", []), CHILDREN_END_GRACE_S)
            self.kill(signal.SIGKILL)
            raise
        self._fit_over(trainer)
        return result


#: How long rank 0 waits for the ranks it started to end by themselves after a preemption or a survivors' save,
#: before killing them.
CHILDREN_END_GRACE_S = 20.0


class ChildObserver(threading.Thread):
    """In the launching process: once a child rank has exited with an error, end the job (every child, then this
    process) as Lightning's observer does, but only after this process's main thread has saved what it can after
    the death (``AFTER_DEATH``); when its save is over, the error it raises ends the job instead."""

    def __init__(
        self,
        children: list[subprocess.Popen[Any]],
        first_rank: int,
        poll_seconds: float = 0.5,
        window: AfterDeathWindow = AFTER_DEATH,
    ) -> None:
        super().__init__(daemon=True, name="ddp-plus-child-observer")
        self.children, self.first_rank, self.poll_seconds, self.window = children, first_rank, poll_seconds, window
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Stop watching and return once the thread has ended (the children are not touched)."""
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self.poll_seconds + 1.0)  # it returns at once from its wait, unless amid a save

    @override
    def run(self) -> None:
        while True:
            if self._stopped.wait(self.poll_seconds):
                return
            codes = [child.poll() for child in self.children]
            if all(code == 0 for code in codes):
                return
            if any(codes):
                break
        window = self.window
        window.peer_died({self.first_rank + index for index, code in enumerate(codes) if code})
        window.wait()
        if window.finished.is_set():
            return  # the main thread saved and is raising: the launcher ends the children
        for child in self.children:
            with contextlib.suppress(OSError):
                child.send_signal(signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def wait_for_children(processes: list[Any], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


class ResultsReturningLauncher(_SettlesBeforeLaunch, MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, plus ``before_launch`` and the strategy's results (findings, counts,
    resolved settings) carried from rank 0's worker back to the strategy object in the launching process.

    No save after a rank's death here: when a worker dies, torch's ``start_processes`` ends the others at once."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any | None = None, **kwargs: Any) -> Any:
        args = self._settle(trainer, function, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(self, process_idx: int, trainer: Any, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(process_idx, trainer, *args, **kwargs)
        self._fit_over(trainer)  # in the worker, its results handed back first

    @override
    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra["ddp_plus"] = trainer.strategy.engine.results()
        return extra

    @override
    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if "ddp_plus" in extra:
            extra["ddp_plus"].apply_to(trainer.strategy.engine)  # a WorkerResults, in the launching process


def end_process_now(code: int) -> None:
    """End this process from a thread other than the main one, whose collective may never return: Python's logging
    handlers and the standard streams are flushed first (what a logger has not written yet would be lost), then the
    process exits at once with ``code`` (``atexit`` handlers would wait for the main thread)."""
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


#: The launching process of this child rank, as ``watch_parent`` found it (empty: not a child of the popen launcher).
_launched_by: list[int] = []


def launching_process_gone() -> bool:
    """In a child rank of the popen launcher: whether the launching process that hosted the job's store is gone.
    Only node 0's launching process (global rank 0) hosts it; another node's launching process is a rank like any
    other, whose death leaves the store to its children (Lightning sets ``NODE_RANK`` for them)."""
    hosted_store = os.environ.get("NODE_RANK", "0") == "0"
    return hosted_store and bool(_launched_by) and os.getppid() != _launched_by[-1]


def watch_parent(poll_seconds: float = 1.0) -> threading.Thread | None:
    """In a child rank started by ``KillChildrenOnFailureLauncher``: exit as soon as the launching process is gone."""
    expected = os.environ.get(PARENT_PID_VARIABLE)
    if expected is None or int(expected) != os.getppid() or int(expected) == os.getpid():
        return None  # not started by that launcher (a variable inherited from further up says nothing)
    _launched_by.append(int(expected))

    def run() -> None:
        while os.getppid() == int(expected):
            time.sleep(poll_seconds)
        AFTER_DEATH.peer_died(set())
        AFTER_DEATH.wait()  # a save of the last step by this survivor comes first
        if AFTER_DEATH.finished.is_set():
            time.sleep(AFTER_DEATH.exit_seconds)  # the main thread raises what it saved and ends the process itself
        end_process_now(1)  # the launcher died: nobody will complete this rank's collectives

    thread = threading.Thread(target=run, name="ddp-plus-parent-watch", daemon=True)
    thread.start()
    return thread


#: The backends whose collectives wait for a dead peer until the process group's timeout instead of failing when its
#: connections close: NCCL (its kernels spin on the device; torch's watchdog acts only at the timeout).
WAIT_FOR_THE_DEAD = frozenset({"nccl"})


def abort_collectives_on_a_death() -> None:
    """After the process group exists: on a backend that waits for the dead (``WAIT_FOR_THE_DEAD``), a death the
    launcher sees aborts this process's communicators (``ProcessGroup.abort``), so that a survivor leaves its hung
    collective within seconds, not at the timeout. What then happens is torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``:
    with ``2`` the survivor's wait raises and it saves the last step; with torch's default (``3``) torch ends the
    process, and the job ends, saving nothing, but at once."""
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else ""
    AFTER_DEATH.leave_collectives = abort_default_group if backend in WAIT_FOR_THE_DEAD else None


def abort_default_group() -> None:
    default_group().abort()


_held_groups: list[Any] = []
_registered = False


def register_process_group_shutdown() -> None:
    """Destroy the process group at exit, on the main thread, while the interpreter is still whole.

    Two ways a gloo group otherwise ends a finished run with SIGABRT, both seen here:

    - the group outlives ``atexit`` (e.g. a DDP wrapper left in a reference cycle holds it through its reducer) and is
      destroyed by the interpreter's final garbage collection; its worker threads may then release Python-owned
      tensors of a finished collective, a thread that asks for the GIL during shutdown is ended by CPython, and the
      forced unwind through a C++ destructor calls ``std::terminate``;
    - the script destroys the group itself while a worker thread still holds the last reference to a finished
      collective whose Python callback (PowerSGD's, for one) closes over the group: the worker then destroys the
      group and joins itself (``std::system_error``).

    So the group created for this strategy is held until the ``atexit`` handler, which collects cyclic garbage,
    destroys the group if the script has not, and only then drops the last reference, on the main thread, after the
    workers have long gone idle.
    """
    global _registered
    if dist.is_available() and dist.is_initialized():
        group = default_group()
        if not any(held is group for held in _held_groups):
            _held_groups.append(group)
    if not _registered:
        _registered = True
        atexit.register(_shutdown_process_group)


def _shutdown_process_group() -> None:
    gc.collect()
    destroy_dist_connection()
    _held_groups.clear()
    gc.collect()


def remove_leftover_forward_redirection(module: Any) -> None:
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
