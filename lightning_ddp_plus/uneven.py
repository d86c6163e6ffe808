"""Uneven inputs: ranks that read their own shard hold different numbers of batches.

Lightning's ``DistributedSampler`` pads every rank to the same length, but an ``IterableDataset`` split by rank,
``datasets``' ``split_dataset_by_node``, webdataset shards or ``use_distributed_sampler=False`` often leave one
rank with fewer batches. The rank that runs out leaves the epoch, and the others wait in a gradient all-reduce it
never joins: gloo fails with "Connection closed by peer", NCCL hangs until the collective timeout.

Every rank knows one batch ahead whether the batch it is about to train on is its epoch's last (Lightning's loop
prefetches one). The ranks exchange that one flag per batch, before the batch's backward, and decide together
(``uneven_decision``, a pure function):

- ``"error"`` (default): every rank raises ``UnevenInputsError`` at the first batch that is some rank's last and not
  another's, naming each rank's batch counts and the fixes; replicas are identical (the batch is not trained);
- ``"stop"``: every rank makes that batch its epoch's last, so all ranks end the epoch together; the batches the
  longer ranks did not train on are counted and reported once per epoch.

With ``gradient_accumulation_steps=1`` and automatic optimization the flag travels in the per-step guard's
all-reduce (``sync_guard``), so it costs no collective of its own; otherwise one all-reduce of two integers on the
guard's gloo group per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

UnevenInputs = Literal["error", "stop"]
UNEVEN_MODES: tuple[str, ...] = get_args(UnevenInputs)


class UnevenInputsError(RuntimeError):
    """Ranks hold different numbers of batches in an epoch (``uneven_inputs="error"``)."""


@dataclass(frozen=True)
class RankBatches:
    """One rank at one batch: how many batches of the epoch it has trained on, including this one, whether this one
    is its last, and the epoch's length when the loader knows it (``None`` otherwise)."""

    number: int
    last: bool
    length: int | None = None


def uneven_flags(last: bool) -> list[int]:
    """What a rank sends: maximums over ranks of these two say whether some rank ends here and some does not."""
    return [int(last), int(not last)]


def shards_differ(maximums: list[int]) -> bool:
    """``uneven_flags``' maximums over the ranks: True when some rank ends here and another goes on.

    >>> shards_differ([1, 1]), shards_differ([1, 0]), shards_differ([0, 1])
    (True, False, False)
    """
    return bool(maximums[0]) and bool(maximums[1])


def uneven_message(ranks: list[RankBatches], epoch: int) -> str:
    """Every rank's counts, in words.

    >>> uneven_message([RankBatches(4, False, 6), RankBatches(4, True, 4)], epoch=0)
    'epoch 0: rank 0 has 6 batches (at batch 4 now), rank 1 has 4 (batch 4 is its last)'
    """
    parts = []
    for rank, state in enumerate(ranks):
        if state.last:
            parts.append(f"rank {rank} has {state.number} (batch {state.number} is its last)")
        elif state.length is not None:
            parts.append(f"rank {rank} has {state.length} batches (at batch {state.number} now)")
        else:
            parts.append(f"rank {rank} has more than {state.number} batches (its loader has no length)")
    return f"epoch {epoch}: " + ", ".join(parts)


def surplus(state: RankBatches) -> int | None:
    """Batches a rank does not train on when the epoch stops at ``state.number`` (``None``: unknown length).

    >>> surplus(RankBatches(4, False, 6)), surplus(RankBatches(4, True, 4)), surplus(RankBatches(4, False))
    (2, 0, None)
    """
    if state.last:
        return 0
    return state.length - state.number if state.length is not None else None


def error_text(ranks: list[RankBatches], epoch: int) -> str:
    return (
        f"Uneven inputs: the ranks hold different numbers of training batches ({uneven_message(ranks, epoch)}). "
        "Stock DDP would leave the longer ranks waiting in a gradient all-reduce that the shorter one never joins "
        "(gloo: 'Connection closed by peer'; NCCL: a hang until the collective timeout); no rank trained on this batch, "
        "so replicas are identical. Fix: give every rank the same number of batches (Lightning's DistributedSampler "
        "does; for an IterableDataset split by rank, cap every shard at the shortest one's length), or set "
        "`DDPPlusStrategy(uneven_inputs='stop')` to end each epoch on every rank when the first rank runs out."
    )


def stop_text(ranks: list[RankBatches], epoch: int, counted: list[int | None]) -> str:
    dropped = ", ".join(
        f"rank {rank}: {'an unknown number of' if n is None else n} batch{'es' if n != 1 else ''}"
        for rank, n in enumerate(counted)
    )
    return (
        f"DDPPlusStrategy(uneven_inputs='stop'): {uneven_message(ranks, epoch)}; every rank ended the epoch after "
        f"batch {ranks[0].number}. Not trained on: {dropped}."
    )


class UnevenInputsCheck:
    """Owns ``uneven_inputs``: the flag of the batch about to train, the decision, and the epoch's forced end.

    Args:
        mode: ``"error"`` or ``"stop"``.
        info: how the once-per-epoch report reaches the user (rank 0 only in a Trainer).
    """

    def __init__(self, mode: UnevenInputs, info: Any) -> None:
        self.mode = mode
        self._info = info
        self._held: RankBatches | None = None
        #: ``(epoch, batch number)`` after which ``"stop"`` ended an epoch on every rank.
        self.forced_end: tuple[int, int] | None = None
        #: Per stopped epoch: the batches each rank did not train on (``None``: unknown).
        self.not_trained: dict[int, list[int | None]] = {}

    def reset(self) -> None:
        self._held, self.forced_end, self.not_trained = None, None, {}

    def hold(self, state: RankBatches) -> None:
        """Keep this batch's flag for the guard's all-reduce after its backward."""
        self._held = state

    def take_held(self) -> RankBatches | None:
        held, self._held = self._held, None
        return held

    def forced_length(self, epoch: int) -> int | None:
        """The number of batches ``"stop"`` gave this epoch, once decided."""
        return self.forced_end[1] if self.forced_end is not None and self.forced_end[0] == epoch else None

    def decide(self, state: RankBatches, maximums: list[int], gather: Any, epoch: int) -> bool:
        """After the flags' all-reduce: raise (``"error"``), or return True when this batch must end the epoch on
        this rank (``"stop"``). ``gather`` exchanges a few integers per rank (only when the shards differ)."""
        if not shards_differ(maximums):
            return False
        rows = gather([state.number, int(state.last), -1 if state.length is None else state.length])
        ranks = [RankBatches(row[0], bool(row[1]), None if row[2] < 0 else row[2]) for row in rows]
        if self.mode == "error":
            raise UnevenInputsError(error_text(ranks, epoch))
        counted = [surplus(rank) for rank in ranks]
        self.not_trained[epoch] = counted
        self.forced_end = (epoch, state.number)
        self._info(stop_text(ranks, epoch, counted))
        return not state.last
