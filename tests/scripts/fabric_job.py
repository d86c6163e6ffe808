"""Lightning Fabric with ``ddp_plus`` on one 2-rank process group: ``fabric_job.py OUT_JSON CASES_JSON``.

Each case trains a small model with a plain Fabric loop over this rank's shard (rows ``rank::2``) of a fixed
regression data set and records the outcome, the counts, and every rank's final parameters.
"""

import dataclasses
import os
import shutil
import signal
import tempfile
import time

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_ddp_plus import DDPPlusFabricStrategy, Preempted
from tests.helpers import CheckpointNet, flat_parameters, job_main, regression_data

COUNT = {"calls": 0}


def counting_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    COUNT["calls"] += 1
    return default_hooks.allreduce_hook(state, bucket)


class WarmupNet(nn.Module):
    """Body -> head, and an auxiliary head that ``forward(x, aux=True)`` also returns (used on some steps only)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, aux: bool = False) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + (self.aux(h) if aux else 0)


def make_model(case: dict) -> nn.Module:
    torch.manual_seed(1)
    if case.get("checkpoint_net"):
        return CheckpointNet(checkpointing="reentrant")
    if "warmup" in case:
        return WarmupNet()
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def preempted_with(fabric, model, optimizer, batches, at_step: int) -> dict:
    """Rank 1 gets SIGTERM before the backward after step ``at_step``; the loop saves the agreed step and ends as
    the preemption guide shows; then it loads that file and trains the remaining batches."""
    folder = fabric.broadcast(tempfile.mkdtemp() if fabric.global_rank == 0 else None)
    path, steps = os.path.join(folder, "last.ckpt"), 0
    try:
        for xb, yb in batches[steps:]:
            if steps == at_step and fabric.global_rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            fabric.backward(nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if fabric.strategy.preemption_agreed:
                started = time.monotonic()
                fabric.save(path, {"model": model, "optimizer": optimizer, "steps": steps})
                fabric.strategy.end_preempted(path, time.monotonic() - started)
        outcome: dict = {"preempted": None}
    except Preempted as preempted:
        state = {"model": model, "optimizer": optimizer, "steps": 0}
        fabric.load(path, state)
        for xb, yb in batches[state["steps"] :]:
            fabric.backward(nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
        fabric.barrier()  # every rank has loaded the file before it goes
        outcome = {"preempted": str(preempted), "code": preempted.code, "saved_steps": state["steps"]}
    if fabric.global_rank == 0:
        shutil.rmtree(folder)
    return outcome


def run_case(case: dict) -> dict:
    COUNT["calls"] = 0
    kwargs = dict(case.get("strategy", {}))
    if case.get("by_name"):
        strategy = "ddp_plus"
    else:
        strategy = DDPPlusFabricStrategy(process_group_backend="gloo", ddp_comm_hook=counting_hook, **kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = make_model(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = regression_data(case.get("num_samples", 40)).tensors
    rank = fabric.global_rank
    batches = [(x[rank::2][i : i + 4], y[rank::2][i : i + 4]) for i in range(0, len(x) // 2, 4)]
    if "uneven" in case:
        batches = batches[: case["uneven"][rank]]
    outcome = {"error": None, "message": None, "steps": 0}
    try:
        if case.get("idiom") == "no_backward_sync":
            k = case["k"]
            for index, (xb, yb) in enumerate(batches):
                closes = (index + 1) % k == 0 or index == len(batches) - 1
                with fabric.no_backward_sync(model, enabled=not closes):
                    fabric.backward(nn.functional.mse_loss(model(xb), yb) / k)
                if closes:
                    optimizer.step()
                    optimizer.zero_grad()
                    outcome["steps"] += 1
        elif "oom_above" in case:  # rank 1 holds chunks of oom_above rows at most (torch's error beyond)
            limit = case["oom_above"]

            def loss_of(module, chunk):
                if rank == 1 and len(chunk[0]) > limit:
                    raise torch.OutOfMemoryError(f"CUDA out of memory ({len(chunk[0])} rows)")
                return nn.functional.mse_loss(module(chunk[0]), chunk[1])

            for batch in fabric.strategy.micro_batches(batches):
                fabric.strategy.train_in_chunks(model, batch, loss_of)
                if fabric.strategy.sync_gradients:
                    optimizer.step()
                    optimizer.zero_grad()
                    outcome["steps"] += 1
            outcome["chunk_size"] = fabric.strategy.engine.chunks.size
        elif "preempt_at" in case:
            outcome.update(preempted_with(fabric, model, optimizer, batches, case["preempt_at"]))
        else:
            for xb, yb in fabric.strategy.micro_batches(batches):
                if case.get("slow_rank") == rank:  # its batch arrives late: a slow loader on this rank only
                    time.sleep(case["delay_s"])
                if "warmup" in case:  # the auxiliary head trains for the first `warmup` steps only
                    fabric.backward(nn.functional.mse_loss(model(xb, aux=outcome["steps"] < case["warmup"]), yb))
                else:
                    fabric.backward(nn.functional.mse_loss(model(xb), yb))
                if fabric.strategy.sync_gradients:
                    optimizer.step()
                    optimizer.zero_grad()
                    outcome["steps"] += 1
                    if case.get("corrupt_after") == outcome["steps"] and rank == 1:
                        with torch.no_grad():
                            next(model.parameters()).add_(1e-3)
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        outcome.update(error=type(error).__name__, message=str(error)[:1500])
    stragglers = fabric.strategy.engine.stragglers
    finding = stragglers.last_finding if stragglers is not None else None
    flat = flat_parameters(model)
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    stats = fabric.strategy.sync_stats
    return {
        **case,
        **outcome,
        "strategy_type": type(fabric.strategy).__name__,
        "hook_calls": COUNT["calls"],
        "synced_backwards": stats.synced_backwards,
        "skipped_backwards": stats.skipped_backwards,
        "optimizer_steps": stats.optimizer_steps,
        "findings": [finding.rule.id for finding in fabric.strategy.findings],
        "static_graph": fabric.strategy.settings.static_graph,
        "bucket_choice": None if fabric.strategy.bucket_choice is None else [fabric.strategy.bucket_choice.chosen_mb],
        "params": [t.tolist() for t in gathered],
        "straggler": None if finding is None else dataclasses.asdict(finding),
    }


if __name__ == "__main__":
    job_main(run_case)
