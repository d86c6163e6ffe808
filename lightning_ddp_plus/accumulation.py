"""Gradient-accumulation windows: where a micro-batch sits, whether its backward all-reduces, how its loss is scaled.

Pure functions over integers, so the rules are testable without processes; the strategy applies them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Optional

from lightning_ddp_plus._messages import describe_bad_value

#: ``"mean"``: a short last window's gradient is the mean over the micro-batches it really had (as the HF Trainer).
#: ``"lightning"``: Lightning's rule, every window's gradient sum is divided by k, so a short window is shrunk by r/k.
ShortWindow = Literal["mean", "lightning"]
SHORT_WINDOW_MODES = ("mean", "lightning")


@dataclass(frozen=True)
class WindowPosition:
    """Where one micro-batch sits in its accumulation window.

    >>> window_position(batch_number=10, steps=4, num_batches=10)
    WindowPosition(index=1, length=2)
    >>> window_position(batch_number=10, steps=4, num_batches=10).closes_window
    True
    """

    index: int  # 0-based position inside the window
    length: int  # micro-batches the window really has (short at the end of an epoch)

    @property
    def closes_window(self) -> bool:
        return self.index == self.length - 1


def window_position(batch_number: int, steps: int, num_batches: Optional[float]) -> WindowPosition:
    """Position of the ``batch_number``-th (1-based) micro-batch of an epoch of ``num_batches`` (``inf``/``None``
    when unknown) with windows of ``steps`` micro-batches; the last window of an epoch may be shorter.

    >>> [window_position(b, 4, 10).length for b in range(1, 11)]
    [4, 4, 4, 4, 4, 4, 4, 4, 2, 2]
    """
    start = (batch_number - 1) // steps * steps
    length = steps
    if num_batches is not None and num_batches != float("inf"):
        length = max(1, min(steps, int(num_batches) - start))
    return WindowPosition(index=batch_number - 1 - start, length=length)


def loss_scale(position: WindowPosition, steps: int, short_window: ShortWindow, automatic: bool) -> float:
    """Factor applied to a micro-batch's loss before backward.

    In automatic optimization Lightning has already divided the loss by ``steps``; in manual optimization the
    strategy divides it (the user does not), by the real window length with ``"mean"``.

    >>> loss_scale(WindowPosition(0, 2), steps=4, short_window="mean", automatic=True)
    2.0
    >>> loss_scale(WindowPosition(0, 2), steps=4, short_window="mean", automatic=False)
    0.5
    >>> loss_scale(WindowPosition(0, 2), steps=4, short_window="lightning", automatic=False)
    0.25
    """
    divisor = position.length if short_window == "mean" else steps
    if automatic:
        return steps / divisor
    return 1.0 / divisor


def check_accumulation_steps(value: Optional[int]) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            describe_bad_value(
                "gradient_accumulation_steps", value, "expected a positive integer (micro-batches per optimizer step) or None.", "set e.g. `gradient_accumulation_steps=4`, or leave it None and use `Trainer(accumulate_grad_batches=...)`."
            )
        )
    return value


def merge_accumulation_settings(strategy_steps: Optional[int], trainer_steps: object) -> int:
    """The one k both settings describe; fails when both are set and differ.

    ``Trainer(accumulate_grad_batches=1)`` is Lightning's default and so counts as unset.

    >>> merge_accumulation_settings(4, 1), merge_accumulation_settings(None, 3), merge_accumulation_settings(4, 4)
    (4, 3, 4)
    """
    if isinstance(trainer_steps, dict):
        raise ValueError(
            describe_bad_value("accumulate_grad_batches", trainer_steps, "DDPPlusStrategy needs one fixed number of micro-batches per optimizer step; schedules are not supported.", "use one integer.")
        )
    trainer_k = int(trainer_steps) if trainer_steps is not None else 1
    if strategy_steps is None or trainer_k == 1:
        return strategy_steps or trainer_k
    if strategy_steps != trainer_k:
        raise ValueError(
            f"`DDPPlusStrategy(gradient_accumulation_steps={strategy_steps})` and `Trainer(accumulate_grad_batches={trainer_k})` "
            "describe the same thing and disagree. Fix: set only one of them (the strategy's also works in manual optimization)."
        )
    return strategy_steps


@dataclass
class SyncStats:
    """Counts kept by the strategy on each rank: backward passes that all-reduced, backward passes that did not, and
    optimizer steps. With accumulation, ``synced_backwards == optimizer_steps``."""

    synced_backwards: int = 0
    skipped_backwards: int = 0
    optimizer_steps: int = 0

    def as_metrics(self, prefix: str = "ddp/") -> dict[str, float]:
        return {f"{prefix}{name}": float(value) for name, value in asdict(self).items()}
