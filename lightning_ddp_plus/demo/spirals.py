"""A small but real classification task whose data is generated locally: points on interleaved noisy spirals.

``SpiralDataModule`` makes the data from a fixed seed (identical on every rank, no downloads); Lightning's
``DistributedSampler`` gives each rank its own share. ``SpiralClassifier`` is an MLP whose validation accuracy is a
``torchmetrics`` metric: its state is summed over all ranks before ``compute()``, so the logged figure is the
accuracy over the whole validation set, not rank 0's half.

Run it on 2 CPU processes with ``ddp-plus demo`` (or ``ddp-plus fit --config configs/cpu.yaml`` in the repository).
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


def make_spirals(num_samples: int, num_classes: int, noise: float, seed: int) -> TensorDataset:
    """``num_samples`` 2-D points on ``num_classes`` interleaved spiral arms, with Gaussian noise.

    >>> data = make_spirals(8, 2, 0.1, seed=0)
    >>> data.tensors[0].shape, data.tensors[1].tolist()
    (torch.Size([8, 2]), [0, 1, 0, 1, 0, 1, 0, 1])
    """
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_samples) % num_classes
    radius = torch.rand(num_samples, generator=generator)
    angle = radius * 3 * math.pi + labels * (2 * math.pi / num_classes)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    points = points + noise * torch.randn(points.shape, generator=generator)
    return TensorDataset(points, labels)


class SpiralDataModule(L.LightningDataModule):
    """Train and validation splits of the spiral task, generated from ``seed`` (validation from ``seed + 1``).

    Args:
        num_train: training samples.
        num_val: validation samples; keep it divisible by the world size so no sample is counted twice.
        num_classes: spiral arms.
        noise: standard deviation of the noise added to each point.
        batch_size: per-process batch size.
        seed: data seed, the same on every rank.
    """

    def __init__(
        self,
        num_train: int = 8192,
        num_val: int = 2048,
        num_classes: int = 3,
        noise: float = 0.04,
        batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        hp: Any = self.hparams  # Lightning's AttributeDict
        self.train_set = make_spirals(hp.num_train, hp.num_classes, hp.noise, hp.seed)
        self.val_set = make_spirals(hp.num_val, hp.num_classes, hp.noise, hp.seed + 1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.hparams["batch_size"], shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=256)


class SpiralClassifier(L.LightningModule):
    """An MLP classifier for the spiral task, with accuracy computed over all ranks.

    Args:
        num_classes: number of classes; must match the data module.
        hidden: width of the hidden layers.
        depth: number of hidden layers.
        lr: Adam learning rate.
    """

    def __init__(self, num_classes: int = 3, hidden: int = 128, depth: int = 3, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = 2
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_accuracy_history: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.net(x)
        return logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_accuracy.update(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        # Logging the metric object lets Lightning call compute() at epoch end, which sums the metric state over
        # all ranks first: every rank logs the accuracy over the whole validation set.
        self.log("val_acc", self.val_accuracy, prog_bar=True)

    def on_train_epoch_end(self) -> None:
        # Validation ran at the end of this training epoch; its logged figures are in callback_metrics by now.
        if "val_acc" in self.trainer.callback_metrics:
            self.val_accuracy_history.append(float(self.trainer.callback_metrics["val_acc"]))

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero and self.val_accuracy_history:
            history = ", ".join(f"{value:.3f}" for value in self.val_accuracy_history)
            print(f"val_acc per epoch (all {self.trainer.world_size} ranks): {history}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
