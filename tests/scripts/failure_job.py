"""A 2-rank ``ddp_plus`` job (popen launcher) in which one rank misbehaves at a given step.

``failure_job.py MODE RANK STEP TIMEOUT TAG [STALL_REPORT_AFTER [SETUP_TIMEOUT]]``: MODE ``hang`` sleeps for 120 s
before the step's backward (so the other rank waits in the all-reduce), ``hang_behind_host`` does the same while the
collectives run behind the host as on NCCL (``BehindTheHost``), ``slow_setup`` does the same after rank 0
spent ``SETUP_S`` in ``setup`` (rank 1 waits meanwhile in DDP's first broadcast), ``crash`` raises; the modes that put the ranks out of step
issue a collective on that rank only: ``extra_log`` logs a metric with ``sync_dist=True``, ``rank_barrier`` calls
the strategy's ``barrier``, ``extra_val_batch`` gives that rank one validation batch more; ``out_of_memory`` raises torch's
``OutOfMemoryError`` there (as CUDA's allocator would) (validation every STEP
steps, each batch's loss logged with ``sync_dist=True``). TAG only marks the command line so the test can find any process left behind.
"""

import os
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression, regression_data

HANG_S = 120
SETUP_S = 6


class BehindTheHost:
    """What NCCL does to the host, on gloo (mode ``hang_behind_host``): a comm hook whose all-reduce runs
    asynchronously and whose future is complete at once, so the backward returns before the gradients are reduced;
    the work queued so far is this "stream", which the ledger probes as it would a CUDA event; and a host sync at the
    end of every batch (as a ``.item()``), where the rank blocks when a peer hangs, outside any collective's call."""

    def __init__(self) -> None:
        self.works: list = []

    def hook(self, state, bucket):
        self.works.append(torch.distributed.all_reduce(bucket.buffer(), async_op=True))
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    def probe(self):
        queued = list(self.works)
        return lambda: all(work.is_completed() for work in queued)

    def synchronize(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()


STREAM = BehindTheHost()


class Misbehaving(TinyRegression):
    def __init__(self, mode: str, rank: int, step: int) -> None:
        super().__init__(num_samples=256, batch_size=4)
        self.mode, self.bad_rank, self.bad_step = mode, rank, step

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            # the wall-clock time of the failure, so the test bounds what follows it, not the job's start-up
            print(f"failure starts at {time.time():.3f}", flush=True)
            if self.mode in ("hang", "slow_setup", "hang_behind_host"):
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

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.mode == "hang_behind_host":
            STREAM.synchronize()  # the host sync of the batch (a `.item()` on NCCL)

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
    behind = {"ddp_comm_hook": STREAM.hook} if mode == "hang_behind_host" else {}
    strategy = DDPPlusStrategy(timeout=timeout, stall_report_after=stall, setup_timeout=setup_timeout, **behind)
    if behind:
        strategy.engine.ledger.device_completion = STREAM.probe
    if mode == "extra_val_batch":
        model, validation = UnevenValidation(mode, rank, step), {"val_check_interval": step, "num_sanity_val_steps": 0}
    else:
        model, validation = Misbehaving(mode, rank, step), {}
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=os.environ.get("DDP_PLUS_TEST_ACCELERATOR", "cpu"),  # the GPU check: "gpu"
        devices=2,
        max_epochs=1,
        use_distributed_sampler=False,
        **validation,
        **QUIET_TRAINER,
    )
    trainer.fit(model)


if __name__ == "__main__":
    main()
