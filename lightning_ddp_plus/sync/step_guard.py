"""The guard on every synced backward: no optimizer step is applied with gradients that were not all-reduced.

torch's reducer all-reduces its buckets strictly in order. When a parameter gets no gradient on some step (a head
used only during warm-up, LayerDrop, a tower skipped for a batch) and ``find_unused_parameters`` is off, its bucket
never becomes ready, so neither it nor any later bucket is launched and ``finalize_backward`` never runs: the
optimizer would apply each rank's own gradients, and torch says so only at the next forward. When that happens on
some ranks only, the ranks have launched different numbers of bucket all-reduces on the gradient group: a rank that
launched them all waits inside its backward for partners that never come.

What the guard does after every backward that should have synchronized:

1. Locally: ``_check_reducer_finalized()`` says whether this rank's reducer finished, and when not, which
   parameters got no gradient (torch's own account), hence the first bucket it never launched.
2. A rank whose reducer did not finish *completes the reduction itself* (``complete_reduction``): it launches that
   bucket and every later one through the reducer's own path, filled with its local gradients (zeros where a
   parameter got none, as ``find_unused_parameters=True`` sends), and waits. Every rank has then issued the same
   bucket collectives in the same order, so the gradient group is consistent again and a rank blocked in its
   backward is released at once. It needs no knowledge of the other ranks, so it runs before any agreement.
3. The ranks agree whether any rank did not finish: the flags ride in the last bucket (``flag_carrier``), which a
   finished rank's reducer launched and an unfinished rank launches in its completion, with its news; where nothing
   can ride (another communication hook), with one all-reduce of a few integers on a small gloo group of their own
   (``side_channel.SideChannel``: the gradient group may still carry this backward's bucket all-reduces, and an NCCL
   group carries no CPU flags).
4. Only after a fault: every rank learns which parameters each rank left without gradient, and ``.grad`` gets the
   exact average (``settle_gradients``).

The front ends only call
``DDPPlusEngine.after_backward``; what a fault leads to (raise, or resolve and train on) is decided by the conflict
rules (``conflicts.check.decide_late_fault``, rule R6) and applied by the engine.
"""

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.pipeline.component import FitStart, StepComponent
from lightning_ddp_plus.private_apis.torch_ddp import (
    can_complete_reductions,
    has_comm_hook,
    reducer_parameters,
    reducer_unfinished,
    run_bucket_hook,
    zeroed_buckets,
)
from lightning_ddp_plus.sync.flag_carrier import FlagCarrier
from lightning_ddp_plus.sync.side_channel import SideChannel

#: torch's reducer names the parameters of this backward that got no gradient (``_check_reducer_finalized``).
_UNMARKED = re.compile(r"Parameter indices which did not receive grad for rank \d+:((?: \d+)+)")


def unmarked_parameters(ddp: DistributedDataParallel, message: str) -> list[Parameter]:
    """The parameters whose gradient hook did not fire in this backward, from the reducer's own error message (a
    torch whose message does not list them: the parameters without ``.grad``, the same without accumulation)."""
    parameters = reducer_parameters(ddp)
    found = _UNMARKED.search(message)
    if found is None:
        return [p for p in parameters if p.grad is None]
    return [parameters[int(index)] for index in found.group(1).split()]


@dataclass(frozen=True)
class Completion:
    """What ``complete_reduction`` did on a rank whose reducer had not finished."""

    launched: int  # buckets the reducer had launched
    buckets: int  # buckets in all
    unmarked: tuple[Parameter, ...]  # parameters that got no gradient in this backward


def complete_reduction(ddp: DistributedDataParallel, message: str, every_bucket: bool = False) -> Completion:
    """Launch, through the reducer's communication hook, the buckets its backward did not (torch launches buckets
    strictly in order, so: from the first bucket holding a parameter that got no gradient), filled with this rank's
    gradients (zeros where it has none), and wait for them. The main group is consistent afterwards; the values that
    reach ``.grad`` are settled by ``settle_gradients`` once the ranks agree.

    ``every_bucket``: this rank's synced backward never started (it failed before), so it launched none."""
    unmarked = list(reducer_parameters(ddp)) if every_bucket else unmarked_parameters(ddp, message)
    missing = {id(p) for p in unmarked}
    buckets = zeroed_buckets(ddp)
    first = (
        0
        if every_bucket
        else next(
            (index for index, bucket in enumerate(buckets) if any(id(p) in missing for p in bucket.parameters())),
            len(buckets),
        )
    )
    # without a hook of its own the reducer divides by the world size while copying gradients into a bucket
    divisor = ddp.process_group.size() if not has_comm_hook(ddp) else 1
    works = []
    for bucket in buckets[first:]:
        for view, parameter in zip(bucket.gradients(), bucket.parameters()):
            if parameter.grad is not None:
                view.copy_(parameter.grad)
        if divisor > 1:
            bucket.buffer().div_(divisor)
        works.append(run_bucket_hook(ddp, bucket))
    for work in works:
        work.wait()
    return Completion(launched=first, buckets=len(buckets), unmarked=tuple(unmarked))


def settle_gradients(
    ddp: DistributedDataParallel,
    reduced: list[Parameter],
    finished_ranks: list[int],
    no_rank_had: list[Parameter],
    exact: bool,
    own_chunks: Callable[[list[Parameter]], None] | None = None,
) -> bool:
    """After a fault, on every rank: give ``.grad`` the exact average of this step. Returns False when it cannot be
    known here (``exact`` False: some rank's backward failed, or bucket views were reduced in place), in which case
    every gradient is dropped (the optimizer skips the step).

    ``reduced``: the parameters DDP's reducer holds (those that required grad at the wrap). One unfrozen since
    (``BaseFinetuning``) was never all-reduced: a finished rank holds its own gradient for it, not the mean, so it is
    left to ``LeftOutGradients``, which averages it after the settle.

    A rank whose reducer finished holds the exact average (every unfinished rank sent its own gradients for the
    buckets it completed), so its gradients are broadcast. When none finished, every rank still holds its local
    gradients (``finalize_backward`` never ran), so they are averaged once more, by hand. A parameter no rank gave a
    gradient keeps ``.grad`` None, as with ``find_unused_parameters=True``.

    ``own_chunks``: the hook reduce-scatters (``optimizer_sharding=True``), so no rank holds the whole average, and
    each rank's own chunk of it is what the hook received: it writes that into ``.grad`` (no collective).
    """
    parameters = [p for p in ddp.module.parameters() if p.requires_grad]
    if not exact:
        for parameter in parameters:
            parameter.grad = None
        return False
    skip = {id(p) for p in no_rank_had}
    kept = [p for p in reduced if id(p) not in skip]
    group = ddp.process_group
    if own_chunks is not None:
        own_chunks(kept)
    elif finished_ranks:  # the side channel's ranks: the world
        through_one_flat_tensor(kept, lambda flat: dist.broadcast(flat, src=finished_ranks[0], group=group))
    else:
        through_one_flat_tensor(kept, lambda flat: dist.all_reduce(flat.div_(group.size()), group=group))
    for parameter in reduced:
        if id(parameter) in skip:
            parameter.grad = None
    return True


def through_one_flat_tensor(parameters: Sequence[Parameter], collective: Callable[[Tensor], Any]) -> None:
    """``collective`` on the gradients of ``parameters`` at once, flattened into one tensor (a parameter without a
    gradient counts zeros), and the result copied back into each ``.grad``."""
    gradients = []
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        gradients.append(parameter.grad)
    flat = torch.cat([gradient.reshape(-1) for gradient in gradients])
    collective(flat)
    for gradient, value in zip(gradients, flat.split([g.numel() for g in gradients])):
        gradient.copy_(value.view_as(gradient))


@dataclass(frozen=True)
class BucketsLaunched:
    """How far a rank's reducer got in a backward that did not finish."""

    launched: int
    total: int


@dataclass(frozen=True)
class SyncFault:
    """A synced backward after which some rank's reducer had not all-reduced every bucket (now completed by hand).

    ``unused`` holds, per rank, the parameters that got no gradient there in that backward's unlaunched buckets.
    """

    step: int
    unused: tuple[tuple[str, ...], ...]
    #: per rank: the buckets its reducer launched, or ``None`` where the reducer finished
    launched: tuple[BucketsLaunched | None, ...]
    #: Some rank's backward itself failed (torch: "Your training graph has changed in this iteration" with
    #: ``static_graph=True``): its gradients are incomplete, so the step cannot be applied as it is.
    aborted: bool = False
    #: The step's gradients could not be made exact and were dropped on every rank (the optimizer skips them).
    skipped: bool = False

    def describe(self) -> str:
        """Per rank, in words.

        >>> SyncFault(step=4, unused=(("aux.weight",), ()), launched=(BucketsLaunched(1, 3), None)).describe()
        'rank 0: aux.weight (its reducer launched 1 of 3 buckets); rank 1: none (its reducer finished)'
        """
        parts = []
        for rank, (names, counts) in enumerate(zip(self.unused, self.launched)):
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") or "none"
            state = (
                "its reducer finished"
                if counts is None
                else f"its reducer launched {counts.launched} of {counts.total} buckets"
            )
            parts.append(f"rank {rank}: {shown} ({state})")
        return "; ".join(parts)


@dataclass(frozen=True)
class GuardOutcome:
    """What the check after a synced backward found: a fault (``None``: every reducer finished), and the maximum
    over the ranks of each flag that travelled with the agreement."""

    fault: SyncFault | None
    flag_maximums: list[int]


class SyncGuard(StepComponent):
    """Owns the side channel's per-step check after each synced backward, and what a fault does to ``.grad``.

    Args:
        enabled: ``DDPPlusStrategy(sync_guard=...)``.
        channel: the engine's side channel (opened by the engine before ``attach``).
        warn: how a warning reaches the user (rank 0 only in a Trainer).
    """

    def __init__(
        self,
        enabled: bool,
        channel: SideChannel,
        warn: Callable[[str], None],
        own_chunks: Callable[[list[Parameter]], None] | None = None,
        carrier: FlagCarrier | None = None,
    ) -> None:
        self.enabled = enabled
        #: The flags' ride in the last bucket (where ``carrier.installed``), else the side channel's all-reduce.
        self.carrier = carrier or FlagCarrier(list)
        self._warn = warn
        self.channel = channel
        #: With a reduce-scatter hook: writes each rank's received chunks into ``.grad`` (see ``settle_gradients``).
        self.own_chunks = own_chunks
        self._parameters: list[tuple[str, Parameter]] = []
        self._active = False
        #: Synced backwards checked in the current fit on this rank.
        self.checks = 0

    @property
    def active(self) -> bool:
        """The guard checks every synced backward of the current fit."""
        return self._active

    def describe(self) -> str:
        """How the guard runs, for the setup line."""
        if not self._active:
            return "on (checked once the wrapper is built)" if self.enabled else "off"
        return "on (flags in the last bucket)" if self.carrier.installed else "on (all-reduce per step)"

    def fit_starts(self, fit: FitStart) -> None:
        self.attach(fit.ddp)

    def fit_ends(self, failed: bool) -> None:
        self.detach()

    def attach(self, ddp: DistributedDataParallel) -> None:
        self._active = False
        self.checks = 0
        if not self.enabled or not self.channel.open:
            return
        if not can_complete_reductions(ddp):
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

    def check(
        self,
        ddp: DistributedDataParallel,
        step: int,
        flags: Sequence[int] = (),
        aborted: bool = False,
        never_started: bool = False,
    ) -> GuardOutcome:
        """After a synced backward (``aborted``: one that raised on this rank; ``never_started``: this rank failed
        before its synced backward began, so it launches every bucket; also taken when an aborted backward marked no
        gradient ready): complete this rank's reduction if it did not finish, and agree with the other ranks.
        ``flags`` travel with the guard's own (their maximum over the ranks is returned), so that another per-step
        decision (uneven inputs) costs no collective of its own.

        Where the flags ride in the last bucket, a rank with news sends them in the completion that launches it, and
        a rank whose reducer finished sent its own when its reducer launched it: no message of their own. A rank
        whose backward raised after its last bucket left has nothing to complete (its news is lost; its gradients
        were all-reduced whole).
        """
        message = reducer_unfinished(ddp)
        carrier = self.carrier if self.carrier.installed else None
        if carrier is not None and carrier.received and message is None:
            aborted = never_started = False  # every bucket left, the last with this rank's flags
        # a backward that raised before any gradient was ready marked nothing, so the reducer reports itself finished;
        # it launched no bucket either (torch runs its finalize only once every node of the graph succeeded)
        never_started = never_started or (aborted and message is None)
        unfinished = message is not None or aborted
        self.checks += 1
        sent = [int(unfinished), int(aborted), *flags]
        completion = None
        if unfinished:
            if carrier is not None:
                carrier.news = sent
            completion = complete_reduction(ddp, message or "", every_bucket=never_started)
        received = carrier.take() if carrier is not None else None
        agreed = received if received is not None else self.channel.maximum(sent)
        if not agreed[0]:
            return GuardOutcome(None, agreed[2:])
        return GuardOutcome(self._fault(ddp, step, completion, aborted=bool(agreed[1])), agreed[2:])

    def _fault(
        self, ddp: DistributedDataParallel, step: int, completion: Completion | None, aborted: bool
    ) -> SyncFault:
        unmarked = {id(p) for p in completion.unmarked} if completion is not None else set()
        local = [int(id(p) in unmarked) for _, p in self._parameters]
        no_grad = [int(p.grad is None) for _, p in self._parameters]
        counts = [completion.launched, completion.buckets] if completion is not None else [-1, -1]
        rows = self.channel.gather([*local, *no_grad, *counts])
        size = len(self._parameters)
        finished = [rank for rank, row in enumerate(rows) if row[-1] < 0]
        no_rank_had = [p for index, (_, p) in enumerate(self._parameters) if all(row[size + index] for row in rows)]
        # exact unless some backward failed, or bucket views were reduced in place on ranks that all stopped early
        # (the reduce-scatter's chunks are recorded as received, in place or not)
        in_place = ddp.gradient_as_bucket_view and self.own_chunks is None
        exact = not aborted and (bool(finished) or not in_place)
        reduced = [p for _, p in self._parameters]
        applied = settle_gradients(ddp, reduced, finished, no_rank_had, exact, self.own_chunks)
        return SyncFault(
            step=step,
            unused=tuple(tuple(name for (name, _), on in zip(self._parameters, row[:size]) if on) for row in rows),
            launched=tuple(None if row[-1] < 0 else BucketsLaunched(row[-2], row[-1]) for row in rows),
            aborted=aborted,
            skipped=not applied,
        )
