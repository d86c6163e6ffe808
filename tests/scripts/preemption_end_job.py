"""When a notice is taken relative to the fit's own end: ``preemption_end_job.py OUT_JSON CASES_JSON`` (2 ranks).

``"after_training"``: rank 1 signals itself in ``on_train_end``, after the last step's agreement, so no step boundary
takes the notice: it is passed on to the handler from before the fit, which records which of the fit's last hooks had
run by then (Lightning's ``on_fit_end`` and ``teardown`` come after the strategy's teardown).
``"async_save"``: every rank signals itself in a forward; the agreed step is saved through ``AsyncCheckpointIO`` over
a checkpoint IO that takes ``WRITE_S`` to write, and the report says how long the save took.
"""

import os
import signal
import time

import lightning as L
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_ddp_plus import DDPPlusStrategy, Preempted
from tests.helpers import QUIET_TRAINER, TinyRegression, job_main

#: How long the slow checkpoint IO takes to write a file.
WRITE_S = 1.0


class SlowCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(WRITE_S)
        super().save_checkpoint(checkpoint, path, storage_options)


class Events(L.Callback):
    """The fit's last hooks as they run; sends the case's signal at its moment."""

    def __init__(self, case: dict) -> None:
        self.case, self.seen = case, []

    def send(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.case["at"] == "async_save" and trainer.global_step == 2 and "sent" not in self.seen:
            self.seen.append("sent")
            self.send()

    def on_train_end(self, trainer, pl_module):
        self.seen.append("on_train_end")
        if self.case["at"] == "after_training" and trainer.global_rank == 1:
            self.send()

    def on_fit_end(self, trainer, pl_module):
        self.seen.append("on_fit_end")

    def teardown(self, trainer, pl_module, stage):
        self.seen.append("teardown")


def run_case(case: dict) -> dict:
    events = Events(case)
    passed_on: list[list[str]] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: passed_on.append(list(events.seen)))
    root = case["root"]
    plugins = [AsyncCheckpointIO(SlowCheckpointIO())] if case["at"] == "async_save" else []
    checkpoints = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=0)
    options = {**QUIET_TRAINER, "enable_checkpointing": True, "default_root_dir": root, "plugins": plugins}
    trainer = L.Trainer(
        strategy=DDPPlusStrategy(timeout="60s"),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        callbacks=[events, checkpoints],
        **options,
    )
    report = None
    try:
        trainer.fit(TinyRegression(num_samples=32))
    except Preempted as error:
        report = error.report
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    by_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, passed_on)
    saved = report is not None and report.path is not None and os.path.exists(report.path)
    return {
        **case,
        "passed_on_by_rank": by_rank,
        "preempted": report is not None,
        "save_seconds": report.save_seconds if report is not None else None,
        "saved": saved,
        "global_step": trainer.global_step,
    }


if __name__ == "__main__":
    job_main(run_case)
