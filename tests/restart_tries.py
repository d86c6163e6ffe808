"""Kill-and-restart tries under torchrun: ``python tests/restart_tries.py [TRIES] [--stock]``.

Each try runs ``tests/scripts/restart_job.py`` with ``torchrun --nproc-per-node 2 --max-restarts 1``; rank 1 kills
itself (SIGKILL) at optimizer step 5. Reports the successes, the time from the kill to training again, the steps
redone after the restart, and the largest parameter difference to an uninterrupted run. ``--stock`` runs the same
job with Lightning's ``DDPStrategy`` (and Lightning's own ``ckpt_path="last"``) for comparison.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import run_job, torchrun_command


def one_run(scratch: Path, name: str, kill_at: int, stock: bool) -> tuple[int, str, dict | None]:
    out, ckpt = scratch / f"{name}.json", scratch / f"{name}-ckpt"
    args = torchrun_command("restart_job.py", out, ckpt, kill_at, 1)
    try:
        result = run_job(args, timeout=240, env={"DDP_PLUS_TRY_STOCK": "1"} if stock else None)
        code, output = result.returncode, result.stdout
    except AssertionError as timed_out:  # run_job kills the whole job at its time limit
        code, output = -1, str(timed_out)
    return code, output, json.loads(out.read_text()) if out.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tries", type=int, nargs="?", default=20)
    parser.add_argument("--stock", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        _, _, whole = one_run(scratch, "whole", -1, args.stock)
        assert whole is not None
        successes, gaps, redone, diffs = 0, [], [], []
        for attempt in range(args.tries):
            code, output, result = one_run(scratch, f"try{attempt}", 5, args.stock)
            killed = re.search(r"\[(\d+\.\d+)\] rank 1 kills itself", output)
            again = re.search(r"\[(\d+\.\d+)\] attempt 1 rank 0 trains from step (\d+)", output)
            ok = code == 0 and result is not None and result["attempt"] == 1
            successes += ok
            if killed and again:
                gaps.append(float(again.group(1)) - float(killed.group(1)))
                redone.append(5 - int(again.group(2)))
            if ok:
                diffs.append(max(abs(a - b) for a, b in zip(result["params"], whole["params"])))
            print(f"try {attempt + 1}: {'ok' if ok else f'FAILED (exit {code})'}", flush=True)
    print(f"\n{'stock DDPStrategy' if args.stock else 'ddp_plus'}: {successes}/{args.tries} restarts finished")
    if gaps:
        print(
            f"kill to training again: median {statistics.median(gaps):.1f} s (min {min(gaps):.1f}, max {max(gaps):.1f})"
        )
        print(f"steps redone after the restart: {sorted(set(redone))}")
    if diffs:
        print(f"largest parameter difference to the uninterrupted run: {max(diffs):.2e}")


if __name__ == "__main__":
    main()
