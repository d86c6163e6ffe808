"""The communication hook of ``optimizer_sharding=True``: each gradient bucket is reduce-scattered as soon as DDP has
it, so that each rank receives the average of its own chunk (``bucket_shards``) and nothing else.

A reduce-scatter moves (N-1)/N of the bucket per rank, half of what an all-reduce moves; the all-gather of the
updated parameters after the step moves the other half. So sharded training moves DDP's bytes.

After a window's closing backward, a rank's chunk of every bucket holds the averaged gradient and the rest of its
gradients hold zeros: the sum of the ranks' gradients is the averaged gradient, and anything linear (a rescale, the
per-item factor) acts on it as on DDP's. The one backward that must all-reduce although its window goes on (a static
graph's first, which torch's reducer needs synced) runs a plain all-reduce instead, which keeps accumulation exact.
"""

# real (not string) annotations: torch compares the hook's with dist.GradBucket and Future

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ddp_plus.sharding.bucket_shards import BucketLayout, chunk_size


@dataclass(eq=False, kw_only=True)
class GradientShards:
    """The hook's state, shared with the sharded optimizers: the bucket layout the reducer last used, and the bytes
    this rank's collectives sent."""

    process_group: Any = None
    """The group the hook and the optimizers communicate in (``None``: the default group)."""
    all_reduce_now: Callable[[], bool] = lambda: False
    """Whether the running backward must all-reduce in full (a static graph's first, whatever its window)."""
    parameters: list[Tensor] = field(default_factory=list)
    """Every parameter a bucket held, in the order first seen: a ``BucketLayout`` names them by position here."""
    layout: BucketLayout | None = None
    """The buckets of the latest backward that reduce-scattered every bucket."""
    sent_bytes: int = 0
    """Bytes this rank's reduce-scatters, all-reduces and all-gathers sent (ring algorithm: (N-1)/N of each
    collective's full size, twice for an all-reduce)."""
    _index: dict[int, int] = field(default_factory=dict)
    _seen: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    _waiter: ThreadPoolExecutor | None = None

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

    def future_of(self, work: Any, then: Callable[[], Tensor]) -> torch.futures.Future[torch.Tensor]:
        """A future of ``then()`` once ``work`` completes. gloo gives no future for a reduce-scatter ("Work::getFuture
        not implemented"): a thread of this state's waits for it then, so the backward still runs on meanwhile."""
        try:
            return cast("torch.futures.Future[Tensor]", work.get_future().then(lambda _: then()))
        except RuntimeError:
            pass
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def wait_then() -> None:
            try:
                work.wait()
                future.set_result(then())
            except Exception as error:  # the backward's wait raises it
                future.set_exception(error)

        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddp-plus-reduce-scatter")
        self._waiter.submit(wait_then)
        return future

    def count(self, elements: int, element_size: int, times: int = 1) -> None:
        world = self.world_size
        self.sent_bytes += times * elements * element_size * (world - 1) // world


def reduce_scatter_hook(state: GradientShards, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average this bucket's gradients into each rank's chunk (zeros elsewhere); see the module's docstring."""
    state.record(bucket)
    buffer = bucket.buffer()
    world, group = state.world_size, state.process_group
    if state.all_reduce_now():
        state.count(buffer.numel(), buffer.element_size(), times=2)
        work = dist.all_reduce(buffer.div_(world), group=group, async_op=True)
        return cast("torch.futures.Future[Tensor]", work.get_future().then(lambda _: buffer))
    size = buffer.numel()
    chunk = chunk_size(size, world)
    padded = buffer if chunk * world == size else torch.cat([buffer, buffer.new_zeros(chunk * world - size)])
    padded.div_(world)
    shard = buffer.new_empty(chunk)
    state.count(chunk * world, buffer.element_size())
    work = dist.reduce_scatter_tensor(shard, padded, group=group, async_op=True)
    begin = state.rank * chunk
    end = min(begin + chunk, size)

    def own_chunk_only(_: Any = None) -> Tensor:
        buffer.zero_()
        if end > begin:
            buffer[begin:end].copy_(shard[: end - begin])
        return buffer

    return state.future_of(work, own_chunk_only)
