"""The memory plan: per-rank bytes of each DDP layout for one model, optimizer and training batch.

Per rank, DDP keeps the parameters (and buffers), their gradients, DDP's gradient buckets (a flat copy of the
gradients, unless ``gradient_as_bucket_view`` makes the gradients views of them), the optimizer state (all of it, or
with ``optimizer_sharding=True`` the fullest rank's chunks of it, and then also, among the gradients, the averaged
chunk it received, kept from the backward to the step), and the activations one training forward saves for its
backward. A step holds more than that at its peak, briefly: the backward's temporaries (the
gradients of the largest outputs, two logits-sized tensors for a language model's loss) or the optimizer step's
intermediates, whichever is larger; both are measured (one forward and backward, and one optimizer step on copies,
counted tensor by tensor) and shown as ``transient``, so ``step peak`` is the most one step holds. The step is
measured where the plan runs, as the job's device would run it (``memory.devices``: the optimizer implementation
torch picks there, the allocator's rounding). What the plan does not count (the CUDA context, the cuBLAS workspace,
allocator fragmentation and caching, communication buffers) is left to ``headroom``, a fraction of the device kept
free.

Example (a model measured once, then planned for 8 ranks on an 80 GiB device, with no process started):

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
>>> optimizer = torch.optim.AdamW(model.parameters())
>>> batch = torch.randn(32, 512)
>>> figures = measure_model(model, optimizer, lambda: model(batch).sum(), inputs=batch)
>>> plan = plan_layouts(figures, world_size=8, device_memory=80 * 2**30)
>>> plan.layout("ddp").optimizer_state == 2 * plan.layout("ddp").gradients + 4 * 4
True
>>> plan.decision.layout
'ddp'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_ddp_plus.memory.decisions import Decision, decide
from lightning_ddp_plus.memory.devices import DeviceAllocation, device_allocation
from lightning_ddp_plus.memory.measure import (
    ParameterFigures,
    backward_peak_bytes,
    checkpointing_on,
    checkpointing_toggle,
    parameter_figures,
    runs_foreach,
    saved_activation_bytes,
    stepped_copy,
    tensor_bytes,
)
from lightning_ddp_plus.memory.sizes import format_size
from lightning_ddp_plus.sharding.bucket_shards import BucketLayout, pieces_of
from lightning_ddp_plus.sharding.partition import bytes_per_rank

#: The layouts the plan computes: (name, title, gradient_as_bucket_view, optimizer_sharding, checkpointing).
LAYOUTS: tuple[tuple[str, str, bool, bool, bool], ...] = (
    ("ddp", "DDP", False, False, False),
    ("ddp_bucket_view", "DDP, gradient_as_bucket_view", True, False, False),
    ("sharded", "DDP + ZeRO-1 (optimizer_sharding), bucket view", True, True, False),
    ("sharded_checkpointing", "ZeRO-1, bucket view, activation checkpointing", True, True, True),
)


@dataclass(frozen=True)
class ModelFigures:
    """What one replica takes, measured once; the plan for any world size follows by arithmetic."""

    groups: tuple[tuple[ParameterFigures, ...], ...]
    buffers: int
    activations: int
    #: activations with activation checkpointing, when the model can switch it (else ``None``)
    activations_checkpointed: int | None = None
    checkpointing_on: bool = False
    #: rows of the batch the activations were measured on (``None``: unknown, so no chunk size is suggested)
    rows: int | None = None
    #: the most one forward and backward hold at once beyond parameters, gradients and batch (activations and the
    #: backward's temporaries); ``None``: not measured, the activations stand for it
    backward_peak: int | None = None
    #: the same with activation checkpointing, where ``activations_checkpointed`` is known
    backward_peak_checkpointed: int | None = None
    #: what one optimizer step allocates beyond the state it keeps
    optimizer_temporaries: int = 0
    #: whether that step is torch's ``foreach`` implementation, whose temporaries are the size of all the parameters it
    #: steps (so a rank stepping its share under ``optimizer_sharding`` holds its share of them); else a
    #: per-parameter loop's, the size of the largest parameter, on any rank
    optimizer_foreach: bool = False
    #: the device the step was measured for (``None``: the CPU it ran on, nothing reproduced)
    device: DeviceAllocation | None = None

    @property
    def parameters(self) -> int:
        return sum(p.bytes for group in self.groups for p in group)

    @property
    def trainable(self) -> int:
        return sum(p.bytes for group in self.groups for p in group if p.trainable)

    @property
    def optimizer_state(self) -> int:
        return sum(p.optimizer_state for group in self.groups for p in group)

    def optimizer_state_by_rank(self, world_size: int) -> list[int]:
        """Each rank's share with ``optimizer_sharding=True``: the elements that have state, in the optimizer's order,
        in N equal chunks (DDP's buckets are chunked one by one, so a rank may hold a few elements more, the padding).
        """
        stateful = [p for group in self.groups for p in group if p.optimizer_state and p.numel]
        layout = BucketLayout((tuple((index, p.numel) for index, p in enumerate(stateful)),))
        return [
            round(
                sum(
                    piece.length * stateful[piece.parameter].optimizer_state / stateful[piece.parameter].numel
                    for piece in pieces_of(layout, rank, world_size)
                )
            )
            for rank in range(world_size)
        ]

    def optimizer_state_by_rank_whole_parameters(self, world_size: int) -> list[int]:
        """Each rank's share with ``optimizer_sharding="all_reduce"`` (torch's partition of whole parameters)."""
        numels = [[p.numel for p in group] for group in self.groups]
        states = [[p.optimizer_state for p in group] for group in self.groups]
        return bytes_per_rank(numels, states, world_size)


@dataclass(frozen=True)
class Layout:
    """Per-rank bytes of one layout (the fullest rank's, where ranks differ)."""

    name: str
    title: str
    parameters: int
    gradients: int
    buckets: int
    optimizer_state: int
    activations: int
    #: the step's peak beyond the activations: the backward's temporaries or the optimizer step's, the larger
    transient: int = 0
    #: rows per chunk, for the layout that trains each batch in chunks (``chunk_size``)
    chunk_size: int | None = None

    @property
    def total(self) -> int:
        """The step's peak: what is held throughout, the activations, and the larger of the transients."""
        return (
            self.parameters + self.gradients + self.buckets + self.optimizer_state + self.activations + self.transient
        )


@dataclass(frozen=True)
class MemoryPlan:
    figures: ModelFigures
    world_size: int
    device_memory: int | None
    headroom: float
    layouts: tuple[Layout, ...]
    configured: str | None = None
    decision: Decision | None = None
    advice: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def usable(self) -> int | None:
        return None if self.device_memory is None else int(self.device_memory * (1 - self.headroom))

    def layout(self, name: str) -> Layout:
        return next(layout for layout in self.layouts if layout.name == name)

    def fits(self, name: str) -> bool | None:
        usable = self.usable
        return None if usable is None else self.layout(name).total <= usable

    def render(self) -> str:
        """The plan as the text ``ddp-plus check`` prints."""
        header = f"memory plan per rank, world size {self.world_size}"
        if self.device_memory is not None:
            header += (
                f", device {format_size(self.device_memory)} ({format_size(self.usable or 0)} usable, "
                f"{self.headroom:.0%} headroom for what the plan does not count)"
            )
        columns = ("parameters", "gradients", "buckets", "optimizer", "activations", "transient", "step peak")
        titles = [layout.title + (" (configured)" if layout.name == self.configured else "") for layout in self.layouts]
        width = max([48, *(len(title) + 2 for title in titles)])
        lines = [header, f"  {'layout':<{width}}" + "".join(f"{c:>13}" for c in columns) + "  fits"]
        for layout, title in zip(self.layouts, titles):
            values = (
                layout.parameters,
                layout.gradients,
                layout.buckets,
                layout.optimizer_state,
                layout.activations,
                layout.transient,
                layout.total,
            )
            fits = self.fits(layout.name)
            mark = "?" if fits is None else "yes" if fits else "no"
            lines.append(f"  {title:<{width}}" + "".join(f"{format_size(v):>13}" for v in values) + f"  {mark}")
        lines += [f"  note: {note}" for note in self.notes]
        if self.decision is None:
            lines.append("verdict: no device memory known (pass `--device-memory 80GiB`, or run where the device is)")
        else:
            lines.append(f"verdict: {self.decision.verdict}; next step: {self.advice}")
        return "\n".join(lines)


def device_memory_of(device: torch.device) -> int | None:
    """Total memory of an accelerator device, through its torch module (``torch.cuda``, ``torch.xpu`` ...);
    ``None`` for the CPU or where this torch cannot say."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    properties = getattr(module, "get_device_properties", None)
    available = getattr(module, "is_available", None)
    if properties is None or available is None or not available():
        return None
    total = getattr(properties(device), "total_memory", None)
    return int(total) if total else None


def measure_model(
    module: Module,
    optimizer: Optimizer | None,
    training_forward: Callable[[], Any] | None,
    inputs: Any = None,
    checkpointing: bool = True,
    rows: int | None = None,
    device_type: str | None = None,
) -> ModelFigures:
    """Measure one replica: the parameters in the optimizer's groups, the state the optimizer will keep, and the
    activations of ``training_forward()`` (one training forward on one micro-batch, returning the loss), and, where
    the model can switch activation checkpointing and ``checkpointing`` is on, of the same forward with it.
    ``training_forward=None``: no forward (e.g. a model built on the ``meta`` device), activations 0.
    ``device_type``: the device the job trains on (default: the one the parameters are on, the CPU for ``meta``);
    the step is measured here as it runs there (``memory.devices``)."""
    if device_type is None:  # a model built on the meta device is placed later: the CPU's, unless told
        device_type = next((p.device.type for p in module.parameters() if p.device.type != "meta"), "cpu")
    device = device_allocation(device_type)
    granularity = device.granularity
    groups = tuple(tuple(group) for group in parameter_figures(module, optimizer, granularity))
    buffers = sum(tensor_bytes(b, granularity) for b in module.buffers())
    foreach = optimizer is not None and runs_foreach(optimizer, device.foreach_optimizers)
    if training_forward is None:
        return ModelFigures(groups, buffers, activations=0, optimizer_foreach=foreach, device=device)
    was_training = module.training
    module.train()
    activations = saved_activation_bytes(module, training_forward, inputs, granularity)
    peak = backward_peak_bytes(module, training_forward, inputs, granularity)
    checkpointed = peak_checkpointed = None
    toggle = checkpointing_toggle(module) if checkpointing else None
    already_on = checkpointing_on(module)
    if toggle is not None and not already_on:
        enable, disable = toggle
        enable()
        try:
            checkpointed = saved_activation_bytes(module, training_forward, inputs, granularity)
            peak_checkpointed = backward_peak_bytes(module, training_forward, inputs, granularity)
        finally:
            disable()
    module.train(was_training)
    return ModelFigures(
        groups,
        buffers,
        activations,
        checkpointed,
        checkpointing_on=already_on,
        rows=rows,
        backward_peak=peak,
        backward_peak_checkpointed=peak_checkpointed,
        optimizer_temporaries=(
            stepped_copy(optimizer, device.foreach_optimizers, granularity)[1] if optimizer is not None else 0
        ),
        optimizer_foreach=foreach,
        device=device,
    )


def optimizer_temporaries_on_rank(figures: ModelFigures, sharded_state: int | None) -> int:
    """The optimizer step's temporaries on the fullest rank: all of them without sharding (``sharded_state=None``);
    with it, a foreach step's in proportion to the state that rank steps (torch's partition of whole parameters),
    a loop's unchanged (the largest parameter is on some rank)."""
    if sharded_state is None or not figures.optimizer_foreach or figures.optimizer_state <= 0:
        return figures.optimizer_temporaries
    return -(-figures.optimizer_temporaries * sharded_state // figures.optimizer_state)


def _layout(
    figures: ModelFigures,
    sharded_state: int,
    received: int,
    name: str,
    title: str,
    bucket_view: bool,
    sharded: bool,
    checkpointed: bool,
) -> Layout:
    activations, peak = figures.activations, figures.backward_peak
    if checkpointed and figures.activations_checkpointed is not None:
        activations, peak = figures.activations_checkpointed, figures.backward_peak_checkpointed
    stepped = optimizer_temporaries_on_rank(figures, sharded_state if sharded else None)
    return Layout(
        name,
        title,
        parameters=figures.parameters + figures.buffers,
        gradients=(0 if bucket_view else figures.trainable) + (received if sharded else 0),
        buckets=figures.trainable,
        optimizer_state=sharded_state if sharded else figures.optimizer_state,
        activations=activations,
        transient=max(0, (peak or 0) - activations, stepped - activations),
    )


def _notes(figures: ModelFigures, world_size: int, shares: list[int]) -> tuple[str, ...]:
    notes = []
    device = figures.device
    if device is not None and device.device_type != "cpu":
        notes.append(
            f"measured here as a {device.device_type} step: torch's "
            + ("foreach" if figures.optimizer_foreach else "per-parameter")
            + " optimizer implementation, "
            + (
                f"each allocation rounded up to {device.granularity} bytes"
                if device.granularity_known
                else f"exact bytes (this plan does not know how the {device.device_type} allocator rounds)"
            )
        )
    if figures.checkpointing_on:
        notes.append("activation checkpointing is on in this model: every layout's activations are with it")
    if world_size > 1 and shares and max(shares) > 0:
        notes.append(
            "optimizer state per rank with sharding: "
            + ", ".join(format_size(s) for s in shares[:8])
            + (" ..." if world_size > 8 else "")
            + f" (1/{world_size} would be {format_size(figures.optimizer_state / world_size)})"
        )
    return tuple(notes)


def _decided(plan: MemoryPlan) -> MemoryPlan:
    """``plan`` with the decision table's verdict for its device memory, and the advice filled in."""
    figures, world_size = plan.figures, plan.world_size
    decision = decide({layout.name: bool(plan.fits(layout.name)) for layout in plan.layouts})
    micro = next((layout for layout in plan.layouts if layout.name == "chunks"), None)
    size = micro.chunk_size if micro is not None else ""
    decision = dataclasses.replace(decision, verdict=decision.verdict.format(chunk_size=size))
    fsdp = (figures.parameters + figures.trainable + figures.optimizer_state) / world_size
    advice = decision.advice.format(
        chunk_size=micro.chunk_size if micro is not None else "",
        chunk_layout=micro.title.rsplit(",", 1)[0] if micro is not None else "",
        sharding_saves=format_size(plan.layout("ddp_bucket_view").total - plan.layout("sharded").total),
        parameters=format_size(figures.trainable),
        bucket_view_saves=format_size(plan.layout("ddp").gradients),
        world_size=world_size,
        fsdp_per_rank=format_size(fsdp),
    )
    return dataclasses.replace(plan, decision=decision, advice=advice)


def plan_layouts(
    figures: ModelFigures,
    world_size: int,
    device_memory: int | None = None,
    headroom: float = 0.1,
    configured: tuple[bool, bool] | None = None,
    whole_parameters: bool = False,
) -> MemoryPlan:
    """Per-rank bytes of each layout at ``world_size``, and the decision when ``device_memory`` is known.
    ``whole_parameters``: sharding shares whole parameters (``optimizer_sharding="all_reduce"``), not elements.

    ``configured``: the run's (``gradient_as_bucket_view``, ``optimizer_sharding``), marked in the table (and
    added as a row when no computed layout is it)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom}")
    by_rank = figures.optimizer_state_by_rank_whole_parameters if whole_parameters else figures.optimizer_state_by_rank
    shares = by_rank(world_size)
    sharded_state = max(shares, default=0)
    checkpointing_row = figures.activations_checkpointed is not None and not figures.checkpointing_on
    # optimizer_sharding=True keeps the averaged chunk a rank received from the backward to the step (a synced
    # backward that does not end its window counts it again in the next one); "all_reduce" keeps no such copy
    received = 0 if whole_parameters else -(-figures.trainable // world_size)
    layouts = [_layout(figures, sharded_state, received, *spec) for spec in LAYOUTS if not spec[4] or checkpointing_row]
    configured_name = None
    if configured is not None:
        bucket_view, sharded = configured
        match = next((spec for spec in LAYOUTS if spec[2:4] == (bucket_view, sharded) and not spec[4]), None)
        if match is None:
            title = "configured: ZeRO-1, no bucket view"
            layouts.append(_layout(figures, sharded_state, received, "configured", title, bucket_view, sharded, False))
            configured_name = "configured"
        else:
            configured_name = match[0]
    notes = _notes(figures, world_size, shares)
    plan = MemoryPlan(figures, world_size, device_memory, headroom, tuple(layouts), configured_name, notes=notes)
    if device_memory is None:
        return plan
    micro = _chunk_layout(plan)
    if micro is not None:
        plan = dataclasses.replace(plan, layouts=(*plan.layouts, micro))
    return _decided(plan)


def _chunk_layout(plan: MemoryPlan) -> Layout | None:
    """Where a whole batch's activations do not fit but one row's do: the cheapest of DDP, bucket view and ZeRO-1
    with the largest ``chunk_size`` whose chunk's step peak fits beside the rest (the activations and the
    backward's temporaries grow with the rows of a chunk; the rest, and the optimizer step's temporaries, do not)."""
    figures, usable = plan.figures, plan.usable
    rows = figures.rows
    if rows is None or rows < 2 or usable is None or figures.activations <= 0:
        return None
    if any(plan.fits(name) for name in ("ddp", "ddp_bucket_view", "sharded")):
        return None  # the whole batch fits
    per_row = figures.activations / rows
    peak_per_row = max(figures.backward_peak or 0, figures.activations) / rows
    for name in ("ddp", "ddp_bucket_view", "sharded"):
        base = plan.layout(name)
        held = base.total - base.activations - base.transient
        stepped = optimizer_temporaries_on_rank(figures, base.optimizer_state if name == "sharded" else None)
        if held + stepped > usable:
            continue
        size = min(rows - 1, int((usable - held) // peak_per_row))
        if size >= 1:
            activations = int(per_row * size)
            transient = max(0, int(peak_per_row * size) - activations, stepped - activations)
            return dataclasses.replace(
                base,
                name="chunks",
                title=f"{base.title}, chunk_size={size}",
                activations=activations,
                transient=transient,
                chunk_size=size,
            )
    return None
