"""Which run wrote a save: the identity every save of the strategy records, and the earlier logger versions whose
saves a resume may take.

Each run of a script with the default logger (or any logger that numbers its versions) writes its checkpoints to
the next ``version_K/checkpoints``. A requeued SLURM job or a restarted torchrun attempt is the same run started
again, so ``ckpt_path="last"`` must find its save in an earlier version; a new experiment that shares
``default_root_dir`` (another learning rate in a sweep) is another run, and must start from scratch, as with stock
Lightning. What tells them apart is the run's identity: the scheduler's job id (``SLURM_JOB_ID``, kept by a requeue)
and torchrun's run id (``TORCHELASTIC_RUN_ID``, the same in every attempt of a ``torchrun --rdzv-id``). Every save
records it (``RUN_KEY``); an earlier version's saves are taken only when they record this run's identity. A run with
neither id cannot be told from a new experiment, so it never takes an earlier version's save (pass ``ckpt_path=`` a
file to resume one).
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: The entry of a checkpoint that records the run that wrote it (``RunIdentity.as_dict``).
RUN_KEY = "ddp_plus_run"
#: A logger's version folder.
VERSION_FOLDER = re.compile(r"version_\d+")
#: torchrun's run id when none was given (``--rdzv-id`` defaults to it): it names no run.
NO_RUN_ID = ("", "none")


@dataclass(frozen=True, kw_only=True)
class RunIdentity:
    """Who a run is, as far as the environment says.

    >>> RunIdentity(slurm_job="7").same_run(RunIdentity(slurm_job="7", torchrun_run="r"))
    True
    >>> RunIdentity(slurm_job="7").same_run(RunIdentity(slurm_job="8")), RunIdentity().same_run(RunIdentity())
    (False, False)
    >>> RunIdentity(slurm_job="7", torchrun_run="r").describe()
    'SLURM job 7, torchrun run r'
    """

    slurm_job: str | None = None
    """``SLURM_JOB_ID``: a requeued job keeps it."""
    torchrun_run: str | None = None
    """``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``): every restarted attempt of the job has it."""

    @classmethod
    def of_this_process(cls) -> RunIdentity:
        run = os.environ.get("TORCHELASTIC_RUN_ID")
        return cls(slurm_job=os.environ.get("SLURM_JOB_ID") or None, torchrun_run=None if run in NO_RUN_ID else run)

    @classmethod
    def recorded(cls, checkpoint: Mapping[str, Any]) -> RunIdentity:
        """The identity a checkpoint records (none: a save of another tool, or of an earlier version)."""
        entry = checkpoint.get(RUN_KEY)
        if not isinstance(entry, Mapping):
            return cls()
        return cls(**{name: str(entry[name]) for name in ("slurm_job", "torchrun_run") if entry.get(name)})

    @property
    def known(self) -> bool:
        return self.slurm_job is not None or self.torchrun_run is not None

    def same_run(self, other: RunIdentity) -> bool:
        """Both name the same job or the same torchrun run."""
        pairs = ((self.slurm_job, other.slurm_job), (self.torchrun_run, other.torchrun_run))
        return any(mine is not None and mine == theirs for mine, theirs in pairs)

    def describe(self) -> str:
        parts = [f"SLURM job {self.slurm_job}"] if self.slurm_job else []
        parts += [f"torchrun run {self.torchrun_run}"] if self.torchrun_run else []
        return ", ".join(parts) or "no job or run id"

    def as_dict(self) -> dict[str, str | None]:
        return asdict(self)


def earlier_versions(directory: str) -> list[str]:
    """For ``.../version_K/checkpoints``: the ``checkpoints`` folders of the other versions beside it that exist.

    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> for version in (0, 1, 2):
    ...     os.makedirs(os.path.join(root, f"version_{version}", "checkpoints"))
    >>> [os.path.relpath(path, root) for path in earlier_versions(os.path.join(root, "version_2", "checkpoints"))]
    ['version_0/checkpoints', 'version_1/checkpoints']
    >>> earlier_versions(os.path.join(root, "elsewhere"))
    []
    >>> import shutil; shutil.rmtree(root)
    """
    folder = os.path.normpath(directory)
    version, name = os.path.split(folder)
    base, version_name = os.path.split(version)
    if name != "checkpoints" or not VERSION_FOLDER.fullmatch(version_name) or not os.path.isdir(base):
        return []
    others = sorted(entry for entry in os.listdir(base) if VERSION_FOLDER.fullmatch(entry) and entry != version_name)
    return [path for entry in others if os.path.isdir(path := os.path.join(base, entry, "checkpoints"))]


def identity_of_file(path: str) -> RunIdentity:
    """The identity a torch checkpoint file records, read without loading its tensors (memory-mapped); none when it
    cannot be read weights-only."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):  # torn, another format, or classes
        return RunIdentity()  # a weights-only load refuses: no identity to trust
    return RunIdentity.recorded(checkpoint) if isinstance(checkpoint, Mapping) else RunIdentity()


@dataclass(frozen=True, kw_only=True)
class EarlierVersions:
    """What a resume takes of the earlier versions beside the run's own checkpoint folders."""

    taken: tuple[str, ...]
    """The folders whose saves record this run's identity."""
    left: tuple[str, ...]
    """The folders with saves of another run (or of a run that cannot be told apart)."""
    identity: RunIdentity
    """This run's identity."""

    def describe_left(self) -> str | None:
        """The one line that says which folders were left and why (``None``: none was)."""
        if not self.left:
            return None
        folders = ", ".join(self.left)
        if not self.identity.known:
            why = (
                "they may be another run's, and this run has no job id (SLURM_JOB_ID) or torchrun run id "
                "(TORCHELASTIC_RUN_ID) to tell its own saves from another experiment's"
            )
        else:
            why = f"they are another run's (this run is {self.identity.describe()})"
        return (
            f"DDPPlusStrategy: not resuming from the saves in {folders}: {why}; pass `ckpt_path=` one of those files "
            "to resume it."
        )


def newest_checkpoint(folder: str) -> str | None:
    names = [name for name in os.listdir(folder) if name.endswith(".ckpt")] if os.path.isdir(folder) else []
    paths = [os.path.join(folder, name) for name in names]
    return max(paths, key=os.path.getmtime) if paths else None


def sort_earlier_versions(directories: list[str], can_read: bool) -> EarlierVersions:
    """Which earlier versions beside ``directories`` hold this run's saves (``can_read``: the checkpoint IO writes
    torch files, so a save's identity can be read; otherwise none is taken). One version holds one run's saves, so
    its newest file speaks for it."""
    identity = RunIdentity.of_this_process()
    taken: list[str] = []
    left: list[str] = []
    for folder in (earlier for directory in directories for earlier in earlier_versions(directory)):
        newest = newest_checkpoint(folder)
        if newest is None:
            continue
        mine = identity.known and can_read and identity.same_run(identity_of_file(newest))
        (taken if mine else left).append(folder)
    return EarlierVersions(taken=tuple(taken), left=tuple(left), identity=identity)
