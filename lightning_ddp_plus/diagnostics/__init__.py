"""Diagnostics: the replica guard, telemetry, ``ddp-plus report`` and ``ddp-plus check`` (the conflict checks and
the memory plan).

May import: ``config``, ``sync``, ``conflicts``, ``memory``.
"""
