"""Shared wording for configuration errors: every message names the argument, the value, what is allowed, the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def closest_name(value: str, choices: Iterable[str]) -> str | None:
    """Return the allowed name closest to a misspelt ``value``, or ``None`` when nothing is close.

    >>> closest_name("ncll", ["nccl", "gloo", "mpi"])
    'nccl'
    >>> closest_name("zzz", ["nccl", "gloo"]) is None
    True
    """
    matches = difflib.get_close_matches(value.lower(), list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def describe_bad_value(argument: str, value: Any, allowed: str, fix: str) -> str:
    """Format the one message style the package uses for a rejected setting."""
    return f"`{argument}={value!r}` is not valid: {allowed} Fix: {fix}"
