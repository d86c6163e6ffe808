"""The prepared NCCL check of the save after a rank's death, for a machine with 2 CUDA devices. It is not part of the
CPU suite (its name is not ``test_*``) and says "skipped" without 2 GPUs:

    python tests/gpu/nccl_rank_death_check.py                    # NCCL, about a minute
    python tests/gpu/nccl_rank_death_check.py --accelerator cpu  # the same jobs on gloo (a dry run of the script)

On NCCL a survivor's collective does not fail when its peer dies: it waits until the process group's timeout. The
launcher's observer (rank 0) and the parent watch (a child rank) abort the survivor's communicators as soon as they
see the death (``abort_collectives_on_a_death``). The jobs run with a 600 s timeout, so an end within 120 s of the kill
is the abort's, not the timeout's:

1. ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (abort the communicator, keep the process): rank 1 killed in its backward,
   rank 0 saves the last step and ends with ``RankDied``; then rank 0 killed, rank 1 saves alone;
2. torch's default handling: the job ends within 120 s of the kill (torch may end the survivor before it saves).

Each check prints PASS or FAIL with the seconds from the kill to the job's end; the exit code is the failures.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import run_checks

END_WITHIN_S = 120


def killed_job(case: dict, handling: str | None) -> tuple[int, dict, dict | None, float]:
    from tests.helpers import python_script, run_job

    env = {"DDP_PLUS_TEST_TIMEOUT": "600s"}
    if handling is not None:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = handling
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        result = run_job(python_script("rank_death_job.py") + ["kill", folder, json.dumps(case)], 900, env)
        ended = time.time()
        killed = json.loads((directory / "killed.json").read_text())
        survivor = directory / f"outcome-rank{1 - case['to']}.json"
        outcome = json.loads(survivor.read_text()) if survivor.exists() else None
    return result.returncode, killed, outcome, ended - killed["time"]


def survivor_saves(dead: int) -> tuple[bool, str]:
    code, killed, outcome, took = killed_job({"to": dead, "at": "backward"}, handling="2")
    saved = outcome is not None and outcome["step"] is not None and outcome["gone"] == [dead]
    ok = saved and code != 0 and took < END_WITHIN_S
    return ok, f"rank {dead} killed at step {killed['global_step']}: outcome {outcome}, ended {took:.1f} s after"


def job_ends_at_once() -> tuple[bool, str]:
    code, _, outcome, took = killed_job({"to": 1, "at": "backward"}, handling=None)
    return code != 0 and took < END_WITHIN_S, f"ended {took:.1f} s after the kill (exit {code}); outcome {outcome}"


def main() -> int:
    return run_checks(
        __doc__.split("\n\n")[0],
        [
            ("rank 1 dies, rank 0 saves", lambda: survivor_saves(1)),
            ("rank 0 dies, rank 1 saves alone", lambda: survivor_saves(0)),
            ("torch's default handling ends the job at once", job_ends_at_once),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
