"""Byte sizes as people write them: ``80GiB``, ``24 GB``, ``512MiB``, ``1e9``."""

from __future__ import annotations

import re

from lightning_ddp_plus.config.messages import ArgumentValueError, describe_bad_value

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int, argument: str = "--device-memory") -> int:
    """Bytes in ``text``.

    >>> parse_size("80GiB"), parse_size("24 GB"), parse_size(1024)
    (85899345920, 24000000000, 1024)
    """
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ArgumentValueError(
            describe_bad_value(
                argument,
                text,
                "expected a positive size: a number with B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                "(powers of 1024).",
                f"write e.g. `{argument} 80GiB`.",
            )
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(size: float, digits: int = 2) -> str:
    """``size`` bytes in the largest binary unit that keeps it at least 1, with ``digits`` decimals.

    >>> format_size(85899345920), format_size(1536), format_size(12), format_size(4096, digits=1)
    ('80.00 GiB', '1.50 KiB', '12 B', '4.0 KiB')
    """
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= factor:
            return f"{size / factor:.{digits}f} {unit}"
    return f"{int(size)} B"
