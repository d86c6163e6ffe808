"""Bucket-size cases on one 2-rank process group: ``buckets_job.py OUT_JSON CASES_JSON``.

Each case trains ``WideRegression`` (8 layers of 256x256, 2 MiB of gradients: several buckets at 1 MiB) with stock
``DDPStrategy`` or ``DDPPlusStrategy`` and reports the reducer's bucket layout at the end of training, the final
parameters, and with ``bucket_cap_mb="auto"`` the choice as every rank made it and the log line.
"""

import logging

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression, flat_parameters, job_main


class WideRegression(TinyRegression):
    def __init__(self, num_samples: int = 160, batch_size: int = 4, lr: float = 0.01) -> None:
        super().__init__(num_samples=num_samples, batch_size=batch_size, lr=lr, features=256)
        torch.manual_seed(1)
        self.net = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.Tanh())], nn.Linear(256, 1))


class LayoutAtTrainEnd(L.Callback):
    layout = bucket_bytes_cap = None

    def on_train_end(self, trainer, pl_module):
        ddp = trainer.strategy.model
        data = ddp._get_ddp_logging_data()
        self.layout = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        self.bucket_bytes_cap = ddp.bucket_bytes_cap


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_case(case: dict) -> dict:
    kwargs = dict(case.get("strategy", {}))
    k = kwargs.pop("accumulate_grad_batches", 1)
    if case.get("stock"):
        strategy = DDPStrategy(process_group_backend="gloo", **kwargs)
    else:
        strategy = DDPPlusStrategy(process_group_backend="gloo", **kwargs)
    layout = LayoutAtTrainEnd()
    lines = Lines()
    logging.getLogger("lightning_ddp_plus").addHandler(lines)
    logging.getLogger("lightning.pytorch").addHandler(lines)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        accumulate_grad_batches=k,
        callbacks=[layout],
        **QUIET_TRAINER,
    )
    model = WideRegression(num_samples=case.get("samples", 160))
    try:
        trainer.fit(model)
    finally:
        logging.getLogger("lightning_ddp_plus").removeHandler(lines)
        logging.getLogger("lightning.pytorch").removeHandler(lines)
    choice = getattr(strategy, "bucket_choice", None)
    choices = [None, None]
    dist.all_gather_object(choices, None if choice is None else (choice.chosen_mb, choice.medians_ms))
    return {
        "layout": layout.layout,
        "bucket_bytes_cap": layout.bucket_bytes_cap,
        "parameters": flat_parameters(model).tolist(),
        "global_step": trainer.global_step,
        "choices": choices,
        "candidates": list(choice.candidates) if choice else None,
        "lines": [line for line in lines.lines if "bucket_cap_mb" in line],
    }


if __name__ == "__main__":
    job_main(run_case)
