"""The guard on every synced backward: no optimizer step is applied with gradients that were not all-reduced.

torch's reducer all-reduces its buckets strictly in order. When a parameter gets no gradient on some step (a head
used only during warm-up, LayerDrop, a tower skipped for a batch) and ``find_unused_parameters`` is off, its bucket
never becomes ready, so neither it nor any later bucket is launched and ``finalize_backward`` never runs: the
optimizer would apply each rank's own gradients, and torch says so only at the next forward. When that happens on
some ranks only, the ranks have launched different numbers of bucket all-reduces on the main process group: a rank
that launched them all waits inside its backward for partners that never come.

What the guard does after every backward that should have synchronized:

1. Locally (no communication): ``_check_reducer_finalized()`` says whether this rank's reducer finished.
2. A rank whose reducer did not finish *completes the reduction itself*: it hands the buckets the reducer never
   launched to the same communication hook (its local gradients, zeros where a parameter got none, as
   ``find_unused_parameters=True`` would send), waits for every bucket of this backward, and writes the averaged
   gradients into ``.grad``. Every rank has then issued the same bucket collectives in the same order, so the main
   group is consistent again and a rank blocked in its backward is released at once. It needs no knowledge of the
   other ranks, which is why it can run before any agreement: a finished rank's backward returns only after every
   unfinished rank has issued its missing buckets.
3. All ranks agree on one tiny all-reduce on a small gloo group of their own (the main group may still carry bucket
   all-reduces of this backward in flight, and an NCCL group cannot carry CPU flags): did any rank not finish?
   Only then, a second exchange tells every rank which parameters each rank left without gradient, so that a
   parameter no rank used keeps ``.grad`` untouched, as with ``find_unused_parameters=True``.

The front ends' hooks only call ``DDPPlusEngine.after_backward``; the decision what to do with a fault (raise, or
resolve and train on) is the engine's, from ``checkpointing_conflict``.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.nn.parallel import DistributedDataParallel

HookFunction = Callable[[Any, dist.GradBucket], "torch.futures.Future[torch.Tensor]"]


class BucketLog:
    """The buckets the reducer handed to the communication hook since the last ``clear``, with their futures: which
    buckets this backward launched, and where their averaged gradients will be."""

    def __init__(self) -> None:
        self.entries: list[tuple[dist.GradBucket, torch.futures.Future]] = []

    def clear(self) -> None:
        self.entries.clear()


def logged_hook(hook: HookFunction, log: BucketLog) -> HookFunction:
    """Wrap ``hook`` so that every bucket it is handed, and the future it returns, is logged."""

    # Real (not string) annotations: torch's register_comm_hook compares them with dist.GradBucket and Future.
    def ddp_plus_logged_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        log.entries.append((bucket, future))
        return future

    ddp_plus_logged_hook.__qualname__ = getattr(hook, "__qualname__", repr(hook))
    return ddp_plus_logged_hook


def can_check_reducer(ddp: DistributedDataParallel) -> bool:
    """Whether this torch lets the guard ask a reducer if it finished (and lets it complete one)."""
    reducer = getattr(ddp, "reducer", None)
    return all(
        callable(getattr(reducer, name, None))
        for name in ("_check_reducer_finalized", "_get_zeros_like_grad_buckets", "_run_comm_hook")
    )


def reducer_finished(ddp: DistributedDataParallel) -> bool:
    """Local and cheap: did this rank's reducer launch every bucket and finalize the backward?"""
    try:
        ddp.reducer._check_reducer_finalized()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class Completion:
    """What ``complete_reduction`` did on a rank whose reducer had not finished."""

    launched: int  # buckets the reducer had launched
    buckets: int  # buckets in all
    without_gradient: tuple[Parameter, ...]  # parameters of the unlaunched buckets with no gradient on this rank


def _hook_result(value: Any) -> Tensor:
    return value[0] if isinstance(value, (list, tuple)) else value


def complete_reduction(ddp: DistributedDataParallel, log: BucketLog) -> Completion:
    """Launch the buckets the reducer did not, through its communication hook, and write every bucket's averaged
    gradients into ``.grad`` (what ``finalize_backward`` would have done). A parameter with no gradient gets the
    average too (``.grad`` is set); ``restore_missing`` undoes that for parameters no rank used."""
    buckets = ddp.reducer._get_zeros_like_grad_buckets()  # every bucket, in launch order, with zeroed buffers
    launched = len(log.entries)
    pending = list(log.entries)
    missing: list[Parameter] = []
    for bucket in buckets[launched:]:
        for view, parameter in zip(bucket.gradients(), bucket.parameters()):
            if parameter.grad is None:
                missing.append(parameter)
            else:
                view.copy_(parameter.grad)
        pending.append((bucket, ddp.reducer._run_comm_hook(bucket)))
    for bucket, future in pending:
        result = _hook_result(future.wait()).reshape(-1)
        offset = 0
        for parameter in bucket.parameters():
            size = parameter.numel()
            value = result[offset : offset + size].view_as(parameter)
            offset += size
            if parameter.grad is None:
                parameter.grad = value.clone()
            elif parameter.grad.data_ptr() != value.data_ptr():  # a bucket view already holds the result
                parameter.grad.copy_(value)
    log.clear()
    return Completion(launched=launched, buckets=len(buckets), without_gradient=tuple(missing))


class SideChannel:
    """A small gloo group of the job's ranks for the guard's flags, separate from the group that carries the
    gradients: that one may hold bucket all-reduces in flight that a flag all-reduce would be paired with, and an
    NCCL group carries no CPU tensors."""

    def __init__(self) -> None:
        self._group: Any = None

    @property
    def open(self) -> bool:
        return self._group is not None

    def start(self, timeout: timedelta) -> None:
        """Create the group (a collective: every rank calls it at the same point of its setup)."""
        self.stop()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def stop(self) -> None:
        if self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except (RuntimeError, ValueError):  # the default group went first (interpreter shutdown)
                pass
            self._group = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self._group) if self._group is not None else 1

    def maximum(self, values: Sequence[int]) -> list[int]:
        """Each value's maximum over the ranks (one all-reduce of a few integers)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def total(self, values: Sequence[int]) -> list[int]:
        """Each value's sum over the ranks (one all-reduce of a few integers)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def _all_reduce(self, values: Sequence[int], op: Any) -> list[int]:
        if self._group is None:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(tensor, op=op, group=self._group)
        return tensor.tolist()

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's values, by rank (all ranks pass the same number of values)."""
        if self._group is None:
            return [list(values)]
        tensor = torch.tensor(list(values), dtype=torch.int64)
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(gathered, tensor, group=self._group)
        return [t.tolist() for t in gathered]


@dataclass(frozen=True)
class SyncFault:
    """A synced backward after which some rank's reducer had not all-reduced every bucket (now completed by hand).

    ``unused`` holds, per rank, the parameters that got no gradient there in that backward's unlaunched buckets.
    """

    step: int
    unused: tuple[tuple[str, ...], ...]
    launched: tuple[tuple[int, int], ...]  # per rank: (buckets launched by the reducer, buckets in all)
    #: Some rank's backward itself failed (torch: "Your training graph has changed in this iteration" with
    #: ``static_graph=True``): its gradients are incomplete, so the step cannot be applied as it is.
    aborted: bool = False

    @property
    def unused_everywhere(self) -> tuple[str, ...]:
        common = set(self.unused[0]).intersection(*self.unused[1:]) if self.unused else set()
        return tuple(name for name in self.unused[0] if name in common)

    def describe(self) -> str:
        """Per rank, in words.

        >>> SyncFault(step=4, unused=(("aux.weight",), ()), launched=((1, 3), (3, 3))).describe()
        'rank 0: aux.weight (reducer launched 1 of 3 buckets); rank 1: none (launched 3 of 3)'
        """
        parts = []
        for rank, (names, (launched, total)) in enumerate(zip(self.unused, self.launched)):
            if names:
                shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                parts.append(f"rank {rank}: {shown} (reducer launched {launched} of {total} buckets)")
            else:
                parts.append(f"rank {rank}: none (launched {launched} of {total})")
        return "; ".join(parts)


class SyncGuard:
    """Owns the bucket log, the side channel and the check after each synced backward.

    Args:
        enabled: ``DDPPlusStrategy(sync_guard=...)``.
        channel: the engine's side channel (opened by the engine before ``attach``).
        warn: how a warning reaches the user (rank 0 only in a Trainer).
    """

    def __init__(self, enabled: bool, channel: SideChannel, warn: Callable[[str], None]) -> None:
        self.enabled = enabled
        self._warn = warn
        self.log = BucketLog()
        self.channel = channel
        self._parameters: list[tuple[str, Parameter]] = []
        self._active = False
        #: Synced backwards checked in the current fit on this rank.
        self.checks = 0

    @property
    def active(self) -> bool:
        """The guard checks every synced backward of the current fit."""
        return self._active

    def attach(self, ddp: DistributedDataParallel) -> None:
        self.log.clear()
        self._active = False
        self.checks = 0
        if not self.enabled or not self.channel.open:
            return
        if not can_check_reducer(ddp):
            self._warn(
                "DDPPlusStrategy: this torch's reducer does not expose _check_reducer_finalized / "
                "_get_zeros_like_grad_buckets / _run_comm_hook, so the guard on every synced backward is OFF: a "
                "parameter unused on a later step will not be caught before the optimizer step. Set "
                "find_unused_parameters=True if the model's graph can change between steps."
            )
            return
        self._parameters = [(name, p) for name, p in ddp.module.named_parameters() if p.requires_grad]
        self._active = True

    def detach(self) -> None:
        self._active = False
        self.log.clear()

    def check(
        self, ddp: DistributedDataParallel, step: int, flags: Sequence[int] = (), aborted: bool = False
    ) -> tuple[SyncFault | None, list[int]]:
        """After a synced backward (``aborted``: one that raised on this rank): complete this rank's reduction if it
        did not finish, and agree with the other ranks. ``flags`` travel in the same all-reduce (their maximum over
        ranks is returned), so that another per-step decision (uneven inputs) costs no collective of its own."""
        self.checks += 1
        launched = len(self.log.entries)
        completion = None if reducer_finished(ddp) and not aborted else complete_reduction(ddp, self.log)
        self.log.clear()
        agreed = self.channel.maximum([int(completion is not None), int(aborted), *flags])
        if not agreed[0]:
            return None, agreed[2:]
        fault = self._fault(step, completion or Completion(launched, launched, ()), aborted=bool(agreed[1]))
        return fault, agreed[2:]

    def _fault(self, step: int, completion: Completion, aborted: bool) -> SyncFault:
        missing = {id(p) for p in completion.without_gradient}
        local = [int(id(p) in missing) for _, p in self._parameters]
        rows = self.channel.gather([*local, completion.launched, completion.buckets])
        for index, (_, parameter) in enumerate(self._parameters):
            if all(row[index] for row in rows):  # as find_unused_parameters=True: no rank used it, .grad untouched
                parameter.grad = None
        return SyncFault(
            step=step,
            unused=tuple(tuple(name for (name, _), on in zip(self._parameters, row) if on) for row in rows),
            launched=tuple((row[-2], row[-1]) for row in rows),
            aborted=aborted,
        )
