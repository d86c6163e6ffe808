"""Straggler attribution on 2 ranks: ``run_case`` is one fit (the diagnostics job runs these cases among its own;
``straggler_job.py OUT_JSON CASES_JSON`` runs them alone).

A case: each case is ``{"name", "slow" (None, "data" or "compute"), "rank", "delay_s",
"steps", "every", "buffers" (a BatchNorm, so DDP broadcasts buffers in every forward), "epoch_steps" (batches per
epoch; default ``steps``)}``. A slow rank sleeps
``delay_s`` per batch while its batch is loaded (``data``) or in its ``training_step`` (``compute``). Rank 0 writes,
per case, the straggler warnings given (rank 0 gives them) and every comparison's per-rank phase medians.
"""

import os
import time
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression, job_main, regression_data


class Comparisons(L.Callback):
    """Keeps every comparison's per-rank medians (the strategy keeps only the last)."""

    def __init__(self) -> None:
        self.times: list[list[dict]] = []
        #: The last comparison's medians when each epoch after the first starts (an epoch's end compares).
        self.at_epoch_start: list[list[dict]] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch > 0:
            self.at_epoch_start.append([vars(times) for times in trainer.strategy.phase_times])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        watch = trainer.strategy.engine.stragglers
        latest = [vars(times) for times in watch.last_times]
        if latest and (not self.times or latest != self.times[-1]):
            self.times.append(latest)

    def on_train_end(self, trainer, pl_module) -> None:
        # a step's comparison runs once the loop counted it (at the next forward): the last step's, at the fit's end,
        # where the tail's own comparison (``compare_since_last``) would run too: only the cadence's is kept
        if trainer.global_step % trainer.strategy.engine.arguments.find_stragglers_every_n_steps == 0:
            self.on_train_batch_end(trainer, pl_module, None, None, 0)


class Slow(TinyRegression):
    def __init__(self, slow: str | None, rank: int, delay_s: float, steps: int, buffers: bool) -> None:
        super().__init__(num_samples=4 * steps, batch_size=4)
        self.slow, self.slow_rank, self.delay_s = slow, rank, delay_s
        if buffers:
            self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def _pause(self, kind: str) -> None:
        if self.slow == kind and self.global_rank == self.slow_rank:
            time.sleep(self.delay_s)

    def training_step(self, batch, batch_idx):
        self._pause("compute")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        def collate(items):
            self._pause("data")
            return torch.utils.data.default_collate(items)

        data = regression_data(self.hparams.num_samples, self.hparams.features)
        return DataLoader(data, batch_size=self.hparams.batch_size, collate_fn=collate)


def run_case(case: dict) -> dict:
    comparisons = Comparisons()
    strategy = DDPPlusStrategy(find_stragglers_every_n_steps=case["every"])
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=os.environ.get("DDP_PLUS_TEST_ACCELERATOR", "cpu"),  # the GPU check: "gpu"
        devices=2,
        max_steps=case["steps"],
        max_epochs=-1,
        callbacks=[comparisons],
        use_distributed_sampler=False,
        **QUIET_TRAINER,
    )
    epoch_steps = case.get("epoch_steps", case["steps"])  # batches per epoch
    model = Slow(case["slow"], case["rank"], case["delay_s"], epoch_steps, case.get("buffers", False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    said = [str(warning.message) for warning in caught if "straggler" in str(warning.message)]
    return {**case, "warnings": said, "comparisons": comparisons.times, "at_epoch_start": comparisons.at_epoch_start}


if __name__ == "__main__":
    job_main(run_case)
