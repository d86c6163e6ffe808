"""What a spawned worker found and counted, carried back to the strategy object in the process that launched it
(``start_method="spawn"``/``"fork"``: the launcher pickles it from rank 0's worker)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.conflicts.check import ConflictCheck, FindingRecord, finding_records, findings_from_records
from lightning_ddp_plus.conflicts.settings_in_effect import SettingsInEffect
from lightning_ddp_plus.diagnostics.replicas import ReplicaGuard
from lightning_ddp_plus.diagnostics.telemetry import SyncTelemetry
from lightning_ddp_plus.sync.accumulation import AccumulationWindow, SyncStats
from lightning_ddp_plus.sync.buckets import BucketTuner
from lightning_ddp_plus.sync.comm_hooks import HookAssembly


class Counted(Protocol):
    """The components whose findings and counts a worker carries back (the engine has them)."""

    conflicts: ConflictCheck
    in_effect: SettingsInEffect
    window: AccumulationWindow
    telemetry: SyncTelemetry | None
    replica_guard: ReplicaGuard
    hooks: HookAssembly
    buckets: BucketTuner | None


@dataclass  # not frozen: Lightning's launcher maps over the results it carries, and refuses frozen dataclasses
class WorkerResults:
    """A worker's findings, resolved settings and counters, as plain data."""

    findings: list[FindingRecord]
    model_fixes: list[str]
    settings: DDPSettings
    sync_stats: dict[str, int]
    steps: int
    telemetry_totals: dict[str, Any] | None
    replica_check_seconds: list[float]
    hook_calls: int
    bucket_choice: Any

    @classmethod
    def of(cls, engine: Counted) -> WorkerResults:
        telemetry, buckets = engine.telemetry, engine.buckets
        return cls(
            findings=finding_records(engine.conflicts.findings),
            model_fixes=list(engine.conflicts.model_fixes),
            settings=engine.in_effect.current,
            sync_stats=dataclasses.asdict(engine.window.stats),
            steps=engine.window.steps,
            telemetry_totals=dataclasses.asdict(telemetry.totals) if telemetry is not None else None,
            replica_check_seconds=list(engine.replica_guard.check_seconds),
            hook_calls=engine.hooks.counter.calls,
            bucket_choice=buckets.choice if buckets is not None else None,
        )

    def apply_to(self, engine: Counted) -> None:
        engine.conflicts.findings = findings_from_records(self.findings)
        engine.conflicts.model_fixes = self.model_fixes
        engine.in_effect.current = self.settings
        engine.window.steps = self.steps
        engine.window.stats = SyncStats(**self.sync_stats)
        if engine.telemetry is not None and self.telemetry_totals is not None:
            engine.telemetry.totals = dataclasses.replace(engine.telemetry.totals, **self.telemetry_totals)
        engine.replica_guard.check_seconds = self.replica_check_seconds
        engine.hooks.counter.calls = self.hook_calls
        if engine.buckets is not None:
            engine.buckets.choice = self.bucket_choice
