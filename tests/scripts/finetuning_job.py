"""Layers frozen before DDP wraps the module and unfrozen in a later epoch: ``finetuning_job.py OUT_JSON CASES_JSON``.

Each case fits one model with Lightning's ``BaseFinetuning`` (it freezes in ``setup``, before the wrap) or with the
reference: a callback that freezes the same layers just after the wrap (``on_fit_start``), where DDP holds every
parameter and, with ``find_unused_parameters=True``, all-reduces them once they train. Reported: the parameters and
how far apart the two replicas ended.
"""

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.strategies import DDPStrategy

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression, job_main

UNFREEZE_AT_EPOCH = 1


class UnfreezeTheFirstLayer(BaseFinetuning):
    """The first layer frozen in ``setup`` (before the wrap), unfrozen as a new group at epoch 1."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == UNFREEZE_AT_EPOCH:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, lr=0.05, initial_denom_lr=1.0)


class FreezeAfterTheWrap(L.Callback):
    """The reference: the same layer frozen once DDP holds it, and unfrozen as a new group at the same epoch."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        BaseFinetuning.freeze(pl_module.net[0])

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == UNFREEZE_AT_EPOCH:
            BaseFinetuning.make_trainable(pl_module.net[0])
            parameters = list(pl_module.net[0].parameters())
            trainer.optimizers[0].add_param_group({"params": parameters, "lr": 0.05})


class HeadFirst(TinyRegression):
    """The optimizer starts with what trains from the first epoch (the head)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[2].parameters(), lr=0.05, momentum=0.9)


class HeadFirstWithAux(HeadFirst):
    """The same, with a head that every rank uses but rank 1 at one step after the unfreeze: a guard fault whose rank 0
    has finished its reducer (rank 1 has not), settled before the optimizer step."""

    AUX_STEP = 9  # epoch 2 (4 steps an epoch), the first layer trainable

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.aux = torch.nn.Linear(1, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step != self.AUX_STEP or dist.get_rank() == 0:
            loss = loss + 0.1 * self.aux(loss.reshape(1, 1)).sum()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trains = [*self.net[2].parameters(), *self.aux.parameters()]
        return torch.optim.SGD(trains, lr=0.05, momentum=0.9)


def run_case(case: dict) -> dict:
    if case["reference"]:
        strategy: Any = DDPStrategy(process_group_backend="gloo", find_unused_parameters=True)
        strategy = DDPPlusStrategy(**case["strategy"]) if "strategy" in case else strategy
        callback: L.Callback = FreezeAfterTheWrap()
    else:
        stock = case.get("stock", False)
        strategy = DDPStrategy(process_group_backend="gloo") if stock else DDPPlusStrategy(**case.get("strategy", {}))
        callback = UnfreezeTheFirstLayer()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=3, callbacks=[callback], **QUIET_TRAINER
    )
    model = HeadFirstWithAux(num_samples=32) if case.get("aux") else HeadFirst(num_samples=32)
    trainer.fit(model)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(replicas, flat)
    return {
        **case,
        "params": flat.tolist(),
        "replica_spread": (replicas[0] - replicas[1]).abs().max().item(),
        "groups": len(trainer.optimizers[0].param_groups),
    }


if __name__ == "__main__":
    job_main(run_case)
