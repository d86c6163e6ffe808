"""Fits on one process group of 1 or 2 ranks, some resuming a checkpoint taken on the other number of ranks:
``world_size_job.py OUT_JSON CASES_JSON`` (started once per rank by the test).

A case trains a regression model on 256 shuffled samples (or ``samples``), 8 rows per rank per batch (or
``batch_size``), for one epoch (or ``epochs``), in manual optimization with ``manual`` (accumulating with the
strategy's ``gradient_accumulation_steps``: ``strategy_accumulate``), with ``optimizer_sharding`` with ``sharding``,
and with any other strategy arguments in ``strategy`` (Trainer arguments in ``trainer``); ``stateful``: the loader
keeps its own place (``state_dict``/``load_state_dict``); ``iterable``: each rank's rows come from an
``IterableDataset`` that shards itself;
``items``: the loss is a mean over a varying subset of the rows, returned with ``num_items``; ``one_cycle``: Lightning's
OneCycleLR recipe (its length from ``trainer.estimated_stepping_batches``); ``stop_after`` ends it after that many
optimizer steps (``max_steps``; ``stop_at``: ``trainer.should_stop``, which leaves the schedule's length as it is)
with a checkpoint in ``checkpoint``; ``resume`` continues from one. Every
rank records the indices of the samples it trained; rank 0 writes them with the parameters and the log lines.
"""

import io
import logging
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, job_main, regression_data

#: Set by the test for every rank (Lightning removes it from the environment at the end of a fit).
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


class Indexed(Dataset):
    def __init__(self, length: int) -> None:
        self.data = regression_data(length)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        x, y = self.data[index]
        return index, x, y


class RankShardIndexed(IterableDataset):
    """This rank's rows ``rank::world`` of ``Indexed``, in a fixed order, as an iterable without a length (Lightning
    adds no sampler to it; the data set shards itself)."""

    def __init__(self, length: int, rank: int, world: int) -> None:
        self.rows, self.rank, self.world = Indexed(length), rank, world

    def __iter__(self):
        return (self.rows[index] for index in range(self.rank, len(self.rows), self.world))


class StatefulLoader(DataLoader):
    """A loader that keeps its own place: the batches it gave this epoch, skipped again after a resume."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.given, self.skip = 0, 0

    def __iter__(self):
        skip, self.skip, self.given = self.skip, 0, 0
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.given = index + 1
                yield batch

    def state_dict(self) -> dict:
        return {"given": self.given}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state["given"]


class Regression(L.LightningModule):
    def __init__(self, batch_size: int = 8, samples: int = 256, stateful: bool = False, items: bool = False) -> None:
        super().__init__()
        self.batch_size, self.samples, self.stateful, self.items = batch_size, samples, stateful, items
        self.iterable = False
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.seen: list[int] = []
        self.draws: list[float] = []  # one number from torch's generator per batch: where each rank's stream stands

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen += index.tolist()
        self.draws.append(torch.rand(1).item())
        if self.items:  # a mean over the rows whose index is not a multiple of 3: a count that varies per batch
            kept = (index % 3 != 0).float()
            loss = ((self.net(x) - y).squeeze(1) ** 2 * kept).sum() / kept.sum().clamp(min=1)
            return {"loss": loss, "num_items": (index % 3 != 0).sum()}
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        if self.iterable:
            return DataLoader(
                RankShardIndexed(self.samples, self.global_rank, self.trainer.world_size), self.batch_size
            )
        return (StatefulLoader if self.stateful else DataLoader)(
            Indexed(self.samples), batch_size=self.batch_size, shuffle=True
        )

    one_cycle = False

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)
        if not self.one_cycle:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)  # builds the loader before a resume restores the loop
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StopAt(L.Callback):
    """Ends the fit after optimizer step ``step``, as an early stop does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True


class ManualRegression(Regression):
    """The same model in manual optimization, accumulating with the strategy's window."""

    def __init__(self, batch_size: int = 8, samples: int = 256, stateful: bool = False) -> None:
        super().__init__(batch_size, samples, stateful)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        if self.trainer.strategy.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()


def run_case(case: dict) -> dict:
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("lightning.pytorch").addHandler(handler)
    world = WORLD
    callbacks: list = [StopAt(case["stop_at"])] if case.get("stop_at") else []
    if case.get("stop_after") or case.get("stop_at"):
        path = case["checkpoint"]
        callbacks.append(
            ModelCheckpoint(
                dirpath=path.rsplit("/", 1)[0],
                filename=path.rsplit("/", 1)[1][:-5],
                every_n_train_steps=case.get("stop_after") or case["stop_at"],
                save_top_k=-1,
            )
        )
    strategy = DDPPlusStrategy(
        on_world_size_change=case.get("mode", "keep_global_batch"),
        timeout="60s",
        gradient_accumulation_steps=case.get("strategy_accumulate"),
        optimizer_sharding=case.get("sharding", False),
        **case.get("strategy", {}),
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_epochs=case.get("epochs", 1),
        max_steps=case.get("stop_after") or -1,
        accumulate_grad_batches=case.get("accumulate", 1),
        callbacks=callbacks,
        **{**QUIET_TRAINER, "enable_checkpointing": bool(callbacks), **case.get("trainer", {})},
    )
    model = (ManualRegression if case.get("manual") else Regression)(
        case.get("batch_size", 8), case.get("samples", 256), case.get("stateful", False)
    )
    model.items, model.iterable = case.get("items", False), case.get("iterable", False)
    model.one_cycle = case.get("one_cycle", False)
    outcome: dict = {"error": None}
    try:
        trainer.fit(model, ckpt_path=case.get("resume"))
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        outcome["error"] = f"{type(error).__name__}: {error}"
    logging.getLogger("lightning.pytorch").removeHandler(handler)
    seen, draws, next_draw = [None] * world, [None] * world, [None] * world
    dist.all_gather_object(seen, model.seen)
    dist.all_gather_object(draws, model.draws)
    dist.all_gather_object(next_draw, torch.rand(1).item())  # the draw a resume of this fit's checkpoint makes first
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {
        **case,
        **outcome,
        "world_size": world,
        "global_step": trainer.global_step,
        "accumulation": trainer.accumulate_grad_batches
        if model.automatic_optimization
        else strategy.gradient_accumulation_steps,
        "seen": seen,
        "draws": draws,
        "next_draw": next_draw,
        "params": [t.tolist() for t in gathered],
        "log": log.getvalue(),
    }


if __name__ == "__main__":
    job_main(run_case)
