"""Runs per-step guard and uneven-input cases on one 2-rank process group: ``step_guard_job.py OUT_JSON CASES_JSON``.

Models whose graph changes after the first step (a warm-up head dropped after 3 optimizer steps, a tower skipped on
rank 0 only at step 4, one head per batch, a real ``transformers`` wav2vec2 with LayerDrop), and shards of different
lengths. Each case records the outcome (error type and message, the optimizer steps that ran), every rank's
parameters, the batches each rank trained on, and, for errors, the seconds from the start of the shorter rank's
last batch (or of the faulty step) to the error on each rank. ``"stock": true`` uses Lightning's ``DDPStrategy``.
"""

import time
import warnings

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.sync import comm_hooks
from tests.helpers import QUIET_TRAINER, flat_parameters, job_main, regression_data, strategy_outcome

FLAGS_RIDE_BUCKETS = comm_hooks.flags_ride_buckets


def _flags_ride_nothing(*args: object) -> bool:
    return False


class Shard(IterableDataset):
    """``length`` rows of a fixed data set for this rank (rows differ per rank), as an iterable without a length."""

    def __init__(self, rank: int, length: int) -> None:
        self.rows = regression_data(64, seed=rank)
        self.length = length

    def __iter__(self):
        return (self.rows[i] for i in range(self.length))


class GuardNet(L.LightningModule):
    """Body -> head, plus a part that some steps do not use (``variant``):

    - ``warmup``: an auxiliary head whose loss counts for the first ``warmup_steps`` optimizer steps only;
    - ``tower_one_rank``: a tower that rank 0 skips at optimizer step 4 (0-based global step 3), rank 1 never;
    - ``late_start`` (``late_start_one_rank``): an auxiliary head that joins at optimizer step 3 (on rank 0 only);
    - ``multitask``: two heads, batch ``i`` trains head ``i % 2``;
    ``data="sampler"`` trains on a map-style data set instead of per-rank shards (even, by Lightning's sampler).

    - ``wav2vec2``: a tiny real ``Wav2Vec2ForSequenceClassification`` with ``layerdrop`` (seeded, so that the
      layers dropped are the same on both ranks and in the reference run).
    """

    def __init__(
        self,
        variant: str = "warmup",
        batches: tuple = (6, 6),
        batch_size: int = 4,
        warmup_steps: int = 3,
        manual: bool = False,
        layerdrop: float = 0.0,
        sync_dist: bool = False,
        data: str = "shards",
        val_batches: tuple | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        torch.manual_seed(1)
        if variant == "wav2vec2":
            from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification, logging

            logging.set_verbosity_error()
            config = Wav2Vec2Config(
                hidden_size=16,
                num_hidden_layers=4,
                num_attention_heads=2,
                intermediate_size=32,
                conv_dim=(8, 8),
                conv_stride=(5, 4),
                conv_kernel=(10, 8),
                num_conv_pos_embeddings=4,
                num_conv_pos_embedding_groups=2,
                num_labels=2,
                layerdrop=layerdrop,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                feat_proj_dropout=0.0,
                final_dropout=0.0,
                mask_time_prob=0.0,
                classifier_proj_size=8,
            )
            self.w2v = Wav2Vec2ForSequenceClassification(config)
            return
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.extra = nn.Linear(16, 16 if variant == "tower_one_rank" else 1)

    def loss(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        variant = self.hparams.variant
        if variant == "wav2vec2":
            torch.manual_seed(100 + self.global_step)  # LayerDrop draws: the same on both ranks and in every run
            signal = x.repeat(1, 50)  # (batch, 400) samples
            return self.w2v(input_values=signal, labels=(y[:, 0] > 0).long()).loss
        h = self.body(x)
        if variant == "warmup":
            loss = nn.functional.mse_loss(self.head(h), y)
            if self.global_step < self.hparams.warmup_steps:
                loss = loss + nn.functional.mse_loss(self.extra(h), y)
            return loss
        if variant == "tower_one_rank":
            if not (self.global_rank == 0 and self.global_step == 3):
                h = h + self.extra(h)
            return nn.functional.mse_loss(self.head(h), y)
        if variant in ("late_start", "late_start_one_rank"):  # a head that joins at step 3 (on rank 0 only)
            loss = nn.functional.mse_loss(self.head(h), y)
            if self.global_step >= 2 and (variant == "late_start" or self.global_rank == 0):
                loss = loss + nn.functional.mse_loss(self.extra(h), y)
            return loss
        head = self.head if batch_idx % 2 == 0 else self.extra  # multitask
        return nn.functional.mse_loss(head(h), y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch, batch_idx)
        if self.hparams.sync_dist:
            self.log("train_loss", loss, sync_dist=True, on_step=True)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.manual_backward(loss)
        if self.trainer.strategy.sync_gradients if hasattr(self.trainer.strategy, "sync_gradients") else True:
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def train_dataloader(self) -> DataLoader:
        if self.hparams.data == "sampler":  # a map-style data set: Lightning gives each rank a DistributedSampler
            return DataLoader(regression_data(2 * 4 * self.hparams.batches[0]), batch_size=4)
        return DataLoader(Shard(self.global_rank, self.hparams.batches[self.global_rank] * self.hparams.batch_size), 4)

    def val_dataloader(self) -> DataLoader | list:
        if self.hparams.val_batches is None:
            return []
        return DataLoader(Shard(self.global_rank, self.hparams.val_batches[self.global_rank] * 4), 4)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch, batch_idx), sync_dist=True)  # epoch level: reduced once, at the end

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # momentum: a parameter no rank used must keep .grad None (as find_unused_parameters=True leaves it), or its
        # momentum would move it
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Timeline(L.Callback):
    """When each batch started (monotonic seconds) and how many batches this rank trained on."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.trained = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        self.starts.append(time.monotonic())

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.trained += 1


def run_case(case: dict) -> dict:
    warnings.filterwarnings("ignore", message=".*(find_unused_parameters|does not have many workers).*")
    # "all_reduce": the flags take an all-reduce of their own every step, as where a comm hook leaves them nothing to
    # ride in (else they ride in the last gradient bucket)
    riding = case.get("agreement") != "all_reduce"
    comm_hooks.flags_ride_buckets = FLAGS_RIDE_BUCKETS if riding else _flags_ride_nothing
    strategy_kwargs = dict(case.get("strategy", {}))
    accumulate = strategy_kwargs.pop("accumulate_grad_batches", 1)
    if case.get("stock"):
        strategy = L.pytorch.strategies.DDPStrategy(process_group_backend="gloo", **strategy_kwargs)
    else:
        strategy = DDPPlusStrategy(process_group_backend="gloo", **strategy_kwargs)
    timeline = Timeline()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=case.get("epochs", 1),
        accumulate_grad_batches=accumulate,
        callbacks=[timeline],
        **QUIET_TRAINER,
    )
    model = GuardNet(**case.get("model", {}))
    outcome = {"error": None, "message": None, "seconds_to_error": None}
    try:
        trainer.fit(model)
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        since = timeline.starts[-1] if timeline.starts else time.monotonic()
        outcome = {
            "error": type(error).__name__,
            "message": str(error),
            "seconds_to_error": time.monotonic() - since,
        }
    flat = flat_parameters(model)
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    local = torch.tensor(
        [
            timeline.trained,
            trainer.global_step,
            -1 if outcome["seconds_to_error"] is None else int(outcome["seconds_to_error"] * 1e6),
        ]
    )
    rows = [torch.zeros_like(local) for _ in range(2)]
    dist.all_gather(rows, local)
    return {
        **case,
        **outcome,
        "params": [t.tolist() for t in gathered],
        "trained": [int(r[0]) for r in rows],
        "global_step": [int(r[1]) for r in rows],
        "seconds_to_error_by_rank": [None if r[2] < 0 else int(r[2]) / 1e6 for r in rows],
        **strategy_outcome(strategy, trainer),
    }


if __name__ == "__main__":
    job_main(run_case)
