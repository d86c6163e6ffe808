"""``num_items``: the optimizer step's gradient is the mean over every item (token, pixel, sample) of the
accumulation window on every rank, as one device computing the loss over the concatenated global batch would get.

DDP averages over ranks and accumulation over micro-batches: both weigh every micro-batch the same, which is wrong
for a loss that is a mean over a varying number of items (padded or packed sequences). Here the count is learnt
after the fact, not up front: each micro-batch's backward runs on ``loss * num_items / unit`` (its items' summed loss,
divided by a constant every rank shares), DDP all-reduces as always, and when the window closes one all-reduce of a
few numbers gives the window's items on every rank; the gradients are then multiplied by
``world_size * unit / items``. Those numbers are known before the closing backward's last bucket leaves, so where the
step's flags ride in it (``flag_carrier``, a bucket of 32 or 64 bits) they ride along and cost no message of their
own. Knowing the count up front would need every micro-batch of the window fetched (and
held in memory) before the first forward, which is what the Hugging Face Trainer does; scaling afterwards needs
nothing held, costs one host read per optimizer step (and the small all-reduce where nothing rides), and no device
sync per micro-batch (the counts stay on the device until then).

``unit`` is the previous window's mean items per micro-batch (1 in a fit's first window), the same on every rank
because it comes from the all-reduce: it keeps the summed loss near the size of a mean loss, so that a compressing
comm hook (fp16, bf16) sees gradients of the usual size; with a comm hook the count's all-reduce runs before the
backward that closes the window instead, so that the buckets hold the final gradient from the first window on.

With ``across_ranks=False`` (the Hugging Face Trainer's ``average_tokens_across_devices=False``) each rank divides by
its own window's items before the all-reduce, and DDP's average over ranks follows: no collective is added.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, describe_bad_value
from lightning_ddp_plus.pipeline.component import AgreedStep, BackwardStart, FitStart, StepComponent
from lightning_ddp_plus.sync.accumulation import AccumulationWindow

_ALLOWED = "a non-negative integer or a one-element integer tensor: the number of items the loss is a mean over."
_FIX = "return `{'loss': loss, 'num_items': (labels != -100).sum()}` from `training_step`."


def check_num_items(value: Any) -> int | Tensor:
    """``value`` as a count: an ``int`` (checked here) or a one-element integer tensor (its sign is checked with the
    window's all-reduce, so that no micro-batch waits for the device).

    >>> check_num_items(12), check_num_items(torch.tensor(3))
    (12, tensor(3))
    >>> check_num_items(2.5)
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentTypeError: `num_items=2.5` is not valid: a non-negative integer ...
    """
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            shown = f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
            raise ArgumentTypeError(describe_bad_value("num_items", shown, _ALLOWED, _FIX))
        return value.detach().reshape(())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(describe_bad_value("num_items", value, _ALLOWED, _FIX))
    if value < 0:
        raise ArgumentValueError(describe_bad_value("num_items", value, _ALLOWED, _FIX))
    return value


def counts_first(arguments: Any) -> tuple[bool, bool]:
    """(whether the window's items are counted before its closing backward rather than after, whether a comm hook
    sees the buckets) for the strategy's ``arguments``. Counted first with a comm hook: a compressing one would
    otherwise see the summed loss, which could overflow fp16 in a fit's first window. Not with
    ``chunk_size="auto"``, which may run that backward again: a rank whose first attempt fails before it cannot
    know whether its step gives ``num_items``, so it could not match the others' collective.

    >>> from types import SimpleNamespace as S
    >>> counts_first(S(comm_hook="fp16", ddp_comm_wrapper=None, chunk_size=None))
    (True, True)
    >>> counts_first(S(comm_hook="fp16", ddp_comm_wrapper=None, chunk_size="auto"))
    (False, True)
    """
    hooked = arguments.comm_hook is not None or arguments.ddp_comm_wrapper is not None
    return hooked and arguments.chunk_size != "auto", hooked


@dataclass(frozen=True)
class WindowItems:
    """One closed window, summed over every rank: the items' summed loss, the items, the micro-batches that gave a
    count, those that did not, and the negative counts among them."""

    loss_sum: float
    items: float
    counted: int
    uncounted: int
    negative: int

    def problem(self) -> str | None:
        """What was wrong with the counts, in the package's error wording; ``None`` when nothing."""
        if self.uncounted:
            return describe_bad_value(
                "num_items",
                f"given for {self.counted} and missing for {self.uncounted} micro-batches of one optimizer step",
                "every training step of a fit returns it, or none does (the first one decides).",
                "return `num_items` from every training step (0 when a batch has no items).",
            )
        if self.negative:
            return describe_bad_value("num_items", f"negative on {self.negative} micro-batches", _ALLOWED, _FIX)
        return None


#: The agreement's flags of per-item averaging: some rank averages per item, some rank does not (both: they differ).
ITEMS_ON, ITEMS_OFF = "num_items given", "num_items not given"
#: The window's numbers summed over the ranks, in this order (``ItemAveraging.numbers``; what rides in the last bucket):
#: the items' summed loss, the items, the micro-batches with a count and without, the negative counts; then whether a
#: rank gives none.
_WINDOW_NUMBERS = ("_loss_sum", "_items", "_counted", "_uncounted", "_negative")
ITEM_SUMS = len(_WINDOW_NUMBERS) + 1


class ItemAveraging(StepComponent):
    """The window's item counts and the rescale at its end (see the module's docstring).

    Every rank decides at its fit's first backward whether the training step gives counts; the ranks compare their
    decisions in the first window's agreement (two flags, exchanged only where some rank gives counts), or, where the
    counts are all-reduced before the closing backward (``count_first``), in that all-reduce, which every rank then
    joins: ranks that decided otherwise would issue different collectives, so every rank ends with the reason instead.

    Args:
        window: the accumulation window, told when per-item averaging is on (it then rescales nothing itself).
        across_ranks: divide by every rank's items (summed over the ranks once per optimizer step); False: by this
            rank's own.
        count_first: count every rank's items before the backward that closes the window, not after it, so that the
            buckets hold the final gradient (see ``counts_first``).
        hooked: a comm hook sees the buckets (the first window counted after its backward is checked once).
        record: called around the all-reduce with its name and size (the engine's collective ledger).
        info: how a one-line report reaches the user (rank 0 only).
        carried: the window's numbers summed over the ranks as the closing backward's last bucket carried them
            (``sums_now``), or ``None`` where they did not ride: they are then all-reduced.
    """

    agreement_flags = (ITEMS_ON, ITEMS_OFF)
    #: The counts may be all-reduced before the closing backward (not with ``chunk_size="auto"``).
    may_count_first = True
    #: The precision scales the loss for fp16 (a ``GradScaler``): see ``uses_gradient_scaler``.
    scaled_for_fp16 = False

    def __init__(
        self,
        window: AccumulationWindow,
        across_ranks: bool = True,
        count_first: bool = False,
        hooked: bool = False,
        record: Callable[[str, int], AbstractContextManager[Any]] | None = None,
        info: Callable[[str], None] = lambda message: None,
        carried: Callable[[], Tensor | None] = lambda: None,
    ) -> None:
        self.window, self.across_ranks, self.info, self.carried = window, across_ranks, info, carried
        self.count_first, self.hooked = count_first, hooked
        self.record = record or (lambda op, size: nullcontext())
        #: A count given for the next backward (a training step's output, ``manual_backward``, ``fabric.backward``).
        self.pending: Any = None
        #: The trainable parameters and the group of the wrapper whose backward closes the window.
        self._parameters: list[Tensor] = []
        self._group: Any = None
        #: The previous window's mean items per micro-batch (see the module's docstring); the fit's first window.
        self.unit: Tensor | float = 1.0
        self.first_window: bool = True
        self.reset()

    @classmethod
    def for_arguments(
        cls,
        arguments: Any,
        window: AccumulationWindow,
        record: Callable[[str, int], AbstractContextManager[Any]] | None = None,
        info: Callable[[str], None] = lambda message: None,
        carried: Callable[[], Tensor | None] = lambda: None,
    ) -> ItemAveraging:
        """The averaging the strategy's ``arguments`` ask for (``average_items_across_ranks``, and the comm hook and
        ``chunk_size`` that decide ``counts_first``)."""
        first, hooked = counts_first(arguments)
        across = arguments.average_items_across_ranks
        averaging = cls(window, across, first, hooked, record=record, info=info, carried=carried)
        averaging.may_count_first = arguments.chunk_size != "auto"
        return averaging

    def uses_gradient_scaler(self, scaler: bool) -> None:
        """The front end's precision has a gradient scaler (fp16): the counts are all-reduced before the closing
        backward, so that the first window's micro-batches run at their own items' scale (the scaler's 65536 times
        a summed loss overflowed fp16, and the scaler skipped the fit's first step without a word), and a window
        without items is skipped through the scaler (its step asserts on gradients that are all ``None``)."""
        self.scaled_for_fp16 = scaler
        if scaler and self.may_count_first:
            self.count_first = True

    def fit_starts(self, fit: FitStart) -> None:
        self.reset()

    def agreement_needed(self) -> bool:
        """The ranks compare their decisions in the fit's first window only."""
        return self.first_window

    def agreement_values(self) -> dict[str, int]:
        return {ITEMS_ON: int(self.on is True), ITEMS_OFF: int(self.on is False)} if self.first_window else {}

    def before_backward(self, backward: BackwardStart) -> None:
        self._closing = backward.closes_window
        if self._closing and self.on is not False:  # without counts (decided at the fit's first backward): no work
            self._parameters = [p for p in backward.ddp.module.parameters() if p.requires_grad]
            self._group = backward.ddp.process_group

    def agreed(self, agreed: AgreedStep) -> None:
        """After the backward that closed the window (every rank agreed, and no rank ran out of memory)."""
        if agreed.flags.get(ITEMS_ON) and agreed.flags.get(ITEMS_OFF):
            raise ArgumentValueError(_ranks_differ())
        if self.on and not self._closing:
            self.refuse_mid_window_sync()
        if self._closing and not agreed.out_of_memory:
            self.window_closed(self._parameters, self._group)

    def refuse_mid_window_sync(self) -> None:
        """A synced backward that closes no window (``static_graph=True`` with accumulation: torch's reducer needs the
        fit's first backward synced) all-reduces the items' summed loss before any count is known. Exact on its own
        (the window's end divides the sum), not where something acts on that sum as if it were final: a comm hook
        (fp16 compression overflows at 65504, and the check for it runs only at the window's end), each rank's own
        items (their division runs before the closing all-reduce, this one went unscaled). Measured: fp16
        compression on large gradients trained to NaN on diverged replicas, and each rank's own items 2e-4 away from
        one device (6e-8 without the static graph). ``optimizer_sharding=True`` stays exact (its reduce-scatter counts
        the received chunk again, and the window's end divides the sum). Every rank raises here, before the optimizer
        step."""
        reasons = [
            reason
            for applies, reason in (
                (self.hooked, "a `ddp_comm_hook` (a compressing hook would overflow on the items' summed loss)"),
                (not self.across_ranks, "`average_items_across_ranks=False` (each rank divides before its all-reduce)"),
            )
            if applies
        ]
        if reasons:
            raise ArgumentValueError(
                describe_bad_value(
                    "num_items",
                    "given with static_graph=True and gradient accumulation",
                    "the fit's first micro-batch is all-reduced before its window's count is known (torch's static "
                    "graph needs it synced), which is exact only without " + "; ".join(reasons) + ".",
                    "set `static_graph=False` (the first micro-batch then waits for its window), or drop the setting "
                    "named.",
                )
            )

    def closing_without_counts(self, ddp: Any) -> None:
        """Before the first window's closing backward of a rank that gives no counts, where the others' counts are
        all-reduced before it (``count_first``): it joins that all-reduce with none, so that a rank that gives them
        does not wait alone, and every rank ends with the reason when some do."""
        if not (self.count_first and self.across_ranks and self.first_window and self.on is False):
            return
        self.first_window = False  # none gives counts (else this raises): none joins again
        self._totals([p for p in ddp.module.parameters() if p.requires_grad], ddp.process_group, without_counts=True)
        self._clear()

    def reset(self) -> None:
        """A new fit: the first training step decides again whether counts are given (and a count an earlier fit
        left unused is dropped)."""
        self.on: bool | None = None
        self.pending = None
        self.unit, self.first_window = 1.0, True
        #: The last window's loss per item over every rank (what one device would print); ``None`` before one.
        self.loss_per_item: float | None = None
        #: The running backward closes the window; the trainable parameters and the group of its wrapper.
        self._closing = False
        self._clear()

    def _clear(self) -> None:
        self._loss_sum: Tensor | float = 0.0
        self._items: Tensor | int = 0
        self._negative: Tensor | int = 0
        self._counted = self._uncounted = 0
        #: What the window's closing micro-batch is divided by, where it was known before its backward.
        self._closing_divisor: Tensor | float | None = None
        self._counted_early: WindowItems | None = None

    def take(self) -> int | Tensor | None:
        """The count for the backward about to run (``None``: none given); the fit's first backward decides."""
        value, self.pending = self.pending, None
        if self.on is None:
            self.on = self.window.per_item = value is not None
            if self.on:
                self.info(
                    "per-item averaging is on (the training step returns `num_items`): each optimizer step's gradient "
                    "is the mean over every item of its window on "
                    + ("every rank." if self.across_ranks else "each rank, then averaged over the ranks.")
                )
        elif value is not None and not self.on:
            raise ArgumentValueError(
                describe_bad_value(
                    "num_items",
                    value,
                    "every training step of a fit returns it, or none does; the fit's first step did not.",
                    "return `num_items` from every training step (0 when a batch has no items).",
                )
            )
        if value is None:
            if self.on:
                self._uncounted += 1
            return None
        return check_num_items(value)

    def loss_factor(self, count: int | Tensor) -> Tensor | float:
        """The factor on the mean loss of a micro-batch of ``count`` items before its backward, once ``recorded``
        (the micro-batch that closes the window is divided by what ``before_closing_backward`` decided)."""
        return count / (self.unit if self._closing_divisor is None else self._closing_divisor)

    def recorded(self, count: int | Tensor, mean_loss: Tensor) -> None:
        """A backward is about to run on a micro-batch of ``count`` items (0: a padding batch) whose loss is
        ``mean_loss``, a mean over them."""
        self._counted += 1
        if self.count_first and self.first_window and self._counted == 1:
            # this rank's own unit: the closing backward's rescale (``unit / divisor``) acts on local gradients,
            # so the ranks need not share it, and the window starts at a mean loss's size, not a summed loss's
            self.unit = count.clamp(min=1).double() if isinstance(count, Tensor) else float(max(count, 1))
        self._items = self._items + count
        # a mean over no item is NaN (torch's cross entropy with every label ignored): it adds nothing
        summed = mean_loss.detach().double() * count
        if isinstance(count, Tensor):
            self._negative = self._negative + (count < 0).long()
            self._loss_sum = self._loss_sum + torch.where(count != 0, summed, torch.zeros_like(summed))
        elif count:
            self._loss_sum = self._loss_sum + summed

    def mark(self) -> tuple[Any, ...]:
        """Where the counts stand before a batch's attempt (a batch run again after an out-of-memory error)."""
        return self._loss_sum, self._items, self._negative, self._counted, self._uncounted

    def rewind(self, mark: tuple[Any, ...]) -> None:
        self._loss_sum, self._items, self._negative, self._counted, self._uncounted = mark
        self._closing_divisor = self._counted_early = None

    def before_closing_backward(self, parameters: list[Tensor], group: Any = None) -> None:
        """Before the backward that closes the window (after ``recorded``), where the items are known before the
        all-reduce: this rank's own (``across_ranks=False``), or every rank's (``count_first``: the all-reduce of
        the counts runs now). The gradients so far, and this micro-batch's loss, are then divided by the items
        (times the world size, which DDP's average divides again), so that the buckets hold the final gradient."""
        if not self.on or (self.across_ranks and not self.count_first):
            return
        if self.across_ranks:
            window, world_size = self._totals(parameters, group)
            self._counted_early = window
            divisor: Tensor | float = window.items / world_size if window.items else 1.0
        else:
            items = self._items
            divisor = items.clamp(min=1) if isinstance(items, Tensor) else max(items, 1)
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(self.unit / divisor)
        self._closing_divisor = divisor

    def numbers(self, dtype: torch.dtype, device: torch.device, without_counts: bool = False) -> Tensor:
        """This rank's numbers of the window, to be summed over the ranks (``_WINDOW_NUMBERS``, then whether this
        rank gives no counts)."""
        numbers = [*(getattr(self, name) for name in _WINDOW_NUMBERS), int(without_counts)]
        return torch.stack([torch.as_tensor(n, dtype=dtype, device=device).reshape(()) for n in numbers])

    def sums_now(self, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """What rides in the last bucket as it leaves (``flag_carrier``): the window's numbers in the backward that
        closes it, where they are summed after it (``None``: nothing to sum now)."""
        if not (self.on and self._closing and self.across_ranks) or self.count_first:
            return None
        return self.numbers(dtype, device)

    def _totals(self, parameters: list[Tensor], group: Any, without_counts: bool = False) -> tuple[WindowItems, int]:
        """The window's numbers summed over the ranks (as the last bucket carried them, else one all-reduce; this
        rank's alone with ``across_ranks=False``) and the world size; raises on counts given for some micro-batches
        and not others, or negative, and on ranks that give none beside ranks that do (``without_counts``: this rank
        gives none, see ``closing_without_counts``)."""
        device = parameters[0].device if parameters else torch.device("cpu")
        carried = None if without_counts or self.count_first or not self.across_ranks else self.carried()
        summed = self.numbers(torch.float64, device, without_counts) if carried is None else carried
        world_size = 1
        if self.across_ranks and dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size(group)
            if carried is None:
                with self.record("item count all_reduce (num_items)", summed.numel() * 8):
                    dist.all_reduce(summed, group=group)
        values = summed.tolist()  # the one host read per optimizer step
        window = WindowItems(values[0], values[1], int(values[2]), int(values[3]), int(values[4]))
        ranks_without = int(values[5])
        if ranks_without and window.counted:
            raise ArgumentValueError(_ranks_differ())
        if not ranks_without and (problem := window.problem()) is not None:
            raise ArgumentValueError(problem)
        return window, world_size

    def window_closed(self, parameters: list[Tensor], group: Any = None) -> WindowItems | None:
        """After the window's synced backward (every rank agreed): the counts' all-reduce (unless it ran before the
        backward), then the gradients of ``parameters`` multiplied by ``world_size * unit / items``; with no item on
        any rank, the step is skipped (gradients set to ``None``, which every torch optimizer skips)."""
        if not self.on:
            self.first_window = False  # the ranks compared their decisions in this window's agreement
            return None
        early = self._counted_early
        window, world_size = (early, 1) if early is not None else self._totals(parameters, group)
        scaled_before = self._closing_divisor is not None
        unit, self.unit = self.unit, (window.items / window.counted if window.items > 0 else self.unit)
        first, self.first_window = self.first_window, False
        self.loss_per_item = window.loss_sum / window.items if window.items else None
        self._clear()
        if window.items == 0 and self.across_ranks:
            through = " (through the gradient scaler, which halves its scale)" if self.scaled_for_fp16 else ""
            warnings.warn(
                f"num_items: no item in this optimizer step's window on any rank; the step is skipped{through}."
            )
            for parameter in parameters:
                # the scaler's step asserts when no gradient is left; a non-finite one makes it skip the step
                parameter.grad = torch.full_like(parameter, float("nan")) if self.scaled_for_fp16 else None
        elif not scaled_before:
            factor = world_size * unit / window.items
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.mul_(factor)
            if self.hooked and first:
                refuse_overflow(parameters)
            if self.scaled_for_fp16 and first:
                warn_first_window_overflow(parameters)
        return window


def _ranks_differ() -> str:
    return describe_bad_value(
        "num_items",
        "given by the first training step on some ranks and not on others",
        "every rank's training step returns it, or none does: the ranks would otherwise average differently and "
        "issue different collectives.",
        "return `num_items` on every rank (0 where a batch has no items), whatever the rank's data.",
    )


def _finite(parameters: list[Tensor]) -> bool:
    gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
    return not gradients or bool(torch.stack([torch.isfinite(gradient).all() for gradient in gradients]).all())


def warn_first_window_overflow(parameters: list[Tensor]) -> None:
    """A fit's first window counted after its backward under fp16's gradient scaler (``chunk_size="auto"``
    keeps the count after): it ran at the items' summed loss times the scaler's scale, and where that overflowed,
    the scaler skips the step. Said once, with the way to count first."""
    if not _finite(parameters):
        warnings.warn(
            "num_items: the fit's first window overflowed fp16 (with chunk_size='auto' its count comes after "
            "the backward, so it ran at the items' summed loss times the gradient scaler's scale): the scaler skips "
            "this optimizer step and halves its scale. Set a fixed `chunk_size` (or none) to count first."
        )


def refuse_overflow(parameters: list[Tensor]) -> None:
    """A fit's first window counted after its backward, with a comm hook (``chunk_size="auto"``): its buckets
    held the items' summed loss, which a compressing hook may have overflowed (fp16 stops at 65504). One check of
    every gradient, once per fit, so that the run ends with the reason instead of training on from NaN."""
    if not _finite(parameters):
        raise ArgumentValueError(
            describe_bad_value(
                "num_items",
                "a first window whose gradients are not finite after the comm hook",
                "with a comm hook and `chunk_size='auto'` the first window's buckets carry the items' summed loss"
                " (the window's count comes after its backward), which fp16 compression cannot hold above 65504.",
                "use a fixed `chunk_size` (the count then comes first and the buckets hold the final gradient),"
                " bf16 compression (`ddp_comm_hook='bf16'`), or no compression.",
            )
        )
