"""The stall watchdog: a thread on every rank that notices a collective waited in too long, and has the ranks explain
it to each other through the job's store, never through the process group that is stuck.

Every ``POLL_SECONDS`` the thread looks at this rank's ledger. When a collective this rank issued has not completed for
longer than ``stall_report_after``, it asks for an episode (one counter in the store). A rank's thread looks at the
store only while its main thread has made no progress (entered or left a collective, changed phase) for half of
``stall_report_after``: a rank that another waits on stops making progress too (every step ends in a collective), so it
is looking by the time it is asked, and a job whose ranks keep stepping costs the store nothing. A rank that looks sees
the new episode at its next look at the store (every ``store_poll_seconds(world_size)``: the store's load stays bounded
as the job grows) and writes its state there once (``stalls.RankState``: its ledger's last records, its phase and step,
and where its main thread is, with its stack). Rank 0's thread reads every state, decides (``explain_stall``) and writes
the report under one key, which the others read: an episode costs O(N) store reads, not every rank reading every other's
(O(N^2)). Rank 0's thread runs even when its main thread is the one stuck, and the store lives in its process:

- out of step: rank 0 prints the report and ends its process, which ends the job at once instead of at the timeout
  (the popen launcher's child ranks exit when their parent is gone; under torchrun the agent stops the others). A
  gloo wait cannot be interrupted from another thread: ``ProcessGroup.abort`` returns at once, but the blocked wait
  only returns when a peer's connection closes. A rank whose collective fails first ("Connection
  closed by peer") ends through the strategy's ``on_exception`` with the same report;
- not reached, or every rank waits: rank 0 prints the report; the collective timeout still ends the job, and its
  error carries the same report on every rank (``last_report``).

The store is reached through a client of this thread's own, so a main thread blocked inside a store call cannot
block it; the store's server runs in rank 0's process on a thread of its own, so rank 0's main thread being stuck
does not stop it from answering. That server ends with rank 0's process, and a client that asks a server that is
gone prints a long C++ warning: so every rank says in the store when its thread stopped, and rank 0 stops last,
after the others (at most ``STOP_WAIT_SECONDS``), at the end of a fit and at the process's exit, unless it ends on an
error (a dead peer never says it stopped).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_ddp_plus.diagnostics.call_sites import collective_in_progress, stack_text, user_call_site
from lightning_ddp_plus.diagnostics.collective_ledger import CollectiveLedger, enter_device
from lightning_ddp_plus.diagnostics.stalls import RankState, StallReport, explain_stall, state_of
from lightning_ddp_plus.pipeline.component import FitStart, StepComponent
from lightning_ddp_plus.private_apis.torch_distributed import default_store
from lightning_ddp_plus.processes.launcher import end_process_now
from lightning_ddp_plus.processes.restart import restart_attempt, store_client

#: How often the thread looks at this rank's ledger (and, in a job of up to ``RANKS_PER_POLL`` ranks, at the store).
POLL_SECONDS = 0.5
#: Ranks whose store polls together make one poll per ``POLL_SECONDS`` (a job's polls at most ~128 per second).
RANKS_PER_POLL = 64
#: How long a rank waits for the others' states in an episode before it reports without them.
EXCHANGE_SECONDS = 5.0
#: How long rank 0's thread waits, when stopping, for the other ranks' threads to stop first.
STOP_WAIT_SECONDS = 2.0

#: Consecutive store errors after which a watchdog says so and stops (one transient timeout is not the end).
STORE_ERRORS_TOLERATED = 5
#: The longest wait before asking a store that did not answer again (the waits double from ``POLL_SECONDS``).
MAX_BACKOFF_SECONDS = 8.0

_running: list[StallWatchdog] = []


def store_poll_seconds(world_size: int) -> float:
    """How often each rank asks the store for a new episode: every ``POLL_SECONDS`` up to ``RANKS_PER_POLL`` ranks,
    then less often, so that the store answers about the same number of polls per second at any size.

    >>> store_poll_seconds(8), store_poll_seconds(64), store_poll_seconds(1024)
    (0.5, 0.5, 8.0)
    """
    return POLL_SECONDS * max(1.0, world_size / RANKS_PER_POLL)


_stop_at_exit = False


def main_thread_frame() -> Any:
    """The main thread's current frame (read from another thread)."""
    return sys._current_frames().get(threading.main_thread().ident or -1)


class StallWatchdog(StepComponent):
    """The thread of one rank, for one fit.

    Args:
        ledger: this rank's collective ledger.
        report_after: how long a collective may be waited in before the ranks compare states (the argument
            ``stall_report_after`` in effect).
        end_process: ends this process (out of step: rank 0 ends, which ends the job).
        say: how a report reaches the user.
        warn: how a warning reaches the user at a fit's start (no client of the store could be made).
    """

    def __init__(
        self,
        ledger: CollectiveLedger,
        report_after: timedelta,
        end_process: Callable[[int], None] = end_process_now,
        say: Callable[[str], None] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.ledger, self.report_after = ledger, report_after.total_seconds()
        self._end_process, self._say, self._warn = end_process, say or _to_stderr, warn or _to_stderr
        #: The last report this rank took part in (``None``: no stall yet), for the timeout's error.
        self.last_report: StallReport | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handled = 0
        self._requested_for: int | None = None
        self._store: Any = None
        self._server: Any = None
        self._rank, self._world_size, self._prefix = 0, 1, ""
        self._mine: RankState | None = None  # this rank's state in the episode it answered

    def fit_starts(self, fit: FitStart) -> None:
        start_for_fit(self, self._warn)

    def fit_ends(self, failed: bool) -> None:
        self.stop(orderly=not failed)

    def __getstate__(self) -> dict[str, Any]:
        """A spawned worker gets the watchdog unstarted (threads, events and store clients do not cross)."""
        state = dict(self.__dict__)
        state.update(_stop=None, _thread=None, _store=None, _server=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stop = threading.Event()

    def start(self, store: Any, rank: int, world_size: int, prefix: str, server: Any = None) -> None:
        """Watch this rank; ``store``: a client of the job's store for this thread alone. ``server``: on rank 0, the
        job's own store object, held until the orderly stop: a script that destroys the process group itself
        (common with Fabric) would otherwise take the store's server down while the other ranks' threads ask it."""
        global _stop_at_exit
        self.stop()
        # each thread has its own event: a thread an earlier stop left behind (stuck in a store call) stays stopped
        self._stop = threading.Event()
        self._handled = int(store.add(f"{prefix}/episodes", 0))  # episodes before this fit are not its
        self._requested_for = None
        self._store, self._rank, self._world_size, self._prefix = store, rank, world_size, prefix
        self._server = server
        self._thread = threading.Thread(
            target=self._run,
            args=(store, rank, world_size, prefix, self._stop),
            name="ddp-plus-stall-watchdog",
            daemon=True,
        )
        self._thread.start()
        if not _stop_at_exit:
            _stop_at_exit = True
            atexit.register(_stop_every_watchdog)  # Fabric has no end of fit: the process's exit is its end
        _running.append(self)

    def stop(self, orderly: bool = True) -> None:
        """Stop the thread. ``orderly`` (the job goes on, or ends well): rank 0, whose process hosts the store, stops
        after the others (see the module's docstring). After a failure nobody waits: a store behind a cut link may
        not answer for a long time, and the job is ending anyway."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=2 * POLL_SECONDS)  # a daemon thread: one stuck in a store call is left behind
        self._thread = None
        if self in _running:
            _running.remove(self)
        if orderly:
            self._stop_in_order()
        self._store = self._server = None  # released here, on the stopping thread, not at the interpreter's end

    def _stop_in_order(self) -> None:
        stopped, store = f"{self._prefix}/stopped", self._store

        def say_stopped() -> None:
            with contextlib.suppress(Exception):  # the store may be gone already (rank 0 ended first)
                store.add(stopped, 1)

        if self._rank != 0:
            signal = threading.Thread(target=say_stopped, name="ddp-plus-stall-watchdog-stop", daemon=True)
            signal.start()
            signal.join(timeout=STOP_WAIT_SECONDS)
            return
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        with contextlib.suppress(Exception):
            while int(store.add(stopped, 0)) < self._world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.02)

    def _run(self, store: Any, rank: int, world_size: int, prefix: str, stop: threading.Event) -> None:
        episodes = f"{prefix}/episodes"
        store_errors, entered = 0, None
        looks_per_poll = round(store_poll_seconds(world_size) / POLL_SECONDS)
        quiet_after = self.report_after / 2
        for look in itertools.count(1):
            if stop.wait(POLL_SECONDS):
                return
            if not dist.is_initialized():
                return  # this rank destroyed its process group: nothing of it can stall any more
            try:
                if self.ledger.device is not entered:  # before its first probe of the device's events
                    entered = self.ledger.device
                    enter_device(entered)
                current, now = self.ledger.current, time.monotonic()
                waited = now - current.started if current is not None else 0.0
                asks = current is not None and waited > self.report_after and self._requested_for != current.sequence
                if asks and current is not None:
                    store.add(episodes, 1)
                    self._requested_for = current.sequence  # once per collective (asked again if the add failed)
                quiet = now - self.ledger.progressed > quiet_after
                if not asks and (not quiet or look % looks_per_poll):
                    continue
                latest = int(store.add(episodes, 0))  # read the counter without waiting
                if latest > self._handled:
                    self._exchange(store, rank, world_size, prefix, latest, stop)
                store_errors = 0
            except (dist.DistNetworkError, dist.DistStoreError) as error:
                # a store call that timed out is asked again, later each time; a store that stays away ended with
                # the job (its server lives in rank 0's process)
                store_errors += 1
                if stop.is_set():
                    return
                if store_errors >= STORE_ERRORS_TOLERATED:
                    self._say(f"lightning-ddp-plus: rank {rank}'s stall watchdog stopped: the store is gone ({error})")
                    return
                backoff = min(MAX_BACKOFF_SECONDS, POLL_SECONDS * 2**store_errors)
                if store_errors == 1:  # said once per streak: a transient timeout must not flood the log
                    self._say(
                        f"lightning-ddp-plus: rank {rank}'s stall watchdog: the job's store did not answer ({error}); "
                        f"asking again, less often each time (diagnosis resumes when it answers)"
                    )
                if stop.wait(backoff):
                    return
            except Exception as error:  # noqa: BLE001 - the watchdog must never take the job down by itself
                if not stop.is_set():
                    self._say(f"lightning-ddp-plus: rank {rank}'s stall watchdog stopped: {error}")
                return

    def _exchange(
        self, store: Any, rank: int, world_size: int, prefix: str, latest: int, stop: threading.Event
    ) -> None:
        """Answer the latest episode: write this rank's state; rank 0 then decides with every rank's state and
        writes the report, which the others read. Two ranks may ask at once, and a rank may see an episode late: a
        rank that sees a newer episode while it waits answers that one instead."""
        self._answer(store, rank, prefix, latest)
        report = self._decide(store, prefix, world_size, stop) if rank == 0 else self._read_report(store, prefix, stop)
        if report is None:
            return
        repeated = self.last_report is not None and (self.last_report.kind, self.last_report.culprits) == (
            report.kind,
            report.culprits,
        )
        self.last_report = report
        if not repeated and rank == 0:
            self._act(report)

    def _answer(self, store: Any, rank: int, prefix: str, latest: int) -> None:
        """This rank's state, now, under episode ``latest`` (the one it answers)."""
        frame = main_thread_frame()
        mine = state_of(
            rank, self.ledger, user_call_site(frame), stack_text(frame), outside_ledger=collective_in_progress(frame)
        )
        store.set(f"{prefix}/{latest}/{rank}", json.dumps(mine.as_data()))
        self._handled, self._mine = latest, mine

    def _newer(self, store: Any, rank: int, prefix: str) -> bool:
        """A newer episode was asked for meanwhile: answered now (True)."""
        latest = int(store.add(f"{prefix}/episodes", 0))
        if latest > self._handled:
            self._answer(store, rank, prefix, latest)
            return True
        return False

    def _decide(self, store: Any, prefix: str, world_size: int, stop: threading.Event) -> StallReport | None:
        """Rank 0: every rank's state (N - 1 reads), the decision, and the report written for the others."""
        deadline = time.monotonic() + EXCHANGE_SECONDS
        other = 1
        while other < world_size and time.monotonic() < deadline:
            if store.check([f"{prefix}/{self._handled}/{other}"]):
                other += 1
            elif stop.wait(0.05):
                return None  # stopped: the fit is over, and a new thread may already be watching
            elif self._newer(store, 0, prefix):
                other = 1  # every rank answers the newer one
        key = f"{prefix}/{self._handled}"
        assert self._mine is not None  # answered before deciding
        states = [self._mine]
        for rank in range(1, world_size):
            if store.check([f"{key}/{rank}"]):
                states.append(RankState.from_data(json.loads(store.get(f"{key}/{rank}"))))
        report = None
        if any(state.current is not None for state in states):  # else the wait ended before the states were read
            report = explain_stall(states, world_size)
            missing = world_size - len(states)
            if missing:
                report = StallReport(report.kind, f"{report.text} ({missing} rank(s) did not answer.)", report.culprits)
        store.set(f"{key}/report", json.dumps(dataclasses.asdict(report) if report is not None else None))
        return report

    def _read_report(self, store: Any, prefix: str, stop: threading.Event) -> StallReport | None:
        """A rank but 0: the report rank 0 wrote for the episode this rank answered (one read), or ``None``."""
        deadline = time.monotonic() + EXCHANGE_SECONDS + 2.0
        while not store.check([f"{prefix}/{self._handled}/report"]):
            if time.monotonic() > deadline or stop.wait(0.05):
                return None
            self._newer(store, self._rank, prefix)
        data = json.loads(store.get(f"{prefix}/{self._handled}/report"))
        return None if data is None else StallReport(data["kind"], data["text"], tuple(data["culprits"]))

    def _act(self, report: StallReport) -> None:
        if report.kind == "out_of_step":
            self._say(
                "lightning-ddp-plus: the job ends now, without waiting for the collective timeout: the ranks are "
                f"out of step (rank 0 ends its process, and the other ranks end with it).\n{report.text}"
            )
            self._end_process(1)
            return
        self._say(f"lightning-ddp-plus: a collective has waited longer than {self.report_after:g} s.\n{report.text}")


def _stop_every_watchdog() -> None:
    # a process ending on an uncaught error (a Fabric loop's `RankDied`, say) does not wait for its peers' threads:
    # a dead peer's never says it stopped, and the wait would add its whole bound to the job's end
    orderly = getattr(sys, "last_value", None) is None
    for watchdog in _running[:]:  # a copy: stop() removes each from the list
        watchdog.stop(orderly=orderly)


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


#: Fits in this process, for the stall watchdog's keys in the job's store.
_FIT_NUMBERS = itertools.count(1)
#: How long the stall watchdog's store client waits for the store (a cut link must not hold up the job's end).
STORE_TIMEOUT = timedelta(seconds=5)


def start_for_fit(watchdog: StallWatchdog, warn: Callable[[str], None]) -> None:
    """Start ``watchdog`` for a new fit, on every rank of a job of two or more (every rank counts its fits alike, so
    the fit's keys in the job's store agree, and keys of earlier fits stay apart)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    store = store_client(STORE_TIMEOUT)  # fails fast on a cut link, rather than at the collective timeout
    if store is None:
        warn("DDPPlusStrategy: no client of the job's store could be made, so stalls are not explained.")
        return
    prefix = f"ddp_plus/stalls/attempt_{restart_attempt() or 0}/fit_{next(_FIT_NUMBERS)}"
    rank = dist.get_rank()
    watchdog.start(store, rank, dist.get_world_size(), prefix, server=default_store() if rank == 0 else None)
