"""The prepared GPU checks (not part of the CPU suite: their names are not ``test_*``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable


def run_checks(
    description: str, checks: list[tuple[str, Callable[[], tuple[bool, str]]]], devices_needed: int = 2
) -> int:
    """``--accelerator gpu`` (default; "skipped" without ``devices_needed`` CUDA devices) or ``cpu`` (a dry run on
    gloo): each check prints PASS or FAIL with its detail; returns the failures (the exit code)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    args = parser.parse_args()
    import torch

    if args.accelerator == "gpu" and torch.cuda.device_count() < devices_needed:
        print(f"skipped: needs {devices_needed} CUDA device(s), found {torch.cuda.device_count()}")
        return 0
    os.environ["DDP_PLUS_TEST_ACCELERATOR"] = args.accelerator  # the jobs' Trainer (gpu: NCCL)
    failures = 0
    for name, check in checks:
        ok, detail = check()
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return failures
