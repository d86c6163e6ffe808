"""The notice: which signals mean "save and stop", and a handler that only records one.

A signal handler runs between two bytecodes of the main thread, wherever it is: inside a collective, a save, a
lock held by the logging module. So the handler here writes three attributes and returns; the agreement, the save
and the exit happen later, at the next optimizer-step boundary (``stop.PreemptionStop``). A second signal during
the save is recorded and changes nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, closest_name, describe_bad_value

#: Signals a process cannot catch, so they cannot carry a notice.
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_names() -> list[str]:
    """The signal names this platform has, in number order."""
    return [
        item.name for item in sorted(signal.Signals, key=int) if item.name.startswith("SIG") and "_" not in item.name
    ]


def check_preemption_signals(argument: str, value: Any) -> tuple[str, ...]:
    """A list of signal names (``[]``: off), upper-cased, each once.

    >>> check_preemption_signals("preemption_signals", ["sigterm", "SIGUSR1", "SIGTERM"])
    ('SIGTERM', 'SIGUSR1')
    >>> check_preemption_signals("preemption_signals", "SIGTERM")
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentTypeError: `preemption_signals='SIGTERM'` is not valid: expected a list of signal names, got str. Fix: write `preemption_signals=['SIGTERM']` (YAML: `preemption_signals: [SIGTERM]`), or `[]` to turn notice handling off.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        shown = f"['{value}']" if isinstance(value, str) else "['SIGTERM']"
        raise ArgumentTypeError(
            describe_bad_value(
                argument,
                value,
                f"expected a list of signal names, got {type(value).__name__}.",
                f"write `{argument}={shown}` (YAML: `{argument}: [{shown[2:-2]}]`), or `[]` to turn notice handling off.",
            )
        )
    names: list[str] = []
    known = signal_names()
    for item in value:
        name = item.upper() if isinstance(item, str) else item
        if name in UNCATCHABLE:
            raise ArgumentValueError(
                describe_bad_value(
                    argument,
                    list(value),
                    f"{name} cannot be caught by a process, so it cannot ask for a save.",
                    "use SIGTERM (Kubernetes, torchrun, SLURM at the time limit) or the signal of SLURM's "
                    "`--signal=SIGUSR1@90`, e.g. ['SIGTERM', 'SIGUSR1'].",
                )
            )
        if name not in known:
            near = closest_name(name.lower(), [k.lower() for k in known]) if isinstance(name, str) else None
            hint = f"did you mean {near.upper()!r}? " if near else ""
            raise ArgumentValueError(
                describe_bad_value(
                    argument,
                    list(value),
                    f"{item!r} is not a signal name; allowed: this platform's catchable signals, such as SIGTERM, "
                    "SIGUSR1, SIGUSR2, SIGINT, SIGHUP.",
                    f"{hint}write names such as ['SIGTERM', 'SIGUSR1'].",
                )
            )
        if name not in names:
            names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class Notice:
    """One rank's notice: the signal, the rank that got it, and the optimizer steps it had applied then."""

    signal_name: str
    rank: int
    step: int

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by this signal: 128 + its number."""
        return 128 + int(signal.Signals[self.signal_name])


class NoticeWatch:
    """Records the first preemption signal a process gets; installed for the duration of a fit.

    Args:
        signals: the signal names that mean "save and stop" (checked).
    """

    def __init__(self, signals: Sequence[str]) -> None:
        self.signals = tuple(signals)
        #: The first notice's signal number (``None``: no notice yet), and the steps done then.
        self.signum: int | None = None
        self.step_when_received = 0
        #: Signals received in all (a second one during the save changes nothing).
        self.count = 0
        #: Optimizer steps applied so far (the engine sets it after each one; the handler reads it).
        self.steps_done = 0
        self._previous: dict[int, Any] = {}

    @property
    def pending(self) -> bool:
        return self.signum is not None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def previous_handlers(self) -> dict[int, Any]:
        """The handlers in place before ``install``, by signal number."""
        return dict(self._previous)

    def install(self) -> None:
        """Put the recording handler on every notice signal (main thread only; Python allows no other)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.signals:
            number = int(signal.Signals[name])
            previous = signal.signal(number, self._record)
            if number not in self._previous:
                self._previous[number] = previous

    def reinstall(self) -> None:
        """Put the recording handler back on every notice signal (after another library replaced it)."""
        for number in self._previous:
            signal.signal(number, self._record)

    def uninstall(self) -> None:
        """Give every signal its handler from before ``install``."""
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def pass_on(self) -> None:
        """After ``uninstall``: a notice that no step boundary took (it came after the last step) is delivered
        again, to the handler from before the fit (by default it ends the process)."""
        if self.signum is not None:
            signum, self.signum = self.signum, None
            signal.raise_signal(signum)

    def clear(self) -> None:
        self.signum, self.count = None, 0

    def notice(self, rank: int) -> Notice | None:
        if self.signum is None:
            return None
        return Notice(signal.Signals(self.signum).name, rank, self.step_when_received)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # no collective, no I/O, no lock: a few attributes, read at the next step boundary
        self.count += 1
        if self.signum is None:
            self.step_when_received = self.steps_done
            self.signum = signum
