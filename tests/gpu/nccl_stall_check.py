"""The prepared NCCL check of the stall and straggler reports, for a machine with 2 CUDA devices. It is not part of
the CPU suite (its name is not ``test_*``) and says "skipped" without 2 GPUs:

    python tests/gpu/nccl_stall_check.py                    # NCCL, a few minutes
    python tests/gpu/nccl_stall_check.py --accelerator cpu  # the same checks on gloo (a dry run of the script)

1. a hung rank is named with its line before the collective timeout (rank 1 asleep in ``training_step``; on NCCL
   rank 0's host runs ahead of its gradient all-reduce and blocks at a later host sync);
2. an extra ``self.log(..., sync_dist=True)`` on one rank is named as out of step and ends the job at once;
3. a rank slowed in its ``training_step`` is named as the straggler, in its compute phase.

Each check prints PASS or FAIL with the seconds from the fault to the job's end; the exit code is the failures.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import run_checks

TIMEOUT_S = 60


def hung_rank() -> tuple[bool, str]:
    from tests.test_failures import run_failing_job, site

    code, output, since, survivors = run_failing_job("hang", 1, step=3, timeout_s=TIMEOUT_S, stall="2s")
    report = "a collective has waited longer than 2 s" in output  # said before the timeout ended the job
    named = report and "rank 1 has not reached it" in output and site("time.sleep(HANG_S)") in output
    ok = code != 0 and named and not survivors and since < TIMEOUT_S + 30
    return ok, f"named: {named}, job ended {since:.1f} s after the hang (timeout {TIMEOUT_S} s)"


def out_of_step() -> tuple[bool, str]:
    from tests.test_failures import run_failing_job

    code, output, since, survivors = run_failing_job("extra_log", 0, step=3, timeout_s=TIMEOUT_S, stall="2s")
    named = "The ranks are out of step" in output and "sync_dist=True" in output
    ok = code != 0 and named and not survivors and since < 30
    return ok, f"named: {named}, job ended {since:.1f} s after the extra collective"


def straggler() -> tuple[bool, str]:
    from tests.helpers import run_case_job

    case = {"name": "slow compute", "slow": "compute", "rank": 1, "delay_s": 0.15, "steps": 24, "every": 10}
    with tempfile.TemporaryDirectory() as folder:
        [result] = run_case_job("straggler_job.py", [case], Path(folder) / "out.json", timeout=600)
    warnings = result["warnings"]
    ok = any("rank 1 is the straggler: compute" in warning for warning in warnings)
    return ok, warnings[0][:300] if warnings else "no straggler named"


def main() -> int:
    return run_checks(
        __doc__.split("\n\n")[0],
        [("hung_rank", hung_rank), ("out_of_step", out_of_step), ("straggler", straggler)],
    )


if __name__ == "__main__":
    sys.exit(main())
