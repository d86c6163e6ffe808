"""Resuming on another number of ranks: the same global batch and the same place in the data.

A checkpoint records the data-parallel layout it was taken with (``DataLayout``). When a fit resumes on a different
world size, ``plan_world_size_change`` decides, as a pure function of the saved layout, the new world size and
``on_world_size_change``:

- ``"keep_global_batch"`` (default): accumulation is recomputed so that an optimizer step still trains the same number
  of rows (2 -> 1 ranks doubles it); sizes that cannot reach the same global batch are refused, naming the world sizes
  that can;
- ``"keep_per_rank_batch"``: accumulation stays and the global batch changes, which is said with both values;
- ``"error"``: the resume is refused, naming both world sizes.

Either way the epoch resumes at the same *sample*. A ``DistributedSampler`` of any world size deals one permutation
of the data set (fixed by its seed and the epoch) to the ranks in turn, so after ``b`` batches of ``B`` rows on ``W``
ranks the samples consumed are exactly the permutation's first ``b * B * W``; ``ResumeAtSample`` deals the rest of
that permutation to the new ranks in the same way. With the global batch kept, every later optimizer step trains the
same set of samples as the uninterrupted run, so for losses that are means over rows the parameters are the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from torch.utils.data import DistributedSampler, Sampler

from lightning_ddp_plus.config.messages import ArgumentValueError

#: ``DDPPlusStrategy(on_world_size_change=...)``.
WorldSizeChange = Literal["keep_global_batch", "keep_per_rank_batch", "error"]

#: Where a Trainer checkpoint keeps the layout.
LAYOUT_KEY = "ddp_plus_data_layout"


@dataclass(frozen=True)
class DataLayout:
    """The data-parallel layout a checkpoint was taken with (plain values: it loads weights-only)."""

    world_size: int
    rows_per_rank: int  # the training loader's batch size
    accumulation: int  # micro-batches per optimizer step (Lightning's or the strategy's)
    epoch: int
    batches_consumed: int  # of the checkpoint's epoch, per rank
    dataset_length: int | None  # None: the loader has no DistributedSampler
    shuffle: bool
    seed: int
    chunk_size: int | None = None

    @property
    def global_batch(self) -> int:
        return self.rows_per_rank * self.world_size * self.accumulation

    @property
    def samples_consumed(self) -> int:
        return self.batches_consumed * self.rows_per_rank * self.world_size

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DataLayout:
        values = {"chunk_size": values.get("micro_batch_size"), **values}  # its name before 0.2.0
        return cls(**{name: values[name] for name in cls.__dataclass_fields__ if name in values})


@dataclass(frozen=True)
class ResumePlan:
    """What a resume on ``world_size`` ranks does."""

    world_size: int
    accumulation: int
    #: Batches of the epoch per rank already consumed, counted in the new layout (the loop's counters).
    batches_consumed: int
    #: Samples of the epoch consumed: where the rest of the epoch starts in its permutation.
    samples_consumed: int
    message: str


def reachable_world_sizes(layout: DataLayout, limit: int = 64) -> list[int]:
    """World sizes up to ``limit`` that keep the global batch with the same rows per rank.

    >>> reachable_world_sizes(DataLayout(2, 8, 1, 0, 4, 256, True, 0))
    [1, 2]
    """
    per_step = layout.global_batch // layout.rows_per_rank
    return [size for size in range(1, limit + 1) if per_step % size == 0]


def plan_world_size_change(layout: DataLayout, world_size: int, mode: WorldSizeChange) -> ResumePlan | None:
    """``None`` when the world size did not change; else the plan, or ``ArgumentValueError`` naming the sizes.

    >>> plan_world_size_change(DataLayout(2, 8, 1, 0, 4, 256, True, 0), 1, "keep_global_batch").message
    'world size changed 2 -> 1: keeping the global batch of 16 (accumulation 1 -> 2), resuming epoch 0 at sample 64 of 256'
    """
    old = layout.world_size
    if world_size == old:
        return None
    where = f"epoch {layout.epoch} at sample {layout.samples_consumed}" + (
        f" of {layout.dataset_length}" if layout.dataset_length is not None else ""
    )
    if layout.batches_consumed == 0:
        where = f"at the start of epoch {layout.epoch}"
    if mode == "error":
        raise ArgumentValueError(
            f"`on_world_size_change='error'` is not valid for this resume: the checkpoint was taken on {old} ranks and "
            f"this run has {world_size}. Fix: run on {old} ranks, or set `on_world_size_change='keep_global_batch'` "
            "(the same global batch, accumulation recomputed) or 'keep_per_rank_batch'."
        )
    if mode == "keep_global_batch":
        per_rank_steps, remainder = divmod(layout.global_batch, layout.rows_per_rank * world_size)
        if remainder or per_rank_steps < 1:
            sizes = ", ".join(map(str, reachable_world_sizes(layout)))
            raise ArgumentValueError(
                f"`on_world_size_change='keep_global_batch'` is not valid for this resume: the global batch of "
                f"{layout.global_batch} ({layout.rows_per_rank} rows per rank x {old} ranks x accumulation "
                f"{layout.accumulation}) cannot be reached on {world_size} ranks with {layout.rows_per_rank} rows per "
                f"rank. Fix: run on one of {sizes} ranks, change the loader's batch size so that "
                f"{layout.global_batch} is a multiple of it times {world_size}, or set "
                "`on_world_size_change='keep_per_rank_batch'`."
            )
        accumulation = per_rank_steps
        message = (
            f"world size changed {old} -> {world_size}: keeping the global batch of {layout.global_batch} "
            f"(accumulation {layout.accumulation} -> {accumulation}), resuming {where}"
        )
    else:
        accumulation = layout.accumulation
        new_global = layout.rows_per_rank * world_size * accumulation
        message = (
            f"world size changed {old} -> {world_size}: keeping {layout.rows_per_rank} rows per rank and accumulation "
            f"{accumulation}, so the global batch changes from {layout.global_batch} to {new_global}: each optimizer "
            f"step averages over {new_global / layout.global_batch:g}x the rows, so the same learning rate moves the "
            f"parameters differently (scale it by the same factor to keep the linear scaling rule); resuming {where}"
        )
    batches, _ = divmod(layout.samples_consumed, layout.rows_per_rank * world_size)
    return ResumePlan(world_size, accumulation, batches, layout.samples_consumed, message)


class ResumeAtSample(Sampler[int]):
    """A ``DistributedSampler`` whose next pass deals the rest of its epoch's permutation from ``start`` on, in turn
    to ``num_replicas`` ranks (padded by wrapping around, as the sampler pads); later passes are the sampler's own.

    >>> sampler = DistributedSampler(range(8), num_replicas=1, rank=0, shuffle=False)
    >>> list(ResumeAtSample(sampler, start=4, epoch=0)), list(ResumeAtSample(sampler, start=6, epoch=0))
    ([4, 5, 6, 7], [6, 7])
    """

    #: every rank gets as many samples as the others (``uneven_inputs`` then compares no counts)
    deals_every_rank_the_same = True

    def __init__(self, sampler: DistributedSampler[Any], start: int, epoch: int) -> None:
        self.sampler, self.start, self.epoch = sampler, start, epoch
        self._resumed = False

    def __iter__(self) -> Iterator[int]:
        if self._resumed:
            return iter(self.sampler)
        self._resumed = True
        whole: DistributedSampler[Any] = DistributedSampler(
            self.sampler.dataset,
            num_replicas=1,
            rank=0,
            shuffle=self.sampler.shuffle,
            seed=self.sampler.seed,
        )
        whole.set_epoch(self.epoch)
        rest = list(whole)[self.start :]
        replicas, rank = self.sampler.num_replicas, self.sampler.rank
        padding = -len(rest) % replicas
        rest += list(itertools.islice(itertools.cycle(rest), padding)) if rest else []
        return iter(rest[rank::replicas])

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
