"""torchrun's ``c10d`` rendezvous, made to take a node that joins a running elastic job (``--rdzv-backend ddp-plus``).

Why stock ``c10d`` cannot grow a job: every agent caches the
address of the workers' store (``MASTER_ADDR``/``MASTER_PORT``) from its first round. In a later round, rank 0's
agent, still holding its cache, does not publish the address again under that round's keys, and a node that joins
then waits for it until its 60 s store timeout ends its agent. (Stock ``c10d`` shrinks: nobody new needs the address.)

This handler is ``c10d``'s, with two changes, both made after torch's own rendezvous of each round:

- **The address, every round.** Rank 0 publishes its workers' store address under the round's keys, and every other
  rank reads it from there. A joining node's agent finds it; a node that was rank 1 before and is rank 0 now makes a
  store of its own, as torch does, and the others follow it.
- **The attempt, from the round.** The round number lives in the rendezvous state, which every agent shares, so the
  job's attempt is the round less the job's first round, the same on every rank of a round whatever each agent's
  restart count says. It reaches the workers as ``DDP_PLUS_RENDEZVOUS_ATTEMPT`` (``processes.restart`` reads it):
  a membership change is an attempt like a restart, so the joined attempt resumes from the last checkpoint.

The rendezvous settings (``--rdzv-conf``) are ``c10d``'s, read as torch's ``create_handler`` reads them. What it reads
of torch's handler state is reached through ``private_apis.torch_rendezvous.RoundRecordingHandler``. torch finds the backend through the ``torchrun.handlers``
entry point, which names the small ``lightning_ddp_plus_rendezvous`` module, so that a torchrun agent that does not
use this backend does not import Lightning.
"""

from __future__ import annotations

import os
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

from lightning_ddp_plus.private_apis.torch_rendezvous import RoundRecordingHandler
from lightning_ddp_plus.processes.restart import RENDEZVOUS_ATTEMPT_ENV

#: ``torchrun --rdzv-backend ddp-plus`` (the ``torchrun.handlers`` entry point in pyproject.toml)
BACKEND_NAME = "ddp-plus"
FIRST_ROUND_KEY = "ddp_plus/first_round"


class RoundByRoundRendezvousHandler(RoundRecordingHandler):
    """``c10d``'s handler that publishes the workers' store address in every round and numbers the attempts by the
    round (see the module's docstring)."""

    def get_backend(self) -> str:
        return BACKEND_NAME  # torchrun checks it against the name it was asked for

    def next_rendezvous(self) -> RendezvousInfo:
        info = super().next_rendezvous()
        store, rank = info.store, info.rank
        if rank == 0:
            address = info.bootstrap_store_info
            if address is None:  # torch builds it for rank 0 in every round it is rank 0
                raise RuntimeError("lightning-ddp-plus: torch's rendezvous gave rank 0 no address for its workers")
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, address.master_addr)
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(address.master_port))
        else:  # a cache of an earlier round may name a store that rank 0 no longer holds
            address = RendezvousStoreInfo(
                master_addr=store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode(),
                master_port=int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode()),
            )
            self.use_workers_store(address)
        first = self.rendezvous_store.compare_set(f"{FIRST_ROUND_KEY}/{self.run_id}", "", str(self.store_round))
        # the agent starts its workers with its own environment, read when they start
        os.environ[RENDEZVOUS_ATTEMPT_ENV] = str(self.store_round - int(first.decode()))
        return RendezvousInfo(store, rank, info.world_size, address)


def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    seconds = params.get_as_int(f"{key}_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def create_round_by_round_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler for ``--rdzv-backend ddp-plus``: ``c10d``'s store, state and settings, this module's rounds."""
    backend, store = create_backend(params)
    timeout = RendezvousTimeout(*(_timeout(params, key) for key in ("join", "last_call", "close", "heartbeat")))
    handler: RendezvousHandler = RoundByRoundRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3,
    )
    return handler
