"""Sync telemetry: per optimizer step, gradient buckets all-reduced, bytes sent (after compression hooks),
backward passes synced and skipped, and the time spent waiting for the last all-reduce of a backward.

Bytes are counted where they are sent: every ``torch.distributed.all_reduce`` the communication hook issues during
a backward (torch's own hooks call it through the module attribute), so an fp16 hook reports half the bytes and
PowerSGD its compressed factors.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist


@dataclass
class StepTelemetry:
    """One optimizer step's communication."""

    step: int = 0
    buckets: int = 0
    bytes_sent: int = 0
    synced_backwards: int = 0
    skipped_backwards: int = 0
    comm_wait_ms: float = 0.0

    def as_metrics(self, prefix: str = "ddp/") -> dict[str, float]:
        return {f"{prefix}{name}": float(value) for name, value in asdict(self).items() if name != "step"}


class SyncTelemetry:
    """Collects the figures of the current optimizer step; ``end_step`` closes it."""

    def __init__(self) -> None:
        self.current = StepTelemetry()
        self.last: Optional[StepTelemetry] = None
        self.totals = StepTelemetry()
        self._last_launch: Optional[float] = None

    def timed_hook(self, hook: Callable) -> Callable:
        """Wrap a communication hook: count its buckets and time the wait for the backward's last bucket."""
        telemetry = self

        def ddp_plus_timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            telemetry.current.buckets += 1
            future = hook(state, bucket)
            if not bucket.is_last():
                return future
            launched = time.perf_counter()

            def finished(done: torch.futures.Future) -> torch.Tensor:
                telemetry.current.comm_wait_ms += (time.perf_counter() - launched) * 1000
                return done.value()

            return future.then(finished)

        return ddp_plus_timed_hook

    @contextmanager
    def counting_bytes(self) -> Generator:
        """Count the bytes of every all-reduce issued while the body (a backward) runs."""
        original = dist.all_reduce
        telemetry = self

        def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            telemetry.current.bytes_sent += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        try:
            yield None
        finally:
            dist.all_reduce = original

    def count_backward(self, synced: bool) -> None:
        if synced:
            self.current.synced_backwards += 1
        else:
            self.current.skipped_backwards += 1

    def end_step(self, step: int) -> StepTelemetry:
        self.current.step = step
        self.last = self.current
        for name, value in asdict(self.current).items():
            if name != "step":
                setattr(self.totals, name, getattr(self.totals, name) + value)
        self.current = StepTelemetry()
        return self.last


class DDPTelemetry(pl.Callback):
    """Logs the strategy's per-step sync telemetry under ``ddp/`` and a compact ``ddp_MB`` in the progress bar.

    ``DDPPlusStrategy(telemetry=True)`` adds it by itself; add it yourself to choose where it sits in the list.
    """

    def __init__(self) -> None:
        self._logged_step = -1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        telemetry: Optional[SyncTelemetry] = getattr(trainer.strategy, "telemetry", None)
        if telemetry is None or telemetry.last is None or telemetry.last.step == self._logged_step:
            return
        self._logged_step = telemetry.last.step
        pl_module.log_dict(telemetry.last.as_metrics(), on_step=True, on_epoch=False, sync_dist=False)
        pl_module.log("ddp_MB", telemetry.last.bytes_sent / 2**20, on_step=True, on_epoch=False, prog_bar=True)
