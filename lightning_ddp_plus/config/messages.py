"""Shared wording for configuration errors: every message names the argument, the value, what is allowed, the fix.

The errors that carry such a message are ``ArgumentValueError`` and ``ArgumentTypeError`` (a ``ValueError`` and a
``TypeError``, so ``except ValueError`` still catches them): the ``ddp-plus`` command shows their message alone, with
no traceback, because it already says everything.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any


class ArgumentValueError(ValueError):
    """A strategy argument has a value the package refuses; the message names it, what is allowed and the fix."""


class ArgumentTypeError(TypeError):
    """A strategy argument has a type the package refuses; the message names it, what is allowed and the fix."""


#: What ``describe_bad_value`` writes, so that the message can be found again inside another library's error text.
BAD_VALUE_MESSAGE = re.compile(r"`(?P<argument>[\w.]+)=(?P<value>.*?)` is not valid: .*? Fix: .*")


def closest_name(value: str, choices: Iterable[str]) -> str | None:
    """Return the allowed name closest to a misspelt ``value``, or ``None`` when nothing is close.

    >>> closest_name("ncll", ["nccl", "gloo", "mpi"])
    'nccl'
    >>> closest_name("zzz", ["nccl", "gloo"]) is None
    True
    """
    matches = difflib.get_close_matches(value.lower(), list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def renamed_message(former: str, name: str, since: str, fix: str) -> str:
    """The one wording of a former name the package still takes (an argument, an import, a method), for Lightning's
    deprecation warning.

    >>> renamed_message("MicroBatch", "Chunk", "0.2.0", "import `lightning_ddp_plus.Chunk`")
    '`MicroBatch` is renamed `Chunk` (since lightning-ddp-plus 0.2.0). Fix: import `lightning_ddp_plus.Chunk`; the former name goes in the next major release.'
    """
    return (
        f"`{former}` is renamed `{name}` (since lightning-ddp-plus {since}). Fix: {fix}; the former name goes in the "
        "next major release."
    )


def describe_bad_value(argument: str, value: Any, allowed: str, fix: str) -> str:
    """Format the one message style the package uses for a rejected setting.

    >>> describe_bad_value("timeout", -5, "it must be positive.", "write e.g. '30m'.")
    "`timeout=-5` is not valid: it must be positive. Fix: write e.g. '30m'."
    """
    return f"`{argument}={value!r}` is not valid: {allowed} Fix: {fix}"
