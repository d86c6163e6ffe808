"""Diagnostics cases on one 2-rank process group: ``diagnostics_job.py OUT_JSON CASES_JSON``.

A case may corrupt one parameter on rank 1 after a given optimizer step, count all-reduces with its own hook (to
check the telemetry against), and snapshot buffers at the start of the last step's forward (after DDP's broadcast).
"""

import statistics

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, CheckpointNet, TinyRegression, job_main
from tests.scripts.pipeline_job import run_case as run_pipeline_case
from tests.scripts.straggler_job import run_case as run_straggler_case

INDEPENDENT = {"calls": 0, "bytes": 0}


def independent_counting_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    INDEPENDENT["calls"] += 1
    INDEPENDENT["bytes"] += buffer.numel() * buffer.element_size()
    return default_hooks.allreduce_hook(state, bucket)


class CorruptRank1(L.Callback):
    def __init__(self, step: int, parameter: str) -> None:
        self.step, self.parameter = step, parameter

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 1:
            with torch.no_grad():
                dict(pl_module.named_parameters())[self.parameter].add_(1e-3)


class BufferSnapshot(L.Callback):
    """Copies the buffers as the last training forward sees them (DDP broadcasts before the inner forward)."""

    def __init__(self) -> None:
        self.snapshot = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == trainer.num_training_batches - 1:
            handle = None

            def grab(module, args):
                buffers = [b.detach().double().flatten() for b in module.buffers()]
                self.snapshot = torch.cat(buffers) if buffers else None
                handle.remove()

            handle = pl_module.register_forward_pre_hook(grab)


def run_case(case: dict) -> dict:
    if "straggler" in case:
        return {**case, **run_straggler_case(case["straggler"])}
    if "pipeline" in case:
        return {**case, **run_pipeline_case(case["pipeline"])}
    INDEPENDENT.update(calls=0, bytes=0)
    strategy_kwargs = dict(case.get("strategy", {}))
    if strategy_kwargs.pop("independent_hook", False):
        strategy_kwargs["ddp_comm_hook"] = independent_counting_hook
    strategy = DDPPlusStrategy(process_group_backend="gloo", **strategy_kwargs)
    callbacks = []
    if "corrupt" in case:
        callbacks.append(CorruptRank1(**case["corrupt"]))
    snapshot = BufferSnapshot()
    callbacks.append(snapshot)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=case.get("epochs", 1),
        callbacks=callbacks,
        **QUIET_TRAINER,
    )
    model_kwargs = case.get("model", {})
    model = (
        CheckpointNet(**model_kwargs) if model_kwargs.pop("checkpoint_net", False) else TinyRegression(**model_kwargs)
    )
    result = {**case, "error": None, "message": None}
    try:
        trainer.fit(model)
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        result.update(error=type(error).__name__, message=str(error))
    if snapshot.snapshot is not None and snapshot.snapshot.numel():
        gathered = [torch.zeros_like(snapshot.snapshot) for _ in range(2)]
        dist.all_gather(gathered, snapshot.snapshot)
        result["buffers_equal_after_forward"] = torch.equal(gathered[0], gathered[1])
    telemetry = strategy.telemetry
    result.update(
        optimizer_steps=strategy.sync_stats.optimizer_steps,
        synced_backwards=strategy.sync_stats.synced_backwards,
        skipped_backwards=strategy.sync_stats.skipped_backwards,
        replica_checks=len(strategy.replica_check_seconds),
        replica_check_ms=statistics.median(strategy.replica_check_seconds) * 1000
        if strategy.replica_check_seconds
        else None,
        broadcast_buffers=strategy.settings.broadcast_buffers,
        independent=dict(INDEPENDENT),
        telemetry_totals=telemetry.totals.__dict__ if telemetry else None,
        telemetry_last=telemetry.last.__dict__ if telemetry and telemetry.last else None,
    )
    return result


if __name__ == "__main__":
    job_main(run_case)
