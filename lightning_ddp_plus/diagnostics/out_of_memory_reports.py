"""An out-of-memory error that ``chunk_size`` does not get around, explained on every rank.

Where ``chunk_size`` is not ``"auto"`` (or outside its chunks), an out-of-memory error on one rank becomes
``ChunkOutOfMemoryError`` naming the rank, the phase, the batch's rows and the fix. The rank leaves that message
in the job's store before it raises, so that the ranks whose next collective then breaks say the same instead of
the transport's error ("Connection closed by peer").
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from lightning_ddp_plus.diagnostics.collective_ledger import CollectiveLedger
from lightning_ddp_plus.processes.restart import restart_attempt, store_client
from lightning_ddp_plus.sync.chunks import (
    PHASES,
    ChunkOutOfMemoryError,
    ChunkSize,
    ChunkSizer,
    OutOfMemory,
    batch_rows,
    default_mode_message,
    is_out_of_memory,
)

#: How long a rank's error waits for the job's store to say whether a peer ran out of memory.
REPORT_STORE_TIMEOUT = timedelta(seconds=2)


def _report_store() -> Any:
    """A client of the job's store of its own on every rank: it gives up within ``REPORT_STORE_TIMEOUT`` (on a cut
    link the default group's client would wait for the whole collective timeout), and every rank reads and writes
    the same keys (the default group's store adds a prefix of its own)."""
    return store_client(REPORT_STORE_TIMEOUT)


def _key(rank: int) -> str:
    return f"ddp_plus/out_of_memory/attempt_{restart_attempt() or 0}/rank_{rank}"


def publish(failure: OutOfMemory, message: str) -> None:
    """Leave in the job's store why this rank is about to fail."""
    store = _report_store()
    if store is None:
        return
    try:
        store.set(_key(failure.rank), message)
    except (RuntimeError, ValueError):
        pass


def peer_report(world_size: int) -> str | None:
    """What a rank that ran out of memory left in the job's store (``publish``), if one did."""
    store = _report_store()
    if store is None:
        return None
    for rank in range(world_size):
        key = _key(rank)
        try:
            if store.check([key]):
                return bytes(store.get(key)).decode()
        except (RuntimeError, ValueError):
            return None
    return None


class OutOfMemoryReports:
    """Explains an out-of-memory error in a training batch, on this rank and on its peers.

    Args:
        setting: ``chunk_size`` as given.
        ledger: the collective ledger (the phase this rank is in).
        sizer: the rows per chunk in effect (``None``: the whole batch).
    """

    def __init__(self, setting: ChunkSize, ledger: CollectiveLedger, sizer: ChunkSizer) -> None:
        self.setting, self.ledger, self.sizer = setting, ledger, sizer

    @contextmanager
    def explained(self, batch: Any, rank: int, world_size: int) -> Generator[None, None, None]:
        """Around a training batch: an out-of-memory error here becomes ``ChunkOutOfMemoryError`` (left in the
        job's store first), and a collective that breaks because a peer ran out says so."""
        try:
            yield
        except ChunkOutOfMemoryError:
            raise
        except Exception as error:
            if is_out_of_memory(error):
                phase = self.ledger.phase if self.ledger.phase in PHASES else "forward"
                rows = batch_rows(batch) or 0
                failure = OutOfMemory(rank, phase, min(self.sizer.size or rows, rows), rows)
                message = default_mode_message(failure, self.setting)
                publish(failure, message)
                raise ChunkOutOfMemoryError(message) from error
            if isinstance(error, RuntimeError) and world_size > 1:
                peer = peer_report(world_size)
                if peer is not None:
                    explained = ChunkOutOfMemoryError(peer)
                    explained.broken_collective = error  # that rank's process ended: a death, saved after
                    raise explained from None
            raise
