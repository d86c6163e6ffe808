"""Run the real-model zoo on 2 gloo ranks and write its table: ``python tests/zoo_table.py OUT.md [--only MODEL ...]``
(``--results RUNS.json``: the table of runs made already, e.g. by the tests' zoo job).

For every case: what stock ``DDPStrategy`` does, what ``ddp_plus`` defaults do, what ``resolve`` does, and the counts
(cases, stock failures, refused, trained correctly, missed, false alarms).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import run_case_job
from tests.zoo import outcome, zoo_cases


def describe(run: dict) -> str:
    text = outcome(run)
    rules = [rule for rule in run["findings"] if not rule.startswith("A")]
    if text == "refused":
        return f"refused ({', '.join(rules)}), 0 steps"
    if text == "error":
        first = (run["message"] or "").split("\n")[0][:60]
        return f"error: {first}"
    if text == "wrong":
        return f"wrong: {len(run['unchanged'])} trainable tensors never learn"
    return f"correct{' (' + ', '.join(rules) + ')' if rules else ''}"


def table(results: list[dict]) -> str:
    lines = ["| model | setting | stock | ddp_plus defaults | resolve |", "|---|---|---|---|---|"]
    counts = dict.fromkeys(
        ("cases", "stock failures", "refused", "trained correctly", "missed", "false alarms", "resolve correct"), 0
    )
    for case in results:
        runs = {run["kind"]: run for run in case["results"]}
        stock, plus, resolve = outcome(runs["stock"]), outcome(runs["ddp_plus"]), outcome(runs["resolve"])
        setting = case["setting"] + (f", k={case['k']}" if "k" in case else "")
        lines.append(
            f"| {case['model']} | {setting} | {stock} | {describe(runs['ddp_plus'])} | {describe(runs['resolve'])} |"
        )
        counts["cases"] += 1
        counts["resolve correct"] += resolve == "correct"
        if stock == "correct":
            counts["false alarms"] += plus != "correct" or runs["ddp_plus"]["max_diff_to_stock"] != 0.0
        else:
            counts["stock failures"] += 1
            counts["refused"] += plus == "refused"
            counts["trained correctly"] += plus == "correct"
            counts["missed"] += plus not in ("refused", "correct")
    return "\n".join(lines) + "\n\n" + ", ".join(f"{name}: {value}" for name, value in counts.items()) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--only", nargs="*", help="model names to run")
    parser.add_argument("--results", help="the zoo job's results to tabulate instead of running it")
    args = parser.parse_args(argv)
    cases = [case for case in zoo_cases() if not args.only or case["model"] in args.only]
    started = time.perf_counter()
    if args.results:
        wanted = {(case["model"], case["setting"], case.get("k")) for case in cases}
        ran = json.loads(Path(args.results).read_text())
        results = [case for case in ran if (case["model"], case["setting"], case.get("k")) in wanted]
    else:
        with tempfile.TemporaryDirectory() as scratch:
            results = run_case_job("zoo_job.py", cases, Path(scratch) / "zoo.json", timeout=900)
    text = table(results)
    Path(args.out).write_text(text)
    print(text + f"\n{len(cases)} cases in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
