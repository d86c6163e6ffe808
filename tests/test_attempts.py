"""The ranks of one torchrun attempt agree on its number through the store that outlives the attempts
(``lightning_ddp_plus.processes.restart.agree_on_attempt``), whatever order they start in (threads on one real store)."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_ddp_plus.processes.restart import agree_on_attempt

TIMEOUT = timedelta(seconds=10)


def start_attempt(store: dist.Store, ranks: list[int]) -> dict[int, int]:
    """Start ``ranks`` in this order, each in a thread of its own a little after the one before."""
    agreed: dict[int, int] = {}
    threads = []
    for rank in ranks:
        thread = threading.Thread(
            target=lambda rank=rank: agreed.__setitem__(rank, agree_on_attempt(store, rank, TIMEOUT))
        )
        thread.start()
        threads.append(thread)
        thread.join(timeout=0.3)  # the next rank starts once this one has finished or is waiting
    for thread in threads:
        thread.join(timeout=15)
    return agreed


def test_every_attempt_gets_one_number_whichever_rank_starts_first():
    store = dist.HashStore()
    assert start_attempt(store, [0, 1, 2]) == {0: 0, 1: 0, 2: 0}
    # rank 0 is the slowest to start: the others must wait for it, not take the previous attempt's number
    assert start_attempt(store, [2, 1, 0]) == {0: 1, 1: 1, 2: 1}
    assert start_attempt(store, [1, 0, 2]) == {0: 2, 1: 2, 2: 2}


def test_a_rank_that_rank_0_never_joins_ends_with_a_clear_error():
    store = dist.HashStore()
    assert start_attempt(store, [0, 1]) == {0: 0, 1: 0}
    with pytest.raises(TimeoutError, match="rank 1 waited 0:00:00.200000 for rank 0 to start this torchrun attempt"):
        agree_on_attempt(store, 1, timedelta(seconds=0.2))
