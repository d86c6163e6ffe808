"""torch elastic's private names that ``--rdzv-backend ddp-plus`` uses, in a module of their own: only torchrun's
agent imports it (through ``processes.rendezvous``), so a training process does not load torch's rendezvous.

| what | torch names used | checked on | probe, and what happens without it |
|---|---|---|---|
| torchrun's rendezvous state (``RoundRecordingHandler``) | ``DynamicRendezvousHandler._get_store``, ``_state_holder``, ``_store``, ``_settings``, ``_bootstrap_store_info`` | 2.13.0, 2.14.1, 2.15.0 | none: ``--rdzv-backend ddp-plus`` needs them |
"""

from __future__ import annotations

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

__all__ = ["RoundRecordingHandler"]


class RoundRecordingHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler, with the round its store was made for kept, and its state read through
    named properties (``processes.rendezvous`` builds on them)."""

    store_round = 0

    def _get_store(self) -> Store:
        # read once, when torch makes the round's store: the heartbeat thread may sync a newer state later
        self.store_round = self._state_holder.state.round
        return super()._get_store()

    @property
    def rendezvous_store(self) -> Store:
        """The rendezvous' own store (shared by every agent of the job)."""
        store: Store = self._store
        return store

    @property
    def run_id(self) -> str:
        return str(self._settings.run_id)

    def use_workers_store(self, address: RendezvousStoreInfo) -> None:
        """Make ``address`` the workers' store this agent hands to its workers (torch caches one from round one)."""
        self._bootstrap_store_info = address
