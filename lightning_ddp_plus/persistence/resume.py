"""Resuming a fit: which checkpoint, decided once for all ranks, loaded no wider than it must be, and the data
continued where the checkpoint's epoch stopped. ``ResumeCoordinator`` is the one object a front end talks to.

When a fit should resume (``resume_from_last``, or your own ``ckpt_path="last"``), the strategy hands Lightning
``NEWEST_READABLE`` instead of a path, so that every rank, with or without files in its view, reaches
``resume_start``; there, once the process group exists, rank 0 lists the candidates of the run's own checkpoint
directories (``checkpoint_files``), checks them newest first, and broadcasts its choice, so all ranks load the same
file. What happens when nothing is readable depends on who asked:

- ``resume_from_last="always"``: checkpoints exist and none is readable -> ``CheckpointResumeError`` on every rank
  (nothing there yet is a first run: it starts from scratch with a warning, as Lightning does);
- ``"on_restart"`` and a user's ``ckpt_path="last"``: a warning naming every file and why, then a start from
  scratch (a restart must not fail the same way until torchrun's restarts are used up).

The chosen file is loaded with ``weights_only=True``. A checkpoint that holds more than tensors and plain containers
(hyperparameters of your own classes, say) is loaded again with ``weights_only=False``, with a warning naming the
reason: it passed the check and lies in a directory this run's callbacks write to, so this job wrote it.

Lightning restores the loop counters of a mid-epoch checkpoint but starts the epoch's data from its first batch, so
the first batches are seen twice and the last ones never; ``SkipFirstSampler`` skips what the epoch had consumed.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import pickle
import re
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_ddp_plus.persistence.files import (
    NEWEST_READABLE,
    CheckpointResumeError,
    ResumeChoice,
    choose_resume,
    present_reason,
    resume_candidates,
    unreadable_reason,
)
from lightning_ddp_plus.persistence.generators import (
    GENERATORS_KEY,
    base_seed,
    every_ranks_generator_states,
    give_generators_back,
)
from lightning_ddp_plus.persistence.io import AtomicCheckpointIO, accepts_argument, is_local_path
from lightning_ddp_plus.persistence.runs import RUN_KEY, RunIdentity, sort_earlier_versions
from lightning_ddp_plus.persistence.world_size import (
    LAYOUT_KEY,
    DataLayout,
    ResumeAtSample,
    WorldSizeChange,
    plan_world_size_change,
)
from lightning_ddp_plus.private_apis.lightning import (
    lightning_last_checkpoint,
    route_resume_start,
    trainer_of,
    training_loaders,
    update_dataloader,
    user_chose_checkpoint,
)
from lightning_ddp_plus.processes.restart import restart_attempt

#: ``resume_from_last``: ``"on_restart"`` resumes an attempt that torchrun restarted after a failure.
ResumeMode = Literal["on_restart", "always", "never"]


def should_resume(mode: str, timeout: timedelta = timedelta(minutes=5)) -> bool:
    """Whether to resume from the last checkpoint: ``"on_restart"`` in a restarted torchrun attempt only."""
    if mode == "always":
        return True
    return mode == "on_restart" and (restart_attempt(timeout) or 0) > 0


#: Who asked for the resume: the strategy's ``resume_from_last`` mode, or ``"last"`` (the user's ``ckpt_path``).
ResumeRequest = str


#: Where a preemption saves when the Trainer has no ``ModelCheckpoint`` (under ``default_root_dir``); a resume looks
#: there too.
NO_CHECKPOINT_CALLBACK_PATH = os.path.join("checkpoints", "last.ckpt")


def checkpoint_directories(trainer: Any) -> tuple[list[str], list[str]]:
    """Where this run's saves may be: the directories of its ``ModelCheckpoint`` callbacks (resolved by their
    ``setup``); the files of its ``OnExceptionCheckpoint`` callbacks; without a ``ModelCheckpoint``, the preemption
    save's file; with SLURM's ``auto_requeue``, Lightning's requeue checkpoints (``hpc_ckpt_N.ckpt`` in
    ``default_root_dir``), where a preemption or a survivor's save goes there. The earlier logger versions beside a
    directory are ``runs.sort_earlier_versions``'s to take."""
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    directories = [
        str(callback.dirpath)
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint) and callback.dirpath
    ]
    files = [str(callback.ckpt_path) for callback in trainer.callbacks if isinstance(callback, OnExceptionCheckpoint)]
    if not directories:
        files.append(os.path.join(str(trainer.default_root_dir), NO_CHECKPOINT_CALLBACK_PATH))
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        root = str(trainer.default_root_dir)
        requeue_files = (
            sorted(name for name in os.listdir(root) if HPC_CHECKPOINT.fullmatch(name)) if os.path.isdir(root) else []
        )
        files += [os.path.join(root, name) for name in requeue_files]
    return directories, files


#: Lightning's SLURM requeue checkpoint names.
HPC_CHECKPOINT = re.compile(r"hpc_ckpt_\d+\.ckpt")


def writes_torch_zip(checkpoint_io: CheckpointIO) -> bool:
    """Whether files of ``checkpoint_io`` are ``torch.save`` archives, which can be checked without loading."""
    if isinstance(checkpoint_io, AtomicCheckpointIO):
        checkpoint_io = checkpoint_io.checkpoint_io
    inner = getattr(checkpoint_io, "checkpoint_io", None)  # AsyncCheckpointIO writes through its inner IO
    if inner is not None and not isinstance(checkpoint_io, TorchCheckpointIO):
        return writes_torch_zip(inner)
    return type(checkpoint_io) is TorchCheckpointIO


def choose(trainer: Any, checkpoint_io: CheckpointIO) -> ResumeChoice | None:
    """Rank 0's choice (``None`` when a checkpoint directory is not local: then Lightning's own ``"last"`` rule):
    the newest readable file of the run's own folders and of the earlier versions that hold this run's saves."""
    directories, files = checkpoint_directories(trainer)
    if not all(is_local_path(path) for path in [*directories, *files]):
        return None
    torch_files = writes_torch_zip(checkpoint_io)
    earlier = sort_earlier_versions(directories, can_read=torch_files)
    searched = (*directories, *earlier.taken)
    choice = choose_resume(resume_candidates(searched, files), unreadable_reason if torch_files else present_reason)
    from_earlier = choice.path is not None and os.path.dirname(choice.path) in map(os.path.realpath, earlier.taken)
    why = f"saved by this job ({earlier.identity.describe()}) in an earlier version" if from_earlier else None
    return dataclasses.replace(choice, searched=searched, why=why, left_out=earlier.describe_left())


def resolve(
    choice: ResumeChoice | None,
    request: ResumeRequest,
    directories: list[str],
    lightning_last: Callable[[], Any],
    warn: Callable[[str], None],
    info: Callable[[str], None],
) -> Any:
    """The ``ckpt_path`` that Lightning's ``resume_start`` gets for ``choice`` (the same on every rank)."""
    where = ", ".join(choice.searched if choice else directories) or "the run's checkpoint directories (none set)"
    if choice is None:
        info("DDPPlusStrategy: the checkpoint directory is not local; Lightning's rule for 'last' picks the file.")
        return lightning_last()
    if choice.left_out is not None:
        info(choice.left_out)
    if choice.path is not None:
        why = f"; {choice.why}" if choice.why else ""
        if choice.skipped:
            warn(
                f"DDPPlusStrategy: not resuming from {len(choice.skipped)} newer checkpoint(s): "
                f"{choice.describe_skipped()}. Resuming from {choice.path}, the newest readable checkpoint{why}, "
                "instead."
            )
        else:
            info(f"DDPPlusStrategy: resuming from {choice.path}, the newest readable checkpoint in {where}{why}.")
        return choice.path
    if choice.candidates == 0:
        warn(
            f"DDPPlusStrategy: a resume was requested but there is no checkpoint in {where} yet; starting from scratch."
        )
        return None
    message = f"none of the {choice.candidates} checkpoints in {where} is readable: {choice.describe_skipped()}"
    if request == "always":
        raise CheckpointResumeError(
            f"DDPPlusStrategy(resume_from_last='always'): {message}. Delete or restore those files to start from "
            "scratch or from a good copy, pass `ckpt_path=` a checkpoint you trust, or set `resume_from_last="
            "'on_restart'` to start from scratch when nothing is readable."
        )
    warn(f"DDPPlusStrategy: {message}. Starting from scratch.")
    return None


def load(checkpoint_io: CheckpointIO, path: str, warn: Callable[[str], None]) -> dict[str, Any]:
    """Load the chosen checkpoint with ``weights_only=True``, or, when its contents need more and the checkpoint IO
    can say so, with ``weights_only=False`` and a warning (see the module's docstring)."""
    if not accepts_argument(checkpoint_io.load_checkpoint, "weights_only"):
        warn(
            f"DDPPlusStrategy: {type(checkpoint_io).__name__}.load_checkpoint takes no `weights_only`, so {path} is "
            "loaded as that checkpoint IO loads it."
        )
        return checkpoint_io.load_checkpoint(path)
    try:
        return checkpoint_io.load_checkpoint(path, weights_only=True)
    except pickle.UnpicklingError as error:
        reason = next((line for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        warn(
            f"DDPPlusStrategy: {path} holds more than tensors and plain containers ({reason.strip() or error}); it "
            f"lies in {os.path.dirname(path)}, which this run's own callbacks write to, so it is loaded with "
            "`weights_only=False`. To keep resumes weights-only, register those classes with "
            "`torch.serialization.add_safe_globals([...])`."
        )
        return checkpoint_io.load_checkpoint(path, weights_only=False)


class SkipFirstSampler(Sampler[Any]):
    """``sampler`` without its first ``skip`` indices, on its next pass only (the rest of an interrupted epoch).

    >>> sampler = SkipFirstSampler(range(10), skip=4)
    >>> list(sampler), list(sampler), len(sampler)
    ([4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 10)
    """

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = sampler, skip
        #: every rank skips as many as the others: the shards stay as even as the sampler made them
        self.deals_every_rank_the_same = isinstance(sampler, DistributedSampler)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def restores_its_own_place(dataloader: Any) -> bool:
    """A loader with ``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``): Lightning saves its
    state in the checkpoint and gives it back at a resume, so it continues where it stopped by itself."""
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


class SkipFirstBatches:
    """``dataloader`` without its first ``skip`` batches, on its next pass only: they are fetched and dropped, as an
    iterable data set has no sampler to skip with. Everything else is the loader's own.

    >>> from torch.utils.data import DataLoader
    >>> loader = SkipFirstBatches(DataLoader(range(6), batch_size=2), skip=2)
    >>> [batch.tolist() for batch in loader], len(list(loader)), loader.batch_size, len(loader)
    ([[4, 5]], 3, 2, 3)

    Its length is the loader's, as ``SkipFirstSampler``'s is the sampler's: the epoch's batches, which the restored
    loop counts from where it stopped (a sized iterable data set stays sized, so a fractional
    ``val_check_interval`` still has an epoch to take a fraction of).
    """

    def __init__(self, dataloader: Any, skip: int) -> None:
        self.dataloader, self.skip = dataloader, skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.dataloader), skip, None)

    def __len__(self) -> int:
        return len(self.dataloader)  # a TypeError, as the loader's, where it has no length

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["dataloader"], name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopPosition:
    """Where a resumed fit's loop stands in the data, read when the training loader is built: from the Trainer's
    restored loop, or, for a loader built before Lightning restores it, from the checkpoint it is about to restore.

    Lightning's documented OneCycleLR recipe reads ``trainer.estimated_stepping_batches`` in ``configure_optimizers``,
    which builds the training loader inside the strategy's ``setup``, before ``restore_training_state``; the fit loop
    then keeps that loader. Read from the fresh loop, a mid-epoch resume would plan no skip (the epoch's first batches
    trained again, its last ones never). The checkpoint's loop state is the one Lightning restores, so it says the
    same as the restored loop, and a change to its batch counters (a world-size change) is restored with it.
    """

    restarting: bool
    """The fit restarts inside an epoch that was not finished (Lightning's ``fit_loop.restarting``)."""
    ready: int
    """The epoch's batches counted ready (``batch_progress.current.ready``)."""
    is_last_batch: bool
    """The checkpoint was taken on the epoch's last batch."""
    epoch: int
    """``trainer.current_epoch`` as the restored loop says it."""
    progress: dict[str, Any]
    """The batch progress' state (``state_dict``), which ``shift_batches`` changes."""
    set_progress: Callable[[dict[str, Any]], None]

    @classmethod
    def of_trainer(cls, trainer: Any) -> LoopPosition:
        fit_loop = trainer.fit_loop
        progress = fit_loop.epoch_loop.batch_progress
        return cls(
            restarting=bool(fit_loop.restarting),
            ready=int(progress.current.ready),
            is_last_batch=bool(progress.is_last_batch),
            epoch=int(trainer.current_epoch),
            progress=progress.state_dict(),
            set_progress=progress.load_state_dict,
        )

    @classmethod
    def of_checkpoint(cls, fit_loop: dict[str, Any], trainer: Any) -> LoopPosition:
        """From a checkpoint's ``loops["fit_loop"]``, as Lightning's restore will set the loop (its ``restarting``
        rule included: an epoch not finished, or training by steps)."""
        progress, epochs = fit_loop["epoch_loop.batch_progress"], fit_loop["epoch_progress"]["current"]
        unfinished = any(epochs[name] != epochs["processed"] for name in ("ready", "started"))
        return cls(
            restarting=unfinished or trainer.max_steps != -1,
            ready=int(progress["current"]["ready"]),
            is_last_batch=bool(progress["is_last_batch"]),
            epoch=int(epochs["completed"]),
            progress=progress,
            set_progress=lambda state: fit_loop.__setitem__("epoch_loop.batch_progress", state),
        )

    @property
    def consumed(self) -> int:
        """Batches of the current epoch that a mid-epoch checkpoint had consumed (0 when not restarting mid-epoch;
        a checkpoint taken on the epoch's last batch continues with the next epoch, from its beginning)."""
        return 0 if not self.restarting or self.is_last_batch else self.ready

    @property
    def at_epoch_end(self) -> bool:
        return self.restarting and self.is_last_batch

    def shift_batches(self, shift: int) -> None:
        """Every batch counter moved by ``shift`` (the same batches in another layout's batch size)."""
        state = {**self.progress}
        for tracker in ("current", "total"):
            state[tracker] = {name: count + shift for name, count in self.progress[tracker].items()}
        self.set_progress(state)


class ResumingStrategy(Protocol):
    """What the coordinator needs of the strategy it serves."""

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def checkpoint_io(self) -> CheckpointIO: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


class ResumeArguments(Protocol):
    """The strategy arguments resuming follows."""

    @property
    def resume_from_last(self) -> ResumeMode: ...

    @property
    def process_group_timeout(self) -> timedelta: ...

    @property
    def on_world_size_change(self) -> WorldSizeChange: ...


class ResumeCoordinator:
    """Owns the resume of a Trainer strategy's fits: the request before launch, the choice on every rank, the
    weights-only load of the chosen file, and the rest of an interrupted epoch's data.

    Args:
        arguments: ``resume_from_last``; ``process_group_timeout``, how long a rank waits for rank 0 to start a
            torchrun attempt; ``on_world_size_change``.
        strategy: the strategy whose process group, checkpoint IO and rank are used.
        warn: how warnings reach the user (rank 0 only).
        info: how one-line reports reach the user (rank 0 only).
    """

    def __init__(
        self,
        arguments: ResumeArguments,
        strategy: ResumingStrategy,
        warn: Callable[[str], None],
        info: Callable[[str], None],
        set_accumulation: Callable[[int], None],
    ) -> None:
        self.mode, self.timeout, self.strategy = arguments.resume_from_last, arguments.process_group_timeout, strategy
        self._warn, self._info = warn, info
        self.on_world_size_change = arguments.on_world_size_change
        self._set_accumulation = set_accumulation
        #: The layout of the checkpoint this fit loaded (``None``: none loaded, or one without a layout).
        self.saved_layout: DataLayout | None = None
        #: Every rank's generator states in the checkpoint this fit loaded, until they are given back (``None``: none).
        self.saved_generators: list[dict[str, Any] | None] | None = None
        self._sampler_seed: int | None = None
        self._request: ResumeRequest = "never"
        #: The file chosen on every rank (``None`` before a choice, or when nothing was chosen).
        self.chosen: str | None = None
        #: The loaded checkpoint's fit loop state, until the fit's loader is built, and whether the strategy's setup
        #: (before Lightning restores the loop) is running.
        self._loaded_fit_loop: dict[str, Any] | None = None
        self._before_restore = False

    def before_launch(self, trainer: Any, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The launched call's arguments: a fit that should resume gets ``NEWEST_READABLE`` as its ``ckpt_path``
        (unless it names a file), which Lightning's ``resume_start`` then resolves through ``choose_on_every_rank``."""
        from lightning.pytorch.trainer.states import TrainerFn

        self._loaded_fit_loop = None  # a checkpoint of this fit's, if any, is loaded after the launch
        if trainer.state.fn != TrainerFn.FITTING:
            return args
        parameters = list(inspect.signature(function).parameters)
        index = parameters.index("ckpt_path") if "ckpt_path" in parameters else None
        if index is None or index >= len(args) or user_chose_checkpoint(trainer):
            return args
        if args[index] == "last":
            self._request = "last"
        elif args[index] is None and should_resume(self.mode, self.timeout):
            self._request = self.mode
            self._info(f"DDPPlusStrategy: attempt {restart_attempt()} resumes from the newest readable checkpoint.")
        else:
            return args
        # Lightning resolves ``ckpt_path`` in its connector's ``resume_start``, before any public hook runs
        route_resume_start(
            trainer, lambda path: self.choose_on_every_rank(trainer) if path == NEWEST_READABLE else path
        )
        return (*args[:index], NEWEST_READABLE, *args[index + 1 :])

    def choose_on_every_rank(self, trainer: Any) -> Any:
        """Rank 0 chooses, every rank gets its choice (a collective), and the path Lightning should load."""
        choice = choose(trainer, self.strategy.checkpoint_io) if self.strategy.is_global_zero else None
        choice = self.strategy.broadcast(choice)

        directories, _ = checkpoint_directories(trainer)
        lightning_last = lambda: lightning_last_checkpoint(trainer)
        path = resolve(choice, self._request, directories, lightning_last, self._warn, self._info)
        self.chosen = None if path is None else str(path)
        return path

    def load_checkpoint(
        self, path: Any, lightning_load: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """The strategy's ``load_checkpoint``: the chosen file weights-only (see the module's docstring); any other
        file, or a ``weights_only`` you set, as Lightning loads it (``lightning_load``)."""
        chosen_here = self.chosen is not None and str(path) == self.chosen
        if not chosen_here or args or kwargs.get("weights_only") is not None:
            checkpoint = lightning_load(path, *args, **kwargs)
        else:
            torch.cuda.empty_cache()
            checkpoint = load(self.strategy.checkpoint_io, str(path), self._warn)
        layout = checkpoint.get(LAYOUT_KEY)
        self.saved_layout = DataLayout.from_dict(layout) if isinstance(layout, dict) else None
        loops = checkpoint.get("loops")  # restored by Lightning from this very dict, after the strategy's setup
        self._loaded_fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
        generators = checkpoint.get(GENERATORS_KEY)
        self.saved_generators = generators if isinstance(generators, list) else None
        self._sampler_seed = self.saved_layout.seed if self.saved_layout is not None else None
        return checkpoint

    def give_generators_back(self, rank: int, world_size: int) -> None:
        """Before the first training batch after a resume: this rank's generator states from the checkpoint, or, for
        a rank it did not have, generators seeded from the seed and the rank (``generators``)."""
        saved, self.saved_generators = self.saved_generators, None
        if saved is None:
            return
        give_generators_back(saved, rank, self._sampler_seed)
        seed = base_seed(self._sampler_seed)
        if world_size > len(saved):  # said once, by rank 0, for every new rank
            new = range(len(saved), world_size)
            names = f"rank {new[0]}" if len(new) == 1 else f"ranks {new[0]}-{new[-1]}"
            self._info(
                f"DDPPlusStrategy: {names} did not exist when the checkpoint was taken (on {len(saved)} ranks): "
                f"random generators of a new rank start from seed {seed} plus its rank."
            )
        lost = [str(held) for held in range(min(world_size, len(saved))) if saved[held] is None]
        if lost:
            self._info(
                f"DDPPlusStrategy: the checkpoint was saved by a survivor of a rank's death and holds no random "
                f"generator states of rank(s) {', '.join(lost)} (the dead went with it): they start from seed {seed} "
                "plus their rank."
            )

    def saving(
        self,
        checkpoint: dict[str, Any],
        module: Any,
        accumulation: int,
        chunk_size: int | None = None,
        gather_generators: bool = True,
    ) -> dict[str, Any]:
        """The checkpoint with the layout it is taken with (``DataLayout``), during a fit of ``module``, and every
        rank's random generator states (``gather_generators``: a gather; off for a survivor's save after a rank's
        death, whose collective would include the dead rank)."""
        trainer = trainer_of(module)
        if trainer is None:
            return checkpoint
        checkpoint[RUN_KEY] = RunIdentity.of_this_process().as_dict()  # the job a resume may take this save for
        try:
            if gather_generators:
                checkpoint[GENERATORS_KEY] = every_ranks_generator_states()
        except RuntimeError as error:  # a peer is gone (a save while the job fails): the rest of the save still counts
            self._warn(f"DDPPlusStrategy: the checkpoint keeps no random generator states ({error}).")
        loaders = training_loaders(trainer)
        loader = loaders[0] if len(loaders) == 1 and isinstance(loaders[0], DataLoader) else None
        if loader is None or loader.batch_size is None:
            return checkpoint
        inner: Any = getattr(loader.sampler, "sampler", loader.sampler)  # inside a ResumeAtSample or SkipFirstSampler
        sampler: DistributedSampler[Any] | None = inner if isinstance(inner, DistributedSampler) else None
        checkpoint[LAYOUT_KEY] = DataLayout(
            world_size=trainer.world_size,
            rows_per_rank=loader.batch_size,
            accumulation=accumulation,
            epoch=trainer.current_epoch,
            batches_consumed=int(trainer.fit_loop.epoch_loop.batch_progress.current.ready),
            dataset_length=len(sampler.dataset) if sampler is not None else None,  # type: ignore[arg-type]  # a sampler's dataset is sized
            shuffle=bool(sampler.shuffle) if sampler is not None else False,
            seed=int(sampler.seed) if sampler is not None else 0,
            chunk_size=chunk_size,
        ).as_dict()
        return checkpoint

    @contextmanager
    def loop_not_restored(self) -> Generator[None, None, None]:
        """Around the strategy's ``setup``: a training loader built there (``estimated_stepping_batches``) is built
        before Lightning restores the loop, so its place in the data is read from the checkpoint (``LoopPosition``)."""
        self._before_restore = True
        try:
            yield
        finally:
            self._before_restore = False

    def position(self, trainer: Any) -> LoopPosition:
        if self._before_restore and self._loaded_fit_loop is not None:
            return LoopPosition.of_checkpoint(self._loaded_fit_loop, trainer)
        return LoopPosition.of_trainer(trainer)

    def dataloader(self, dataloader: Any, trainer: Any) -> Any:
        """The training loader continuing where the checkpoint's epoch stopped, or ``dataloader`` itself."""
        position = self.position(trainer)
        consumed = position.consumed
        layout, self.saved_layout = self.saved_layout, None
        if layout is not None:  # where the restored loop stands (an epoch's end resumes at the next one's start)
            epoch = position.epoch + 1 if position.at_epoch_end else position.epoch
            layout = dataclasses.replace(layout, epoch=epoch, batches_consumed=consumed)
        plan = None if layout is None else plan_world_size_change(layout, trainer.world_size, self.on_world_size_change)
        if plan is not None:
            # the loop's counters are in the checkpoint's batches, the epoch's end included: Lightning starts the
            # next epoch only when they reach the epoch's batches of this run
            counted = position.ready if position.at_epoch_end else consumed
            assert layout is not None  # a plan comes from a layout
            return self._resume_on_another_world_size(dataloader, trainer, layout, plan, counted, position)
        if consumed == 0 or not isinstance(dataloader, DataLoader):
            return dataloader
        if restores_its_own_place(dataloader):  # Lightning gave it its state back: skipping would skip twice
            self._info(f"DDPPlusStrategy: resuming mid-epoch after {consumed} batches; the loader restores its place.")
            return dataloader
        if isinstance(dataloader.dataset, IterableDataset):
            self._info(
                f"DDPPlusStrategy: resuming mid-epoch after {consumed} batches; the training data is an iterable data "
                "set, which cannot skip, so those batches are fetched again and dropped, not trained (exact when it "
                "yields the same batches in the same order again)."
            )
            return SkipFirstBatches(dataloader, consumed)
        if dataloader.batch_size is None:
            return dataloader
        self._info(
            f"DDPPlusStrategy: resuming mid-epoch, skipping the {consumed} batches the epoch had consumed before the "
            "checkpoint (Lightning's warning that the loader is not resumable does not apply: the sampler is)."
        )
        return update_dataloader(dataloader, SkipFirstSampler(dataloader.sampler, consumed * dataloader.batch_size))

    def _resume_on_another_world_size(
        self, dataloader: Any, trainer: Any, layout: DataLayout, plan: Any, consumed: int, position: LoopPosition
    ) -> Any:
        """Accumulation as planned, the loop's batch counters in the new layout's batches, and the rest of the
        epoch's permutation dealt to the new ranks (``ResumeAtSample``)."""
        sampler = getattr(dataloader, "sampler", None)
        if restores_its_own_place(dataloader):  # Lightning saves and loads its state: only k changes
            self._set_accumulation(plan.accumulation)
            if trainer.lightning_module.automatic_optimization:
                trainer.accumulate_grad_batches = plan.accumulation
            self._info(f"DDPPlusStrategy: {plan.message.rsplit(', resuming', 1)[0]}; the loader restores its place.")
            return dataloader
        if not isinstance(sampler, DistributedSampler) or dataloader.batch_size != layout.rows_per_rank:
            raise CheckpointResumeError(
                f"{plan.message.split(':')[0]}, and the training loader is not one the strategy can place on the new "
                "ranks (it needs Lightning's DistributedSampler and the same batch size as the checkpoint's, "
                f"{layout.rows_per_rank}). Fix: resume on {layout.world_size} ranks, or let Lightning add the sampler "
                "(`use_distributed_sampler=True`) and keep the batch size."
            )
        self._set_accumulation(plan.accumulation)
        trainer.accumulate_grad_batches = plan.accumulation if trainer.lightning_module.automatic_optimization else 1
        samples = consumed * layout.rows_per_rank * layout.world_size
        shift = samples // (layout.rows_per_rank * plan.world_size) - consumed
        position.shift_batches(shift)  # the loop's batch counters in the new layout's batches
        self._info(f"DDPPlusStrategy: {plan.message}.")
        if layout.batches_consumed == 0:  # an epoch's start: the sampler's own order, from its first sample
            return dataloader
        return update_dataloader(dataloader, ResumeAtSample(sampler, samples, position.epoch))
