"""Checks of one argument's value that several owners share: a flag, a positive number, a count, one of a few names.

Each returns the value it accepts (normalized where the check says so) and raises ``ArgumentValueError`` or
``ArgumentTypeError`` with the message style of ``messages.describe_bad_value``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, closest_name, describe_bad_value


def require_bool(argument: str, value: Any) -> bool:
    """Reject truthy stand-ins (``"false"``, ``0``) that would silently mean something else.

    >>> require_bool("telemetry", "yes")
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentTypeError: `telemetry='yes'` is not valid: expected True or False, got str. Fix: write `telemetry=True` or `telemetry=False`.
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(
            describe_bad_value(
                argument,
                value,
                f"expected True or False, got {type(value).__name__}.",
                f"write `{argument}=True` or `{argument}=False`.",
            )
        )
    return value


def require_positive_number(argument: str, value: Any, example: str) -> float:
    """A finite number greater than zero (``int`` or ``float``, not ``bool``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(
            describe_bad_value(
                argument,
                value,
                f"expected a positive number, got {type(value).__name__}.",
                f"write e.g. `{argument}={example}`.",
            )
        )
    if not math.isfinite(value) or value <= 0:
        raise ArgumentValueError(
            describe_bad_value(
                argument, value, "it must be a finite number greater than zero.", f"write e.g. `{argument}={example}`."
            )
        )
    return value


def require_positive_int_or_none(argument: str, value: Any, example: str, meaning: str = "") -> int | None:
    """``None`` or an integer of at least 1 (``bool`` is refused although it is an ``int``).

    >>> require_positive_int_or_none("model_averaging_period", 0, "4")
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentValueError: `model_averaging_period=0` is not valid: expected a positive integer or None. Fix: set e.g. `model_averaging_period=4`.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = f"expected a positive integer{f' ({meaning})' if meaning else ''} or None."
        raise ArgumentValueError(describe_bad_value(argument, value, what, f"set e.g. `{argument}={example}`."))
    return value


def require_count(argument: str, value: Any, example: str) -> int:
    """An integer of at least 0 (``None`` and ``bool`` are refused).

    >>> require_count("ledger_length", -1, "64")
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentValueError: `ledger_length=-1` is not valid: expected an integer of 0 or more. Fix: set e.g. `ledger_length=64`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArgumentValueError(
            describe_bad_value(
                argument, value, "expected an integer of 0 or more.", f"set e.g. `{argument}={example}`."
            )
        )
    return value


def require_one_of(argument: str, value: Any, allowed: Sequence[str], fix: str) -> Any:
    """One of the ``allowed`` names; a misspelt one gets the closest name first in the fix.

    >>> require_one_of("uneven_inputs", "skip", ("error", "stop", "join"), "use 'error' (the default).")
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentValueError: `uneven_inputs='skip'` is not valid: allowed: error, stop, join. Fix: did you mean 'stop'? Or use 'error' (the default).
    """
    if isinstance(value, str) and value in allowed:
        return value
    suggestion = closest_name(value, allowed) if isinstance(value, str) else None
    if suggestion is not None:
        fix = f"did you mean {suggestion!r}? Or {fix[0].lower()}{fix[1:]}"
    raise ArgumentValueError(describe_bad_value(argument, value, f"allowed: {', '.join(allowed)}.", fix))
