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


@pytest.mark.parametrize(
    ("world", "local", "expected"),
    [("1", "1", (1, True)), ("3", "1", (3, True)), ("2", "1", (2, False)), ("4", "2", (2, False))],
)
def test_an_elastic_attempt_trains_on_the_nodes_torchrun_started(monkeypatch, world, local, expected):
    """Trainer(devices=1, num_nodes=2) under torchrun: an attempt on 1 or 3 nodes trains on them (and says so); one
    on 2 needs nothing; devices per node other than torchrun's are left to Lightning's own check."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from lightning_ddp_plus.processes.launcher import nodes_of_this_attempt

    variables = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}
    for name, value in {**variables, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": local}.items():
        monkeypatch.setenv(name, value)
    nodes, line = nodes_of_this_attempt(TorchElasticEnvironment(), devices=1, num_nodes=2)
    assert (nodes, line is not None) == expected
    if line:
        assert f"torchrun started this attempt on {nodes} node(s)" in line and "`Trainer(num_nodes=2)`" in line
        fabric = nodes_of_this_attempt(TorchElasticEnvironment(), devices=1, num_nodes=2, front_end="Fabric")[1]
        assert "`Fabric(num_nodes=2)` says 2" in fabric


def test_the_attempt_the_ddp_plus_rendezvous_gives_is_taken_as_it_is(monkeypatch):
    """Under ``--rdzv-backend ddp-plus`` the round numbers the attempt; a worker whose agent counted no restart (a
    node that joined) takes it, with no agreement through the store."""
    from lightning_ddp_plus.processes import restart

    monkeypatch.setattr(restart, "_agreed_attempt", None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # would ask the store, which is not there
    monkeypatch.setenv(restart.RENDEZVOUS_ATTEMPT_ENV, "2")
    assert restart.restart_attempt() == 2


def test_torchrun_finds_the_ddp_plus_rendezvous_backend():
    from importlib.metadata import entry_points

    (backend,) = [point for point in entry_points(group="torchrun.handlers") if point.name == "ddp-plus"]
    create = backend.load()()
    # a module outside the package: torch loads every backend's entry point in every torchrun agent
    assert callable(create) and backend.module == "lightning_ddp_plus_rendezvous"
