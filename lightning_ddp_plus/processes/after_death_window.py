"""The window in which a survivor saves after a rank's death (``save_on_rank_death``): whether this process's main
thread is at it, so that the threads that would end the process (the launcher's child observer, a child's watch of
its parent) wait for it, within a bound. The launcher sets it up at each launch; the front ends' saves open it, and
tell it, at each step boundary, how long a step takes."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Any


class AfterDeathWindow:
    """Whether this process's main thread is saving after a rank's death, so that a thread about to end the process
    (the parent watch, the child observer) waits for it, within a bound.

    ``enabled`` is set at each launch whose strategy saves after a rank's death (``save_on_rank_death``). A survivor
    learns of the death at its next collective, at most one step's compute later: it gets ``notice_seconds`` to start
    (three times the slowest step seen, at least ``min_notice_seconds``: a rank hung outside any collective never
    starts, and must not hold the job long), then ``save_seconds`` to agree and write, then ``exit_seconds`` to raise
    its error and end by itself.
    """

    def __init__(
        self, min_notice_seconds: float = 10.0, save_seconds: float = 330.0, exit_seconds: float = 30.0
    ) -> None:
        self.enabled = False
        self.min_notice_seconds, self.notice_seconds = min_notice_seconds, min_notice_seconds
        self.save_seconds, self.exit_seconds = save_seconds, exit_seconds
        self.started, self.finished = threading.Event(), threading.Event()
        #: The global ranks this process's launcher saw exit with an error (the survivors need not wait for them).
        self.dead_ranks: set[int] = set()
        #: Ends this process's collectives in flight once a peer is known dead, where the backend's would wait for it
        #: until the timeout (``abort_collectives_on_a_death``); ``None``: they fail by themselves (gloo).
        self.leave_collectives: Callable[[], None] | None = None

    def reset(self, enabled: bool) -> None:
        """At each launch (a process may fit several times)."""
        self.enabled, self.notice_seconds = enabled, self.min_notice_seconds
        self.dead_ranks, self.leave_collectives = set(), None
        self.started.clear()
        self.finished.clear()

    def peer_died(self, ranks: set[int]) -> None:
        """The launcher saw ``ranks`` exit with an error, or this child's launching process is gone (``set()``: its
        rank is the node's first, not known here). Where collectives would wait for the dead until the timeout, this
        process's are aborted now (once), so that the main thread's wait raises and it can save."""
        self.dead_ranks |= ranks
        leave, self.leave_collectives = self.leave_collectives, None
        if self.enabled and leave is not None and not self.started.is_set():
            with contextlib.suppress(Exception):  # the group may be gone already; the bound below still holds
                leave()

    def step_took(self, seconds: float) -> None:
        """A step's time, as the run goes: a survivor may need as long to reach its next collective."""
        self.notice_seconds = max(self.notice_seconds, 3.0 * seconds)

    def wait(self) -> None:
        """Until the main thread's save is over (or never started): at most ``notice_seconds + save_seconds``."""
        if not self.enabled:
            return
        if self.started.wait(self.notice_seconds):
            self.finished.wait(self.save_seconds)

    @contextlib.contextmanager
    def saving(self) -> Any:
        """The main thread's save after a death. A SIGTERM meanwhile (torchrun's agent stops the survivors as soon
        as it sees a worker die) is held until the save is over, then delivered: a death is not a notice."""
        self.started.set()
        held: list[int] = []
        previous, mask = None, None
        if self.enabled and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
            # Kept off this thread too: a signal that lands in a store call here interrupts it (a failed agreement)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            yield
        finally:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one still pending comes now, to `held`
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.finished.set()
            if held:
                signal.raise_signal(signal.SIGTERM)


#: This process's window (one main thread per process).
AFTER_DEATH = AfterDeathWindow()
