"""Diagnostics: the replica guard, telemetry, what torch's errors mean (``torch_errors``), the collective ledger and
what a stall means (``collective_ledger``, ``call_sites``, ``stalls``), ``ddp-plus report`` and ``ddp-plus check``
(the conflict checks and the memory plan).

May import: ``config``, ``sync``, ``conflicts``, ``memory``, ``processes``, ``pipeline``, ``private_apis``.
"""
