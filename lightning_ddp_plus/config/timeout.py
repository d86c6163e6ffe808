"""Collective timeout parsing: seconds, ``timedelta``, unit strings (``"1h30m"``) and clock strings (``"0:30:00"``)."""

from __future__ import annotations

import math
import re
from datetime import timedelta

import torch.distributed as dist

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, describe_bad_value
from lightning_ddp_plus.pipeline.component import ForwardStart, StepComponent
from lightning_ddp_plus.private_apis.torch_distributed import set_group_timeout

#: torch's and Lightning's default for non-NCCL process groups, and ours for every backend.
DEFAULT_TIMEOUT = timedelta(seconds=1800)

#: What ``DDPPlusStrategy(timeout=...)`` accepts. ``int`` is covered by ``float`` for type checkers and jsonargparse.
TimeoutLike = timedelta | float | str

_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_UNIT_TERM = re.compile(r"(\d+(?:\.\d+)?)\s*([dhms])", re.IGNORECASE)
_UNIT_FORM = re.compile(r"^(?:\s*\d+(?:\.\d+)?\s*[dhms])+\s*$", re.IGNORECASE)
# str(timedelta) renders "1 day, 0:00:00" / "2 days, 1:30:00" / "0:30:00"; accept exactly those shapes back.
_CLOCK_FORM = re.compile(r"^(?:(\d+)\s+days?,\s*)?(\d+):([0-5]?\d):([0-5]?\d(?:\.\d+)?)$", re.IGNORECASE)
_NUMBER_FORM = re.compile(r"^\d+(?:\.\d+)?$")

_ALLOWED = (
    "a positive number of seconds (1800), a datetime.timedelta, a unit string such as '90s', '30m', '2h', "
    "'1h30m' or '1d', or a clock string such as '0:30:00' or '1 day, 0:00:00'."
)


def parse_timeout(value: TimeoutLike | None, argument: str = "timeout") -> timedelta:
    """Turn any accepted timeout form into a positive ``timedelta``; ``None`` means the default of 30 minutes.

    An unquoted ``1:00:00`` in a YAML file reaches us as the integer 3600 (YAML 1.1 reads it in base 60), which is
    the same duration, so it needs no special case.

    >>> parse_timeout("1h30m")
    datetime.timedelta(seconds=5400)
    >>> parse_timeout("0:30:00") == parse_timeout(1800) == parse_timeout("30m")
    True
    >>> parse_timeout("1 day, 0:00:00")
    datetime.timedelta(days=1)
    """
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, bool):
        raise ArgumentTypeError(
            describe_bad_value(
                argument, value, f"a boolean is not a duration; expected {_ALLOWED}", "give a duration such as '30m'."
            )
        )
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_timeout_string(value, argument)
    else:
        raise ArgumentTypeError(
            describe_bad_value(
                argument,
                value,
                f"type {type(value).__name__} is not accepted; expected {_ALLOWED}",
                "give a duration such as '30m'.",
            )
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ArgumentValueError(
            describe_bad_value(
                argument,
                value,
                f"the timeout must be a finite duration greater than zero; expected {_ALLOWED}",
                "give the longest time a collective may wait, e.g. '30m' (the default); raise it rather than "
                "disabling it so that a hung rank still ends the job.",
            )
        )
    return timedelta(seconds=seconds)


def _parse_timeout_string(text: str, argument: str) -> float:
    stripped = text.strip()
    if _NUMBER_FORM.match(stripped):
        return float(stripped)
    if _UNIT_FORM.match(stripped):
        return sum(float(amount) * _UNIT_SECONDS[unit.lower()] for amount, unit in _UNIT_TERM.findall(stripped))
    clock = _CLOCK_FORM.match(stripped)
    if clock:
        days, hours, minutes, seconds = clock.groups()
        return int(days or 0) * 86400.0 + int(hours) * 3600.0 + int(minutes) * 60.0 + float(seconds)
    raise ArgumentValueError(
        describe_bad_value(
            argument,
            text,
            f"the string could not be read as a duration; expected {_ALLOWED}",
            "write it as e.g. '30m', '1h30m' or '0:30:00'.",
        )
    )


def format_timeout(value: timedelta) -> str:
    """Render a timeout compactly for logs: ``'30m'``, ``'1h30m'``, ``'90s'``.

    >>> format_timeout(timedelta(seconds=5400))
    '1h30m'
    """
    remaining = value.total_seconds()
    parts = []
    for unit, size in _UNIT_SECONDS.items():
        count = int(remaining // size)
        if count:
            parts.append(f"{count}{unit}")
            remaining -= count * size
    if remaining > 1e-9 or not parts:
        parts.append(f"{remaining:g}s")
    return "".join(parts)


def check_setup_timeout(
    setup_timeout: timedelta | None, backend: str | None, can_set: bool, settable_backends: tuple[str, ...]
) -> None:
    """``setup_timeout`` needs a torch that changes a group's timeout after its creation, on a backend it changes.

    >>> check_setup_timeout(timedelta(hours=2), "mpi", True, ("gloo", "nccl"))
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentValueError: `setup_timeout='2h'` is not valid: the step timeout is set on the process group once the first training step starts, and torch cannot change the timeout of an 'mpi' group (only of gloo and NCCL groups). Fix: drop `setup_timeout` and raise `timeout` itself, or use a gloo or NCCL backend.
    """
    if setup_timeout is None or backend is None:
        return
    shown = format_timeout(setup_timeout)
    if not can_set:
        raise ArgumentValueError(
            describe_bad_value(
                "setup_timeout",
                shown,
                "this torch cannot change a process group's timeout once the group exists "
                "(`torch.distributed.distributed_c10d._set_pg_timeout` is missing).",
                "drop `setup_timeout` and raise `timeout` itself, or use a torch release that has it.",
            )
        )
    if backend not in settable_backends:
        raise ArgumentValueError(
            describe_bad_value(
                "setup_timeout",
                shown,
                "the step timeout is set on the process group once the first training step starts, and torch "
                f"cannot change the timeout of an {backend!r} group (only of gloo and NCCL groups).",
                "drop `setup_timeout` and raise `timeout` itself, or use a gloo or NCCL backend.",
            )
        )


class GroupTimeouts(StepComponent):
    """The default group's timeout over a fit, where ``setup_timeout`` makes it differ from ``timeout``: the setup
    timeout until the first training step, ``timeout`` from there to the end of the fit, then the setup timeout
    again for whatever sets up next.

    Args:
        step: ``timeout``, what a training step's collectives wait.
        setup: ``setup_timeout`` (``None``: ``timeout`` throughout, nothing is switched).
    """

    def __init__(self, step: timedelta, setup: timedelta | None) -> None:
        self.step, self.setup = step, setup
        #: The fit has run a training step (so ``timeout`` is in effect).
        self.steps_started = False

    @property
    def switching(self) -> GroupTimeouts | None:
        """This, where ``setup_timeout`` makes the group's timeout change over a fit; ``None`` (nothing to call at any
        point) where ``timeout`` holds throughout."""
        return self if self.setup is not None else None

    def forward_starts(self, forward: ForwardStart) -> None:
        if forward.training:  # setup is over: a step waits `timeout`
            self.first_step()

    def fit_ends(self, failed: bool) -> None:  # what comes next (another fit) sets up again
        self.fit_ended()

    def first_step(self) -> None:
        """At each training forward: the first one of a fit switches to ``timeout``."""
        if not self.steps_started:
            self.steps_started = True
            self._switch(self.step)

    def fit_ended(self) -> None:
        if self.steps_started:
            self.steps_started = False
            self._switch(self.setup or self.step)

    def in_effect(self) -> tuple[timedelta, str]:
        """The timeout a collective waits now, and the argument that set it."""
        if self.steps_started or self.setup is None:
            return self.step, "timeout"
        return self.setup, "setup_timeout"

    def _switch(self, timeout: timedelta) -> None:
        if self.setup is not None and dist.is_available() and dist.is_initialized():
            set_group_timeout(timeout)
