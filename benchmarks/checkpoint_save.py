"""Saving a checkpoint: Lightning's ``TorchCheckpointIO`` against ``AtomicCheckpointIO``, side by side, as ratios.

    python benchmarks/checkpoint_save.py --megabytes 100 --repeats 9 --dir /path/on/the/disk [--dir /dev/shm/x]

For each directory the two are run alternately (``--repeats`` each). Reported per save: the median time, and the
peak of Python-heap allocations (``tracemalloc``: Lightning's IO serializes into a ``BytesIO`` and copies its value
once more; tensor storage itself is allocated by torch and not counted in either). Lightning stages its save in the
system temp dir, which is where ``tempfile`` points (``TMPDIR``). The atomic save fsyncs the file and the directory;
on a tmpfs that costs nothing, on a disk it is the price of a checkpoint that survives a node crash.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning.fabric.plugins import TorchCheckpointIO

from lightning_ddp_plus.persistence.io import AtomicCheckpointIO


def one_save(io: object, checkpoint: dict, path: Path) -> tuple[float, int]:
    tracemalloc.start()
    started = time.perf_counter()
    io.save_checkpoint(checkpoint, path)
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, peak


def compare(directory: Path, megabytes: float, repeats: int) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint = {"state_dict": {"w": torch.randn(int(megabytes * 2**20 / 4))}, "global_step": 1}
    variants = {"lightning": TorchCheckpointIO(), "atomic": AtomicCheckpointIO()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, list[int]] = {name: [] for name in variants}
    for name, io in variants.items():  # warm-up: page cache, allocator
        one_save(io, checkpoint, directory / f"{name}.ckpt")
    for _ in range(repeats):
        for name, io in variants.items():
            seconds, peak = one_save(io, checkpoint, directory / f"{name}.ckpt")
            times[name].append(seconds)
            peaks[name].append(peak)
    result = {
        name: {
            "median_s": statistics.median(times[name]),
            "min_s": min(times[name]),
            "max_s": max(times[name]),
            "python_heap_peak_mb": max(peaks[name]) / 2**20,
        }
        for name in variants
    }
    result["ratio_atomic_to_lightning"] = result["atomic"]["median_s"] / result["lightning"]["median_s"]
    for name in variants:
        (directory / f"{name}.ckpt").unlink(missing_ok=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=100)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", action="append", type=Path, help="where to save (repeatable); default: a temp dir")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    scratch = None
    directories = args.dir
    if not directories:
        scratch = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
        directories = [scratch]
    try:
        report = {
            "megabytes": args.megabytes,
            "repeats": args.repeats,
            "tempdir": tempfile.gettempdir(),
            "results": {str(directory): compare(directory, args.megabytes, args.repeats) for directory in directories},
        }
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(
        "| directory | Lightning (median s) | atomic (median s) | ratio | Python heap peak, Lightning / atomic (MB) |"
    )
    print("|---|---|---|---|---|")
    for directory, row in report["results"].items():
        print(
            f"| {directory} | {row['lightning']['median_s']:.3f} | {row['atomic']['median_s']:.3f} | "
            f"{row['ratio_atomic_to_lightning']:.2f}x | {row['lightning']['python_heap_peak_mb']:.0f} / "
            f"{row['atomic']['python_heap_peak_mb']:.1f} |"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
