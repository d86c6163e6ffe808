"""Checkpoint and resume cases on one 2-rank process group: ``checkpoint_job.py OUT_JSON CASES_JSON``.

Each case trains ``TinyRegression`` (momentum, so a wrong resume shows) under ``ddp_plus`` with
``ModelCheckpoint(dirpath=DIR, every_n_train_steps=2, save_top_k=-1, save_last=...)``. Before the fit, rank 0 can tear
files of DIR (cut to half their size, as a kill during a copy leaves them) or point Python's temp dir somewhere
(``tempfile.tempdir``: where Lightning's own checkpoint IO stages a save). ``ballast_mb`` adds a persistent buffer so
the checkpoint has a chosen size. Each case records the outcome, the step training started from, the resume warnings,
every rank's parameters, and the files DIR holds afterwards.
"""

import os
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.persistence.files import unreadable_reason
from tests.helpers import TinyRegression, flat_parameters, job_main


class BallastRegression(TinyRegression):
    def __init__(self, ballast_mb: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("ballast", torch.zeros(int(ballast_mb * 2**20 / 4)))


class AnnouncedCheckpoint(ModelCheckpoint):
    """Prints when each save begins and ends (``tests/kill_save_tries.py`` kills rank 0 in between)."""

    def _save_checkpoint(self, trainer, filepath):
        print(f"[{time.time():.6f}] save begins {os.path.basename(filepath)} pid {os.getpid()}", flush=True)
        super()._save_checkpoint(trainer, filepath)
        print(f"[{time.time():.6f}] save ends {os.path.basename(filepath)}", flush=True)


class SaveCalls(L.Callback):
    """Counts this rank's ``torch.save`` calls and ``Trainer.save_checkpoint`` calls during the fit, wrapped where
    Lightning's own ``test_model_checkpoint_no_extraneous_invocations`` wraps ``torch.save``: only rank 0 may call it,
    once per save (``torch.save`` also serializes any tensor that ``pickle`` meets, e.g. in ``all_gather_object``)."""

    def __init__(self) -> None:
        self.torch_saves = self.checkpoint_saves = 0

    def on_train_start(self, trainer, pl_module):
        save, save_checkpoint = torch.save, trainer.save_checkpoint

        def counted_save(*args, **kwargs):
            self.torch_saves += 1
            return save(*args, **kwargs)

        def counted_save_checkpoint(*args, **kwargs):
            self.checkpoint_saves += 1
            return save_checkpoint(*args, **kwargs)

        torch.save, trainer.save_checkpoint = counted_save, counted_save_checkpoint
        self.restore = lambda: setattr(torch, "save", save) or vars(trainer).pop("save_checkpoint")

    def on_train_end(self, trainer, pl_module):
        self.restore()


class StartStep(L.Callback):
    def __init__(self) -> None:
        self.step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def prepare(case: dict) -> None:
    directory = Path(case["dir"])
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for name in case.get("tear", []):
            path = directory / name
            os.truncate(path, os.path.getsize(path) // 2)
    if dist.is_initialized():
        dist.barrier()


def run_case(case: dict) -> dict:
    prepare(case)
    tempfile.tempdir = case.get("tempdir")  # None: Python's default again
    strategy = DDPPlusStrategy(
        process_group_backend="gloo",
        broadcast_buffers=False,
        timeout=case.get("timeout", "60s"),
        resume_from_last=case.get("resume_from_last", "never"),
        atomic_checkpoints=case.get("atomic", True),
    )
    start, saves = StartStep(), SaveCalls()
    checkpoint = (AnnouncedCheckpoint if case.get("announce_saves") else ModelCheckpoint)(
        dirpath=case["dir"], every_n_train_steps=2, save_top_k=-1, save_last=case.get("save_last", True)
    )

    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=case["max_steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint, start, saves],
    )
    model = BallastRegression(ballast_mb=case.get("ballast_mb", 0.0), num_samples=64, batch_size=4, momentum=0.9)
    outcome = {"error": None, "message": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, ckpt_path=case.get("ckpt_path"))
        except Exception as error:
            if case.get("reraise"):  # end the process as a user's script would
                print(f"[{time.time():.3f}] rank {trainer.global_rank} ends with {type(error).__name__}", flush=True)
                raise
            outcome = {"error": type(error).__name__, "message": str(error)}
    tempfile.tempdir = None
    flat = flat_parameters(model)
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    starts = [None, None]
    dist.all_gather_object(starts, start.step)
    save_calls = [None, None]
    dist.all_gather_object(save_calls, {"torch": saves.torch_saves, "checkpoint": saves.checkpoint_saves})
    directory = Path(case["dir"])
    files = {path.name: unreadable_reason(path) for path in sorted(directory.iterdir())} if directory.exists() else {}
    return {
        **case,
        **outcome,
        "warnings": [str(w.message) for w in caught if "DDPPlusStrategy" in str(w.message)],
        "params": [t.tolist() for t in gathered],
        "global_step": trainer.global_step,
        "start_step": starts,
        "save_calls": save_calls,
        "files": files,
        "links": {p.name: os.readlink(p) for p in directory.iterdir() if p.is_symlink()} if directory.exists() else {},
    }


if __name__ == "__main__":
    job_main(run_case)
