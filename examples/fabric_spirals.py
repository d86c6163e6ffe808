"""Lightning Fabric with ``Fabric(strategy="ddp_plus")``: the spiral classifier trained by a plain Fabric loop on 2 CPU
processes, with gradient accumulation (one all-reduce per optimizer step), the conflict check on the first forward and
the replica guard.

    python examples/fabric_spirals.py        # 2 CPU processes, gloo, k=2

``fabric.strategy.micro_batches(loader)`` marks the loader's last batch, so the short last window of an epoch closes
too; ``fabric.strategy.sync_gradients`` says when to step. The strategy divides each loss by its window's length.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `examples.*` importable when run as a script

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_ddp_plus import DDPPlusFabricStrategy
from lightning_ddp_plus.demo.spirals import make_spirals


def main() -> None:
    strategy = DDPPlusFabricStrategy(
        process_group_backend="gloo", timeout="5m", gradient_accumulation_steps=2, verify_replicas_every_n_steps=10
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(7)
    model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    train = fabric.setup_dataloaders(DataLoader(make_spirals(8192, 3, 0.04, seed=0), batch_size=64, shuffle=True))
    val_x, val_y = make_spirals(2048, 3, 0.04, seed=1).tensors
    for epoch in range(6):
        for x, y in fabric.strategy.micro_batches(train):
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            if fabric.strategy.sync_gradients:
                optimizer.step()
                optimizer.zero_grad()
        with torch.no_grad():
            accuracy = (model(val_x).argmax(1) == val_y).float().mean()
        fabric.print(f"epoch {epoch}: val_acc {fabric.all_reduce(accuracy, reduce_op='mean').item():.3f}")
    stats = fabric.strategy.sync_stats
    fabric.print(
        f"rank 0: {stats.optimizer_steps} optimizer steps, {stats.synced_backwards} synced / {stats.skipped_backwards} skipped backwards"
    )


if __name__ == "__main__":
    main()
