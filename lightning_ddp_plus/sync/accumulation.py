"""Gradient-accumulation windows: where a micro-batch sits, whether its backward all-reduces, how its loss is scaled.

``AccumulationWindow`` is the one owner of k and of those decisions; the pure functions below it are its rules, so
they are testable without processes. The front ends (Trainer and Fabric strategies) only say which micro-batch is
running and apply the answers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from lightning_ddp_plus.config.messages import ArgumentValueError, describe_bad_value
from lightning_ddp_plus.pipeline.component import BackwardEnd, FitStart, StepComponent

#: ``"mean"``: a short last window's gradient is the mean over the micro-batches it really had (as the HF Trainer).
#: ``"lightning"``: Lightning's rule, every window's gradient sum is divided by k, so a short window is shrunk by r/k.
ShortWindow = Literal["mean", "lightning"]


@dataclass(frozen=True)
class WindowPosition:
    """Where one micro-batch sits in its accumulation window.

    ``length`` is the number of micro-batches the window really has. When the epoch's length is not known (an
    iterable loader), ``length_known`` is False: the length is k until the epoch's last batch arrives, which closes
    the window early.

    >>> window_position(batch_number=10, steps=4, num_batches=10)
    WindowPosition(index=1, length=2, length_known=True)
    >>> window_position(batch_number=10, steps=4, num_batches=10).closes_window
    True
    """

    index: int  # 0-based position inside the window
    length: int
    length_known: bool = True

    @property
    def closes_window(self) -> bool:
        return self.index == self.length - 1


def window_position(batch_number: int, steps: int, num_batches: float | None, is_last: bool = False) -> WindowPosition:
    """Position of the ``batch_number``-th (1-based) micro-batch of an epoch of ``num_batches`` (``inf``/``None``
    when unknown) with windows of ``steps`` micro-batches; the last window of an epoch may be shorter. ``is_last``
    says that this micro-batch is the epoch's last (Lightning knows it one batch ahead, also for iterable loaders).

    >>> [window_position(b, 4, 10).length for b in range(1, 11)]
    [4, 4, 4, 4, 4, 4, 4, 4, 2, 2]
    >>> window_position(10, 4, float("inf"), is_last=True)
    WindowPosition(index=1, length=2, length_known=False)
    """
    start = (batch_number - 1) // steps * steps
    index = batch_number - 1 - start
    if num_batches is not None and num_batches != float("inf"):
        return WindowPosition(index=index, length=max(1, min(steps, int(num_batches) - start)))
    return WindowPosition(index=index, length=index + 1 if is_last else steps, length_known=False)


def loss_scale(position: WindowPosition, steps: int, short_window: ShortWindow, divided_by_steps: bool) -> float:
    """Factor applied to a micro-batch's loss before backward, so that the window's gradient is its mean.

    ``divided_by_steps``: the loss was already divided by k (Lightning's automatic optimization does that); otherwise
    (manual optimization, Fabric) the window divides it, by the window's real length with ``"mean"``. When the length
    is not known yet, the loss is divided by k and ``gradient_rescale`` corrects the short window at its end.

    >>> loss_scale(WindowPosition(0, 2), steps=4, short_window="mean", divided_by_steps=True)
    2.0
    >>> loss_scale(WindowPosition(0, 2), steps=4, short_window="mean", divided_by_steps=False)
    0.5
    >>> loss_scale(WindowPosition(0, 2), steps=4, short_window="lightning", divided_by_steps=False)
    0.25
    """
    divisor = position.length if short_window == "mean" and position.length_known else steps
    if divided_by_steps:
        return steps / divisor
    return 1.0 / divisor


def gradient_rescale(position: WindowPosition, steps: int, short_window: ShortWindow) -> float:
    """Factor for the accumulated gradients of a window that closed early on an epoch of unknown length.

    Its micro-batches were scaled by 1/k before anyone knew the window would be short; ``"mean"`` wants 1/length, so
    the gradients are multiplied by k/length before the optimizer step.

    >>> gradient_rescale(WindowPosition(1, 2, length_known=False), steps=4, short_window="mean")
    2.0
    >>> gradient_rescale(WindowPosition(1, 2, length_known=True), steps=4, short_window="mean")
    1.0
    """
    if short_window != "mean" or position.length_known or position.length >= steps:
        return 1.0
    return steps / position.length


def check_accumulation_steps(value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentValueError(
            describe_bad_value(
                "gradient_accumulation_steps",
                value,
                "expected a positive integer (micro-batches per optimizer step) or None.",
                "set e.g. `gradient_accumulation_steps=4`, or leave it None and use `Trainer(accumulate_grad_batches=...)`.",
            )
        )
    return value


def merge_accumulation_settings(strategy_steps: int | None, trainer_steps: object) -> int:
    """The one k both settings describe; fails when both are set and differ.

    ``Trainer(accumulate_grad_batches=1)`` is Lightning's default and so counts as unset.

    >>> merge_accumulation_settings(4, 1), merge_accumulation_settings(None, 3), merge_accumulation_settings(4, 4)
    (4, 3, 4)
    """
    if isinstance(trainer_steps, dict):
        raise ArgumentValueError(
            describe_bad_value(
                "accumulate_grad_batches",
                trainer_steps,
                "DDPPlusStrategy needs one fixed number of micro-batches per optimizer step; schedules are not supported.",
                "use one integer.",
            )
        )
    trainer_k = int(trainer_steps) if isinstance(trainer_steps, (int, float, str)) else 1
    if strategy_steps is None or trainer_k == 1:
        return strategy_steps or trainer_k
    if strategy_steps != trainer_k:
        raise ArgumentValueError(
            describe_bad_value(
                "gradient_accumulation_steps",
                strategy_steps,
                f"`Trainer(accumulate_grad_batches={trainer_k})` describes the same thing, and the two must agree.",
                "set only one of them (the strategy's also works in manual optimization).",
            )
        )
    return strategy_steps


def scale_gradients(parameters: Any, factor: float) -> None:
    """Multiply the gradients of ``parameters`` (an optimizer: those it updates) by ``factor``."""
    if factor == 1.0:
        return
    if hasattr(parameters, "param_groups"):
        parameters = [parameter for group in parameters.param_groups for parameter in group["params"]]
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.mul_(factor)


@dataclass
class SyncStats:
    """Counts kept on each rank: backward passes that all-reduced, backward passes that did not, and optimizer steps.
    With accumulation, ``synced_backwards == optimizer_steps`` (plus one with ``static_graph``, see R3)."""

    synced_backwards: int = 0
    skipped_backwards: int = 0
    optimizer_steps: int = 0

    def as_metrics(self, prefix: str = "ddp/") -> dict[str, float]:
        return {f"{prefix}{name}": float(value) for name, value in asdict(self).items()}


class AccumulationWindow(StepComponent):
    """Owns k and decides, per micro-batch, its loss scale and whether its backward all-reduces.

    Args:
        steps: k as the user gave it to the strategy (``None``: not set there).
        short_window: how a short last window is averaged.

    >>> window = AccumulationWindow(steps=None, short_window="mean")
    >>> window.reconcile(trainer_steps=4)
    4
    >>> window.syncs(WindowPosition(0, 4), static_graph=False), window.syncs(WindowPosition(3, 4), static_graph=False)
    (False, True)
    """

    def __init__(self, steps: int | None, short_window: ShortWindow) -> None:
        self.requested = steps
        self.steps = steps or 1
        self.short_window: ShortWindow = short_window
        self.stats = SyncStats()
        self._synced_backward_seen = False
        self._micro_batches = 0  # for front ends without a loop that counts (Fabric)
        #: The training step gives ``num_items``: the window's items divide its gradient (``item_averaging``).
        self.per_item = False

    def reconcile(self, trainer_steps: object) -> int:
        """Settle k once with the Trainer's ``accumulate_grad_batches`` (before anything is launched)."""
        self.steps = merge_accumulation_settings(self.requested, trainer_steps)
        return self.steps

    def set_steps(self, steps: int) -> None:
        """A resume on another number of ranks changed k (``on_world_size_change="keep_global_batch"``)."""
        self.steps = steps

    def reset(self) -> None:
        """A new fit (or a new DDP wrapper): counts restart, and a static graph's first backward must sync again."""
        self.stats = SyncStats()
        self._synced_backward_seen = False
        self._micro_batches = 0
        self.per_item = False

    def fit_starts(self, fit: FitStart) -> None:
        self.reset()

    def after_backward(self, backward: BackwardEnd) -> None:
        self.record_backward(backward.synced)

    def must_sync_first_backward(self, static_graph: bool) -> bool:
        # torch's reducer asserts (expect_autograd_hooks_) when the very first backward of a static graph runs under
        # no_sync (R3). So the first micro-batch all-reduces too; averaging is linear and that gradient is already
        # identical on every rank, so the window's result stays exact, at the cost of one extra all-reduce per run.
        return static_graph and not self._synced_backward_seen

    def syncs(self, position: WindowPosition, static_graph: bool) -> bool:
        """Whether this micro-batch's backward all-reduces: it closes its window, or R3 needs it."""
        return self.steps == 1 or position.closes_window or self.must_sync_first_backward(static_graph)

    def loss_scale(self, position: WindowPosition, divided_by_steps: bool) -> float:
        return 1.0 if self.steps == 1 else loss_scale(position, self.steps, self.short_window, divided_by_steps)

    def gradient_rescale(self, position: WindowPosition) -> float:
        return 1.0 if self.per_item else gradient_rescale(position, self.steps, self.short_window)

    def peek(self, is_last: bool = False) -> WindowPosition:
        """For front ends that count micro-batches themselves (Fabric): the position of the one about to run;
        ``is_last`` says it is the last of its epoch, which closes the window."""
        return window_position(self._micro_batches + 1, self.steps, None, is_last=is_last)

    def advance(self, position: WindowPosition) -> None:
        """The micro-batch at ``position`` has run its backward."""
        self._micro_batches = 0 if position.closes_window else self._micro_batches + 1

    def step_mid_window_warning(self) -> str:
        """What to say when manual optimization steps on a micro-batch that does not close its window."""
        return (
            f"optimizer.step() was called on a micro-batch that does not close its accumulation window "
            f"(gradient_accumulation_steps={self.steps}): its gradients were not all-reduced, so replicas will "
            "diverge. Fix: call it only when `self.trainer.strategy.sync_gradients` is True."
        )

    def record_backward(self, synced: bool) -> None:
        if synced:
            self.stats.synced_backwards += 1
            self._synced_backward_seen = True
        else:
            self.stats.skipped_backwards += 1

    def record_optimizer_step(self) -> int:
        self.stats.optimizer_steps += 1
        return self.stats.optimizer_steps
