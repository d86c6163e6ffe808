"""``ddp-plus report LOGDIR``: a chart of the sync telemetry a run logged under ``ddp/`` with Lightning's CSVLogger.

Per optimizer step: torch's timings of the forward, the backward's compute and communication and their overlap;
the bytes each rank sent; the backward passes that synced and those that skipped the all-reduce. Run with
``DDPPlusStrategy(telemetry=True)`` and a ``CSVLogger`` (``log_every_n_steps`` sets how many steps are logged).

    ddp-plus report lightning_logs/spirals_cpu            # newest metrics.csv below it -> ddp_report.png beside it
    ddp-plus report lightning_logs/spirals_cpu/version_0 --out report.png

Reading the CSV needs nothing but the standard library; drawing needs matplotlib (``pip install matplotlib``, or the
project's ``bench`` extra).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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


class ReportError(ValueError):
    """The log directory holds no sync telemetry to report."""


@dataclass
class TelemetryLog:
    """One run's ``ddp/`` rows: ``steps[i]`` is the global step of row ``i``; a missing timing is ``nan``."""

    source: Path
    steps: list[int] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in _COLUMNS})

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


def draw(log: TelemetryLog, out: Path) -> Path:
    """Three panels over the optimizer steps: timings (ms), MB sent, synced and skipped backward passes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ReportError("Drawing the report needs matplotlib: pip install matplotlib") from error
    figure, (times, sent, passes) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
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


def main(args: Sequence[str]) -> int:
    """Entry point of ``ddp-plus report``: exit status 0 with a chart written, 1 with the reason printed."""
    parser = argparse.ArgumentParser(prog="ddp-plus report", description=__doc__.splitlines()[0])
    parser.add_argument("logdir", type=Path, help="a CSVLogger save_dir, version_N folder or metrics.csv")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: ddp_report.png beside the CSV)")
    options = parser.parse_args(list(args))
    try:
        log = read_telemetry(find_metrics(options.logdir))
        out = draw(log, options.out or log.source.parent / "ddp_report.png")
    except ReportError as error:
        print(f"ERROR {error}", file=sys.stderr)
        return 1
    summary = log.summary()
    print(f"read {log.source}")
    print("  " + ", ".join(f"{key}={value:.3g}" for key, value in summary.items()))
    print(f"wrote {out}")
    return 0
