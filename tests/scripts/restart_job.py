"""A 2-rank ``ddp_plus`` job for torchrun: ``restart_job.py OUT_JSON CKPT_DIR KILL_AT_STEP K``.

``ModelCheckpoint`` saves ``last.ckpt`` at every optimizer step. On torchrun's first attempt, rank 1 kills itself with
SIGKILL at the start of optimizer step ``KILL_AT_STEP`` (``-1``: never; with ``DDP_PLUS_KILL_NODE=1`` it kills its
torchrun agent first: the node is lost for good). With ``DDP_PLUS_GROW_MARKER=PATH``, an attempt that trains alone
writes PATH at the start of the next optimizer step and waits there for a node to join (its agent's membership
restart ends it); the restarted attempt resumes by itself (the
strategy's ``resume_from_last="on_restart"``). Rank 0 writes the final parameters, ``global_step``, the attempt, and
every micro-batch it trained on (its first sample's value) with the attempt that trained it.
"""

import json
import os
import signal
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.processes.restart import restart_attempt
from tests.helpers import TinyRegression

attempt = restart_attempt() or 0  # the job's attempt, which the ranks agree on (not one agent's restart count)


class Record(L.Callback):
    """Prints when training starts, kills rank 1 at ``kill_at`` on the first attempt, records every micro-batch."""

    def __init__(self, kill_at: int, k: int) -> None:
        self.kill_at, self.k = kill_at, k
        self.seen: list[tuple[int, float]] = []

    def on_train_start(self, trainer, pl_module):
        print(
            f"[{time.time():.3f}] attempt {attempt} rank {trainer.global_rank} trains from step {trainer.global_step}",
            flush=True,
        )

    def on_exception(self, trainer, pl_module, exception):
        # a rank that is slow to end (a long teardown) lets torchrun's agent of the other node rejoin first
        if trainer.global_rank == 0:
            time.sleep(float(os.environ.get("DDP_PLUS_LINGER_S", "0")))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if (
            attempt == 0
            and trainer.global_rank == 1
            and trainer.global_step == self.kill_at
            and batch_idx % self.k == 0
        ):
            print(f"[{time.time():.3f}] rank 1 kills itself at step {self.kill_at}", flush=True)
            if os.environ.get("DDP_PLUS_KILL_NODE") == "1":  # the whole node is lost: its torchrun agent first
                print(f"[{time.time():.3f}] rank 1 kills its node's agent", flush=True)
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        grow_marker = os.environ.get("DDP_PLUS_GROW_MARKER")
        alone = attempt > 0 and trainer.world_size == 1 and trainer.global_step == self.kill_at + 1
        if grow_marker and alone and not os.path.exists(grow_marker):
            print(
                f"[{time.time():.3f}] rank 0 trains alone at step {trainer.global_step}, waits for a node",
                flush=True,
            )
            open(grow_marker, "w").close()
            deadline = time.monotonic() + 120
            while not trainer.received_sigterm and time.monotonic() < deadline:
                time.sleep(0.1)  # until the agent restarts this worker for the node that joined
        self.seen.append((attempt, float(batch[0][0, 0])))


def main() -> None:
    out, ckpt_dir, kill_at, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    record = Record(kill_at, k)
    nodes = int(os.environ.get("DDP_PLUS_NODES", "1"))
    stock = os.environ.get("DDP_PLUS_TRY_STOCK") == "1"  # tests/restart_tries.py --stock: the comparison
    strategy = (
        L.pytorch.strategies.DDPStrategy(process_group_backend="gloo")
        if stock
        else DDPPlusStrategy(
            process_group_backend="gloo",
            timeout="60s",
            optimizer_sharding=os.environ.get("DDP_PLUS_SHARDING") == "1",  # the momentum buffers sharded
        )
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2 // nodes,
        num_nodes=nodes,
        max_epochs=1,
        accumulate_grad_batches=k,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=0)],
    )
    model = TinyRegression(num_samples=80, batch_size=4, momentum=0.9)
    trainer.fit(model, ckpt_path="last" if stock and attempt > 0 else None)
    if trainer.global_rank == 0:
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        result = {"params": params, "global_step": trainer.global_step, "attempt": attempt, "seen": record.seen}
        with open(out, "w") as file:
            json.dump(result, file)


if __name__ == "__main__":
    main()
