"""The decision table: which layout to train with, given which ones fit, as frozen data read in order.

It follows the Hugging Face multi-GPU guide: a model that fits on one device trains with DDP or ZeRO (try both:
sharding frees memory for a larger batch, at DDP's bytes but with its all-gather after the step); one that does not fit needs its
parameters and gradients sharded too (ZeRO-3: Lightning's ``FSDPStrategy`` or ``DeepSpeedStrategy(stage=3)``), or
pipeline / tensor parallelism when even its largest layer does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """Use ``layout`` when it is the first of the table that fits."""

    layout: str
    verdict: str
    advice: str


#: Layout names the plan computes (``plan.LAYOUTS``), cheapest change first.
DECISIONS: tuple[Decision, ...] = (
    Decision(
        "ddp",
        "fits with plain DDP",
        "train with DDP as configured. Optimizer sharding (`optimizer_sharding=True`) would free {sharding_saves} "
        "per rank for a larger batch, at DDP's bytes (a reduce-scatter and an all-gather of {parameters} instead of "
        "the all-reduce), the all-gather after the step: measure both.",
    ),
    Decision(
        "ddp_bucket_view",
        "fits with gradient_as_bucket_view=True",
        "set `gradient_as_bucket_view=True` (gradients become views of DDP's buckets: {bucket_view_saves} less per "
        "rank, no cost in time).",
    ),
    Decision(
        "sharded",
        "fits with optimizer sharding (ZeRO-1)",
        "set `optimizer_sharding=True` and `gradient_as_bucket_view=True` (each rank keeps 1/{world_size} of the "
        "optimizer state).",
    ),
    Decision(
        "chunks",
        "fits with chunk_size={chunk_size}: the activations of a whole batch do not",
        "set `chunk_size={chunk_size}` ({chunk_layout}; the global batch and the schedule stay as "
        "they are), or `chunk_size='auto'`; activation checkpointing is the other way (about one more forward "
        "per step, and the whole batch at once).",
    ),
    Decision(
        "sharded_checkpointing",
        "fits with optimizer sharding and activation checkpointing",
        "set `optimizer_sharding=True`, `gradient_as_bucket_view=True` and enable activation checkpointing "
        "(`model.gradient_checkpointing_enable()` for Hugging Face models; about one more forward per step).",
    ),
    Decision(
        "fsdp",
        "the model itself does not fit: its parameters and gradients must be sharded too",
        "use Lightning's `FSDPStrategy` (ZeRO-3: parameters, gradients and optimizer state sharded, "
        "{fsdp_per_rank} per rank before activations) or `DeepSpeedStrategy(stage=3)`; if even that does not fit, "
        "add CPU offload, or pipeline / tensor parallelism.",
    ),
)


def decide(fits: dict[str, bool]) -> Decision:
    """The first decision whose layout fits; the last (shard everything) when none does.

    >>> decide({"ddp": False, "ddp_bucket_view": False, "sharded": True}).layout
    'sharded'
    >>> decide({"ddp": False}).layout
    'fsdp'
    """
    return next((decision for decision in DECISIONS if fits.get(decision.layout)), DECISIONS[-1])
