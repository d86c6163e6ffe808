"""The stall watchdog's thread over fits, with a real process group and store: a stop ends its thread for good (an
earlier thread stuck in an exchange is never revived beside the next one), every running watchdog stops at exit, one
exit handler serves any number of fits, and a store that is gone is said, not swallowed."""

import atexit
import contextlib
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


def quiet_ledger() -> CollectiveLedger:
    """The ledger of a rank whose main thread has made no progress for an hour (its thread looks at the store)."""
    ledger = CollectiveLedger()
    ledger.progressed -= 3600
    return ledger


def test_a_stop_during_an_exchange_ends_that_thread_and_the_next_fit_has_one_thread(job_store):
    said: list[str] = []
    watchdog = StallWatchdog(quiet_ledger(), timedelta(seconds=60), say=said.append)
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


def test_a_store_that_is_gone_is_said_and_the_watchdog_stops(job_store, monkeypatch):
    monkeypatch.setattr(stall_watchdog, "MAX_BACKOFF_SECONDS", 1.0)  # the waits between the five errors, shortened
    port = free_port()
    serve = (
        f"import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, 1, True); print('up', flush=True)"
    )
    server = subprocess.Popen([sys.executable, "-c", serve + "; time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=5))
        said: list[str] = []
        watchdog = StallWatchdog(quiet_ledger(), timedelta(seconds=60), say=said.append)
        watchdog.start(store, rank=1, world_size=2, prefix="gone")
        [thread] = watchdog_threads()
        time.sleep(2 * stall_watchdog.POLL_SECONDS)
        assert thread.is_alive() and said == []
        server.kill()
        server.wait()
        assert wait_for(lambda: not thread.is_alive(), seconds=30.0)
        assert len(said) == 2, said  # the first error said once, then the end (not one line per error)
        assert "rank 1's stall watchdog: the job's store did not answer" in said[0]
        assert "rank 1's stall watchdog stopped: the store is gone" in said[1], said
        watchdog.stop(orderly=False)
    finally:
        server.kill()
        server.wait()


class CountingStore:
    """A store client that counts its reads (``get``) and passes every other call on."""

    def __init__(self, store) -> None:
        self.store, self.gets = store, 0

    def get(self, key: str) -> bytes:
        self.gets += 1
        return self.store.get(key)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def test_an_episode_costs_o_n_store_reads_and_every_rank_gets_rank_0s_report(job_store):
    """8 ranks' watchdogs in one process, each with its own store client: 7 wait in collective 5, rank 3 has not
    issued it. Rank 0 reads the 7 other states and writes the report; every other rank reads only that."""
    world, stuck = 8, 3
    ledgers, stacks, said = [], contextlib.ExitStack(), []
    for rank in range(world):
        ledger = CollectiveLedger()
        for _ in range(4):
            with ledger.collective("all_reduce", 4):
                pass
        if rank != stuck:
            stacks.enter_context(ledger.collective("gradient all_reduce", 64))  # waiting in collective 5
        ledgers.append(ledger)
    stores = [CountingStore(job_store()) for _ in range(world)]
    watchdogs = [
        StallWatchdog(ledgers[rank], timedelta(seconds=0.3), end_process=lambda code: None, say=said.append)
        for rank in range(world)
    ]
    try:
        for rank, watchdog in enumerate(watchdogs):
            watchdog.start(stores[rank], rank=rank, world_size=world, prefix="scale")
        assert wait_for(lambda: all(w.last_report is not None for w in watchdogs), seconds=20)
    finally:
        for watchdog in watchdogs:
            watchdog.stop(orderly=False)
        stacks.close()
    reports = {(w.last_report.kind, w.last_report.culprits) for w in watchdogs}
    assert reports == {("not_reached", (stuck,))}
    assert f"rank {stuck} has not reached it" in watchdogs[5].last_report.text
    assert stores[0].gets == world - 1 and [s.gets for s in stores[1:]] == [1] * (world - 1)
    assert len(said) == 1 and said[0].startswith("lightning-ddp-plus: a collective has waited longer than 0.3 s")


class CallCountingStore:
    """A store client that counts every call made on it."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def test_a_rank_that_makes_progress_leaves_the_store_alone_and_answers_once_it_stops(job_store):
    """Issue 59: every rank's thread asked the store for a new episode every 0.5 s, steps or not. Now a rank's thread
    looks only once its main thread has made no progress for half of ``stall_report_after`` (here 1 s): a rank that
    another waits on stops making progress too, and then answers the episode."""
    ledger, other = CollectiveLedger(), job_store()
    store = CallCountingStore(job_store())
    watchdog = StallWatchdog(ledger, timedelta(seconds=2), say=lambda text: None)
    watchdog.start(store, rank=1, world_size=2, prefix="busy")
    try:
        at_start = store.calls
        other.add("busy/episodes", 1)  # rank 0 asks
        for _ in range(20):  # 2 s of steps: four looks of the thread
            ledger.enter_phase("forward")
            time.sleep(0.1)
        assert store.calls == at_start
        assert not other.check(["busy/1/1"])
        assert wait_for(lambda: other.check(["busy/1/1"]), seconds=10)  # quiet now: it answers
    finally:
        watchdog.stop(orderly=False)


def test_the_store_is_polled_less_often_as_the_job_grows():
    assert stall_watchdog.store_poll_seconds(2) == stall_watchdog.POLL_SECONDS
    assert stall_watchdog.store_poll_seconds(4096) == 64 * stall_watchdog.POLL_SECONDS


class FlakyStore(CountingStore):
    """A store client whose next ``failures`` calls of ``add`` fail as a timed-out store call does."""

    failures = 0

    def add(self, key: str, value: int) -> int:
        if self.failures:
            self.failures -= 1
            raise dist.DistStoreError("timed out (injected)")
        return self.store.add(key, value)


def test_a_store_error_is_said_once_and_diagnosis_resumes(job_store):
    said: list[str] = []
    ledger = CollectiveLedger()
    store = FlakyStore(job_store())
    watchdog = StallWatchdog(ledger, timedelta(seconds=1.5), say=said.append)
    with ledger.collective("gradient all_reduce", 64):  # waiting from now on
        watchdog.start(store, rank=0, world_size=1, prefix="flaky")
        store.failures = 3
        try:
            assert wait_for(lambda: watchdog.last_report is not None, seconds=20)
        finally:
            watchdog.stop(orderly=False)
    assert store.failures == 0
    assert len(said) == 2, said
    assert "the job's store did not answer (timed out (injected)); asking again" in said[0]
    assert said[1].startswith("lightning-ddp-plus: a collective has waited longer than 1.5 s")


def test_the_thread_makes_the_ranks_device_its_own_before_it_asks_the_devices_events(job_store, monkeypatch):
    """On CUDA the ledger's probes are the device's events, which the watchdog's thread asks; CUDA's current device
    is per thread, so the thread sets the rank's first (else a context of its own on GPU 0). The device is faked:
    ``torch.cuda.set_device`` records who set what."""
    import torch

    entered: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda device: entered.append((threading.current_thread().name, device))
    )
    ledger = CollectiveLedger()
    ledger.follow_device(torch.device("cuda", 1))  # what the engine does with the module's device, at a fit's start
    watchdog = StallWatchdog(ledger, timedelta(seconds=60))
    watchdog.start(job_store(), rank=0, world_size=1, prefix="device")
    assert wait_for(lambda: entered != [], seconds=5.0)
    time.sleep(3 * stall_watchdog.POLL_SECONDS)
    watchdog.stop(orderly=False)
    assert entered == [(THREAD_NAME, torch.device("cuda", 1))]  # once, on the watchdog's thread
    on_cpu = CollectiveLedger()
    on_cpu.follow_device(torch.device("cpu"))
    watchdog = StallWatchdog(on_cpu, timedelta(seconds=60))
    watchdog.start(job_store(), rank=0, world_size=1, prefix="cpu")
    time.sleep(3 * stall_watchdog.POLL_SECONDS)
    watchdog.stop(orderly=False)
    assert len(entered) == 1
