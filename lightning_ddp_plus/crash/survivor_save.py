"""One survivor's part in the save after a peer's death, the same for every front end: agree on the step, write it
if this rank is the one chosen (or wait for the writer's word), and return the ``RankDied`` that ends the run.

What is written, and where, is the front end's: it hands a ``write`` that saves this rank's state atomically.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from lightning_ddp_plus.crash.report import AfterDeathSave, RankDied
from lightning_ddp_plus.crash.survivors import SurvivorAgreement, SurvivorsAgreed


@dataclass(frozen=True, kw_only=True)
class SurvivorSave:
    """What one survivor brings to the save after a peer's death."""

    agreement: SurvivorAgreement
    """This rank's side of the agreement (the store, the ranks, the keys of this run)."""
    step: int
    """The optimizer steps the state this rank holds has applied."""
    cause: str
    """What this rank's collective or store call raised (``peer_gone_in``)."""
    path: str
    """The file to write."""
    write: Callable[[Mapping[int, bytes]], None]
    """Writes this rank's state to ``path``, atomically; called on the writer only, with each survivor's ``shared``
    by rank."""
    not_savable: str | None = None
    """Why nothing can be saved at all (the dead rank held state nobody else has), and what to resume from instead."""
    resume_hint: str | None = None
    """How the next run finds the file (``None``: the Trainer's ``ckpt_path="last"``)."""
    shared: bytes = b""
    """What this rank hands the writer through the store (its random generator states at ``step``)."""


def save_from_survivor(save: SurvivorSave) -> RankDied:
    """The survivors agree on the most steps any of them holds; the lowest rank holding them writes them, the others
    wait for its word; every survivor returns the same ``RankDied`` (what was saved, or why nothing was)."""
    agreement = save.agreement
    agreed = agreement.agree(save.step, save.shared)
    cause = save.cause
    if agreed.alone_because is not None:
        cause = f"{cause}; rank {agreement.rank} decided alone ({agreed.alone_because})"
    said = AfterDeathSave(gone=gone_ranks(agreed, agreement.rank, agreement.world_size), cause=cause)
    if save.resume_hint is not None:
        said = replace(said, resume_hint=save.resume_hint)
    if save.not_savable is not None:
        return RankDied(replace(said, not_saved=save.not_savable))
    if agreed.writer != agreement.rank:
        report = agreement.wait_saved()
        if report is None:
            why = f"rank {agreed.writer} was to save optimizer step {agreed.step} and did not say it had"
            return RankDied(replace(said, not_saved=why))
        return RankDied(replace(said, **report))
    started = time.monotonic()
    try:
        save.write(agreement.shared_with_writer(agreed))
    except Exception as write_error:  # noqa: BLE001 - whatever failed is announced: the others wait for the word
        # a full disk, or a collective in the save (a hook's gather) that cannot run without the dead rank; the
        # write is atomic, so the previous file is whole
        why = f"writing {save.path} failed ({type(write_error).__name__}: {first_line(write_error)}); the file there before, if any, is whole"
        agreement.announce_saved({"not_saved": why})
        return RankDied(replace(said, not_saved=why))
    saved = replace(said, step=agreed.step, path=save.path, writer=agreement.rank)
    saved = replace(saved, save_seconds=time.monotonic() - started)
    agreement.announce_saved(
        {"step": saved.step, "path": saved.path, "writer": saved.writer, "save_seconds": saved.save_seconds}
    )
    return RankDied(saved)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def gone_ranks(agreed: SurvivorsAgreed, rank: int, world_size: int) -> tuple[int, ...]:
    """The ranks that did not answer; without the store, its host (rank 0, whose process hosts the job's store)."""
    if agreed.through_store:
        return agreed.gone(world_size)
    return (0,) if rank != 0 else ()
