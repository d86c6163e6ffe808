"""Runs chunk_size cases on one 2-rank process group: ``chunk_job.py OUT_JSON CASES_JSON``.

Started once per rank by the test. Each case trains a regression model for one epoch of 32-row batches per rank.
Out-of-memory errors are real: torch's ``OutOfMemoryError`` raised where CUDA's allocator raises it (in the forward,
or in the backward through an autograd function) once a rank's batch has more rows than the case's limit, or the CPU
allocator failing under an address-space limit (``RLIMIT_AS``) set on one rank at train start.
"""

import os
import resource
import time

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.memory.suggestion import ChunkSuggestion, parameter_count, write_suggestion
from tests.helpers import QUIET_TRAINER, TinyRegression, job_main

ALLREDUCE_HOOK = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook"


class FailsInBackward(torch.autograd.Function):
    """Identity forward; its backward raises torch's out-of-memory error (where CUDA's allocator would)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({grad.shape[0]} rows)")


class MemoryLimited(TinyRegression):
    """Rank r can hold ``limits[r]`` rows from optimizer step ``from_step`` on; more raise in ``phase``."""

    def __init__(
        self, limits: dict, phase: str, from_step: int = 0, wide: bool = False, at_calls: tuple = (), **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.limits, self.phase, self.from_step = {int(k): v for k, v in limits.items()}, phase, from_step
        #: ``training_step`` calls (one per chunk) that fail on a rank with a limit, whatever their rows
        self.at_calls, self.calls = at_calls, 0
        self.wide = nn.Parameter(torch.linspace(-1, 1, 1 << 21)) if wide else None
        self._saved_limit = None

    def on_train_start(self) -> None:
        if self.phase == "rlimit" and self.global_rank in self.limits:
            # the address space this process has now, and a little more: a large batch cannot be allocated
            with open("/proc/self/statm") as statm:
                pages = int(statm.read().split()[0])
            self._saved_limit = resource.getrlimit(resource.RLIMIT_AS)
            limit = pages * resource.getpagesize() + self.limits[self.global_rank] * (1 << 20)
            resource.setrlimit(resource.RLIMIT_AS, (limit, self._saved_limit[1]))

    def on_train_end(self) -> None:
        if self._saved_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, self._saved_limit)

    def training_step(self, batch, batch_idx):
        x, y = batch
        limit = self.limits.get(self.global_rank)
        if self.at_calls:
            over = limit is not None and self.calls in self.at_calls
        else:
            over = limit is not None and x.shape[0] > limit and self.global_step >= self.from_step
        self.calls += 1
        if over and self.phase == "forward":
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({x.shape[0]} rows)")
        out = self(x)
        if self.wide is not None:  # rows x 8 MiB, two or three times over in the backward
            out = out + (out * self.wide).mean(dim=1, keepdim=True) * 1e-3
        if over and self.phase == "backward":
            out = FailsInBackward.apply(out)
        return nn.functional.mse_loss(out, y)


def run_case(case: dict) -> dict:
    sharded = case.get("strategy", {}).get("optimizer_sharding") is True  # its reduce-scatter is the hook
    strategy = DDPPlusStrategy(
        ddp_comm_hook=None if sharded else ALLREDUCE_HOOK,
        chunk_size=case.get("chunk_size"),
        timeout="60s",
        **case.get("strategy", {}),
    )
    model = MemoryLimited(
        case.get("limits", {}),
        case.get("phase", "forward"),
        case.get("from_step", 0),
        wide=case.get("wide", False),
        at_calls=tuple(case.get("at_calls", ())),
        num_samples=256,
        batch_size=32,
        lr=0.05,
    )
    root = None
    if "plan" in case:  # what `ddp-plus check` leaves in the run's folder (one per rank: no rank waits on another's)
        root = f"{case['plan_root']}/rank{os.environ['LOCAL_RANK']}"
        plan = ChunkSuggestion(**case["plan"], device_memory=1 << 30, parameters=parameter_count(model))
        write_suggestion(root, plan)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        accumulate_grad_batches=case.get("accumulate", 1),
        default_root_dir=root,
        **QUIET_TRAINER,
    )
    started = time.perf_counter()
    error = None
    try:
        trainer.fit(model)
    except Exception as raised:  # noqa: BLE001 - the outcome is what the test checks
        error = f"{type(raised).__name__}: {raised}"
    fit_seconds = time.perf_counter() - started
    if case.get("save_to"):
        trainer.save_checkpoint(case["save_to"])
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    stats = strategy.sync_stats
    return {
        **case,
        "error": error,
        "size": strategy.engine.chunks.size,
        "changes": [[c.old, c.new, [f.rank for f in c.failures]] for c in strategy.engine.chunks.changes],
        "attempt_seconds": [c.attempt_seconds for c in strategy.engine.chunks.changes],
        "fit_seconds": fit_seconds,
        "hook_calls": strategy.comm_hook_counter.calls,
        "optimizer_steps": stats.optimizer_steps,
        "global_step": trainer.global_step,
        "params": [t.tolist() for t in gathered],
    }


if __name__ == "__main__":
    job_main(run_case)
