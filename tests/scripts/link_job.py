"""One node of a 2-node ``ddp_plus`` job whose link is cut mid-training: ``link_job.py OUT_JSON CKPT_DIR MAX_STEPS``.

Each optimizer step sleeps a little (so the test can cut the link while training runs) and prints its time;
``ModelCheckpoint`` saves ``last.ckpt`` every 4 steps on the node of rank 0. The environment says which node this is
(``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or torchrun does. Rank 0 writes the final parameters, the step
training started from and the attempt.
"""

import json
import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.processes.restart import restart_attempt
from tests.helpers import TinyRegression

attempt = restart_attempt() or 0  # the job's attempt, which the ranks agree on (not one agent's restart count)


class Clock(L.Callback):
    def __init__(self) -> None:
        self.start_step = None

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step
        print(
            f"[{time.time():.3f}] attempt {attempt} rank {trainer.global_rank} trains from step {trainer.global_step}",
            flush=True,
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"[{time.time():.3f}] rank {trainer.global_rank} step {trainer.global_step}", flush=True)
        time.sleep(float(os.environ.get("DDP_PLUS_STEP_SLEEP", "0.1")))


def main() -> None:
    out, ckpt_dir, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    clock = Clock()
    trainer = L.Trainer(
        strategy=DDPPlusStrategy(process_group_backend="gloo", timeout=os.environ.get("DDP_PLUS_TIMEOUT", "10s")),
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock, ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=4, save_top_k=0)],
    )
    model = TinyRegression(num_samples=400, batch_size=4, momentum=0.9)
    trainer.fit(model)
    if trainer.global_rank == 0:
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        with open(out, "w") as file:
            json.dump(
                {"params": params, "global_step": trainer.global_step, "attempt": attempt, "start": clock.start_step},
                file,
            )


if __name__ == "__main__":
    main()
