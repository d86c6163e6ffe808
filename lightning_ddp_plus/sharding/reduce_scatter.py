"""The communication hook of ``optimizer_sharding=True``: each gradient bucket is reduce-scattered as soon as DDP has
it, so that each rank receives the average of its own chunk (``bucket_shards``) and nothing else.

A reduce-scatter moves (N-1)/N of the bucket per rank, half of what an all-reduce moves; the all-gather of the
updated parameters after the step moves the other half. So sharded training moves DDP's bytes. NCCL's collectives do
that; on gloo, whose reduce-scatter is a full all-reduce, pairwise exchanges in pieces do (``exchange``), on one thread of
the hook's.

After a synced backward, a rank's chunk of every bucket holds the averaged gradient and the rest of its gradients
hold zeros: the sum of the ranks' gradients is the averaged gradient, and anything linear (a rescale, the per-item
factor) acts on it as on DDP's. A synced backward that does not end its window (a static graph's first, which torch's
reducer needs synced) is followed by more accumulation: there the averaged chunks a rank received count ``N`` times in
the next reduce-scatter (they are one rank's where every rank's local gradient used to be), which keeps the window's
average exact, whichever rank owns those elements by then.

The step's flags ride in the last bucket's reduce-scatter as they ride in DDP's all-reduce (``sync.flag_carrier``):
each rank's chunk of the source is followed by a copy of this rank's flags, so that every rank receives their sum
after its chunk. That costs the flags' few elements once per rank, and no message of their own.
"""

# real (not string) annotations: torch compares the hook's with dist.GradBucket and Future

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ddp_plus.sharding.bucket_shards import BucketLayout, flat_in_memory_order, shard_size
from lightning_ddp_plus.sharding.exchange import exchange_reduce_scatter


class FlagsToCarry(Protocol):
    """The step's flags as a hook that carries them sees them (``sync.flag_carrier.FlagCarrier``)."""

    installed: bool
    """The flags ride in the running fit's buckets."""

    def tail(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """This rank's flags (and sums) to send after its last bucket's gradients."""

    def arrived(self, summed: Tensor) -> None:
        """The ``tail`` summed over the ranks."""


@dataclass(eq=False, kw_only=True)
class GradientShards:
    """The hook's state, shared with the sharded optimizers: the bucket layout the reducer last used, and the bytes
    this rank's collectives sent."""

    process_group: Any = None
    """The group the hook and the optimizers communicate in (``None``: the default group)."""
    exchange_group: Any = None
    """gloo: a group of the same ranks for the hook's exchanges alone (``ZeroSharding`` opens it at a fit's start).
    They run on a thread of their own, and the reducer's own collectives (``find_unused_parameters``' map of the
    parameters used, launched from the backward) would otherwise be paired across ranks in whichever order each
    rank's threads reached the gradient group: a hang, measured from the second step on."""
    parameters: list[Tensor] = field(default_factory=list)
    """Every parameter a bucket held, in the order first seen: a ``BucketLayout`` names them by position here."""
    layout: BucketLayout | None = None
    """The buckets of the latest backward that reduce-scattered every bucket."""
    sent_bytes: int = 0
    """Bytes this rank's reduce-scatters and all-gathers sent: (N-1)/N of each one's full size, as a ring or a
    pairwise exchange sends. The gradients' and parameters' bytes: the step's flags riding after each chunk of the
    last bucket (a few elements per rank) are not counted, as DDP's hook is not handed them either."""
    carrier: FlagsToCarry | None = None
    """The step's flags, carried in the last bucket's reduce-scatter where ``carrier.installed``."""
    _index: dict[int, int] = field(default_factory=dict)
    _seen: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    _waiter: ThreadPoolExecutor | None = None
    _received: dict[int, list[tuple[int, Tensor]]] = field(default_factory=dict)
    _rows: Tensor | None = None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    def index_of(self, parameter: Tensor) -> int:
        """``parameter``'s position in ``parameters`` (added when new)."""
        key = id(parameter)
        if key not in self._index:
            self._index[key] = len(self.parameters)
            self.parameters.append(parameter)
        return self._index[key]

    def record(self, bucket: dist.GradBucket) -> None:
        """Note the bucket's parameters; its last bucket completes the layout (a joined rank's stand-in buckets,
        which hold no parameters, leave it as it is)."""
        parameters = bucket.parameters()
        if not parameters:
            return
        self._seen[bucket.index()] = tuple((self.index_of(p), p.numel()) for p in parameters)
        if bucket.is_last():
            self.layout = BucketLayout(tuple(self._seen[index] for index in sorted(self._seen)))
            self._seen = {}

    @property
    def uses_exchange(self) -> bool:
        """gloo's reduce-scatter is a full all-reduce: pairwise exchanges run there instead (``exchange``)."""
        return dist.get_backend(self.process_group) == "gloo"

    def in_thread(self, run: Callable[[], Tensor]) -> torch.futures.Future[torch.Tensor]:
        """A future of ``run()``, run on this state's one thread, in the order submitted (every rank submits the
        buckets in the same order, so their messages match), while the backward goes on."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run_then_set() -> None:
            try:
                future.set_result(run())
            except RuntimeError as error:  # a collective's failure: the backward's wait raises it
                future.set_exception(cast(Any, error))

        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddp-plus-reduce-scatter")
        self._waiter.submit(run_then_set)
        return future

    def rows(self, world: int, width: int, like: Tensor) -> Tensor:
        """The last bucket's source laid out by rank (each rank's chunk, then the flags), kept from step to step: a
        fresh tensor of a bucket's size costs its pages again every step on CPU (the reducer waits for this bucket's
        future before the next backward can call the hook again)."""
        rows = self._rows
        if rows is None or rows.shape != (world, width) or rows.dtype != like.dtype or rows.device != like.device:
            rows = self._rows = like.new_empty(world, width)
        return rows

    def note_received(self, buffer: Tensor, parameters: list[Tensor], begin: int, end: int) -> None:
        """Keep the averaged elements ``begin .. end`` of this bucket (this rank's chunk), by parameter, until a step
        uses them (``consumed``)."""
        offset = 0
        for parameter in parameters:
            low, high = max(begin, offset), min(end, offset + parameter.numel())
            if high > low:
                self._received.setdefault(self.index_of(parameter), []).append((low - offset, buffer[low:high].clone()))
            offset += parameter.numel()

    def received_for(self, parameters: list[Tensor]) -> bool:
        """Some of ``parameters`` hold chunks received that no step used yet (they count again in this bucket's
        next reduce-scatter)."""
        return any(self._index.get(id(parameter), -1) in self._received for parameter in parameters)

    def count_received_again(self, padded: Tensor, parameters: list[Tensor]) -> None:
        """Before a reduce-scatter (its source divided by N): what this rank received and no step used counts N
        times, as it would have if every rank had kept its own gradient."""
        if not self._received:
            return
        world, offset = self.world_size, 0
        for parameter in parameters:
            for start, values in self._received.pop(self.index_of(parameter), []):
                padded[offset + start : offset + start + values.numel()].add_(values, alpha=(world - 1) / world)
            offset += parameter.numel()

    def received_into_grads(self, parameters: Sequence[Tensor]) -> None:
        """After a fault the per-step guard completed: each parameter's ``.grad`` becomes this rank's chunk of the
        step's average, zeros elsewhere, as every bucket's reduce-scatter left it (recorded when received, whether
        the reducer or the guard launched the bucket). A rank whose reducer did not finish still holds its local
        gradients in ``.grad``, and a finished rank holds only its own chunk, so nothing else is exact."""
        for parameter in parameters:
            grad = torch.zeros_like(parameter)
            flat = flat_in_memory_order(grad)
            for start, values in self._received.get(self._index.get(id(parameter), -1), []):
                flat[start : start + values.numel()].copy_(values)
            parameter.grad = grad

    def consumed(self) -> None:
        """A step used the gradients, or a failed attempt's are discarded: nothing received counts again. (Gradients
        zeroed without a step after a backward that did not end its window would leave what it received counting
        in the next window: Lightning's loops and the chunks of a batch never do that.)"""
        self._received = {}

    def count(self, elements: int, element_size: int, times: int = 1) -> None:
        world = self.world_size
        self.sent_bytes += times * elements * element_size * (world - 1) // world


def divided_into_rows(buffer: Tensor, world: int, chunks: Tensor) -> None:
    """``buffer / world`` written into ``chunks`` (``world`` rows of a chunk each, the last ones zero-padded), in one
    pass.

    >>> chunks = torch.full((2, 3), -1.0)
    >>> divided_into_rows(torch.arange(5.0), 2, chunks)
    >>> chunks
    tensor([[0.0000, 0.5000, 1.0000],
            [1.5000, 2.0000, 0.0000]])
    """
    chunk = chunks.shape[1]
    full, rest = divmod(buffer.numel(), chunk)
    torch.div(buffer[: full * chunk].view(full, chunk), world, out=chunks[:full])
    if full < world:
        chunks[full:].zero_()
        torch.div(buffer[full * chunk :], world, out=chunks[full, :rest])


def reduce_scatter_hook(state: GradientShards, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average this bucket's gradients into each rank's chunk (zeros elsewhere); see the module's docstring."""
    state.record(bucket)
    buffer = bucket.buffer()
    world, group = state.world_size, state.process_group
    size = buffer.numel()
    chunk = shard_size(size, world)
    parameters = bucket.parameters()
    carrier = state.carrier if bucket.is_last() and state.carrier is not None and state.carrier.installed else None
    if carrier is not None and chunk and not state.received_for(parameters):
        # each rank's chunk, then the flags, so that every rank receives their sum after its chunk: the division
        # writes the chunks in place of the division in place below (one pass over the bucket either way)
        tail = carrier.tail(buffer.dtype, buffer.device)
        rows = state.rows(world, chunk + tail.numel(), buffer)
        divided_into_rows(buffer, world, rows[:, :chunk])
        rows[:, chunk:].copy_(tail.expand(world, -1))
        padded = rows.view(-1)
    else:
        padded = buffer if chunk * world == size else torch.cat([buffer, buffer.new_zeros(chunk * world - size)])
        padded.div_(world)
        state.count_received_again(padded, parameters)
        if carrier is not None:  # the same layout, after a copy (chunks received earlier count again)
            tail = carrier.tail(buffer.dtype, buffer.device)
            rows = state.rows(world, chunk + tail.numel(), buffer)
            rows[:, :chunk].copy_(padded.view(world, chunk))
            rows[:, chunk:].copy_(tail.expand(world, -1))
            padded = rows.view(-1)
    width = padded.numel() // world
    state.count(chunk * world, buffer.element_size())  # the gradients' bytes, as DDP's hook is handed them
    begin = state.rank * chunk
    end = min(begin + chunk, size)

    def own_chunk_only(shard: Tensor) -> Tensor:
        own = shard[: end - begin].clone()  # the shard may be a view of the buffer
        if carrier is not None:
            carrier.arrived(shard[chunk:].clone())
        buffer.zero_()
        if end > begin:
            buffer[begin:end].copy_(own)
        state.note_received(buffer, parameters, begin, end)
        return buffer

    if state.uses_exchange:
        exchange_group = state.exchange_group if state.exchange_group is not None else group
        return state.in_thread(lambda: own_chunk_only(exchange_reduce_scatter(padded, exchange_group)))
    shard = buffer.new_empty(width)
    work = dist.reduce_scatter_tensor(shard, padded, group=group, async_op=True)
    return cast("torch.futures.Future[Tensor]", work.get_future().then(lambda _: own_chunk_only(shard)))
