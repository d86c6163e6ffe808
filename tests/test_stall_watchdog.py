"""The stall watchdog's thread over fits, with a real process group and store: a stop ends its thread for good (an
earlier thread stuck in an exchange is never revived beside the next one), every running watchdog stops at exit, one
exit handler serves any number of fits, and a store that is gone is said, not swallowed."""

import atexit
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_ddp_plus.diagnostics import stall_watchdog
from lightning_ddp_plus.diagnostics.collective_ledger import CollectiveLedger
from lightning_ddp_plus.diagnostics.stall_watchdog import StallWatchdog
from tests.helpers import free_port

THREAD_NAME = "ddp-plus-stall-watchdog"


@pytest.fixture
def job_store():
    """A one-rank gloo group on a store of its own (the watchdog runs while a group exists); a client factory."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    dist.init_process_group("gloo", store=server, rank=0, world_size=1)
    try:
        yield lambda: dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=5))
    finally:
        for watchdog in stall_watchdog._running[:]:
            watchdog.stop(orderly=False)
        dist.destroy_process_group()


def watchdog_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME and thread.is_alive()]


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_stop_during_an_exchange_ends_that_thread_and_the_next_fit_has_one_thread(job_store):
    said: list[str] = []
    watchdog = StallWatchdog(CollectiveLedger(), timedelta(seconds=60), say=said.append)
    store = job_store()
    watchdog.start(store, rank=0, world_size=2, prefix="fit1")
    store.add("fit1/episodes", 1)  # an episode: the thread writes its state, then waits for rank 1's (5 s)
    assert wait_for(lambda: store.check(["fit1/1/0"]))  # it is inside the exchange now
    [first] = watchdog_threads()
    watchdog.stop(orderly=False)
    assert wait_for(lambda: not first.is_alive(), seconds=1.0), "the stopped thread went on waiting for rank 1"
    watchdog.start(job_store(), rank=0, world_size=2, prefix="fit2")
    time.sleep(3 * stall_watchdog.POLL_SECONDS)
    assert len(watchdog_threads()) == 1
    watchdog.stop(orderly=False)
    assert said == []


def test_every_running_watchdog_stops_at_exit_and_one_exit_handler_serves_every_fit(job_store):
    handlers_before = atexit._ncallbacks()
    for fit in range(3):  # a fit starts and stops its watchdog: the list of running ones empties each time
        watchdog = StallWatchdog(CollectiveLedger(), timedelta(seconds=60))
        watchdog.start(job_store(), rank=0, world_size=1, prefix=f"fit{fit}")
        watchdog.stop(orderly=False)
    assert atexit._ncallbacks() - handlers_before <= 1
    watchdogs = [StallWatchdog(CollectiveLedger(), timedelta(seconds=60)) for _ in range(3)]
    for number, watchdog in enumerate(watchdogs):
        watchdog.start(job_store(), rank=0, world_size=1, prefix=f"many{number}")
    assert len(watchdog_threads()) == 3
    stall_watchdog._stop_every_watchdog()  # what the exit handler runs
    assert wait_for(lambda: not watchdog_threads(), seconds=2.0)
    assert stall_watchdog._running == []


def test_a_store_that_is_gone_is_said_and_the_watchdog_stops(job_store):
    port = free_port()
    serve = (
        f"import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, 1, True); print('up', flush=True)"
    )
    server = subprocess.Popen([sys.executable, "-c", serve + "; time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=5))
        said: list[str] = []
        watchdog = StallWatchdog(CollectiveLedger(), timedelta(seconds=60), say=said.append)
        watchdog.start(store, rank=1, world_size=2, prefix="gone")
        [thread] = watchdog_threads()
        time.sleep(2 * stall_watchdog.POLL_SECONDS)
        assert thread.is_alive() and said == []
        server.kill()
        server.wait()
        assert wait_for(lambda: not thread.is_alive(), seconds=10.0)
        assert len(said) == 1 and "rank 1's stall watchdog stopped: the store is gone" in said[0], said
        watchdog.stop(orderly=False)
    finally:
        server.kill()
        server.wait()
