"""How a fit that lost a rank ends: ``RankDied``, whose message names the rank that is gone, the step the survivors
saved, the file and how to resume (or why nothing was saved and what to resume from instead)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AfterDeathSave:
    """What the survivors did after a rank's death."""

    gone: tuple[int, ...]
    """The ranks that are gone (or did not answer in time)."""
    cause: str
    """What this survivor's collective or store call raised."""
    step: int | None = None
    """The optimizer steps of the saved state (``None``: nothing saved)."""
    path: str | None = None
    """The file written."""
    writer: int | None = None
    """The survivor that wrote it."""
    save_seconds: float = 0.0
    """How long the write took."""
    not_saved: str | None = None
    """Why nothing was saved, and what to resume from instead."""
    resume_hint: str = 'resume with `Trainer.fit(..., ckpt_path="last")` or `DDPPlusStrategy(resume_from_last=...)`'
    """How the next run finds the file."""

    def line(self) -> str:
        if len(self.gone) == 1:
            who = f"rank {self.gone[0]} is gone"
        elif self.gone:
            who = f"ranks {', '.join(map(str, self.gone))} are gone"
        else:
            who = "a rank is gone"
        head = f"lightning-ddp-plus: {who} ({self.cause})"
        if self.step is None:
            return f"{head}; nothing was saved: {self.not_saved}"
        return (
            f"{head}; the survivors saved optimizer step {self.step} to {self.path} (written by rank {self.writer} "
            f"in {self.save_seconds:.1f} s); {self.resume_hint}: at most the step in progress is lost."
        )


class RankDied(RuntimeError):
    """A fit that lost a rank, ended by a survivor once the last step was saved (or could not be).

    Args:
        save: what the survivors did.
    """

    #: Every survivor raises it by itself once the save is over (the launcher lets the others end, see
    #: ``processes.launcher``).
    ends_every_survivor = True

    def __init__(self, save: AfterDeathSave) -> None:
        super().__init__(save.line())
        self.save = save
