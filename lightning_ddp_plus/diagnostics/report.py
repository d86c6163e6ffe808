"""``ddp-plus report LOGDIR``: a chart of the sync telemetry a run logged under ``ddp/`` with Lightning's CSVLogger.

Per optimizer step: torch's timings of the forward, the backward's compute and communication and their overlap;
the bytes each rank sent; the backward passes that synced and those that skipped the all-reduce. And every rank's
time per step in data fetch, compute, collective wait and optimizer step, side by side (the straggler comparison,
every ``find_stragglers_every_n_steps``), drawn and printed as bars. Run with ``DDPPlusStrategy(telemetry=True)``
and a ``CSVLogger`` (``log_every_n_steps`` sets how many steps are logged).

    ddp-plus report lightning_logs/spirals_cpu            # newest metrics.csv below it -> ddp_report.png beside it
    ddp-plus report lightning_logs/spirals_cpu/version_0 --out report.png

Reading the CSV needs nothing but the standard library; drawing needs matplotlib (``pip install matplotlib``, or the
project's ``bench`` extra).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_COLUMNS = {
    "forward_ms": "ddp/forward_ms",
    "backward_compute_ms": "ddp/backward_compute_ms",
    "backward_comm_ms": "ddp/backward_comm_ms",
    "overlap_ms": "ddp/overlap_ms",
    "bytes_sent": "ddp/bytes_sent",
    "buckets": "ddp/buckets",
    "synced_backwards": "ddp/synced_backwards",
    "skipped_backwards": "ddp/skipped_backwards",
}


#: ``ddp/rank1/data_fetch_ms``: a rank's median phase time at a comparison (``telemetry.phase_metrics``).
_PHASE_COLUMN = re.compile(r"^ddp/rank(\d+)/(\w+)_ms$")
_PHASES = ("data_fetch", "compute", "collective_wait", "optimizer_step")


class ReportError(ValueError):
    """The log directory holds no sync telemetry to report."""


@dataclass
class TelemetryLog:
    """One run's ``ddp/`` rows: ``steps[i]`` is the global step of row ``i``; a missing timing is ``nan``."""

    source: Path
    steps: list[int] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in _COLUMNS})
    #: Each rank's median ms per step in each phase, one value per comparison logged: ``phases[rank][phase]``.
    phases: dict[int, dict[str, list[float]]] = field(default_factory=dict)

    def phase_medians(self) -> dict[int, dict[str, float]]:
        """Per rank and phase, the median over the comparisons logged."""
        return {
            rank: {phase: statistics.median(values) for phase, values in by_phase.items() if values}
            for rank, by_phase in sorted(self.phases.items())
        }

    def summary(self) -> dict[str, float]:
        """Medians of the timings over the steps that have them, MB sent per step, and backward totals."""

        def median(name: str) -> float:
            values = [v for v in self.series[name] if not math.isnan(v)]
            return statistics.median(values) if values else float("nan")

        return {
            "steps": len(self.steps),
            **{
                f"median_{name}": median(name)
                for name in ("forward_ms", "backward_compute_ms", "backward_comm_ms", "overlap_ms")
            },
            "median_MB_per_step": median("bytes_sent") / 2**20,
            "synced_backwards": sum(self.series["synced_backwards"]),
            "skipped_backwards": sum(self.series["skipped_backwards"]),
        }


def find_metrics(logdir: Path) -> Path:
    """``logdir/metrics.csv``, or the newest ``metrics.csv`` below ``logdir`` (CSVLogger writes ``version_N/``)."""
    if logdir.is_file():
        return logdir
    if (logdir / "metrics.csv").is_file():
        return logdir / "metrics.csv"
    found = sorted(logdir.rglob("metrics.csv"), key=lambda path: path.stat().st_mtime)
    if not found:
        raise ReportError(
            f"No metrics.csv under {str(logdir)!r}. Log the run with lightning.pytorch.loggers.CSVLogger and "
            "DDPPlusStrategy(telemetry=True), then pass the logger's save_dir (or its version_N folder)."
        )
    return found[-1]


def read_telemetry(metrics: Path) -> TelemetryLog:
    """The rows of ``metrics`` that carry ``ddp/bytes_sent`` (one per logged optimizer step)."""
    log = TelemetryLog(source=metrics)
    with open(metrics, newline="") as file:
        for row in csv.DictReader(file):
            _read_phases(row, log)
            if not row.get(_COLUMNS["bytes_sent"]):
                continue
            log.steps.append(int(float(row.get("step") or len(log.steps))))
            for name, column in _COLUMNS.items():
                text = row.get(column) or ""
                log.series[name].append(float(text) if text else float("nan"))
    if not log.steps:
        raise ReportError(
            f"{str(metrics)!r} has no ddp/ telemetry rows: train with DDPPlusStrategy(telemetry=True) "
            "(the rows appear every log_every_n_steps optimizer steps)."
        )
    return log


def _read_phases(row: dict[str, str], log: TelemetryLog) -> None:
    for column, text in row.items():
        found = _PHASE_COLUMN.match(column or "")
        if found and text:
            by_phase = log.phases.setdefault(int(found.group(1)), {phase: [] for phase in _PHASES})
            by_phase.setdefault(found.group(2), []).append(float(text))


def phase_bars(log: TelemetryLog, width: int = 40) -> str:
    """Every rank's time per step in each phase as text bars, so a straggler stands out in a terminal.

    >>> log = TelemetryLog(Path("m.csv"), phases={0: {"data_fetch": [3.0]}, 1: {"data_fetch": [150.0]}})
    >>> print(phase_bars(log, width=10))
    phase times per rank (median ms per optimizer step over 1 comparison(s)):
      data fetch       rank 0            3.0
                       rank 1 ########## 150.0
    """
    medians = log.phase_medians()
    if not medians:
        return ""
    longest = max(value for by_phase in medians.values() for value in by_phase.values()) or 1.0
    comparisons = max(len(values) for by_phase in log.phases.values() for values in by_phase.values())
    lines = [f"phase times per rank (median ms per optimizer step over {comparisons} comparison(s)):"]
    for phase in _PHASES:
        for index, (rank, by_phase) in enumerate(medians.items()):
            if phase not in by_phase:
                continue
            value = by_phase[phase]
            label = phase.replace("_", " ") if index == 0 else ""
            lines.append(f"  {label:<16} rank {rank} {'#' * round(width * value / longest):<{width}} {value:.1f}")
    return "\n".join(lines)


def draw(log: TelemetryLog, out: Path) -> Path:
    """Three panels over the optimizer steps: timings (ms), MB sent, synced and skipped backward passes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ReportError("Drawing the report needs matplotlib: pip install matplotlib") from error
    medians = log.phase_medians()
    panels = 4 if medians else 3
    figure, axes = plt.subplots(panels, 1, figsize=(8, 2.7 * panels))
    times, sent, passes = axes[:3]
    for axis in (sent, passes):
        axis.sharex(times)
    steps = log.steps
    for name, color in (
        ("forward_ms", "#6a9f58"),
        ("backward_compute_ms", "#4a7ab7"),
        ("backward_comm_ms", "#d1615d"),
        ("overlap_ms", "#e49444"),
    ):
        times.plot(steps, log.series[name], marker=".", color=color, label=name.removesuffix("_ms").replace("_", " "))
    times.set_ylabel("ms (torch's DDP timings)")
    times.legend(fontsize=8, ncol=4, loc="upper right")
    sent.bar(steps, [b / 2**20 for b in log.series["bytes_sent"]], color="#4a7ab7")
    sent.set_ylabel("MB sent per rank")
    synced, skipped = log.series["synced_backwards"], log.series["skipped_backwards"]
    passes.bar(steps, synced, color="#4a7ab7", label="synced")
    passes.bar(steps, skipped, bottom=synced, color="#bbbbbb", label="skipped (no_sync)")
    passes.set_ylabel("backward passes")
    passes.set_xlabel("optimizer step")
    passes.legend(fontsize=8, loc="upper right")
    if medians:
        _draw_phases(axes[3], medians)
    summary = log.summary()
    figure.suptitle(
        f"{log.source.parent.name}: {summary['steps']} steps, median comm {summary['median_backward_comm_ms']:.1f} ms, "
        f"{summary['median_MB_per_step']:.2f} MB/step",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def _draw_phases(axis: Any, medians: dict[int, dict[str, float]]) -> None:
    """Grouped bars: per phase, one bar per rank (a straggler's phase stands out, and the others' waiting)."""
    ranks = list(medians)
    width = 0.8 / len(ranks)
    for index, rank in enumerate(ranks):
        positions = [p + index * width - 0.4 + width / 2 for p in range(len(_PHASES))]
        axis.bar(positions, [medians[rank].get(phase, 0.0) for phase in _PHASES], width, label=f"rank {rank}")
    axis.set_xticks(range(len(_PHASES)), [phase.replace("_", " ") for phase in _PHASES])
    axis.set_ylabel("ms per step (median)")
    axis.legend(fontsize=8, loc="upper right")


def main(args: Sequence[str]) -> int:
    """Entry point of ``ddp-plus report``: exit status 0 with a chart written, 1 with the reason printed."""
    parser = argparse.ArgumentParser(prog="ddp-plus report", description=__doc__.splitlines()[0])
    parser.add_argument("logdir", type=Path, help="a CSVLogger save_dir, version_N folder or metrics.csv")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: ddp_report.png beside the CSV)")
    parsed = parser.parse_args(list(args))
    try:
        log = read_telemetry(find_metrics(parsed.logdir))
        out = draw(log, parsed.out or log.source.parent / "ddp_report.png")
    except ReportError as error:
        print(f"ERROR {error}", file=sys.stderr)
        return 1
    summary = log.summary()
    print(f"read {log.source}")
    print("  " + ", ".join(f"{key}={value:.3g}" for key, value in summary.items()))
    bars = phase_bars(log)
    if bars:
        print(bars)
    print(f"wrote {out}")
    return 0
