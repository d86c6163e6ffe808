"""A 2-rank ``ddp_plus`` job under torchrun, preempted the way torchrun preempts: ``preemption_torchrun_job.py ROOT
first|resume``.

``first``: at step 3, rank 1 sends SIGTERM to its torchrun agent, which forwards it to every worker and gives them
its shutdown window before SIGKILL. Each rank writes the samples it trained, and lets ``Preempted`` end it.
``resume``: ``resume_from_last="always"`` continues from what the first attempt saved, to the end; then, in the same
processes, an uninterrupted run from scratch; rank 0 writes ``ROOT/result.json``.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ddp_plus import DDPPlusStrategy
from tests.scripts.preemption_job import EPOCHS, IndexedRegression, every_ranks, flat


class SignalAgent(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 3 and not getattr(self, "sent", False):
            self.sent = True
            print(f"rank 1 sends SIGTERM to its torchrun agent at step {trainer.global_step}", flush=True)
            os.kill(os.getppid(), signal.SIGTERM)


def trainer(root: Path, callbacks: list, resume: str) -> L.Trainer:
    return L.Trainer(
        strategy=DDPPlusStrategy(process_group_backend="gloo", timeout="60s", resume_from_last=resume),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1000)],
    )


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2]
    model = IndexedRegression()
    if mode == "first":
        try:
            trainer(root, [SignalAgent()], "never").fit(model)
        finally:
            rank = int(os.environ["RANK"])
            (root / f"trained-{rank}.json").write_text(json.dumps(model.trained))
        return
    resumed = trainer(root, [], "always")
    resumed.fit(model)
    rank = dist.get_rank()
    before = json.loads((root / f"trained-{rank}.json").read_text())
    trained = every_ranks(before + model.trained)
    whole = IndexedRegression()
    trainer(root / "whole", [], "never").fit(whole)
    if rank == 0:
        result = {
            "distance": float((flat(model) - flat(whole)).abs().max()),
            "global_step": resumed.global_step,
            "trained": trained,
        }
        (root / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()  # a Preempted that ends it exits with 143
