"""Diagnostics: the replica guard, telemetry, what torch's errors mean (``torch_errors``), ``ddp-plus report`` and
``ddp-plus check`` (the conflict checks and the memory plan).

May import: ``config``, ``sync``, ``conflicts``, ``memory``, ``processes``.
"""
