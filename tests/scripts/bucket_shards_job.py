"""ZeRO-1 at DDP's bytes on N ranks without a Trainer: ``bucket_shards_job.py OUT_JSON CASES_JSON``.

Each case trains one model with plain DDP and with the reduce-scatter hook and ``BucketShardedOptimizer`` on the
same data (tiny buckets, so that parameters straddle chunks and a bucket smaller than N leaves a rank only padding),
and reports the parameters of both, the state each rank holds, the bytes sent, and the consolidated state against the
plain optimizer's.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp_plus.sharding.optimizer import bucket_sharded
from lightning_ddp_plus.sharding.reduce_scatter import GradientShards, reduce_scatter_hook
from tests.helpers import job_main
from tests.scripts.sharding_job import ensure_group


class Convolutional(nn.Module):
    """A convolution whose weight is channels_last (a parameter that is dense but not contiguous), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1).to(memory_format=torch.channels_last)
        self.head = nn.Linear(6 * 2 * 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(x.view(-1, 3, 2, 3).contiguous(memory_format=torch.channels_last)))
        return self.head(features.flatten(1))


def model(case: dict) -> nn.Module:
    torch.manual_seed(0)
    if case.get("channels_last"):
        return Convolutional()
    return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 5), nn.ReLU(), nn.Linear(5, 1))


def optimizer_for(case: dict, module: nn.Module) -> torch.optim.Optimizer:
    name = case["optimizer"]
    parameters = list(module.parameters())
    if case.get("add_group_at"):  # the head only, at first: the rest joins as a new group (as BaseFinetuning does)
        parameters = parameters[-2:]
    if name == "sgd_momentum":
        return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
    if name == "adafactor":  # factored second moments: one row and one column statistic per matrix
        return torch.optim.Adafactor(parameters, lr=0.01)
    return torch.optim.AdamW(parameters, lr=0.01, weight_decay=0.1)


def train(case: dict, sharded: bool, steps: int, module: nn.Module | None = None, state: Any = None) -> dict:
    """``steps`` optimizer steps of ``k`` micro-batches each (the first all-reduced early when ``early_sync``; the
    parameters' storage replaced before the second when ``replace_storage``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = module or model(case)
    optimizer = optimizer_for(case, module)
    head = {id(p) for p in optimizer.param_groups[0]["params"]}
    body = [p for p in module.parameters() if id(p) not in head]
    if case.get("frozen_before_wrap"):  # as BaseFinetuning freezes, in `setup`: DDP leaves them out of its buckets
        for parameter in body:
            parameter.requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(
        module, bucket_cap_mb=case.get("bucket_mb", 0.0005), find_unused_parameters=bool(case.get("add_group_at"))
    )
    if case.get("add_group_at"):  # frozen after DDP wrapped them: in its buckets, without gradients until unfrozen
        for parameter in body:
            parameter.requires_grad_(False)
    shards = GradientShards(exchange_group=EXCHANGE_GROUP[0])
    if sharded:
        ddp.register_comm_hook(shards, reduce_scatter_hook)
        optimizer = bucket_sharded(optimizer, shards)
    if state is not None:
        optimizer.load_state_dict(state)
    generator = torch.Generator().manual_seed(100 + rank)
    k = case.get("k", 1)
    for step in range(steps):
        if case.get("replace_storage") and step == 1:
            dtype = torch.float64 if case.get("replace_dtype") else None
            for parameter in module.parameters():  # as ``module.to(...)`` does: the same Parameter, a new storage
                parameter.data = parameter.data.to(dtype, copy=True)
        if case.get("add_group_at") == step:  # unfrozen, and a new group: as BaseFinetuning does
            for parameter in body:
                parameter.requires_grad_(True)
            optimizer.add_param_group({"params": body, "lr": 0.02})
        features = 18 if case.get("channels_last") else 7
        dtype = next(module.parameters()).dtype
        for micro in range(k):
            x, y = torch.randn(8, features, generator=generator), torch.randn(8, 1, generator=generator)
            x, y = x.to(dtype), y.to(dtype)
            closes = micro == k - 1
            early = case.get("early_sync") and step == 0 and micro == 0
            context = ddp.no_sync() if not (closes or early) else torch.enable_grad()
            with context:
                (nn.functional.mse_loss(ddp(x), y) / k).backward()
        if case.get("clip"):
            if sharded:
                optimizer.clip_grad_norm_(case["clip"])
            else:
                torch.nn.utils.clip_grad_norm_(module.parameters(), case["clip"])
        optimizer.step()
        optimizer.zero_grad()
    if sharded:
        optimizer.consolidate_state_dict()
    full = optimizer.state_dict() if rank == 0 or not sharded else None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, optimizer.state_bytes() if sharded else None)
    storages = {parameter.untyped_storage().data_ptr() for parameter in module.parameters()}
    return {
        "module": module,
        # the inner optimizer steps views of the parameters, never copies of them
        "pieces_are_views": sharded and all(t.untyped_storage().data_ptr() in storages for t in optimizer.tensors),
        "params": torch.cat([p.detach().flatten() for p in module.parameters()]).tolist(),
        "state": full,
        "state_bytes": gathered,
        "sent_bytes": shards.sent_bytes,
        "buckets": len(shards.layout.buckets) if shards.layout else 0,
        "bucket_elements": [sum(n for _, n in b) for b in shards.layout.buckets] if shards.layout else [],
    }


def max_state_difference(a: dict, b: dict) -> float:
    worst = 0.0
    for index, per_parameter in a["state"].items():
        if index not in b["state"]:  # never stepped
            return float("inf")
        for key, value in per_parameter.items():
            if key not in b["state"][index]:
                return float("inf")
            if isinstance(value, torch.Tensor):
                worst = max(worst, (value.float() - b["state"][index][key].float()).abs().max().item())
    return worst


#: The hook's exchanges on a gloo group of their own, as ``ZeroSharding`` opens one at a fit's start.
EXCHANGE_GROUP: list[Any] = []


def run_case(case: dict) -> dict:
    ensure_group()
    if not EXCHANGE_GROUP:
        EXCHANGE_GROUP.append(dist.new_group(backend="gloo"))
    steps = case.get("steps", 4)
    plain = train(case, sharded=False, steps=steps)
    try:
        sharded = train(case, sharded=True, steps=steps)
    except (ValueError, TypeError) as error:  # what the sharded optimizer refuses, on every rank alike
        return {**case, "refused": str(error)}
    result = {
        **case,
        "world_size": dist.get_world_size(),
        "difference": max(abs(a - b) for a, b in zip(plain["params"], sharded["params"])),
        "state_bytes": sharded["state_bytes"],
        "sent_bytes": sharded["sent_bytes"],
        "buckets": sharded["buckets"],
        "bucket_elements": sharded["bucket_elements"],
        "pieces_are_views": sharded["pieces_are_views"],
    }
    if dist.get_rank() == 0:
        result["state_keys_equal"] = plain["state"]["state"].keys() == sharded["state"]["state"].keys()
        result["state_difference"] = max_state_difference(plain["state"], sharded["state"])
    if case.get("resume"):
        # the consolidated (plain) state, broadcast, loaded into a new sharded run of the same parameters: it goes on
        # as the plain optimizer does with its own state
        shared = [sharded["state"] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        goes_on_plain = train(case, False, 2, module=plain["module"], state=plain["state"])
        goes_on_sharded = train(case, True, 2, module=sharded["module"], state=shared[0])
        result["resumed_difference"] = max(
            abs(a - b) for a, b in zip(goes_on_plain["params"], goes_on_sharded["params"])
        )
    return result


if __name__ == "__main__":
    job_main(run_case)
