"""Reduce-scatter and all-gather as pairwise exchanges (``all_to_all_single``) in pieces, for gloo.

gloo implements ``reduce_scatter_tensor`` as a full all-reduce and keeps a slice (measured on two nodes joined by a
1 Gbit/s link: 32 MiB sent per rank to reduce-scatter 32 MiB on 2 ranks, where a ring sends 16), and its all-gather
runs at 1.7x the link's time. Each rank sending every other rank the part of the buffer that rank owns moves
(N-1)/N of it per rank, as a ring does; in pieces of about ``PIECE_BYTES`` per peer, posted together, the transfers
keep the link busy (measured, 16 MiB sent per rank: one ``all_to_all_single`` 282 ms, 16 pieces 156 ms, a ring of
``isend``/``irecv`` in 1 MiB pieces 168 ms, an all-reduce of 16 MiB 148 ms). NCCL's own collectives are used there.

Every rank posts the same pieces in the same order, from one thread per collective stream, so they match.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: Bytes per piece and peer: small enough that the pieces' transfers overlap, large enough that per-call costs vanish.
PIECE_BYTES = 1 << 20


def _spans(length: int, element_size: int) -> list[tuple[int, int]]:
    pieces = max(1, length * element_size // PIECE_BYTES)
    step = -(-length // pieces)
    return [(start, min(start + step, length)) for start in range(0, length, step)]


def exchange_reduce_scatter(padded: Tensor, group: Any = None) -> Tensor:
    """The sum over ranks of this rank's chunk of ``padded`` (a multiple of the world size long)."""
    world = dist.get_world_size(group)
    rows = padded.view(world, -1)
    chunk = torch.empty_like(rows[0])
    transfers = []
    for start, end in _spans(rows.shape[1], padded.element_size()):
        outgoing = rows[:, start:end].contiguous()
        incoming = torch.empty_like(outgoing)
        transfers.append((start, end, incoming, dist.all_to_all_single(incoming, outgoing, group=group, async_op=True)))
    for start, end, incoming, work in transfers:
        assert work is not None
        work.wait()
        torch.sum(incoming, dim=0, out=chunk[start:end])
    return chunk


def post_all_gather(full: Tensor, shard: Tensor, group: Any = None) -> list[tuple[Tensor, Tensor, Any]]:
    """Start gathering every rank's ``shard`` into its chunk of ``full``, in pieces posted together; hand the result
    to ``finish_all_gather``."""
    world = dist.get_world_size(group)
    rows = full.view(world, -1)
    transfers = []
    for start, end in _spans(shard.numel(), shard.element_size()):
        outgoing = shard[start:end].expand(world, end - start).contiguous()
        incoming = torch.empty_like(outgoing)
        work = dist.all_to_all_single(incoming, outgoing, group=group, async_op=True)
        transfers.append((rows[:, start:end], incoming, work))
    return transfers


def finish_all_gather(transfers: list[tuple[Tensor, Tensor, Any]]) -> None:
    """Wait for the pieces ``post_all_gather`` started and copy them into place."""
    for target, incoming, work in transfers:
        work.wait()
        target.copy_(incoming)
