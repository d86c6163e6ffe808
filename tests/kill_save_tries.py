"""SIGKILL of the saving rank at spread moments of a save: ``python tests/kill_save_tries.py [TRIES]`` (needs root).

A 2-rank ``ddp_plus`` job (``tests/scripts/checkpoint_job.py``) saves a 34 MB checkpoint every 2 steps with
``save_last=True`` into a directory on a filesystem of its own (a tmpfs), the system temp dir staying on the disk.
Rank 0 is killed during its second save (``epoch=0-step=4.ckpt`` then ``last.ckpt``), at a moment spread over the
save's measured duration. Afterwards every ``*.ckpt`` is checked (``unreadable_reason``). Each try runs with
``atomic_checkpoints=True`` and, for comparison, with Lightning's own checkpoint IO (``atomic_checkpoints=False``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_ddp_plus.persistence.files import unreadable_reason
from tests.helpers import (
    REPO_ROOT,
    clean_environment,
    free_port,
    kill_process_groups,
    python_script,
    small_filesystem,
    start_process,
)


def run(directory: Path, atomic: bool, kill_after: float | None) -> tuple[dict[str, str | None], str]:
    case = {"name": "save", "dir": str(directory), "max_steps": 6, "ballast_mb": 34, "atomic": atomic,
            "announce_saves": True}  # fmt: skip
    args = python_script("checkpoint_job.py") + [str(directory.parent / "out.json"), json.dumps([case])]
    port, processes = str(free_port()), []
    for rank in range(2):
        env = {**clean_environment(), "PYTHONPATH": str(REPO_ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": "2"}  # fmt: skip
        processes.append(start_process(args, env))
    lines, begins = [], 0
    try:
        for line in processes[0].stdout:
            lines.append(line)
            if "save begins" in line:
                begins += 1
                if kill_after is not None and begins == 2:  # the second save: step 4's file, then last.ckpt
                    time.sleep(kill_after)
                    os.kill(processes[0].pid, 9)
                    break
        for process in processes:
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
    finally:
        kill_process_groups(processes)
    files = {path.name: unreadable_reason(path) for path in sorted(directory.glob("*.ckpt"))}
    return files, "".join(lines)


def save_seconds(output: str) -> float:
    begins = [float(t) for t in re.findall(r"\[(\d+\.\d+)\] save begins", output)]
    ends = [float(t) for t in re.findall(r"\[(\d+\.\d+)\] save ends", output)]
    return min(end - begin for begin, end in zip(begins, ends))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tries", type=int, nargs="?", default=20)
    args = parser.parse_args()
    report = {}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        for atomic in (True, False):
            with small_filesystem(scratch, "400m") as mount:
                files, output = run(mount / "calibrate", atomic, None)
                duration = save_seconds(output)
            torn_tries, detail = 0, []
            for attempt in range(args.tries):
                with small_filesystem(scratch, "400m") as mount:
                    delay = 2 * duration * attempt / args.tries  # two files per save: step 4's and last.ckpt
                    files, _ = run(mount / "ckpt", atomic, delay)
                    torn = {name: reason for name, reason in files.items() if reason is not None}
                    temporaries = [p.name for p in (mount / "ckpt").iterdir() if not p.name.endswith(".ckpt")]
                    torn_tries += bool(torn)
                    detail.append({"delay_s": round(delay, 4), "files": sorted(files), "torn": sorted(torn),
                                   "temporaries": temporaries})  # fmt: skip
            name = "ddp_plus (atomic)" if atomic else "Lightning's checkpoint IO"
            report[name] = {"save_seconds": round(duration, 4), "tries": args.tries, "torn_tries": torn_tries,
                            "detail": detail}  # fmt: skip
            print(f"{name}: a save takes {duration:.3f} s; {torn_tries} of {args.tries} tries left a torn file")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
