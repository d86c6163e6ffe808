"""PowerSGD over two gradient buckets whose readiness differs between ranks: ``powersgd_order_job.py stock|ddp_plus``.

Rank 1's backward pauses before its first bucket and again between the two buckets. Rank 0 then issues the second
bucket's first all-reduce before the first bucket's can complete, so before that bucket's callback issues its next one;
rank 1 issues them the other way round. Unless the hook keeps the order, the process group pairs collectives of
different sizes, however loaded the machine is. Launched with the popen launcher (2 ranks); prints
``TRAINED step=N`` and whether the replicas agree.
"""

import sys
import time
from datetime import timedelta

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import QUIET_TRAINER


class PauseOnRank1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if dist.get_rank() == 1:
            time.sleep(0.3)
        return grad


class TwoBuckets(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # over 1 MiB of weight each, so two buckets; sizes that differ between the all-reduces a mismatch would pair
        self.first, self.second = nn.Linear(512, 768), nn.Linear(768, 384)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        hidden = PauseOnRank1.apply(torch.tanh(self.first(x)))
        return PauseOnRank1.apply(self.second(hidden)).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(
            TensorDataset(torch.randn(2 * 6 * 4, 512, generator=torch.Generator().manual_seed(0))), batch_size=4
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RegisterTorchHook(L.Callback):
    """Stock Lightning registers `ddp_comm_hook` only on CUDA; on gloo register torch's hook on the wrapper itself."""

    def __init__(self, state) -> None:
        self.state = state

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.model.register_comm_hook(self.state, powerSGD_hook.powerSGD_hook)


def main(variant: str) -> None:
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    callbacks = []
    if variant == "stock":
        strategy = L.pytorch.strategies.DDPStrategy(
            process_group_backend="gloo", timeout=timedelta(seconds=15), bucket_cap_mb=1
        )
        callbacks.append(RegisterTorchHook(state))
    else:
        from lightning_ddp_plus import DDPPlusStrategy

        strategy = DDPPlusStrategy(
            process_group_backend="gloo", timeout=30, bucket_cap_mb=1, ddp_comm_hook="powersgd", ddp_comm_state=state
        )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, callbacks=callbacks, **QUIET_TRAINER
    )
    model = TwoBuckets()
    trainer.fit(model)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    if trainer.global_rank == 0:
        print(f"TRAINED step={trainer.global_step} replicas_equal={torch.equal(*gathered)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
