"""torchrun's entry point for the ``ddp-plus`` rendezvous backend (``torchrun --rdzv-backend ddp-plus``), whose code is
``lightning_ddp_plus.processes.rendezvous``.

A module of its own, outside the package: torch loads every ``torchrun.handlers`` entry point whenever its rendezvous
module is imported, in every torchrun agent, and the package imports Lightning. The package is imported only when a
job picks this backend.
"""

from collections.abc import Callable
from typing import Any


def handler_creator() -> Callable[[Any], Any]:
    """What torch registers under ``ddp-plus``: a function that makes the handler from the rendezvous parameters."""

    def create(params: Any) -> Any:
        from lightning_ddp_plus.processes.rendezvous import create_round_by_round_handler

        return create_round_by_round_handler(params)

    return create
