"""Plain DDP against the overlap bound: where ``ddp_plus`` and stock Lightning stand on a shaped link, per model and
node count.

    sudo python benchmarks/overlap_bound.py [--rates 1gbit 10gbit] [--nodes 2 4] [--models shallow deep] [--repeats 3]

The bound of one optimizer step on ``n`` ranks is ``max(compute, link) + last``:

- ``compute``: the same step with a comm hook that sends nothing (the ``compute_only`` variant, measured in the same
  process group, alternating with the others);
- ``link``: a ring all-reduce of the gradients, ``2 (n-1)/n x gradient bytes / rate``;
- ``last``: the ring all-reduce of the last bucket DDP sends, which cannot start before the backward ends. It is
  read from the reducer's own bucket layout of each variant (after its rebuild, and after ``"auto"`` has chosen).

``max(compute, link)`` alone is the floor no bucket layout can beat. DDP's own schedule has a higher one: the
optimizer step needs every bucket, and the data fetch and the forward need the step's parameters, so neither overlaps
the gradients' communication. ``max(compute, link + data fetch + optimizer step)`` (the phases timed on rank 0 by the
``compute_only`` run's straggler watch) is that floor, before the forward and the last bucket are counted.

Variants: ``compute_only``, ``stock`` (Lightning's ``DDPStrategy``), ``ddp_plus`` (defaults), ``ddp_plus_bucket_auto``
(``bucket_cap_mb="auto"``) and ``step_in_hook``, a prototype and not a feature: ``ddp_plus`` with a comm hook that steps
Adam for each bucket's parameters as soon as that bucket is averaged, so that the step overlaps the later buckets (its
parameters are compared with ``ddp_plus``'s after the same fit). Each rank is a one-core node in its own network
namespace, as in ``benchmarks/sharding.py``, whose runs this reuses.

Models (MLPs trained with Adam, batch 8 per rank): ``shallow`` is 64 -> 2048 -> 1 x [2048x2048] -> 16 (4.36 M
parameters, 16.6 MiB of gradients: few large tensors), ``deep`` is 64 -> 512 -> 12 x [512x512] -> 16 (3.19 M
parameters, 12.2 MiB: many small ones).

Writes ``benchmarks/results/overlap_bound.json`` and ``overlap_bound.md``; without root it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.netns import unavailable_reason
from benchmarks.sharding import parameter_bytes, run_setting, summarize

#: name -> (width, hidden layers)
MODELS = {"shallow": (2048, 1), "deep": (512, 12)}
VARIANTS = ("compute_only", "stock", "ddp_plus", "ddp_plus_bucket_auto", "step_in_hook")


def add_schedule_floor(result: dict) -> dict:
    """Give each all-reduce row of ``result`` DDP's schedule floor, ``max(compute, link + data fetch + optimizer
    step)``, and its ratio to it (the phases of the ``compute_only`` run, which sends nothing).

    >>> phases = {"data fetch": 1.0, "compute": 9.0, "optimizer step": 10.0}
    >>> rows = {"compute_only": {"step_ms": 20.0, "phase_ms": phases},
    ...         "ddp_plus": {"step_ms": 132.0, "link_bound_ms": 99.0}}
    >>> add_schedule_floor({"variants": rows})["variants"]["ddp_plus"]["ratio_to_schedule_floor"]
    1.2
    """
    compute = result["variants"].get("compute_only", {})
    phases = compute.get("phase_ms")
    for row in result["variants"].values():
        if phases and row.get("link_bound_ms"):
            serial = row["link_bound_ms"] + phases["data fetch"] + phases["optimizer step"]
            row["schedule_floor_ms"] = max(compute["step_ms"], serial)
            row["ratio_to_schedule_floor"] = row["step_ms"] / row["schedule_floor_ms"]
    return result


def markdown(results: list[dict]) -> str:
    mib = 2**20
    lines = [
        (
            "| model | link | nodes | variant | ms per step (min-max) | vs stock | buckets sent (MiB, in order) | "
            "max(compute, link) ms | + last bucket ms | vs max(compute, link) | vs the bound with the last bucket | "
            "max(compute, link + data + step) ms | vs it | rank 0's phases: data, compute, collective wait, optimizer "
            "step (ms) | max abs difference to ddp_plus |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for variant, row in result["variants"].items():
            buckets = row.get("bucket_bytes") or []
            with_last = row.get("overlap_bound_with_last_bucket_ms")
            to_last = row.get("ratio_to_bound_with_last_bucket")
            floor = row.get("schedule_floor_ms")
            to_floor = "-" if floor is None else f"{row['ratio_to_schedule_floor']:.2f}"
            difference = row.get("max_abs_difference_to_ddp_plus")
            difference = "-" if difference is None else f"{difference:.1e}"
            phases = ", ".join(f"{ms:.1f}" for ms in (row.get("phase_ms") or {}).values()) or "-"
            lines.append(
                f"| {result['model']} | {result['rate']} | {result['nodes']} | `{variant}` | "
                f"{row['step_ms']:.1f} ({row['step_ms_min']:.1f}-{row['step_ms_max']:.1f}) | "
                f"{row.get('ratio_to_stock', 1):.2f} | {', '.join(f'{b / mib:.2f}' for b in buckets) or '-'} | "
                f"{row.get('overlap_bound_ms', 0):.1f} | {'-' if with_last is None else f'{with_last:.1f}'} | "
                f"{row.get('ratio_to_bound', 0):.2f} | "
                f"{'-' if to_last is None else f'{to_last:.2f}'} | {'-' if floor is None else f'{floor:.1f}'} | "
                f"{to_floor} | {phases} | {difference} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--nodes", nargs="+", type=int, default=[2, 4], help="node counts, on the first rate")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, default=24, help="batches per rank per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if reason := unavailable_reason():
        print(f"overlap_bound: skipped: {reason}.")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / ".overlap_bound.raw.json"
    # the other node counts on the first rate only: the slowest link is where the overlap matters
    settings = [(n, args.rates[0]) for n in args.nodes] + [(min(args.nodes), rate) for rate in args.rates[1:]]
    results = []
    for model in args.models:
        width, layers = MODELS[model]
        setting_args = argparse.Namespace(**{**vars(args), "width": width, "layers": layers})
        for nodes, rate in settings:
            started = time.perf_counter()
            run_setting(setting_args, list(args.variants), nodes, rate, raw)
            summary = summarize(json.loads(raw.read_text()), nodes, rate, parameter_bytes(width, layers))
            results.append(add_schedule_floor({"model": model, "width": width, "hidden_layers": layers, **summary}))
            print(f"{model}, {rate}, {nodes} nodes: done in {time.perf_counter() - started:.0f} s", flush=True)
    if raw.exists():
        raw.unlink()
    import lightning
    import torch

    report = {
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, lightning {lightning.__version__}, gloo",
        "config": {"batch": 8, "batches": args.batches, "repeats": args.repeats, "optimizer": "Adam"},
        "results": results,
    }
    (out / "overlap_bound.json").write_text(json.dumps(report, indent=2))
    text = markdown(results)
    (out / "overlap_bound.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
