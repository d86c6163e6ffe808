"""Which checkpoint a resume uses: the newest *readable* file of the run's own checkpoint directories.

A torn ``last.ckpt`` (a kill during a copy, a full disk, a partial upload) used to lose the job: Lightning resolves
``ckpt_path="last"`` to the newest ``last*.ckpt`` by modification time and fails on it ("PytorchStreamReader failed
reading zip archive: failed finding central directory", or ``[Errno 22] Invalid argument``), and every restarted
attempt fails the same way. Here every candidate is checked before it is used, without unpickling anything: torch
saves a zip archive, so a file is whole when its central directory opens, it holds torch's ``data.pkl``, and every
record's CRC-32 matches (``zipfile``'s ``testzip``, which reads the file once). The newest file that passes wins.

What is trusted: only ``*.ckpt`` files directly in the directories of the run's own ``ModelCheckpoint`` callbacks
(and the file of an ``OnExceptionCheckpoint``), a symlink only when its target lies in one of those directories too.
These files were written by this job; nothing else is opened.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

#: What the strategy passes Lightning as ``ckpt_path`` when it resolves the resume itself (every rank, so every rank
#: reaches the collective choice); never a real file name (it is not a path Lightning treats specially either).
NEWEST_READABLE = "ddp-plus:newest-readable-checkpoint"


def unreadable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why the torch checkpoint at ``path`` cannot be loaded whole, or ``None`` when it can (nothing is unpickled).

    >>> import tempfile, torch
    >>> directory = Path(tempfile.mkdtemp())
    >>> torch.save({"w": torch.ones(4)}, directory / "a.ckpt")
    >>> unreadable_reason(directory / "a.ckpt") is None
    True
    >>> data = (directory / "a.ckpt").read_bytes()
    >>> _ = (directory / "b.ckpt").write_bytes(data[: len(data) // 2])
    >>> unreadable_reason(directory / "b.ckpt").split("(")[0]
    'is torn or not a torch checkpoint '
    >>> import shutil; shutil.rmtree(directory)
    """
    try:
        size = os.path.getsize(path)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if size == 0:
        return "is empty (0 bytes)"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
                return "is a zip archive without torch's data.pkl"
            damaged = archive.testzip()
    except zipfile.BadZipFile as error:
        return f"is torn or not a torch checkpoint ({error}; {size} of its bytes are there)"
    except (OSError, EOFError, ValueError, NotImplementedError) as error:
        return f"cannot be read whole ({type(error).__name__}: {error})"
    if damaged is not None:
        return f"is damaged (the record {damaged} fails its CRC-32 check)"
    return None


def present_reason(path: str | os.PathLike[str]) -> str | None:
    """The check for a checkpoint IO whose format is not torch's zip: the file (or directory) exists and is not
    empty; nothing more can be known without loading it."""
    try:
        if os.path.isdir(path):
            return None if any(Path(path).iterdir()) else "is an empty directory"
        return None if os.path.getsize(path) > 0 else "is empty (0 bytes)"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"


def _inside(path: Path, directories: tuple[Path, ...]) -> bool:
    real = path.resolve()
    return any(real.parent == directory for directory in directories)


def resume_candidates(
    directories: Iterable[str | os.PathLike[str]], files: Iterable[str | os.PathLike[str]] = ()
) -> list[Path]:
    """The checkpoints a resume may use, newest first (by modification time; ``last*`` first among equals): the
    ``*.ckpt`` files directly in ``directories`` and the existing ``files``, symlinks only into those directories.

    >>> import tempfile
    >>> directory = Path(tempfile.mkdtemp())
    >>> for name in ("epoch=0-step=2.ckpt", "last.ckpt", "notes.txt"):
    ...     _ = (directory / name).write_bytes(b"x")
    >>> os.utime(directory / "epoch=0-step=2.ckpt", (1, 1))
    >>> [path.name for path in resume_candidates([directory])]
    ['last.ckpt', 'epoch=0-step=2.ckpt']
    >>> import shutil; shutil.rmtree(directory)
    """
    trusted = tuple(Path(directory).resolve() for directory in directories)
    explicit = [Path(file) for file in files]
    trusted += tuple(file.resolve().parent for file in explicit)
    found: dict[Path, float] = {}
    for directory in trusted:
        if not directory.is_dir():
            continue
        for path in directory.glob("*.ckpt"):
            if _inside(path, trusted):
                try:
                    found[path] = path.stat().st_mtime
                except OSError:  # a dangling symlink: listed, and reported unreadable
                    found[path] = path.lstat().st_mtime
    for file in explicit:
        if file.exists() and _inside(file, trusted):
            found[file.resolve()] = file.stat().st_mtime
    return sorted(found, key=lambda path: (found[path], path.name.startswith("last")), reverse=True)


@dataclass(frozen=True)
class ResumeChoice:
    """What a resume found: the file to load (``None``: none readable), the newer files skipped and why, and how
    many candidates there were.

    >>> ResumeChoice(None, (), 0).describe_skipped()
    ''
    """

    path: str | None
    skipped: tuple[tuple[str, str], ...]
    candidates: int
    searched: tuple[str, ...] = ()
    """The folders the candidates came from."""
    why: str | None = None
    """Why the file was taken, where more than its being the newest readable one (a save of an earlier version)."""
    left_out: str | None = None
    """The line that says which folders were left out and why (``None``: none was)."""

    def describe_skipped(self) -> str:
        return "; ".join(f"{path} {reason}" for path, reason in self.skipped)


def choose_resume(candidates: list[Path], check: Callable[[Path], str | None] = unreadable_reason) -> ResumeChoice:
    """The newest candidate that ``check`` passes, with the newer ones it skipped.

    >>> choose_resume([Path("/nonexistent/last.ckpt")]).skipped
    (('/nonexistent/last.ckpt', 'cannot be read (No such file or directory)'),)
    """
    skipped: list[tuple[str, str]] = []
    for path in candidates:
        reason = check(path)
        if reason is None:
            return ResumeChoice(str(path), tuple(skipped), len(candidates))
        skipped.append((str(path), reason))
    return ResumeChoice(None, tuple(skipped), len(candidates))


class CheckpointResumeError(RuntimeError):
    """``resume_from_last="always"`` found checkpoints, and none of them is readable."""
