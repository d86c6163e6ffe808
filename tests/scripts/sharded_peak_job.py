"""What a ZeRO-1 step holds beyond its steady state, on 2 ranks: ``sharded_peak_job.py OUT_JSON CASES_JSON``.

Each case is an MLP of ``layers`` x [1024 x 1024] under DDP (torch's default buckets, ``gradient_as_bucket_view``)
with the reduce-scatter hook and a sharded Adam. After two steps (DDP's rebuilt buckets, the state allocated), the
peak resident set is reset and one more step runs (forward, backward, step, all-gather); the case reports that step's
peak above what was held before it. Run with ``MALLOC_MMAP_THRESHOLD_`` fixed, so every tensor is its own mapping
that returns to the system when freed, and the resident set follows what tensors hold.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp_plus.sharding.optimizer import bucket_sharded
from lightning_ddp_plus.sharding.reduce_scatter import GradientShards, reduce_scatter_hook
from tests.helpers import job_main
from tests.scripts.sharding_job import ensure_group


def status(key: str) -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key))


def run_case(case: dict) -> dict:
    ensure_group()
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(case["layers"])])
    ddp = nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=True)
    shards = GradientShards()
    ddp.register_comm_hook(shards, reduce_scatter_hook)
    optimizer = bucket_sharded(torch.optim.Adam(module.parameters(), lr=1e-3, foreach=False), shards)
    batch = torch.randn(4, 1024)

    def step() -> None:
        ddp(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step(), step()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident set starts again from here
    held = status("VmRSS:")
    step()
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, status("VmHWM:") - held)
    parameter_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return {**case, "step_above_held": peaks, "parameter_bytes": parameter_bytes}


if __name__ == "__main__":
    job_main(run_case)
