"""Measure the step's peak on real tiny models, beside the memory plan's: one process (a world-size-1 gloo group, so
DDP builds its buckets), each model built after a reset of the peak-RSS counter, two real steps (forward, backward,
AdamW step), the peak read from ``VmHWM``. Run with ``MALLOC_MMAP_THRESHOLD_`` fixed, so every tensor is its own
mapping that returns to the system when freed, and the resident set follows what tensors hold. Prints one JSON line
per model: ``{"model", "planned", "transient", "measured", "fits_below_peak"}``, sizes in bytes."""

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.memory.plan import measure_model, plan_layouts
from tests.test_memory_plan import tiny_gpt2, tiny_llama, tiny_lora


def status(key: str) -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key))


def measured_peak(make, ids, steps: int = 2) -> int:
    if steps > 1:  # a first run pages in code and imports modules: resident, but not what the step holds
        measured_peak(make, ids, steps=1)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident set starts again from here
    base = status("VmRSS:")
    model = make()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ddp = DistributedDataParallel(model)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        del loss
    peak = status("VmHWM:") - base
    del ddp, model, optimizer
    gc.collect()
    return peak


def planned(make, ids, measured: int) -> dict:
    model = make()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    figures = measure_model(
        model, optimizer, lambda: model(input_ids=ids, labels=ids).loss, inputs=ids, checkpointing=False
    )
    layout = plan_layouts(figures, world_size=1).layout("ddp")
    # a device just smaller than the measured peak: the verdict must not say that the configured layout fits
    below = plan_layouts(figures, world_size=1, device_memory=measured - 1, configured=(False, False))
    return {"planned": layout.total, "transient": layout.transient, "fits_below_peak": below.fits("ddp")}


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    models = {"llama": tiny_llama, "gpt2": tiny_gpt2, "peft-lora": tiny_lora}
    for name in sys.argv[1:] or models:
        torch.manual_seed(0)
        ids = torch.randint(0, 1000, (8, 256))
        measured = measured_peak(models[name], ids)
        record = {"model": name, "measured": measured, **planned(models[name], ids, measured)}
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
