"""The stop: every rank stops after the same optimizer step when any rank got a notice.

The decision rides on the agreement the per-step guard already makes after each synced backward
(``sync.step_agreement``), as one more flag, so a run without a notice pays nothing for it:

- Its flag rides in the last gradient bucket (``sync.flag_carrier``), on every backend, with the guard on or off.
- Where nothing can ride in the buckets (a ``ddp_comm_hook``, ``optimizer_sharding``), the guard all-reduces its
  flags every step and the notice is one more integer there; with the guard off too, one all-reduce of one integer
  per step on the side channel.

A notice that lands during a synced backward, or during the optimizer step, is taken at the next step's: the stop
comes at most one optimizer step after the notice. The ranks stop after the first optimizer step applied once they
agreed: with accumulation the agreement is at the window's synced backward, and a synced backward that closes no
window (a static graph's first micro-batch, a manual loop that accumulates in its own code) waits for the step that
does, so a window is always finished, never cut: the saved state is a step boundary, which is exactly what an
uninterrupted run passes through, and the micro-batches already computed are not thrown away.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_ddp_plus.pipeline.component import AgreedStep, StepComponent
from lightning_ddp_plus.preemption.notice import Notice, NoticeWatch
from lightning_ddp_plus.sync.side_channel import SideChannel

#: The agreement flag of a termination notice: some rank got one.
STOP = "stop"


@dataclass(frozen=True)
class StopDecision:
    """What every rank agreed: the notices (each rank that had one), and the optimizer steps applied when every
    rank stops (``None``: the fit stops before its first step)."""

    notices: tuple[Notice, ...]
    stop_after: int | None

    @property
    def first(self) -> Notice:
        return min(self.notices, key=lambda notice: (notice.step, notice.rank))

    @property
    def exit_code(self) -> int:
        return self.first.exit_code

    def describe_notices(self) -> str:
        """``received SIGTERM on rank 1 at step 5`` (every rank with a notice named)."""
        by_signal: dict[tuple[str, int], list[int]] = {}
        for notice in self.notices:
            by_signal.setdefault((notice.signal_name, notice.step), []).append(notice.rank)
        parts = []
        for (name, step), ranks in sorted(by_signal.items(), key=lambda item: item[0][1]):
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            parts.append(f"received {name} on {who} at step {step}")
        return "; ".join(parts)


class PreemptionStop(StepComponent):
    """The notice watch of a run and the ranks' agreement to stop.

    Args:
        signals: ``preemption_signals`` (empty: off).
        channel: the side channel (the flag all-reduce without the guard, and the gather after a stop).
    """

    def __init__(self, signals: Sequence[str], channel: SideChannel) -> None:
        self.watch = NoticeWatch(signals)
        self.channel = channel
        self.agreement_flags = (STOP,) if self.on else ()
        #: Set once the ranks agreed to stop and the step to stop after was applied; the front end saves and ends.
        self.decision: StopDecision | None = None
        #: Every rank's notice, once the ranks agreed to stop at a synced backward; the decision waits for a step.
        self._agreed_notices: tuple[Notice, ...] | None = None

    @property
    def on(self) -> bool:
        return bool(self.watch.signals)

    def add_signal(self, name: str) -> None:
        """Also take ``name`` as a notice (SLURM's requeue signal, with Lightning's ``auto_requeue``)."""
        if name not in self.watch.signals:
            self.watch.signals = (*self.watch.signals, name)

    def start(self) -> None:
        """At the start of a fit, in the main thread of every rank."""
        self.decision, self._agreed_notices = None, None
        self.watch.clear()
        self.watch.steps_done = 0
        if self.on:
            self.watch.install()

    def end(self, pass_on: bool, hold: bool = False) -> None:
        """At the end of a fit: the handlers from before it, and (``pass_on``: the fit ended without an error) a
        notice that no step boundary took, delivered again to them (by default, it ends the process); ``hold``: not
        now but at ``pass_on_held`` (the Trainer's teardown is not the fit's end: ``on_fit_end``, the teardown hooks
        and an asynchronous checkpoint's writes come after it)."""
        if not self.watch.installed:
            return
        self.watch.uninstall()
        if not pass_on or self.decision is not None:  # a failed fit, or a notice the stop took: nothing to pass on
            self.watch.clear()
        elif not hold:
            self.watch.pass_on()

    def pass_on_held(self) -> None:
        """The fit is over, every hook of it run: a notice ``end`` held is delivered to the handlers from before."""
        if not self.watch.installed:
            self.watch.pass_on()

    def agreement_values(self) -> dict[str, int]:
        """This rank's flag in the agreement after a synced backward."""
        return {STOP: int(self.watch.pending)} if self.on else {}

    def agreed(self, agreed: AgreedStep) -> None:
        """A termination notice on some rank: every rank stops after the next optimizer step it applies. Not
        necessarily this backward's: a synced backward may close no window (a static graph's first micro-batch, a
        manual loop that accumulates in its own code), and a stop there would save half a window."""
        if agreed.flags.get(STOP) and not agreed.out_of_memory and self._agreed_notices is None:
            self._agreed_notices = self.every_ranks_notice()

    def step_done(self, step: int) -> None:
        self.watch.steps_done = step
        if self._agreed_notices is not None and self.decision is None:
            self.decision = StopDecision(self._agreed_notices, step)

    def agree_without_guard(self) -> bool:
        """After a synced backward when the guard does not run: one flag all-reduce (only when notices are on)."""
        if not self.on:
            return False
        return bool(self.channel.maximum([int(self.watch.pending)])[0]) if self.channel.open else self.watch.pending

    def every_ranks_notice(self) -> tuple[Notice, ...]:
        """Every rank, once the flag said stop: every rank's notice (one gather, after a notice only)."""
        mine = self.watch.notice(self.channel.rank)
        row = [mine.exit_code - 128, mine.step] if mine is not None else [0, 0]
        return tuple(
            Notice(signal.Signals(values[0]).name, rank, values[1])
            for rank, values in enumerate(self.channel.gather(row))
            if values[0]
        )

    def stop_decided(self, stop_after: int | None) -> StopDecision:
        """Every rank, once the flag said stop after ``stop_after`` steps (``None``: before the first)."""
        self.decision = StopDecision(self.every_ranks_notice(), stop_after)
        return self.decision

    def before_first_step(self) -> StopDecision | None:
        """At the start of training, once per fit: whether some rank got a notice during setup (one all-reduce of
        one integer; nothing has been trained, so there is nothing to save)."""
        if self.agree_without_guard():
            return self.stop_decided(None)
        return None
