"""SLURM's requeue after a preemption save, as Lightning's ``auto_requeue`` does it: ``scontrol requeue JOB`` from
rank 0, with the job id of an array task where there is one."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping


def requeue_command(environ: Mapping[str, str]) -> list[str]:
    """``["scontrol", "requeue", job]``.

    >>> requeue_command({"SLURM_JOB_ID": "77"})
    ['scontrol', 'requeue', '77']
    >>> requeue_command({"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"})
    ['scontrol', 'requeue', '70_3']
    """
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}" if array_job else environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job):
        raise ValueError(f"lightning-ddp-plus: SLURM's job id {job!r} is not a number; not requeueing")
    return ["scontrol", "requeue", job]


def requeue(environ: Mapping[str, str], run: Callable[[list[str]], int] = subprocess.call) -> str:
    """Requeue the job; returns the line that says how it went."""
    command = requeue_command(environ)
    try:
        code = run(command)
    except FileNotFoundError:
        return f"lightning-ddp-plus: `{' '.join(command)}` failed: scontrol is not on PATH"
    if code == 0:
        return f"lightning-ddp-plus: requeued SLURM job {command[-1]}"
    return f"lightning-ddp-plus: `{' '.join(command)}` failed with exit code {code}"
