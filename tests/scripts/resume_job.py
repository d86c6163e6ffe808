"""Checkpoint and resume under ``ddp_plus`` with accumulation: ``resume_job.py OUT_JSON MODE CKPT WRITES_LOG``.

MODE ``full`` trains 2 epochs; ``first`` trains 1 epoch and saves CKPT; ``resume`` continues from CKPT to 2 epochs;
modes joined by commas run one after the other on the same ranks. OUT_JSON gets each mode's parameters (every rank's)
and ``global_step``. Every checkpoint write is logged (with the writing rank) to WRITES_LOG by a counting CheckpointIO.
"""

import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression, flat_parameters


class CountingCheckpointIO(TorchCheckpointIO):
    def __init__(self, log_path: str) -> None:
        self.log_path = log_path

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(self.log_path, "a") as handle:
            handle.write(f"{dist.get_rank()}\n")
        super().save_checkpoint(checkpoint, path, storage_options)


def train(mode: str, ckpt: str, writes_log: str) -> dict:
    strategy = DDPPlusStrategy(gradient_accumulation_steps=3, checkpoint_io=CountingCheckpointIO(writes_log))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=1 if mode == "first" else 2, **QUIET_TRAINER
    )
    model = TinyRegression(num_samples=64, batch_size=4, momentum=0.9)
    trainer.fit(model, ckpt_path=ckpt if mode == "resume" else None)
    if mode == "first":
        trainer.save_checkpoint(ckpt)
    flat = flat_parameters(model)
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    return {"params": [t.tolist() for t in gathered], "global_step": trainer.global_step}


def main() -> None:
    out_path, modes, ckpt, writes_log = sys.argv[1:5]
    results = {mode: train(mode, ckpt, writes_log) for mode in modes.split(",")}
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
