"""``bucket_cap_mb="auto"``: time a few bucket sizes during the first optimizer steps and keep the fastest.

The best size depends on the link and the model: small buckets start the all-reduce early and overlap it with the
backward, but each bucket pays the link's latency; large ones pay it once but start late. Rather than guess, the tuner
gives each candidate a few optimizer steps on the real job and measures them with torch's own DDP runtime statistics
(``backward_compute_time + backward_comm_time - backward_compute_comm_overlap_time``: the backward from its first
gradient to its last all-reduced bucket). A candidate's first iteration is not timed (torch buckets in parameter order
then, and rebuilds the buckets from the real gradient order afterwards). The ranks average their figures with one
all-reduce so that all of them keep the same size, and the reducer is rebuilt in place between optimizer steps (no
gradient is pending then), so training itself is untouched: only its speed differs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.config.messages import ArgumentValueError, describe_bad_value
from lightning_ddp_plus.pipeline.component import FitStart, StepComponent
from lightning_ddp_plus.private_apis.torch_ddp import logging_data, record_runtime_stats, set_bucket_cap
from lightning_ddp_plus.sync.comm_hooks import CommHook

#: The sizes ``"auto"`` tries, in MiB; ``None`` is torch's default (25 MiB with a 1 MiB first bucket).
AUTO_BUCKET_CANDIDATES_MB: tuple[float | None, ...] = (None, 1, 5, 100)
#: Timed iterations per candidate (after its untimed first one).
TIMED_ITERATIONS = 2


def check_auto_with_hook(bucket_cap_mb: object, hook: object) -> None:
    """``bucket_cap_mb="auto"`` rebuilds the buckets while it times them, which PowerSGD's per-bucket state forbids."""
    if bucket_cap_mb == "auto" and hook in (CommHook.POWERSGD, CommHook.BATCHED_POWERSGD):
        assert isinstance(hook, CommHook)
        raise ArgumentValueError(
            describe_bad_value(
                "bucket_cap_mb",
                bucket_cap_mb,
                f"with the {hook.value} hook, which keeps its error feedback per bucket, a size or None is "
                "allowed, not 'auto' (it rebuilds the buckets while it times them).",
                "set a size (e.g. `bucket_cap_mb=25`, or None for torch's default) with PowerSGD.",
            )
        )


def label(cap_mb: float | None) -> str:
    """A candidate size as the choice is logged.

    >>> label(None), label(5), label(2.5)
    ('25 (1 MiB first bucket)', '5', '2.5')
    """
    return "25 (1 MiB first bucket)" if cap_mb is None else f"{cap_mb:g}"


def backward_ns(logging_data: dict[str, Any]) -> int | None:
    """The backward's span, first gradient to last bucket all-reduced, from one iteration's DDP logging data.

    >>> backward_ns({"backward_compute_time": 30, "backward_comm_time": 20, "backward_compute_comm_overlap_time": 15})
    35
    """
    try:
        compute = int(logging_data["backward_compute_time"])
        comm = int(logging_data["backward_comm_time"])
        overlap = int(logging_data["backward_compute_comm_overlap_time"])
    except KeyError:
        return None
    return compute + comm - overlap


def fastest(medians_ms: Sequence[float], candidates: Sequence[float | None]) -> float | None:
    """The candidate with the smallest time (the earlier one on a tie).

    >>> fastest([40.0, 52.0, 38.5, 38.5], (None, 1, 5, 100))
    5
    """
    best = min(range(len(candidates)), key=lambda index: (medians_ms[index], index))
    return candidates[best]


@dataclass
class BucketChoice:
    """What the tuner measured and chose: ``medians_ms[i]`` belongs to ``candidates[i]`` (mean over the ranks)."""

    candidates: tuple[float | None, ...]
    medians_ms: list[float]
    chosen_mb: float | None

    def describe(self) -> str:
        figures = ", ".join(f"{label(c)}: {t:.1f} ms" for c, t in zip(self.candidates, self.medians_ms))
        return f"bucket_cap_mb='auto' chose {label(self.chosen_mb)} MiB (backward with all-reduce per size: {figures})"


@dataclass
class BucketTuner(StepComponent):
    """Gives each candidate ``1 + TIMED_ITERATIONS`` optimizer steps, then keeps the fastest for the rest of the fit.

    ``step_done`` is called after every optimizer step on every rank (the choice is a collective at the same step).
    """

    candidates: tuple[float | None, ...] = AUTO_BUCKET_CANDIDATES_MB
    timed_iterations: int = TIMED_ITERATIONS
    on_rebuilt: Callable[[DistributedDataParallel], None] | None = None
    info: Callable[[str], None] = print
    choice: BucketChoice | None = None
    _index: int = 0
    _iterations: int = 0
    _times_ns: list[list[int]] = field(default_factory=list)

    _ddp: DistributedDataParallel | None = None

    def fit_starts(self, fit: FitStart) -> None:
        """A new fit on a wrapper built with the first candidate (torch's default)."""
        self.choice, self._index, self._iterations = None, 0, 0
        self._times_ns = [[] for _ in self.candidates]
        self._ddp = fit.ddp

    def fit_ends(self, failed: bool) -> None:
        self.stop()
        self._ddp = None

    @property
    def tuning(self) -> bool:
        return self.choice is None and self._index < len(self.candidates)

    def step_done(self, step: int) -> None:
        ddp = self._ddp
        if ddp is None or not self.tuning:
            return
        self._iterations += 1
        if self._iterations > 1:  # the first iteration of a reducer buckets in parameter order: not timed
            record_runtime_stats(ddp)  # this iteration's figures now, not at the next forward
            measured = backward_ns(logging_data(ddp))
            if measured is not None:
                self._times_ns[self._index].append(measured)

    def step_counted(self, step: int) -> None:
        """A candidate timed through: the next one, or, after the last, the choice (an all-reduce: every rank
        reaches it at the same step, once the loop counted it)."""
        ddp = self._ddp
        if ddp is None or not self.tuning or self._iterations < 1 + self.timed_iterations:
            return
        self._index, self._iterations = self._index + 1, 0
        if self._index < len(self.candidates):
            self._switch(ddp, self.candidates[self._index])
        else:
            self._choose(ddp)

    def stop(self) -> None:
        """The fit ends: say so if it ended before a size was chosen (the size then in use stays)."""
        if self.tuning and (self._index or self._iterations):
            needed = len(self.candidates) * (1 + self.timed_iterations)
            done = self._index * (1 + self.timed_iterations) + self._iterations
            self.info(
                f"bucket_cap_mb='auto': the fit ended after {done} optimizer steps, before the {needed} that timing "
                f"{len(self.candidates)} sizes takes; the buckets stayed at {label(self.candidates[self._index])} MiB."
            )
        self._index = len(self.candidates)

    def _switch(self, ddp: DistributedDataParallel, cap_mb: float | None) -> None:
        set_bucket_cap(ddp, cap_mb)
        if self.on_rebuilt is not None:
            self.on_rebuilt(ddp)

    def _choose(self, ddp: DistributedDataParallel) -> None:
        local = [statistics.median(times) / 1e6 if times else float("inf") for times in self._times_ns]
        medians = torch.tensor(local, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = next(ddp.module.parameters()).device
            medians = medians.to(device)
            dist.all_reduce(medians)  # SUM: every rank gets the same figures, hence the same choice
            medians = medians.cpu() / dist.get_world_size()
        figures = medians.tolist()
        chosen = fastest(figures, self.candidates)
        self.choice = BucketChoice(tuple(self.candidates), figures, chosen)
        if chosen != self.candidates[-1]:
            self._switch(ddp, chosen)
        self.info(self.choice.describe())
