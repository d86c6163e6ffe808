"""Print the docs' (docs/guides/every-step.md) table of models whose graph changes after the first step: stock, ``ddp_plus`` defaults and
``resolve``, each with its outcome, the step, and whether the replicas were identical when it stopped.

    python tests/guard_table.py [OUT.md]

Runs the cases of ``tests/test_step_guard.py`` on 2 gloo ranks (about a minute here).
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import run_case_job

MODELS = {
    "warmup": "auxiliary head trained for 3 steps, then dropped",
    "tower_one_rank": "tower skipped by rank 0 only, at step 4",
    "multitask": "one head per batch (multi-task)",
    "wav2vec2": "`Wav2Vec2ForSequenceClassification`, `layerdrop=0.1` (step 1 drops no layer, step 2 one)",
    "late_start_one_rank": "`static_graph=True`, a head that joins at step 3 on rank 0 only",
}
#: Stock waits in an all-reduce the other rank never joins (until the collective timeout): not run here.
ONE_RANK = ("tower_one_rank", "late_start_one_rank")
STOCK_HANGS = "not run: one rank waits in a bucket all-reduce the other never launches, until the collective timeout"
# (label, strategy arguments, stock?) per column; the static-graph row runs with static_graph=True in every column
COLUMNS = [
    ("stock", {}, True),
    ("ddp_plus defaults", {}, False),
    ("resolve", {"checkpointing_conflict": "resolve"}, False),
]


def cases() -> list[dict]:
    rows = []
    for variant in MODELS:
        model = {"variant": variant, **({"layerdrop": 0.1} if variant == "wav2vec2" else {})}
        static = {"static_graph": True} if variant.startswith("late_start") else {}
        rows.append(
            {
                "name": f"{variant}/reference",
                "stock": True,
                "model": model,
                "strategy": {"find_unused_parameters": True},
            }
        )
        for label, strategy, stock in COLUMNS:
            if stock and variant in ONE_RANK:
                continue
            rows.append(
                {"name": f"{variant}/{label}", "stock": stock, "model": model, "strategy": {**static, **strategy}}
            )
    return rows


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def outcome(run: dict, reference: dict) -> str:
    replicas = gap(*run["params"])
    same = "replicas identical" if replicas == 0.0 else f"replicas {replicas:.2g} apart"
    if run["error"]:
        rule = re.search(r"\[(R\d)\]", run["message"] or "")
        where = "at the first forward" if run["optimizer_steps"] == 0 else f"at step {run['optimizer_steps'] + 1}"
        name = f"{run['error']} ({rule.group(1)})" if rule else run["error"]
        seconds = max(s for s in run["seconds_to_error_by_rank"] if s is not None)
        return f"{name} {where}, {seconds:.2f} s into the step; {same}"
    to_reference = gap(run["params"][0], reference["params"][0])
    return f"trained {run['optimizer_steps']} steps, {to_reference:.1g} from `find_unused_parameters=True`; {same}"


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        runs = {run["name"]: run for run in run_case_job("step_guard_job.py", cases(), Path(directory) / "r.json")}
    lines = ["| model (2 ranks, 6 steps) | " + " | ".join(label for label, _, _ in COLUMNS) + " |"]
    lines.append("|---" * (len(COLUMNS) + 1) + "|")
    for variant, title in MODELS.items():
        reference = runs[f"{variant}/reference"]
        cells = [
            STOCK_HANGS if stock and variant in ONE_RANK else outcome(runs[f"{variant}/{label}"], reference)
            for label, _, stock in COLUMNS
        ]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(table + "\n")


if __name__ == "__main__":
    main()
