"""Runs several accumulation configurations on one 2-rank process group: ``accumulation_job.py OUT_JSON CASES_JSON``.

Started once per rank by the test (LOCAL_RANK etc. set), so Lightning launches nothing itself. Each case is one
epoch of 10 micro-batches per rank; a counting hook (torch's plain all-reduce, registered through the strategy)
counts the real all-reduces.
"""

import lightning as L
import torch
import torch.distributed as dist

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import (
    QUIET_TRAINER,
    TinyRegression,
    TinyRegressionIterable,
    TinyRegressionManual,
    TinyRegressionManualIterable,
    job_main,
)

ALLREDUCE_HOOK = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook"


def run_case(case: dict) -> dict:
    strategy = DDPPlusStrategy(
        ddp_comm_hook=ALLREDUCE_HOOK,
        static_graph=case["static_graph"],
        gradient_accumulation_steps=case.get("strategy_k"),
        short_window=case.get("short_window", "mean"),
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        accumulate_grad_batches=case.get("trainer_k", 1),
        **QUIET_TRAINER,
    )
    if case.get("iterable"):
        model_cls = TinyRegressionManualIterable if case["manual"] else TinyRegressionIterable
    else:
        model_cls = TinyRegressionManual if case["manual"] else TinyRegression
    model = model_cls(num_samples=80, batch_size=4, lr=0.05)
    trainer.fit(model)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    stats = strategy.sync_stats
    return {
        **case,
        "hook_calls": strategy.comm_hook_counter.calls,
        "synced_backwards": stats.synced_backwards,
        "skipped_backwards": stats.skipped_backwards,
        "optimizer_steps": stats.optimizer_steps,
        "params": [t.tolist() for t in gathered],
    }


if __name__ == "__main__":
    job_main(run_case)
