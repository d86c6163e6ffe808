"""Which rank keeps which parameter's optimizer state: torch's ``ZeroRedundancyOptimizer`` partition, as arithmetic.

torch assigns whole parameters, never slices: within each parameter group, largest first, each parameter goes to the
rank with the fewest elements so far (counted across groups). A rank's share is therefore uneven on small models
and at most one parameter larger than 1/N of the total.
"""

from __future__ import annotations

from collections.abc import Sequence


def assign_ranks(group_numels: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """The rank of every parameter, group by group, in the order given (``ZeroRedundancyOptimizer._partition_parameters``).

    >>> assign_ranks([[30, 50, 40]], world_size=2)
    [[1, 0, 1]]
    >>> assign_ranks([[5], [5, 1]], world_size=2)
    [[0], [1, 0]]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    sizes = [0] * world_size
    ranks: list[list[int]] = []
    for numels in group_numels:
        group_ranks = [0] * len(numels)
        # sorted() is stable, as torch's sort: equal sizes keep their order
        for index in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
            rank = sizes.index(min(sizes))
            group_ranks[index] = rank
            sizes[rank] += numels[index]
        ranks.append(group_ranks)
    return ranks


def bytes_per_rank(
    group_numels: Sequence[Sequence[int]], group_bytes: Sequence[Sequence[int]], world_size: int
) -> list[int]:
    """Sum ``group_bytes`` (any per-parameter figure, e.g. its optimizer state) over each rank's share.

    >>> bytes_per_rank([[30, 50, 40]], [[240, 400, 320]], world_size=2)
    [400, 560]
    """
    totals = [0] * world_size
    for ranks, sizes in zip(assign_ranks(group_numels, world_size), group_bytes):
        for rank, size in zip(ranks, sizes):
            totals[rank] += size
    return totals
