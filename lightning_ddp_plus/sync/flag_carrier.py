"""The step's flags ride in the last gradient bucket, so that agreeing on them costs no message of its own.

Every decision the ranks must take at the same step (the guard's unfinished reductions, a notice, an epoch's end for
uneven inputs, an out-of-memory retry) is a handful of 0/1 flags. DDP all-reduces every bucket anyway, and torch's
reducer launches them strictly in order, so the last one leaves after everything a rank knows when its backward ends:

- a rank whose reducer finished launched it itself, with the flags it held then;
- a rank whose reducer did not finish (or whose synced backward failed) launches it in ``step_guard``'s completion,
  with its news set, before any rank can read the result.

Numbers that the ranks sum rather than flag ride the same way (``sums``: ``num_items``' counts of the window, which
the backward that closes the window knows before its last bucket leaves). They are exact only in a bucket of 32 or 64
bits (a count of up to 2**24 in float32); in a bucket of 16 bits they are not read, and their owner all-reduces them
itself.

The hook is torch's ``allreduce_hook`` for every bucket but the last, which travels with the flags appended: one pass
over that bucket into a buffer kept from step to step, in place of the division ``allreduce_hook`` makes in place (on
a GPU a few microseconds; on CPU, priced in ``benchmarks/flag_transport.py``). Each rank reads the flags of the
result: their sum over the ranks, so a flag is set where any rank set it. ``optimizer_sharding=True``'s
reduce-scatter carries them too (``tail`` and ``arrived``: after each rank's chunk), and so does the last bucket of
``ddp_comm_hook="fp16"`` or ``"bf16"`` without a ``ddp_comm_wrapper`` (``compressing``: compressed as torch's hook
compresses it; a flag's sum stays above 0 in 16 bits, and the sums are not read there). With another
``ddp_comm_hook`` (PowerSGD's issues its own collectives; a callable is the user's), ``optimizer_sharding="overlap"``
(torch's hook), a hook the user registers on the wrapper later (it takes the carrier's place), or a sparse gradient,
nothing rides: the flags take one all-reduce of their own on the side channel (``side_channel.SideChannel``).
"""

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn import Embedding, EmbeddingBag
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.private_apis.torch_ddp import withdraw_comm_hooks


def flags_ride_buckets(ddp: DistributedDataParallel, hook: object | None, own_hook_later: bool) -> bool:
    """Whether the flags can ride in ``ddp``'s last bucket: no other hook (``hook``: the user's or the sharding's;
    ``own_hook_later``: one registered after the wrap, the ZeRO overlap's), and no sparse gradient."""
    sparse = any(isinstance(m, (Embedding, EmbeddingBag)) and m.sparse for m in ddp.module.modules())
    return hook is None and not own_hook_later and not sparse


#: Bucket dtypes in which a sum rides exactly enough to be read (a count of up to 2**24 in float32).
EXACT_SUMS = (torch.float32, torch.float64)


class FlagCarrier:
    """The communication hook that carries the step's flags in the last bucket, and what it received.

    Args:
        flags_now: this rank's flags when its last bucket leaves (the same number on every rank).
        sums_now: this rank's numbers to sum over the ranks when its last bucket leaves, ``sums`` of them, in the
            bucket's dtype and on its device (``None``: zeros).
        sums: how many numbers ``sums_now`` gives (the same on every rank, whether it has any or not).
    """

    def __init__(
        self,
        flags_now: Callable[[], list[int]],
        sums_now: Callable[[torch.dtype, torch.device], torch.Tensor | None] = lambda dtype, device: None,
        sums: int = 0,
    ) -> None:
        self.flags_now, self.sums_now, self.sums = flags_now, sums_now, sums
        #: The sums over the ranks of the last bucket taken (``None``: none, or not exact in its dtype).
        self.summed: torch.Tensor | None = None
        #: Flags a rank with news sends instead of ``flags_now``'s (the guard's completion of a reduction).
        self.news: list[int] | None = None
        #: The hook is registered on the running fit's wrapper: the flags ride its buckets.
        self.installed = False
        self._received: torch.Tensor | None = None
        self._carried: torch.Tensor | None = None

    def register(self, ddp: DistributedDataParallel) -> None:
        """The carrier's hook on ``ddp``. A hook the user registers on the wrapper later (torch takes one per wrapper)
        takes its place: the reducer is rebuilt without it, and the flags take the side channel."""
        ddp.register_comm_hook(ddp.process_group, self.hook)
        self.riding()

        def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
            self.installed = False
            del ddp.register_comm_hook  # the class's method again
            withdraw_comm_hooks(ddp)
            ddp.register_comm_hook(state, hook)

        setattr(ddp, "register_comm_hook", register_comm_hook)  # noqa: B010 - on the instance, over the method

    def riding(self) -> None:
        """The flags ride in the hook just registered on a new wrapper (this carrier's, or one that carries them)."""
        self._received, self.news, self._carried = None, None, None
        self.installed = True

    def hook(self, group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not bucket.is_last():
            return allreduce_hook(group, bucket)
        return self._carry(group, bucket, None)

    def compressing(self, hook: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
        """torch's compressing ``hook`` (``fp16_compress_hook``, ``bf16_compress_hook``) for every bucket but the
        last, which is compressed the same way (cast to ``dtype``, divided by the world size) with the flags
        appended: ``ddp_comm_hook="fp16"`` or ``"bf16"`` carries them too."""

        def ddp_plus_compressing_carrier(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            if not bucket.is_last():
                return cast("torch.futures.Future[torch.Tensor]", hook(group, bucket))
            return self._carry(group, bucket, dtype)

        return ddp_plus_compressing_carrier

    def _carry(
        self, group: Any, bucket: dist.GradBucket, compressed: torch.dtype | None
    ) -> torch.futures.Future[torch.Tensor]:
        """The last bucket (cast to ``compressed``, if given) all-reduced with the ``tail`` appended."""
        buffer = bucket.buffer()
        dtype, world = compressed or buffer.dtype, dist.get_world_size(group)
        tail = self.tail(dtype, buffer.device)
        size = buffer.numel()
        carried = self._carried
        if carried is None or carried.numel() != size + tail.numel() or carried.dtype != dtype:
            # kept from step to step: a fresh buffer of a bucket's size costs its pages again every step on CPU;
            # the reducer copies the result into the bucket before the next backward can call the hook again
            carried = self._carried = torch.empty(size + tail.numel(), dtype=dtype, device=buffer.device)
        if compressed is None:
            torch.div(buffer, world, out=carried[:size])
        else:  # as torch's compressing hooks: cast, then divide in the compressed dtype
            carried[:size].copy_(buffer).div_(world)
        carried[size:].copy_(tail)
        future = dist.all_reduce(carried, group=group, async_op=True).get_future()

        def split(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = done.value()[0]
            self.arrived(reduced[size:])
            if compressed is None:
                return reduced[:size]
            return buffer.copy_(reduced[:size])  # decompressed in place, as torch's hooks do

        carrying: torch.futures.Future[torch.Tensor] = future.then(split)
        return carrying

    def tail(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What this rank's last bucket carries after its gradients: the flags (a rank with ``news``, its news), then
        the sums (zeros where it has none). Another hook that carries them (the sharding's reduce-scatter) sends
        this, summed over the ranks, and hands the result to ``arrived``."""
        flags = self.news if self.news is not None else self.flags_now()
        tail = torch.empty(len(flags) + self.sums, dtype=dtype, device=device)
        tail[: len(flags)].copy_(torch.tensor(flags, dtype=dtype), non_blocking=True)
        if self.sums:
            sums = self.sums_now(dtype, device)
            if sums is None:
                tail[len(flags) :].zero_()
            else:
                tail[len(flags) :].copy_(sums)
        return tail

    def arrived(self, summed: torch.Tensor) -> None:
        """The ``tail`` summed over the ranks: the last bucket left."""
        self._received = summed

    @property
    def received(self) -> bool:
        """A last bucket left since the last ``take`` (this rank's reducer, or the guard's completion, launched it)."""
        return self._received is not None

    def take(self) -> list[int] | None:
        """Each flag of the last bucket all-reduced since the last take, 1 where any rank set it (``None``: no last
        bucket left); its sums are kept in ``summed`` until the next take. On a GPU this waits for that bucket's
        all-reduce on the host."""
        received, self._received = self._received, None
        self.news, self.summed = None, None
        if received is None:
            return None
        flags = received[: received.numel() - self.sums]
        if self.sums and received.dtype in EXACT_SUMS:
            self.summed = received[flags.numel() :]
        return [int(value > 0) for value in flags.tolist()]
