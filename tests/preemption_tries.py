"""Termination notices at random moments: ``python tests/preemption_tries.py [TRIES [SEED]]``.

Each try is one case of ``tests/scripts/preemption_job.py``: SIGTERM to a random rank (or every rank) from a timer
that fires at a random point of a random step (forward, backward or optimizer step), with accumulation 1 or 2. A
try passes when the fit ended with ``Preempted`` within the bound (the saved step at most 2 steps after the last one
completed before the notice), no checkpoint is torn, the resume trained each sample once per epoch and ended with
the parameters of an uninterrupted run (1e-5). A hang fails the whole launch at its time limit.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import python_script, start_ranks

PER_LAUNCH = 15


def tries(count: int, seed: int = 0) -> list[dict]:
    chooser = random.Random(seed)
    cases = []
    for index in range(count):
        k = chooser.choice([1, 2])
        cases.append(
            {"to": chooser.choice(["all", 0, 1]), "at": "random", "step": chooser.randrange(1, 16 // k - 1),
             "seed": index, "k": k}
        )  # fmt: skip
    return cases


def passed(case: dict) -> str | None:
    if not case["preempted"] and case["passed_on"]:
        return None  # the timer fired after the last step boundary: the fit ended as usual and passed the signal on
    if not case["preempted"]:
        return "not preempted"
    received = min(step for _, _, step in case["notices"])
    if not 1 <= case["stop_after"] - received <= 2:
        return f"stopped {case['stop_after'] - received} steps after the notice"
    if case["torn"]:
        return f"torn: {case['torn']}"
    if set(case["sample_counts"]) != {2}:
        return "a sample trained other than once per epoch"
    if case["distance"] > 1e-5:
        return f"parameters differ by {case['distance']:.2e}"
    return None


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 45
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    cases, results, started = tries(count, seed), [], time.monotonic()
    for first in range(0, count, PER_LAUNCH):
        chunk = cases[first : first + PER_LAUNCH]
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "out.json"
            ranks = start_ranks(
                python_script("preemption_job.py") + [str(out), json.dumps(chunk)],
                timeout=600,
                env={"DDP_PLUS_TMP": str(Path(folder) / "work")},
            )
            if any(rank.returncode for rank in ranks):
                for i, rank in enumerate(ranks):
                    Path(tempfile.gettempdir(), f"preemption-tries-rank{i}.log").write_text(rank.stdout)
                tails = "\n".join(f"--- rank {i} ---\n{rank.stdout[-4000:]}" for i, rank in enumerate(ranks))
                sys.exit(f"a launch failed: {[rank.returncode for rank in ranks]}\n{tails}")
            results += json.loads(out.read_text())
    failures = [(case, reason) for case in results if (reason := passed(case)) is not None]
    seconds = [s for case in results for (s,) in case["seconds_to_end_by_rank"] if s is not None]
    print(
        json.dumps(
            {
                "tries": len(results),
                "hangs": 0,
                "failures": len(failures),
                "torn files": sum(len(case["torn"]) for case in results),
                "notices after the last step, passed on": sum(1 for case in results if not case["preempted"]),
                "steps after the notice": sorted(
                    {c["stop_after"] - min(n[2] for n in c["notices"]) for c in results if c["preempted"]}
                ),
                "notice to Preempted on the noticed rank (s)": [round(min(seconds), 3), round(max(seconds), 3)],
                "wall (s)": round(time.monotonic() - started),
            }
        )
    )
    for case, reason in failures:
        print(reason, json.dumps(case)[:500])
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
