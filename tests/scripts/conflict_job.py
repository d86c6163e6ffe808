"""Runs conflict cases on one 2-rank process group: ``conflict_job.py OUT_JSON CASES_JSON``.

Each case is a strategy configuration and a ``CheckpointNet`` configuration trained for one epoch (3 optimizer
steps per rank). The outcome (finished, or the error type and message, and how many optimizer steps ran before
it) and every rank's parameters are recorded; rank 0 writes them as JSON. A case with ``"stock": true`` uses
Lightning's stock ``DDPStrategy`` instead.
"""

import lightning as L
import torch
import torch.distributed as dist

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, CheckpointNet, flat_parameters, job_main, strategy_outcome


def run_case(case: dict) -> dict:
    strategy_kwargs = dict(case.get("strategy", {}))
    accumulate = strategy_kwargs.pop("accumulate_grad_batches", 1)
    if case.get("stock"):
        strategy = L.pytorch.strategies.DDPStrategy(process_group_backend="gloo", **strategy_kwargs)
    else:
        strategy = DDPPlusStrategy(process_group_backend="gloo", **strategy_kwargs)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        **QUIET_TRAINER,
    )
    model = CheckpointNet(**case.get("model", {}))
    outcome = {"error": None, "message": None}
    try:
        trainer.fit(model)
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        outcome = {"error": type(error).__name__, "message": str(error)}
    params = None
    if case.get("gather", True):
        flat = flat_parameters(model)
        gathered = [torch.zeros_like(flat) for _ in range(2)]
        dist.all_gather(gathered, flat)
        params = [t.tolist() for t in gathered]
    return {
        **case,
        **outcome,
        "params": params,
        **strategy_outcome(strategy, trainer),
    }


if __name__ == "__main__":
    job_main(run_case)
