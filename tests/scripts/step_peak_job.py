"""Measure the step's peak on real tiny models, beside the memory plan's: one process (a world-size-1 gloo group, so
DDP builds its buckets), each model built after a reset of the peak-RSS counter, two real steps (forward, backward,
AdamW step), the peak read from ``VmHWM``. Run with ``MALLOC_MMAP_THRESHOLD_`` fixed, so every tensor is its own
mapping that returns to the system when freed, and the resident set follows what tensors hold.

Each case is ``MODEL@DEVICE_TYPE:ROWSxTOKENS``. For ``@cuda`` on a machine without one, the steps run on the CPU as
CUDA runs them: AdamW's ``foreach`` implementation, the one torch picks for CUDA parameters (the plan is given the
optimizer with ``foreach`` unset and ``device_type="cuda"``, as ``ddp-plus check --device-type cuda`` does). Where
CUDA is present, an ``@cuda`` case trains there and its peak is ``torch.cuda.max_memory_allocated``.

Prints one JSON line per case: ``{"case", "planned", "planned_cpu", "transient", "measured", "fits_below_peak",
"measured_with"}``, sizes in bytes (``planned_cpu``: the plan of the same step as the CPU runs it)."""

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.memory.plan import ModelFigures, measure_model, plan_layouts
from tests.helpers import tiny_llama
from tests.test_memory_plan import tiny_gpt2, tiny_lora

MODELS = {
    "llama": tiny_llama,
    "gpt2": tiny_gpt2,
    "peft-lora": tiny_lora,
    # 10.5 M parameters and a batch of a few tokens: the optimizer step, not the backward, makes the peak
    "llama-wide": lambda: tiny_llama(hidden_size=512, intermediate_size=1024, num_hidden_layers=4),
}
CASES = [
    *(f"{model}@{device}:8x256" for device in ("cpu", "cuda") for model in ("llama", "gpt2", "peft-lora")),
    "llama-wide@cpu:1x16",
    "llama-wide@cuda:1x16",
]


def status(key: str) -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key))


def measured_peak(make, ids, device_type: str, steps: int = 2) -> tuple[int, str]:
    """The peak of ``steps`` real steps beyond what was held before the model was built, and what measured it."""
    on_cuda = device_type == "cuda" and torch.cuda.is_available()
    if steps > 1:  # a first run pages in code and imports modules: resident, but not what the step holds
        measured_peak(make, ids, device_type, steps=1)
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the peak resident set starts again from here
        base = status("VmRSS:")
    model = make().to("cuda" if on_cuda else "cpu")
    model.train()
    # the implementation torch picks on the case's device (foreach for CUDA parameters), chosen explicitly so that a
    # CPU run takes CUDA's path
    foreach = None if on_cuda else device_type == "cuda"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=foreach)
    ddp = DistributedDataParallel(model)
    inputs = ids.to("cuda" if on_cuda else "cpu")
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        del loss
    if on_cuda:
        torch.cuda.synchronize()
        peak, measured_with = torch.cuda.max_memory_allocated() - base, "torch.cuda.max_memory_allocated"
    else:
        peak, measured_with = status("VmHWM:") - base, "VmHWM"
    del ddp, model, optimizer, inputs
    gc.collect()
    return peak, measured_with


#: The CPU's figures of each model and shape, measured by its ``@cpu`` case and planned again by its ``@cuda`` case
#: (``planned_cpu``): a measurement takes as long as a step's.
CPU_FIGURES: dict[tuple[str, tuple[int, ...]], ModelFigures] = {}


def planned(name: str, ids, measured: int, device_type: str) -> dict:
    make = MODELS[name]

    def figures_for(target: str):
        if target == "cpu" and (name, tuple(ids.shape)) in CPU_FIGURES:
            return CPU_FIGURES[name, tuple(ids.shape)]
        model = make()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])  # foreach left unset
        figures = measure_model(
            model,
            optimizer,
            lambda: model(input_ids=ids, labels=ids).loss,
            inputs=ids,
            checkpointing=False,
            device_type=target,
        )
        if target == "cpu":
            CPU_FIGURES[name, tuple(ids.shape)] = figures
        return figures

    def plan(figures, device_memory: int | None = None):
        return plan_layouts(figures, world_size=1, device_memory=device_memory, configured=(False, False))

    figures = figures_for(device_type)  # measured once, planned for two devices
    on_cpu = figures if device_type == "cpu" else figures_for("cpu")
    layout = plan(figures).layout("ddp")
    # a device just smaller than the measured peak: the verdict must not say that the configured layout fits
    below = plan(figures, device_memory=measured - 1)
    return {
        "planned": layout.total,
        "planned_cpu": plan(on_cpu).layout("ddp").total,
        "transient": layout.transient,
        "fits_below_peak": below.fits("ddp"),
    }


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for case in sys.argv[1:] or CASES:
        name, _, rest = case.partition("@")
        device_type, _, shape = rest.partition(":")
        rows, tokens = (int(n) for n in shape.split("x"))
        torch.manual_seed(0)
        ids = torch.randint(0, 1000, (rows, tokens))
        measured, measured_with = measured_peak(MODELS[name], ids, device_type)
        record = {"case": case, "measured": measured, "measured_with": measured_with}
        record.update(planned(name, ids, measured, device_type))
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
