"""How a preempted fit ends: ``Preempted``, a ``SIGTERMException`` (code that catches Lightning's still works) whose
exit code is the shell's for the signal (128 + its number), and the one line rank 0 prints."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NoReturn

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_ddp_plus.preemption.stop import StopDecision


@dataclass(frozen=True)
class PreemptionReport:
    """What was agreed and saved: the decision, the file (``None``: nothing to save), the seconds the save took."""

    decision: StopDecision
    path: str | None = None
    save_seconds: float = 0.0
    resume_hint: str = 'resume with ckpt_path="last"'

    def line(self) -> str:
        """``received SIGTERM on rank 1 at step 5; every rank stopped after optimizer step 6; saved ...``"""
        notices = self.decision.describe_notices()
        if self.decision.stop_after is None:
            return f"lightning-ddp-plus: {notices}, before the first optimizer step; nothing to save, ending"
        saved = f"saved {self.path} in {self.save_seconds:.1f} s" if self.path else "nothing saved"
        return (
            f"lightning-ddp-plus: {notices}; every rank stopped after optimizer step {self.decision.stop_after}; "
            f"{saved}; {self.resume_hint}"
        )


class Preempted(SIGTERMException):
    """A fit that a termination notice stopped, after the agreed step was saved. ``code`` is 128 + the signal's
    number, so a script that lets it propagate exits as a process ended by the signal would (143 for SIGTERM).

    Args:
        report: what was agreed and saved.
    """

    def __init__(self, report: PreemptionReport) -> None:
        super().__init__(report.decision.exit_code)
        self.report = report

    def __str__(self) -> str:
        return self.report.line()


def raise_preempted(report: PreemptionReport, rank_zero: bool, *also: str) -> NoReturn:
    """How every front end ends a preempted loop, on every rank: rank 0 prints the one line (then ``also``, such as
    SLURM's requeue), and ``Preempted`` ends the loop."""
    if rank_zero:
        for line in (report.line(), *also):
            print(line, file=sys.stderr, flush=True)
    raise Preempted(report)
