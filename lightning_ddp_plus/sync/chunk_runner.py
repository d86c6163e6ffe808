"""``chunk_size``: one training batch run in chunks, and run again with smaller chunks after an out-of-memory
error on any rank (``"auto"``), by one owner, ``ChunkRunner``, which both front ends call.

A batch's flow (module by module):

1. the front end calls ``ChunkRunner.run`` with the batch, its step function (forward, loss) and its guarded
   backward;
2. ``run`` splits the batch (``micro_batches.ChunkSizer.chunks``), saves the buffers a batch changes
   (``BufferSnapshot``, ``"auto"`` only), and runs each chunk's forward and backward; only the last chunk's
   backward all-reduces;
3. that backward ends in the ranks' agreement (``step_agreement``), which says whether some rank ran out of memory;
   a rank that ran out itself asks for the same agreement in place of its backward (``recovery.agree_on_failure``),
   after launching the bucket all-reduces the others wait for;
4. when some rank ran out, every rank restores the buffers, gets a fresh reducer, halves the size
   (``ChunkSizer.shrink``, which raises when a single row did not fit) and runs the batch again.

Every step returns a record (``Attempt``, ``StepAgreed``); no exception carries a result between modules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.pipeline.component import FitStart, StepComponent
from lightning_ddp_plus.private_apis.torch_distributed import tensor_version
from lightning_ddp_plus.sync.chunks import ChunkSizer, OutOfMemory, free_memory, is_out_of_memory
from lightning_ddp_plus.sync.item_averaging import ItemAveraging, check_num_items
from lightning_ddp_plus.sync.step_agreement import StepAgreed

#: ``step(chunk) -> (loss or None, output)``: a chunk's forward; ``None``: nothing to run backward on.
ChunkStep = Callable[[Any], tuple[Tensor | None, Any]]
#: ``backward(weighted loss, synced, last chunk) -> what the ranks agreed`` (``StepAgreed()`` when it did not sync).
ChunkBackward = Callable[[Tensor, bool, bool], StepAgreed]


@dataclass(frozen=True)
class ChunksDone:
    """A batch trained in chunks: its loss (detached, the backwards ran: each chunk's weighted by its rows, or by
    its ``num_items`` when the step gives them: the batch's mean), the last chunk's output of the step function, and
    the batch's items (``None``: no count given)."""

    loss: Tensor | None
    output: Any
    num_items: Any = None


@dataclass(frozen=True)
class Attempt:
    """One attempt at a batch: what it trained, or every rank's out-of-memory error that ended it."""

    done: ChunksDone | None
    out_of_memory: tuple[OutOfMemory, ...] = ()


@dataclass(frozen=True)
class SavedBuffer:
    """One buffer before an attempt: its name, the tensor, a copy of its values and its version counter."""

    name: str
    buffer: Tensor
    copy: Tensor
    version: int


@dataclass(frozen=True)
class _BatchCalls:
    """What ``run`` was given for a batch, for each of its attempts."""

    step: ChunkStep
    backward: ChunkBackward
    synced: bool
    rank: int
    split_hook: Any


class OutOfMemoryRecovery(Protocol):
    """What the runner needs of the rest of the run after an out-of-memory error (the engine provides it)."""

    def agree_on_failure(self, failure: OutOfMemory, synced_backward_started: bool) -> StepAgreed:
        """On the rank that failed, in place of its synced backward: the agreement the other ranks are in."""
        ...

    def reset_reducer(self) -> None:
        """A new reducer for the wrapper (a backward that failed half way leaves the old one expecting hooks)."""
        ...


class BufferSnapshot:
    """The buffers a training batch changes (running statistics), saved before an attempt so that the next attempt
    starts from them. The first batch of a fit saves every buffer and learns which ones a batch changes (replaced,
    changed in place by torch's version counter, or holding other values: BatchNorm's kernel updates its running
    statistics without moving their version counter); later batches save only those."""

    def __init__(self) -> None:
        self.changing: set[str] | None = None

    def take(self, module: Module) -> list[SavedBuffer]:
        return [
            SavedBuffer(name, buffer, buffer.detach().clone(), tensor_version(buffer))
            for name, buffer in module.named_buffers()
            if self.changing is None or name in self.changing
        ]

    def learn(self, module: Module, saved: list[SavedBuffer]) -> None:
        """After a batch that trained: keep the names of the buffers it changed (or replaced)."""
        if self.changing is None:
            now = dict(module.named_buffers())
            self.changing = {
                item.name
                for item in saved
                if now.get(item.name) is not item.buffer
                or tensor_version(item.buffer) != item.version
                or not torch.equal(item.buffer, item.copy)
            }

    @staticmethod
    def restore(module: Module, saved: list[SavedBuffer]) -> list[SavedBuffer]:
        """Put the saved values back; returns the snapshot as it now stands (versions moved by the copy)."""
        now = dict(module.named_buffers())
        restored = []
        with torch.no_grad():
            for item in saved:
                buffer = now.get(item.name, item.buffer)
                buffer.copy_(item.copy)
                restored.append(SavedBuffer(item.name, buffer, item.copy, tensor_version(buffer)))
        return restored


class ChunkRunner(StepComponent):
    """Owns a batch's chunks, its attempts, the buffer snapshot, the agreement after an out-of-memory error and the
    retry (see the module's docstring).

    Args:
        sizer: ``chunk_size``: the size in effect and how a batch is split.
        recovery: the agreement and the reducer after an out-of-memory error.
        items: the window's item counts (a chunk's ``num_items`` goes there; a batch run again counts once).
        must_sync: whether the next backward must all-reduce whatever chunk it is (a static graph's first backward,
            rule R3).
    """

    def __init__(
        self, sizer: ChunkSizer, recovery: OutOfMemoryRecovery, items: ItemAveraging, must_sync: Callable[[], bool]
    ) -> None:
        self.sizer, self.recovery, self.items, self.must_sync = sizer, recovery, items, must_sync
        self.buffers = BufferSnapshot()

    def fit_starts(self, fit: FitStart) -> None:
        """A new fit: the buffers a batch changes are learnt again."""
        self.buffers = BufferSnapshot()

    def run(
        self,
        ddp: DistributedDataParallel,
        batch: Any,
        *,
        step: ChunkStep,
        backward: ChunkBackward,
        synced: bool,
        rank: int,
        split_hook: Any = None,
    ) -> ChunksDone:
        """Train ``batch`` in chunks of the size in effect: ``step(chunk)`` runs a chunk's forward, ``backward(loss,
        synced)`` its backward; only the last chunk's is synced (when ``synced``). With ``"auto"``, an out-of-memory
        error on any rank runs the batch again on every rank with half the rows per chunk, until it fits."""
        saved = self.buffers.take(ddp.module) if self.sizer.auto else []
        broadcasts_buffers = ddp.require_forward_param_sync
        counts = self.items.mark()
        while True:
            started = time.perf_counter()
            attempt = self._attempt(ddp, batch, _BatchCalls(step, backward, synced, rank, split_hook))
            if attempt.done is not None:
                self.buffers.learn(ddp.module, saved)
                return attempt.done
            # the batch runs again from what it started with: running statistics, and DDP's buffer broadcast
            saved = BufferSnapshot.restore(ddp.module, saved)
            self.items.rewind(counts)
            ddp.require_forward_param_sync = broadcasts_buffers
            free_memory(next(ddp.module.parameters()).device)
            self.recovery.reset_reducer()
            self.sizer.shrink(attempt.out_of_memory, time.perf_counter() - started)

    def _attempt(self, ddp: DistributedDataParallel, batch: Any, calls: _BatchCalls) -> Attempt:
        step, backward, synced, rank = calls.step, calls.backward, calls.synced, calls.rank
        chunks = self.sizer.chunks(batch, calls.split_hook)
        total = sum(chunk.rows for chunk in chunks)
        losses: list[Tensor] = []
        counts: list[Any] = []
        output: Any = None
        loss: Tensor | None = None
        weighted: Tensor | None = None
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            syncs = (synced and last) or self.must_sync()
            phase = "forward"
            try:
                with nullcontext() if syncs else _sync_off(ddp):
                    loss, output = step(chunk.data)
                if loss is None:
                    continue
                given = output.get("num_items") if isinstance(output, dict) else None
                count = self.items.pending = None if given is None else check_num_items(given)
                weighted = loss * (chunk.rows / total) if count is None else loss  # items: the window divides
                losses.append(weighted.detach() if count is None else loss.detach() * count)
                counts.append(count)
                phase = "backward"
                agreed = backward(weighted, syncs, last)
            except Exception as error:  # only out-of-memory errors are taken over, others re-raised
                if not (self.sizer.auto and is_out_of_memory(error)):
                    raise
                failure = OutOfMemory(rank, phase, chunk.rows, total)
            else:
                if agreed.out_of_memory:  # another rank ran out in this attempt
                    return Attempt(None, agreed.out_of_memory)
                continue
            # out of the handler, the error's traceback and the attempt's graph are gone: free them before the
            # agreement allocates its buckets
            loss = weighted = output = None
            free_memory(next(ddp.module.parameters()).device)
            # a failed synced backward may have launched some of its buckets; before it, none was
            started = phase == "backward" and last and synced
            return Attempt(None, self.recovery.agree_on_failure(failure, synced_backward_started=started).out_of_memory)
        if counts and all(count is not None for count in counts):  # the batch's loss per item, and its items
            items = _summed(counts)
            divisor = items.clamp(min=1) if isinstance(items, Tensor) else max(items, 1)
            return Attempt(ChunksDone(_summed(losses) / divisor, output, items))
        return Attempt(ChunksDone(_summed(losses), output))


def _summed(values: list[Any]) -> Any:
    total: Any = None
    for value in values:
        total = value if total is None else total + value
    return total


@contextmanager
def _sync_off(ddp: DistributedDataParallel) -> Generator[None, None, None]:
    """A chunk before the batch's last: its forward prepares no all-reduce (DDP's ``no_sync``, without resetting a
    setting the caller made)."""
    before = ddp.require_backward_grad_sync
    ddp.require_backward_grad_sync = False
    try:
        yield
    finally:
        ddp.require_backward_grad_sync = before
