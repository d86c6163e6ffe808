"""Elastic restarts (``torchrun --max-restarts N``): a restarted attempt forms its process group every time, resumes
from the last checkpoint by itself, and continues mid-epoch at the batch where the checkpoint was taken.

Why restarts fail without this (stock Lightning too): torchrun's agent hosts one TCPStore
for the whole job and every attempt's workers connect to it on the same ``MASTER_PORT`` with no per-attempt prefix
(``torch.distributed.rendezvous._create_c10d_store``). Gloo publishes each rank's listening address under fixed keys,
so a restarted rank may read the previous attempt's address of its peer: "Connection refused" when that process is
gone, a 5-minute "Connect timeout" when it is still closing, success when the new key happens to come first. The
group is therefore created here on a ``PrefixStore`` named after the job's attempt.

The attempt is not ``TORCHELASTIC_RESTART_COUNT``: that counts one agent's restarts after a failure of its own
workers, and an agent whose workers were still ending when the other node's agent came back restarts them as a
membership change, which torch does not count. Its workers then say attempt 0 while the other node's say 1: they
formed their groups under different prefixes and do not resume alike, and the job is lost (a rank that takes a
few seconds to end is enough). The ranks therefore agree on the attempt through torchrun's store
(``agree_on_attempt``); without torchrun's shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, where torch makes
a new store per attempt) the restart count is used. Under ``--rdzv-backend ddp-plus`` (``processes.rendezvous``) the
rendezvous itself numbers the attempts by its round and gives every worker the number: that holds when a node joins.

What a restarted attempt resumes from, and the rest of its epoch's data, is ``persistence.resume``'s.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment

log = logging.getLogger(__name__)

GENERATION_KEY = "ddp_plus/generation"
#: The attempt that the ``ddp-plus`` rendezvous backend (``processes.rendezvous``) gives the workers of each round
RENDEZVOUS_ATTEMPT_ENV = "DDP_PLUS_RENDEZVOUS_ATTEMPT"
_POLL_S = 0.05
_agreed_attempt: int | None = None


def under_torchrun() -> bool:
    """Whether torchrun's agent started this process."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "").isdigit()


def agree_on_attempt(store: dist.Store, rank: int, timeout: timedelta) -> int:
    """The job's attempt (0 for the first), the same on every rank of one attempt, agreed through ``store``, which
    outlives the attempts (torchrun's agent store).

    Rank 0 counts the attempts; every other rank waits for a count newer than the last one its rank index took. All
    workers of an attempt are stopped before the next one starts, so a newer count is this attempt's; should a
    worker have died before taking its count, its successor takes the older one, the group fails to form within the
    timeout, and the next attempt agrees again.

    An agreement of its own, not the step's: it runs before the process group exists (the group's store depends on
    the attempt), over the one store that outlives the attempts.

    >>> store = dist.HashStore()
    >>> [agree_on_attempt(store, rank, timedelta(seconds=5)) for rank in (0, 1)]
    [0, 0]
    >>> [agree_on_attempt(store, rank, timedelta(seconds=5)) for rank in (0, 1)]
    [1, 1]
    """
    if rank == 0:
        generation = store.add(f"{GENERATION_KEY}/count", 1)
        store.set(GENERATION_KEY, str(generation))
        return generation - 1
    seen_key = f"{GENERATION_KEY}/seen_by_rank_{rank}"
    seen = int(store.get(seen_key)) if store.check([seen_key]) else 0
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        generation = int(store.get(GENERATION_KEY)) if store.check([GENERATION_KEY]) else 0
        if generation > seen:
            store.set(seen_key, str(generation))
            return generation - 1
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"lightning-ddp-plus: rank {rank} waited {timeout} for rank 0 to start this torchrun attempt (it saw "
                f"attempt {seen - 1} last). Fix: look at why rank 0 did not start (its node's torchrun output), or "
                "raise `DDPPlusStrategy(timeout=...)` if its imports take that long."
            )
        time.sleep(_POLL_S)


def restart_attempt(timeout: timedelta = timedelta(minutes=5)) -> int | None:
    """The job's attempt under torchrun (0 for the first; see ``agree_on_attempt``), or ``None`` when torchrun did
    not start this process. The first call agrees with the other ranks and waits for rank 0 up to ``timeout``."""
    global _agreed_attempt
    if not under_torchrun():
        return None
    if _agreed_attempt is None:
        if os.environ.get(RENDEZVOUS_ATTEMPT_ENV, "").isdigit():
            _agreed_attempt = int(os.environ[RENDEZVOUS_ATTEMPT_ENV])
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
            _agreed_attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        else:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
            _agreed_attempt = agree_on_attempt(store, int(os.environ["RANK"]), timeout)
    return _agreed_attempt


def init_process_group(
    cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta, device_id: torch.device | None
) -> None:
    """``init_process_group`` on a store of its own for this restart attempt (see the module's docstring)."""
    if dist.is_initialized():
        return
    rank, world_size = cluster_environment.global_rank(), cluster_environment.world_size()
    os.environ["MASTER_ADDR"] = cluster_environment.main_address
    os.environ["MASTER_PORT"] = str(cluster_environment.main_port)
    store, rank, world_size = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store = dist.PrefixStore(f"ddp_plus/attempt_{restart_attempt(timeout)}/", store)
    log.info(
        f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}, attempt {restart_attempt()}"
    )
    kwargs: dict[str, Any] = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)


def store_client(timeout: timedelta) -> dist.Store | None:
    """A client of the job's store (``MASTER_ADDR``/``MASTER_PORT``) of its own, for a thread that must not share the
    main thread's connection; ``None`` where the job has no such store."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    except (RuntimeError, ValueError) as error:
        log.info(f"no client of the job's store at {host}:{port}: {error}")
        return None
