"""A 2-rank ``ddp_plus`` job (popen launcher) in which one rank misbehaves at a given step.

``failure_job.py MODE RANK STEP TIMEOUT TAG [STALL_REPORT_AFTER]``: MODE ``hang`` sleeps for 120 s before the step's
backward (so the other rank waits in the all-reduce), ``crash`` raises; the modes that put the ranks out of step
issue a collective on that rank only: ``extra_log`` logs a metric with ``sync_dist=True``, ``rank_barrier`` calls
the strategy's ``barrier``. TAG only marks the command line so the test can find any process left behind.
"""

import sys
import time

import lightning as L
import torch

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression

HANG_S = 120


class Misbehaving(TinyRegression):
    def __init__(self, mode: str, rank: int, step: int) -> None:
        super().__init__(num_samples=256, batch_size=4)
        self.mode, self.bad_rank, self.bad_step = mode, rank, step

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            # the wall-clock time of the failure, so the test bounds what follows it, not the job's start-up
            print(f"failure starts at {time.time():.3f}", flush=True)
            if self.mode == "hang":
                print(f"rank {self.global_rank} hangs at step {self.global_step}", flush=True)
                time.sleep(HANG_S)
            elif self.mode == "extra_log":
                self.log("only_here", torch.tensor(1.0), sync_dist=True)
            elif self.mode == "rank_barrier":
                self.trainer.strategy.barrier("only_here")
            else:
                raise RuntimeError(f"deliberate failure on rank {self.global_rank} at step {self.global_step}")
        return super().training_step(batch, batch_idx)


def main() -> None:
    mode, rank, step, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    stall = sys.argv[6] if len(sys.argv) > 6 else "auto"
    strategy = DDPPlusStrategy(timeout=timeout, stall_report_after=stall)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, **QUIET_TRAINER)
    trainer.fit(Misbehaving(mode, rank, step))


if __name__ == "__main__":
    main()
