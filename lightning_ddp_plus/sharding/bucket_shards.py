"""Which rank owns which elements of DDP's gradient buckets, as arithmetic (ZeRO-1 at DDP's bytes).

Each bucket is padded to a multiple of the world size and split into equal, contiguous chunks: rank ``r`` owns chunk
``r`` of every bucket. A reduce-scatter of the bucket gives each rank the sum of its chunk; the same chunk is what
the rank steps and what an all-gather of the bucket collects from it. A parameter may therefore be split between
ranks: a ``Piece`` is the part of one parameter inside one rank's chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class BucketLayout:
    """The parameters of each bucket, in the bucket's order, as (index in the optimizer's flat parameter list,
    number of elements); what DDP's reducer holds after its latest (re)build."""

    buckets: tuple[tuple[tuple[int, int], ...], ...]

    def size(self, bucket: int) -> int:
        """Elements of ``bucket`` (unpadded)."""
        return sum(numel for _, numel in self.buckets[bucket])


def shard_size(size: int, world_size: int) -> int:
    """Elements of each rank's chunk of a bucket of ``size`` elements, padded to a multiple of ``world_size``.

    >>> shard_size(10, 4), shard_size(8, 4), shard_size(0, 2)
    (3, 2, 0)
    """
    return -(-size // world_size)


@dataclass(frozen=True)
class Piece:
    """The elements ``start .. start + length`` of parameter ``parameter`` (flattened), which lie in ``bucket`` at
    ``offset .. offset + length`` of its padded flat buffer, inside this rank's chunk."""

    parameter: int
    start: int
    length: int
    bucket: int
    offset: int


def pieces_of(layout: BucketLayout, rank: int, world_size: int) -> list[Piece]:
    """The pieces rank ``rank`` owns, bucket by bucket, in bucket order.

    >>> layout = BucketLayout(((( 0, 6), (1, 3)),))
    >>> [(p.parameter, p.start, p.length) for p in pieces_of(layout, 0, 2)]
    [(0, 0, 5)]
    >>> [(p.parameter, p.start, p.length) for p in pieces_of(layout, 1, 2)]
    [(0, 5, 1), (1, 0, 3)]
    """
    found = []
    for index, bucket in enumerate(layout.buckets):
        chunk = shard_size(layout.size(index), world_size)
        begin, end = rank * chunk, (rank + 1) * chunk
        offset = 0
        for parameter, numel in bucket:
            low, high = max(begin, offset), min(end, offset + numel)
            if high > low:
                found.append(Piece(parameter, low - offset, high - low, index, low))
            offset += numel
    return found


def bytes_per_rank(layout: BucketLayout, element_bytes: Sequence[int], world_size: int) -> list[int]:
    """Per rank, the sum over its pieces of ``length x element_bytes[parameter]`` (e.g. an optimizer's per-element
    state): how evenly the chunks split the figure.

    >>> bytes_per_rank(BucketLayout((((0, 6), (1, 3)),)), [8, 8], 2)
    [40, 32]
    """
    return [
        sum(piece.length * element_bytes[piece.parameter] for piece in pieces_of(layout, rank, world_size))
        for rank in range(world_size)
    ]


def flat_in_memory_order(tensor: Tensor) -> Tensor:
    """A 1-D view of ``tensor``'s elements in the order they lie in memory: the order of DDP's gradient buckets,
    which lay a parameter out as its strides do (a channels_last weight is dense but not contiguous).

    >>> import torch
    >>> weight = torch.arange(24.0).view(1, 2, 3, 4).to(memory_format=torch.channels_last)
    >>> flat_in_memory_order(weight)[:4].tolist()
    [0.0, 12.0, 1.0, 13.0]
    """
    if tensor.is_contiguous():
        return tensor.view(-1)
    if not _dense(tensor):
        raise ValueError(
            f"optimizer_sharding=True steps pieces of each parameter as DDP's buckets lay them out, and a tensor of "
            f"shape {tuple(tensor.shape)} and strides {tensor.stride()} has gaps or overlaps in memory. Fix: make "
            "the parameter dense (`param.data = param.data.contiguous()`), or set `optimizer_sharding='all_reduce'`."
        )
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


def _dense(tensor: Tensor) -> bool:
    """Whether ``tensor``'s elements fill a block of memory exactly, each once (in some order of its dimensions)."""
    expected = 1
    for size, stride in sorted(
        (pair for pair in zip(tensor.shape, tensor.stride()) if pair[0] != 1), key=lambda p: p[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True
