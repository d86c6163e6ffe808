"""Checkpoint writes that are atomic on the checkpoint's own filesystem.

Lightning's ``TorchCheckpointIO`` serializes the checkpoint into memory, writes it to a temporary file in the system
temp dir and moves that over the target: a rename only when both are on one filesystem (else a copy, which a kill
or a full disk tears), nothing is fsynced (a node crash can leave a renamed but short file), and the temp dir must
hold the whole checkpoint. ``AtomicCheckpointIO`` writes a temporary file beside the target instead, fsyncs it,
renames it over the target and fsyncs the directory, so a reader sees the old file or the new one, whole, even after
a SIGKILL or a power cut. ``torch.save`` streams into that file, so peak memory is lower than Lightning's (no
in-memory copy of the serialized checkpoint).

What each kind of path gets:

- a local path (any POSIX filesystem: a disk, a tmpfs, NFS, Lustre): the temporary file, fsync, rename, fsync above;
- an object store (``s3://``, ``gs://``, ``az://`` ...): no rename exists there; the write goes through the wrapped
  checkpoint IO, and an object store makes an object visible only once its upload completed, so a reader sees the
  previous object or the new one, never a part (the store's guarantee, not ours);
- any other fsspec filesystem: the wrapped checkpoint IO, with whatever that filesystem promises.

A checkpoint IO that you pass (``DDPPlusStrategy(checkpoint_io=...)`` or ``Trainer(plugins=[...])``) stays yours:
``strategy.checkpoint_io`` is that object, with its own methods and attributes (``AtomicSaves``). Saves are
made atomic where what the IO writes is known:

- no IO passed: the strategy's default is ``AtomicCheckpointIO()`` (Lightning's format, saved atomically);
- Lightning's own ``TorchCheckpointIO`` (that class exactly): kept, and the strategy's saves write its format through
  the temporary file;
- ``AsyncCheckpointIO()`` with no IO of its own: its thread writes through ``AtomicCheckpointIO()`` (the default the
  strategy gives it, as Lightning gives it a ``TorchCheckpointIO``);
- any other IO: it saves as it saves, which the strategy says once; it may write elsewhere than the path it is given
  (an upload, a directory of shards), so renaming its output could lose it. Pass ``AtomicCheckpointIO(your_io)`` to
  have it write to the temporary file, which is then fsynced and renamed.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_ddp_plus.private_apis.lightning import PathLike, has_own_checkpoint_io, load_file, wrapping_checkpoint_io

log = logging.getLogger(__name__)

#: Temporary files end with this, so no ``*.ckpt`` listing (Lightning's or ours) ever picks one up.
TEMPORARY_SUFFIX = ".ddp-plus-tmp"
_STARTED = time.time()


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the message names the path and its filesystem's free space.

    It is an ``OSError`` with the original ``errno`` (``ENOSPC`` for a full disk), so code that catches ``OSError``
    still catches it.
    """


def is_local_path(path: PathLike) -> bool:
    """Whether ``path`` is on the local (POSIX) filesystem, where a rename replaces a file atomically."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(get_filesystem(path), LocalFileSystem)


def temporary_path(target: Path) -> Path:
    """A fresh temporary name beside ``target``, hidden and never ending in ``.ckpt``."""
    return target.with_name(f".{target.name}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:  # some filesystems refuse fsync on a directory; the rename itself is still atomic there
        pass
    finally:
        os.close(descriptor)


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete the temporary files that a save killed before this process started left in ``directory``.

    Only files older than this process are removed, so a save in progress elsewhere is left alone.
    """
    removed = []
    with suppress(OSError):
        for path in directory.glob(f".*{TEMPORARY_SUFFIX}"):
            with suppress(OSError):
                if path.stat().st_mtime < _STARTED:
                    path.unlink()
                    removed.append(path)
    return removed


def _free_space(directory: Path) -> str:
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"


def save_error(error: OSError, target: Path, written: int | None) -> CheckpointSaveError:
    """``error`` restated: which checkpoint, which filesystem, how much room, what was kept, the fix."""
    directory = target.parent
    what = os.strerror(error.errno) if error.errno else str(error)
    size = f" after {written / 2**20:.1f} MiB were written" if written else ""
    fix = (
        "free space there, or point `ModelCheckpoint(dirpath=...)` at a filesystem with room for the checkpoint"
        if error.errno in (errno.ENOSPC, errno.EDQUOT)
        else "check that the directory exists and is writable"
    )
    return CheckpointSaveError(
        error.errno,
        f"Saving the checkpoint {target} failed{size}: {what} ({_free_space(directory)} on the filesystem of "
        f"{directory}). The previous checkpoints are untouched and the temporary file was removed; {fix}.",
    )


def atomic_write(target: PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write(temporary)`` for a temporary file beside ``target``, then fsync it, rename it over ``target`` and
    fsync the directory. On any failure the temporary file is removed and ``target`` is left as it was.

    >>> import tempfile
    >>> directory = Path(tempfile.mkdtemp())
    >>> atomic_write(directory / "a.ckpt", lambda path: path.write_bytes(b"whole"))
    >>> (directory / "a.ckpt").read_bytes(), sorted(p.name for p in directory.iterdir())
    (b'whole', ['a.ckpt'])
    >>> shutil.rmtree(directory)
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(target)
    try:
        write(temporary)
        _fsync_written(temporary)
        os.replace(temporary, target)  # a symlink at target (save_last="link") is replaced, its file is not touched
    except BaseException as error:
        written = temporary.stat().st_size if temporary.exists() else None
        with suppress(OSError):
            if temporary.is_dir():
                shutil.rmtree(temporary)
            else:
                temporary.unlink()
        cause = _os_error_in(error)
        if cause is not None:
            raise save_error(cause, target, written) from error
        raise
    fsync_directory(target.parent)


def _os_error_in(error: BaseException) -> OSError | None:
    """The ``OSError`` behind ``error``: itself, or the one torch's zip writer was handling when it raised its own
    ``RuntimeError`` ("unexpected pos ...") on the way out."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, CheckpointSaveError):
            return None
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _fsync_written(path: Path) -> None:
    if path.is_dir():  # a checkpoint IO that writes a directory: make every file in it durable
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            _fsync_written(file)
        fsync_directory(path)
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _torch_save(checkpoint: dict[str, Any]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        # O_EXCL: the name is fresh, never someone else's file; 0o666 lets the umask decide, as open() does
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(descriptor, "wb") as handle:
            torch.save(checkpoint, handle)

    return write


def accepts_argument(method: Callable[..., Any], name: str) -> bool:
    """Whether ``method`` takes the keyword argument ``name`` (named, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


class AtomicCheckpointIO(CheckpointIO):
    """Saves through ``checkpoint_io`` (Lightning's ``TorchCheckpointIO`` when ``None``) atomically on the target's
    own filesystem; loads and removes through it unchanged (see the module's docstring for what each path gets).

    Args:
        checkpoint_io: the checkpoint IO to wrap. With ``None`` or a plain ``TorchCheckpointIO``, ``torch.save``
            writes straight into the temporary file.

    >>> import tempfile
    >>> directory = Path(tempfile.mkdtemp())
    >>> io = AtomicCheckpointIO()
    >>> io.save_checkpoint({"step": torch.tensor(3)}, directory / "last.ckpt")
    >>> io.load_checkpoint(directory / "last.ckpt", weights_only=True)["step"]
    tensor(3)
    >>> shutil.rmtree(directory)
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()
        self._cleaned: set[Path] = set()

    @property
    def writes_directly(self) -> bool:
        """Whether ``torch.save`` writes the file itself (the wrapped IO is Lightning's own, not a subclass)."""
        return type(self.checkpoint_io) is TorchCheckpointIO

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        if not is_local_path(path):
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        target = Path(os.path.abspath(os.fspath(path)))
        self._clean_once(target.parent)
        if self.writes_directly:
            if storage_options is not None:  # what Lightning's TorchCheckpointIO says, so behaviour does not change
                raise TypeError(
                    "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not supported "
                    "for `TorchCheckpointIO`. Please implement your custom `CheckpointIO` to define how you'd like "
                    "to use `storage_options`."
                )
            atomic_write(target, _torch_save(checkpoint))
            return

        def write(temporary: Path) -> None:
            self.checkpoint_io.save_checkpoint(checkpoint, temporary, storage_options=storage_options)

        atomic_write(target, write)

    def load_checkpoint(self, path: PathLike, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        location = map_location if map_location is not None else (lambda storage, loc: storage)
        if self.writes_directly:  # Lightning's own loader, with weights_only on every Lightning version
            if not get_filesystem(path).exists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            return load_file(path, map_location=location, weights_only=weights_only)
        if accepts_argument(self.checkpoint_io.load_checkpoint, "weights_only"):
            return self.checkpoint_io.load_checkpoint(path, map_location=location, weights_only=weights_only)
        return self.checkpoint_io.load_checkpoint(path, map_location=location)

    def remove_checkpoint(self, path: PathLike) -> None:
        self.checkpoint_io.remove_checkpoint(path)

    def teardown(self) -> None:
        self.checkpoint_io.teardown()

    def _clean_once(self, directory: Path) -> None:
        if directory not in self._cleaned:
            self._cleaned.add(directory)
            for path in remove_stale_temporaries(directory):
                log.info(f"Removed {path}, the temporary file of a save that was killed before this run.")


class AtomicSaves:
    """What a front end owns for ``atomic_checkpoints``: the checkpoint IO you passed, untouched, or an atomic
    default, and saves made atomic where that is sound (see the module's docstring). ``atomic_checkpoints=False``
    keeps Lightning's behaviour.

    A front end reads its ``checkpoint_io`` through ``io_in_effect`` and runs its ``save_checkpoint`` inside
    ``saving``.

    Args:
        enabled: ``atomic_checkpoints``.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        #: While the strategy itself saves through Lightning's ``TorchCheckpointIO``: the same format, atomically.
        self.saving_view: CheckpointIO | None = None
        self._said_not_atomic = False

    def default_io(self, passed: CheckpointIO | None) -> CheckpointIO | None:
        """The strategy's IO, where Lightning would create a ``TorchCheckpointIO`` (none passed, or an async IO
        without an IO of its own) the atomic one instead; an IO you passed is returned as it is."""
        if not self.enabled:
            return passed
        if passed is None:
            return AtomicCheckpointIO()
        wrapping = wrapping_checkpoint_io()
        if wrapping is not None and isinstance(passed, wrapping) and not has_own_checkpoint_io(passed):
            async_io: Any = passed
            async_io.checkpoint_io = AtomicCheckpointIO()
        return passed

    @contextmanager
    def saving(self, io: CheckpointIO) -> Generator[None, None, None]:
        """Around the strategy's save through ``io``: Lightning's own IO saves through a temporary file; another IO
        that does not save atomically saves as it saves, said once."""
        if self.enabled and type(io) is TorchCheckpointIO:
            self.saving_view = AtomicCheckpointIO(io)
        elif self.enabled and not self._said_not_atomic and not _saves_atomically(io):
            self._said_not_atomic = True
            rank_zero_warn(
                f"atomic_checkpoints: {type(io).__name__} is your checkpoint IO, kept as you passed it, and saves as "
                "it saves (not through a temporary file: it may write elsewhere than the path it is given). Pass "
                f"`AtomicCheckpointIO({type(io).__name__}(...))` to make its saves atomic, or set "
                "`atomic_checkpoints=False` to silence this."
            )
        try:
            yield
        finally:
            self.saving_view = None


def _saves_atomically(io: CheckpointIO) -> bool:
    wrapping = wrapping_checkpoint_io()
    if wrapping is not None and isinstance(io, wrapping):
        return isinstance(getattr(io, "checkpoint_io", None), AtomicCheckpointIO)
    return isinstance(io, AtomicCheckpointIO)
