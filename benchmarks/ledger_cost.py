"""The collective ledger's and the phase clock's own work per optimizer step, timed in one process.

    python benchmarks/ledger_cost.py [--steps 20000]

A step of ``ddp_plus`` with automatic optimization does, on the main thread: five phase changes, the gradient
all-reduce's record (no call site: Lightning's loop issued it), the per-step guard's agreement, and one
``self.log(..., sync_dist=True)`` record with its call site (the costliest: it walks the stack), and closes the
step on the clock (the comparison's gather every N steps is a collective, measured by the suite's overhead
benchmark). This times exactly that work, without the collectives, on and off, so its cost per step is resolved far
below the noise of a 2-process step time.
"""

import argparse
import time

from lightning_ddp_plus.diagnostics.collective_ledger import CollectiveLedger
from lightning_ddp_plus.diagnostics.phase_timings import StragglerWatch


def one_step(ledger: CollectiveLedger, watch: StragglerWatch | None) -> None:
    ledger.enter_phase("forward", step=1)
    with ledger.collective("all_reduce", 4):  # self.log(..., sync_dist=True): the call site is looked up
        pass
    ledger.enter_phase("backward")
    with ledger.collective("gradient all_reduce", 4096, users_call=False, waits=False):
        if watch is not None:
            watch.clock.switch("collective wait")
    ledger.enter_phase("optimizer step")
    with ledger.collective("flag all_reduce", 16, users_call=False):
        pass
    ledger.enter_phase("data fetch", step=2)
    if watch is not None:
        watch.clock.end_step()


def per_step_us(ledger: CollectiveLedger, watch: StragglerWatch | None, steps: int) -> float:
    for _ in range(200):
        one_step(ledger, watch)
    started = time.perf_counter()
    for _ in range(steps):
        one_step(ledger, watch)
    return (time.perf_counter() - started) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    watch = StragglerWatch(50, warn=print)
    on = per_step_us(CollectiveLedger(64, clock=watch.clock), watch, args.steps)
    ledger_only = per_step_us(CollectiveLedger(64), None, args.steps)
    off = per_step_us(CollectiveLedger(0), None, args.steps)
    print(f"ledger and phase clock on: {on:.1f} us per step")
    print(f"ledger on, phase clock off: {ledger_only:.1f} us per step")
    print(f"ledger off (ledger_length=0, stall_report_after=None): {off:.1f} us per step")


if __name__ == "__main__":
    main()
