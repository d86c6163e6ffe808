"""Uneven inputs: ranks that read their own shard hold different numbers of batches.

Lightning's ``DistributedSampler`` pads every rank to the same length, but an ``IterableDataset`` split by rank,
``datasets``' ``split_dataset_by_node``, webdataset shards or ``use_distributed_sampler=False`` often leave one
rank with fewer batches. The rank that runs out leaves the epoch, and the others wait in a gradient all-reduce it
never joins: gloo fails with "Connection closed by peer", NCCL hangs until the collective timeout.

Every rank knows one batch ahead whether the batch it is about to train on is its epoch's last (Lightning's loop
prefetches one). The ranks exchange that one flag per batch, before the batch's optimizer step, and decide
together (``shards_differ`` and ``surplus`` are the pure decisions):

- ``"error"`` (default): every rank raises ``UnevenInputsError`` at the first batch that is some rank's last and not
  another's, naming each rank's batch counts and the fixes; replicas are identical (the batch is not trained);
- ``"stop"``: every rank makes that batch its epoch's last, so all ranks end the epoch together; the batches the
  longer ranks did not train on are counted and reported once per epoch;
- ``"join"``: the longer ranks train on. A rank that ran out repeats its last batch with its loss multiplied by 0
  (``PaddedBatches``), so it runs every collective the others run (the gradient all-reduce, the guard,
  ``sync_dist=True`` logging, the replica check) and the same optimizer step, scheduler step and ``global_step``,
  and contributes a zero gradient; the averaged gradient is then rescaled from "sum over all ranks / world size" to
  the mean over the batches really trained in the window. Replicas and optimizer state stay identical. This is what
  torch's ``Join`` does for DDP's own collectives, without being blind to the others.

With ``gradient_accumulation_steps=1`` and automatic optimization the ``"error"``/``"stop"`` flag travels in the
per-step guard's agreement (``sync_guard``: a store look-up on gloo), so it costs no collective of its own;
otherwise, and always with ``"join"``, one all-reduce of two integers on the guard's gloo group per batch. Nothing is
exchanged when every training loader has a ``DistributedSampler`` (``even_by_construction``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from lightning_ddp_plus.pipeline.agreement import AgreedFlags
from lightning_ddp_plus.pipeline.component import AgreedStep, FitStart, StepComponent
from lightning_ddp_plus.sync.accumulation import AccumulationWindow, scale_gradients

UnevenInputs = Literal["error", "stop", "join"]
T = TypeVar("T")


class UnevenInputsError(RuntimeError):
    """Ranks hold different numbers of batches in an epoch (``uneven_inputs="error"``)."""


@dataclass(frozen=True)
class RankBatches:
    """One rank at one batch: how many batches of the epoch it has trained on, including this one, whether this one
    is its last, and the epoch's length when the loader knows it (``None`` otherwise)."""

    number: int
    last: bool
    length: int | None = None


#: The agreement's flags of ``uneven_inputs``: their maximums over the ranks say whether some rank ends its epoch at
#: this batch and whether some rank goes on.
SOME_RANK_ENDS, SOME_RANK_GOES_ON = "some rank's epoch ends here", "some rank's epoch goes on"


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


class PaddingState:
    """What ``PaddedBatches`` yielded (True: a padding batch) and how far the training loop has read, shared by the
    wrapper and the strategy: Lightning's loop fetches one batch ahead, so the flag of the batch after the one
    training is known too."""

    def __init__(self) -> None:
        self.flags: list[bool] = []
        self.read = 0

    def advance(self) -> tuple[bool, bool]:
        """At the start of a training batch: (this batch is padding, the next one is)."""
        now = self.flags[self.read] if self.read < len(self.flags) else True
        following = self.flags[self.read + 1] if self.read + 1 < len(self.flags) else now
        self.read += 1
        return now, following


class PaddedBatches:
    """The training loader, then its last batch again and again, each marked as padding in ``state``: the
    ``"join"`` epoch of a rank whose shard ran out goes on until every rank's has (the strategy ends it).

    It has no length (Lightning then ends the epoch only when told to), and it forwards attribute reads to the loader,
    so that Lightning still calls ``sampler.set_epoch`` every epoch.
    """

    def __init__(self, loader: Any, state: PaddingState) -> None:
        self.loader, self.state = loader, state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Any:
        self.state.flags, self.state.read = [], 0
        last = None
        for batch in self.loader:
            self.state.flags.append(False)
            last = batch
            yield batch
        if last is None:
            raise UnevenInputsError(
                "uneven_inputs='join': this rank's training loader is empty, so it has no batch to repeat while the "
                "others train. Fix: give every rank at least one batch."
            )
        while True:
            self.state.flags.append(True)
            yield last


@dataclass(frozen=True)
class EvenShards:
    """Whether every training loader of an epoch draws from a ``DistributedSampler`` (then no count is compared)."""

    epoch: int
    even: bool


@dataclass(frozen=True)
class ForcedEnd:
    """Where ``"stop"`` (or ``"join"``, once every rank ran out) ended an epoch on every rank."""

    epoch: int
    batches: int


@dataclass(frozen=True)
class JoinedCounts:
    """One rank's batches in a ``"join"`` epoch: trained on, and repeated with weight 0 after its shard ran out."""

    trained: int
    padded: int


@dataclass
class _JoinWindow:
    """The current accumulation window under ``"join"``: batch slots over all ranks, and batches really trained."""

    slots: int = 0
    real: int = 0


class UnevenInputsCheck(StepComponent):
    """Owns ``uneven_inputs``: the flag of the batch about to train, the decision, and the epoch's forced end.

    Args:
        mode: ``"error"``, ``"stop"`` or ``"join"``.
        info: how the once-per-epoch report reaches the user (rank 0 only in a Trainer).
        window: the accumulation window (``"join"`` rescales nothing when the window's items divide the gradient).
    """

    agreement_flags = (SOME_RANK_ENDS, SOME_RANK_GOES_ON)

    def __init__(self, mode: UnevenInputs, info: Any, window: AccumulationWindow | None = None) -> None:
        self.mode, self.window = mode, window
        self._info = info
        self._parameters: Any = ()
        self._deferred: RankBatches | None = None
        self._even_shards = EvenShards(epoch=-1, even=False)
        #: Where ``"stop"`` or ``"join"`` ended the current epoch on every rank.
        self.forced_end: ForcedEnd | None = None
        #: Per stopped epoch: the batches each rank did not train on (``None``: unknown).
        self.not_trained: dict[int, list[int | None]] = {}
        #: ``"join"``: the wrapper's flags, whether the batch training now is padding, and per joined epoch every
        #: rank's counts.
        self.padding_state = PaddingState()
        self.padding = False
        self.joined: dict[int, list[JoinedCounts]] = {}
        self._window = _JoinWindow()
        self._epoch, self._this_rank = -1, JoinedCounts(0, 0)

    def fit_starts(self, fit: FitStart) -> None:
        self.reset()
        self._parameters = fit.ddp.module.parameters

    def agreement_needed(self) -> bool:
        """Only a flag held for the guard's check travels (without the guard, the flag has its own all-reduce before
        the batch)."""
        return self._deferred is not None

    def agreement_values(self) -> dict[str, int]:
        """The flag held for the agreement after this batch's synced backward (zeros: none held)."""
        if self._deferred is None:
            return {}
        return dict(zip(self.agreement_flags, uneven_flags(self._deferred.last)))

    @staticmethod
    def maximums(flags: AgreedFlags) -> list[int]:
        """The agreed flags as ``uneven_flags``' maximums."""
        return [flags[SOME_RANK_ENDS], flags[SOME_RANK_GOES_ON]]

    def agreed(self, agreed: AgreedStep) -> None:
        """``"join"``: the window's gradient rescaled to the mean over the micro-batches really trained."""
        if self.mode == "join" and not agreed.out_of_memory:
            per_item = self.window is not None and self.window.per_item
            scale_gradients(self._parameters(), self.take_rescale(per_item))

    def even_by_construction(self, epoch: int, loaders: Callable[[], Any]) -> bool:
        """Whether the epoch's training loaders (``loaders()``) all draw from a ``DistributedSampler`` (then no count
        is compared); looked at once per epoch."""
        if self._even_shards.epoch != epoch:
            self._even_shards = EvenShards(epoch, even_by_construction(loaders()))
        return self._even_shards.even

    def reset(self) -> None:
        self._even_shards = EvenShards(epoch=-1, even=False)
        self._deferred, self.forced_end, self.not_trained = None, None, {}
        self.padding, self.joined, self._window = False, {}, _JoinWindow()
        self._epoch, self._this_rank = -1, JoinedCounts(0, 0)

    def join_batch_starts(self, total: Any, gather: Any, epoch: int, world_size: int) -> bool:
        """``"join"``, before a training batch: one all-reduce (sum) of (this batch is real, the next one is).
        Returns True when no rank has a real batch after this one: the epoch ends here on every rank."""
        now_padding, next_padding = self.padding_state.advance()
        real_now, real_next = total([int(not now_padding), int(not next_padding)])
        self.padding = now_padding
        self._window.slots += world_size
        self._window.real += real_now
        if self._epoch != epoch:
            self._epoch, self._this_rank = epoch, JoinedCounts(0, 0)
        counts = self._this_rank
        self._this_rank = JoinedCounts(counts.trained + int(not now_padding), counts.padded + int(now_padding))
        if real_next:
            return False
        rows = [JoinedCounts(*row) for row in gather([self._this_rank.trained, self._this_rank.padded])]
        self.joined[epoch] = rows
        self.forced_end = ForcedEnd(epoch, self._this_rank.trained + self._this_rank.padded)
        if any(row.padded for row in rows):
            counts_text = ", ".join(
                f"rank {rank}: {row.trained} trained, {row.padded} repeated with weight 0"
                for rank, row in enumerate(rows)
            )
            self._info(
                f"DDPPlusStrategy(uneven_inputs='join'): epoch {epoch} ended when every rank ran out ({counts_text})."
            )
        return True

    def take_rescale(self, per_item: bool = False) -> float:
        """At a synced backward with ``"join"``: the factor that turns the all-reduced gradient (sum over every
        rank's micro-batches of the window / (world size x window)) into the mean over those really trained
        (``per_item``: 1, the window's item count already leaves the padding out)."""
        window, self._window = self._window, _JoinWindow()
        if per_item or not window.real or window.real == window.slots:
            return 1.0
        return window.slots / window.real

    def defer_to_step_check(self, state: RankBatches) -> None:
        """Keep this batch's flag for the per-step guard's agreement after its backward (no collective of its own)."""
        self._deferred = state

    def take_deferred(self) -> RankBatches | None:
        deferred, self._deferred = self._deferred, None
        return deferred

    def forced_length(self, epoch: int) -> int | None:
        """The number of batches ``"stop"`` or ``"join"`` gave this epoch, once decided."""
        return self.forced_end.batches if self.forced_end is not None and self.forced_end.epoch == epoch else None

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
        self.forced_end = ForcedEnd(epoch, state.number)
        self._info(stop_text(ranks, epoch, counted))
        return not state.last


def even_by_construction(loaders: Any) -> bool:
    """Every loader draws from a ``DistributedSampler`` (as Lightning's ``use_distributed_sampler=True`` injects): it
    pads or drops so that every rank gets the same number of samples, so the ranks need not compare counts.

    >>> from torch.utils.data import DataLoader, DistributedSampler
    >>> data = list(range(10))
    >>> even_by_construction([DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0))])
    True
    >>> even_by_construction([DataLoader(data)]), even_by_construction([])
    (False, False)
    """
    from torch.utils.data import DistributedSampler

    loaders = list(loaders or [])

    def distributed(loader: Any) -> bool:
        samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
        # a resume's wrapper around one (the rest of an epoch) says so: ``deals_every_rank_the_same``
        return any(
            isinstance(sampler, DistributedSampler) or getattr(sampler, "deals_every_rank_the_same", False) is True
            for sampler in samplers
        )

    return bool(loaders) and all(distributed(loader) for loader in loaders)


def items_marked_last(
    items: Iterable[T], ends_here: Callable[[RankBatches], bool], length: int | None
) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last, read one item ahead as Lightning's loop fetches; before each item
    ``ends_here(this rank at it)`` may end the iteration there (the ranks' uneven-inputs decision)."""
    iterator = iter(items)
    try:
        item = next(iterator)
    except StopIteration:
        return
    number = 0
    for following in iterator:
        number += 1
        if ends_here(RankBatches(number, last=False, length=length)):
            break
        yield item, False
        item = following
    else:
        number += 1
        ends_here(RankBatches(number, last=True, length=length))
    yield item, True
