"""A 2-rank ``ddp_plus`` job (popen launcher) in which one rank misbehaves at a given step.

``failure_job.py MODE RANK STEP TIMEOUT TAG [STALL_REPORT_AFTER [SETUP_TIMEOUT]]``: MODE ``hang`` sleeps for 120 s
before the step's backward (so the other rank waits in the all-reduce), ``slow_setup`` does the same after rank 0
spent ``SETUP_S`` in ``setup`` (rank 1 waits meanwhile in DDP's first broadcast), ``crash`` raises; the modes that put the ranks out of step
issue a collective on that rank only: ``extra_log`` logs a metric with ``sync_dist=True``, ``rank_barrier`` calls
the strategy's ``barrier``, ``extra_val_batch`` gives that rank one validation batch more; ``out_of_memory`` raises torch's
``OutOfMemoryError`` there (as CUDA's allocator would) (validation every STEP
steps, each batch's loss logged with ``sync_dist=True``). TAG only marks the command line so the test can find any process left behind.
"""

import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression, regression_data

HANG_S = 120
SETUP_S = 6


class Misbehaving(TinyRegression):
    def __init__(self, mode: str, rank: int, step: int) -> None:
        super().__init__(num_samples=256, batch_size=4)
        self.mode, self.bad_rank, self.bad_step = mode, rank, step

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            # the wall-clock time of the failure, so the test bounds what follows it, not the job's start-up
            print(f"failure starts at {time.time():.3f}", flush=True)
            if self.mode in ("hang", "slow_setup"):
                print(f"rank {self.global_rank} hangs at step {self.global_step}", flush=True)
                time.sleep(HANG_S)
            elif self.mode == "extra_log":
                self.log("only_here", torch.tensor(1.0), sync_dist=True)
            elif self.mode == "rank_barrier":
                self.trainer.strategy.barrier("only_here")
            elif self.mode == "out_of_memory":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            else:
                raise RuntimeError(f"deliberate failure on rank {self.global_rank} at step {self.global_step}")
        return super().training_step(batch, batch_idx)

    def setup(self, stage: str) -> None:
        if self.mode == "slow_setup" and self.global_rank == 0:
            print(f"rank 0 prepares for {SETUP_S} s", flush=True)
            time.sleep(SETUP_S)


class UnevenValidation(Misbehaving):
    """Validation every STEP training steps over each rank's own shard: rank RANK holds one batch more, and each
    batch's loss is logged with ``sync_dist=True`` at every step, so its extra batch issues an all-reduce that the
    other rank, back in training, never pairs."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == self.bad_rank and batch_idx == 2:
            print(f"failure starts at {time.time():.3f}", flush=True)
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss, on_step=True, on_epoch=False, sync_dist=True)

    def val_dataloader(self):
        batches = 3 if self.global_rank == self.bad_rank else 2
        return DataLoader(regression_data(4 * batches), batch_size=4)


def main() -> None:
    mode, rank, step, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    stall = sys.argv[6] if len(sys.argv) > 6 else "auto"
    setup_timeout = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] != "None" else None
    strategy = DDPPlusStrategy(timeout=timeout, stall_report_after=stall, setup_timeout=setup_timeout)
    if mode == "extra_val_batch":
        model, validation = UnevenValidation(mode, rank, step), {"val_check_interval": step, "num_sanity_val_steps": 0}
    else:
        model, validation = Misbehaving(mode, rank, step), {}
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        use_distributed_sampler=False,
        **validation,
        **QUIET_TRAINER,
    )
    trainer.fit(model)


if __name__ == "__main__":
    main()
