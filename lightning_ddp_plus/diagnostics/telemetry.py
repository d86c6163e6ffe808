"""Sync telemetry: per optimizer step, gradient buckets all-reduced, bytes sent (after compression), backward passes
synced and skipped, and torch's own timings of the forward, the backward's compute and communication and their overlap.

Nothing is patched and no Python code runs per bucket on the default path: bucket sizes and timings come from
torch's DDP runtime statistics (``DistributedDataParallel._get_ddp_logging_data()``, sampled at a rate set with
``_set_ddp_runtime_logging_sample_rate``), and bytes from the buckets the communication hook is handed (its
counter), reduced by what the named hook sends: half for fp16/bf16, PowerSGD's own count of compressed elements.
torch records an iteration's timings when the next one starts, so a step reports the latest iteration measured.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.diagnostics.phase_timings import TIMED_PHASES, PhaseTimes
from lightning_ddp_plus.pipeline.component import BackwardEnd, FitStart, StepComponent
from lightning_ddp_plus.private_apis.torch_ddp import logging_data, set_timing_sample_rate
from lightning_ddp_plus.sync.comm_hooks import CommHook, HookAssembly

_NS_PER_MS = 1e6
_TIMINGS = {
    "forward_ms": "forward_compute_time",
    "backward_compute_ms": "backward_compute_time",
    "backward_comm_ms": "backward_comm_time",
    "overlap_ms": "backward_compute_comm_overlap_time",
}


@dataclass
class StepTelemetry:
    """One optimizer step's communication; timings are those of ``timed_iteration`` (``nan`` when none is new)."""

    step: int = 0
    buckets: int = 0
    bytes_sent: int = 0
    synced_backwards: int = 0
    skipped_backwards: int = 0
    forward_ms: float = float("nan")
    backward_compute_ms: float = float("nan")
    backward_comm_ms: float = float("nan")
    overlap_ms: float = float("nan")
    timed_iteration: int = -1

    def as_metrics(self, prefix: str = "ddp/") -> dict[str, float]:
        return {
            f"{prefix}{name}": float(value)
            for name, value in asdict(self).items()
            if name != "step" and not math.isnan(value)
        }


_SUMMED = ("buckets", "bytes_sent", "synced_backwards", "skipped_backwards")


def bucket_layout(logging_data: dict[str, Any]) -> list[int]:
    """Sizes in bytes of the buckets the reducer all-reduces now (rebuilt after the first iteration).

    >>> bucket_layout({"bucket_sizes": "4202496", "rebuilt_bucket_sizes": "1050624, 1050624", "has_rebuilt_buckets": 1})
    [1050624, 1050624]
    """
    text = logging_data.get("rebuilt_bucket_sizes") if logging_data.get("has_rebuilt_buckets") else None
    text = text or logging_data.get("bucket_sizes") or ""
    return [int(size) for size in str(text).split(",") if size.strip()]


def compressed_bytes(hook: Any, handed_bytes: int, element_size: int, compressed_elements: int | None) -> int:
    """Bytes the hook really sends for buckets holding ``handed_bytes`` of gradients.

    ``compressed_elements``: PowerSGD's own count of elements sent for these buckets (``None``/0 during its warm-up,
    when it all-reduces the buckets uncompressed). A custom hook is reported as handed.

    >>> compressed_bytes(CommHook.FP16, 4000, 4, None)
    2000
    >>> compressed_bytes(CommHook.POWERSGD, 4000, 4, 50)
    200
    """
    if hook in (CommHook.FP16, CommHook.BF16):
        return handed_bytes // 2
    if hook in (CommHook.POWERSGD, CommHook.BATCHED_POWERSGD) and compressed_elements:
        return compressed_elements * element_size
    return handed_bytes


def phase_metrics(times: list[PhaseTimes], prefix: str = "ddp/") -> dict[str, float]:
    """Every rank's phase medians, as ``ddp/rank1/data_fetch_ms`` (what ``ddp-plus report`` draws side by side).

    >>> phase_metrics([PhaseTimes(1, 150.0, 6.0, 0.5, 0.4)])["ddp/rank1/data_fetch_ms"]
    150.0
    """
    return {
        f"{prefix}rank{rank_times.rank}/{phase.replace(' ', '_')}_ms": rank_times.of(phase)
        for rank_times in times
        for phase in TIMED_PHASES
    }


class SyncTelemetry(StepComponent):
    """Collects the figures of the current optimizer step; ``end_step`` closes it.

    Args:
        sample_rate: torch records timings for the first 10 synced iterations, then every ``sample_rate``-th.
    """

    def __init__(self, hooks: HookAssembly | None = None, sample_rate: int = 1) -> None:
        self.sample_rate, self.hooks = sample_rate, hooks
        self.current = StepTelemetry()
        self.last: StepTelemetry | None = None
        self.totals = StepTelemetry()
        self._ddp: weakref.ref[Any] | None = None
        self._hooks: HookAssembly | None = None
        self._layout: list[int] | None = None
        self._calls = self._handed = self._compressed = 0
        self._timed_iteration = 0

    def attach(self, ddp: DistributedDataParallel, hooks: HookAssembly) -> None:
        """Start a new fit on a new wrapper."""
        self.__init__(hooks, self.sample_rate)  # type: ignore[misc]  # every counter back to a new fit's
        self._ddp, self._hooks = weakref.ref(ddp), hooks
        self._calls, self._handed = hooks.counter.calls, hooks.counter.bucket_bytes
        set_timing_sample_rate(ddp, self.sample_rate)

    def fit_starts(self, fit: FitStart) -> None:
        assert self.hooks is not None, "SyncTelemetry(hooks=...) counts the hook's calls"
        self.attach(fit.ddp, self.hooks)

    def after_backward(self, backward: BackwardEnd) -> None:
        self.count_backward(backward.synced)

    def step_done(self, step: int) -> None:
        self.end_step(step)

    def reducer_rebuilt(self, ddp: DistributedDataParallel) -> None:
        """The wrapper has a new reducer (``bucket_cap_mb="auto"``): new bucket layout, iterations counted from 0."""
        self._layout, self._timed_iteration = None, 0
        set_timing_sample_rate(ddp, self.sample_rate)

    def _logging_data(self) -> dict[str, Any]:
        ddp = self._ddp() if self._ddp is not None else None
        return logging_data(ddp) if ddp is not None else {}

    def count_backward(self, synced: bool) -> None:
        if not synced:
            self.current.skipped_backwards += 1
            return
        self.current.synced_backwards += 1
        hooks = self._hooks
        if hooks is None or hooks.hook is None:
            if self._layout is None:
                data = self._logging_data()
                layout = bucket_layout(data)
                if data.get("has_rebuilt_buckets"):
                    self._layout = layout  # final from here on
            else:
                layout = self._layout
            self.current.buckets += len(layout)
            self.current.bytes_sent += sum(layout)
            return
        counter = hooks.counter
        calls, handed = counter.calls - self._calls, counter.bucket_bytes - self._handed
        self._calls, self._handed = counter.calls, counter.bucket_bytes
        compressed = getattr(hooks.state, "total_numel_after_compression", 0)
        elements, self._compressed = compressed - self._compressed, compressed
        self.current.buckets += calls
        self.current.bytes_sent += compressed_bytes(hooks.hook, handed, counter.element_size, elements)

    def end_step(self, step: int) -> StepTelemetry:
        self.current.step = step
        data = self._logging_data()
        iteration = int(data.get("iteration", 0))
        if iteration > self._timed_iteration and "backward_comm_time" in data:
            self._timed_iteration = iteration
            self.current.timed_iteration = iteration
            for name, key in _TIMINGS.items():
                setattr(self.current, name, data[key] / _NS_PER_MS)
        self.last = self.current
        for name in _SUMMED:
            setattr(self.totals, name, getattr(self.totals, name) + getattr(self.current, name))
        self.current = StepTelemetry()
        return self.last


class DDPTelemetry(pl.Callback):
    """Sends the strategy's per-step sync telemetry to the Trainer's loggers under ``ddp/`` (every
    ``log_every_n_steps`` optimizer steps, as Lightning logs), and ``ddp_MB`` to the progress bar when there is one.

    The figures go to the loggers directly rather than through ``LightningModule.log``, whose result collection
    costs more per call (about 0.3 ms here) than measuring them. ``DDPPlusStrategy(telemetry=True)`` adds this
    callback by itself; add it yourself to choose where it sits in the list.
    """

    def __init__(self) -> None:
        self._logged_step = -1
        self._logged_phase_times: list[PhaseTimes] | None = None

    def log_comparison(self, trainer: pl.Trainer) -> None:
        """Every rank's phase times at a new comparison (made once the loop counted a step: at the next batch, or,
        for the last step, at the fit's end)."""
        phase_times = getattr(trainer.strategy, "phase_times", None)
        if phase_times and phase_times is not self._logged_phase_times:
            self._logged_phase_times = phase_times
            for logger in trainer.loggers:
                logger.log_metrics(phase_metrics(phase_times), step=trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.log_comparison(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.log_comparison(trainer)
        telemetry: SyncTelemetry | None = getattr(trainer.strategy, "telemetry", None)
        if telemetry is None or telemetry.last is None or telemetry.last.step == self._logged_step:
            return
        self._logged_step = telemetry.last.step
        if telemetry.last.step % max(1, getattr(trainer, "log_every_n_steps", 1)) == 0:
            for logger in trainer.loggers:
                logger.log_metrics(telemetry.last.as_metrics(), step=trainer.global_step)
        if trainer.progress_bar_callback is not None:
            pl_module.log(
                "ddp_MB", telemetry.last.bytes_sent / 2**20, on_step=True, on_epoch=False, prog_bar=True, logger=False
            )
