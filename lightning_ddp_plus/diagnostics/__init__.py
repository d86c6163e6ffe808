"""Diagnostics: the replica guard, telemetry, ``ddp-plus report`` and ``ddp-plus check``.

May import: ``config``, ``sync``, ``conflicts``.
"""
