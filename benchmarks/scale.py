"""What the strategy adds per step and at the start as the ranks grow: bare DDP, stock Lightning and ``ddp_plus``
(its flags in the last gradient bucket, and on the side channel) side by side, at 2 to 16 ranks on this machine,
started as torchrun starts them.

Each rank trains a tiny model whose step sleeps ``--sleep`` seconds for the accelerator's time, so that many ranks fit
on a few cores. Its gradient (``--width``; 2,817 elements at the default) is not smaller than gloo's all-reduce needs
to reach its full cost: below about twice the ranks' number of elements, an all-reduce costs less the fewer they are,
so on a gradient of a few elements the flags riding in the last bucket would price gloo's element count, not the
strategy (measured in ``docs/benchmarks.md``). "Bare DDP" is stock Lightning with its per-step SIGTERM broadcast off
(the floor).
``ddp_plus_side_channel`` is ``ddp_plus`` with nothing riding in the buckets, as with PowerSGD's or a user's
``ddp_comm_hook``, or ``optimizer_sharding="overlap"``: the flags take an all-reduce of their own on every synced
backward.

Per variant and world size it reports, from rank 0:

- Python-level collectives (``torch.distributed``'s functions, by name) and store calls (``get``, ``set``, ``check``,
  ``add``, ``wait``, ...) per steady step and before the first step; DDP's own bucket all-reduces run in C++, or in
  a Python communication hook (``ddp_plus``'s flag carrier, torch's ``allreduce_hook``), counted apart as "gradient
  bucket"; calls from a thread other than the main one (the stall watchdog's, once a rank makes no progress) are
  marked so;
- the median step time (between consecutive batch starts, after ``--warm-up`` steps), and its ratio to bare DDP's;
- the CPU time rank 0's process spends per step, all its threads (the hooks' and gloo's included): on a cluster, where
  each rank has cores of its own, this is what a step's host work adds; here, with more ranks than cores, the step
  times also carry every other rank's;
- the time from the process's start to the first training batch (the slowest rank's), and from the last rank's
  ``Trainer.fit`` call to it: what the strategy's start costs once every rank is there. With many processes on a few
  cores, the ranks finish importing torch and Lightning seconds apart (the spread of their ``fit`` calls, reported
  too), and a rank that calls ``fit`` early waits for the last one in the process group's rendezvous, whatever the
  strategy: the time from a rank's own ``fit`` call measures that spread, not the strategy.
- the CPU time from ``fit`` to the first training batch (the most of any rank): what the start costs a rank where each
  rank has cores of its own.

    python benchmarks/scale.py                        # 2, 4, 8, 16 ranks, a few minutes on 2 cores
    python benchmarks/scale.py --ranks 2 4 --steps 20 --out results

Nothing here is asserted; ``tests/test_benchmarks_smoke.py`` runs it tiny so that it cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ranks import run_ranks
from benchmarks.recipes import flags_on_side_channel, no_sigterm_broadcast

VARIANTS = ("bare", "stock", "ddp_plus", "ddp_plus_side_channel")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "all_to_all_single",
    "monitored_barrier",
)
STORE_METHODS = ("get", "set", "check", "add", "wait", "compare_set", "delete_key", "multi_get", "multi_set")


class Counts:
    """Python-level collectives and store calls in this process, by name."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def install(self) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._counted(f"collective {name}", getattr(dist, name)))
        for name in STORE_METHODS:
            if hasattr(dist.Store, name):
                setattr(dist.Store, name, self._counted(f"store {name}", getattr(dist.Store, name)))

    def _counted(self, key: str, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = Path(sys._getframe(1).f_code.co_filename).name
            name = "gradient bucket" if caller in ("flag_carrier.py", "default_hooks.py") else key
            in_main = threading.current_thread() is threading.main_thread()
            self.calls[name if in_main else f"{name} (thread)"] += 1
            return function(*args, **kwargs)

        return counted


def rank_main(variant: str, options: argparse.Namespace) -> None:
    """One rank: a fit of ``options.steps`` steps, its counts and times written by rank 0."""
    started = float(os.environ["SCALE_T0"])
    counts = Counts()
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    counts.install()
    marks: dict[str, Any] = {"batch_starts": [], "cpu_at": [], "calls_at": []}

    class Timing(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            marks["batch_starts"].append(time.time())
            marks["cpu_at"].append(time.process_time())
            marks["calls_at"].append(Counter(counts.calls))

    class Sleepy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            width = options.width
            self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(options.sleep)  # the accelerator's time
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callbacks: list[Any] = [Timing()]
    if variant in ("bare", "stock"):
        from lightning.pytorch.strategies import DDPStrategy

        strategy: Any = DDPStrategy(process_group_backend="gloo")
        if variant == "bare":
            callbacks.append(no_sigterm_broadcast())
    else:
        import lightning_ddp_plus

        strategy = lightning_ddp_plus.DDPPlusStrategy(process_group_backend="gloo")
    world = int(os.environ["WORLD_SIZE"])
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=options.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.environ["SCALE_DIR"],
    )
    data = TensorDataset(torch.randn(8 * options.steps * world, 8), torch.randn(8 * options.steps * world, 1))
    fit_called, fit_cpu = time.time(), time.process_time()
    with flags_on_side_channel(variant == "ddp_plus_side_channel"):
        trainer.fit(Sleepy(), DataLoader(data, batch_size=8))
    first = marks["batch_starts"][0]
    times = [
        {
            "from start": first - started,
            "fit called": fit_called,
            "first": first,
            "CPU to first": marks["cpu_at"][0] - fit_cpu,
        }
    ]
    gathered: list[Any] = [None] * world
    import torch.distributed as dist

    if dist.is_initialized():
        dist.all_gather_object(gathered, times[0])  # after the fit: not counted in its steps
    else:
        gathered = times
    flag_latency = flag_all_reduce_seconds() if dist.is_initialized() else 0.0
    if trainer.global_rank == 0:
        fit_calls = [rank["fit called"] for rank in gathered]
        warm = options.warm_up
        starts, calls = marks["batch_starts"], marks["calls_at"]
        steady = len(starts) - 1 - warm
        per_step = Counter(calls[-1])
        per_step.subtract(calls[warm])
        result = {
            "variant": variant,
            "ranks": world,
            "steady steps": steady,
            "per step": {name: n / steady for name, n in sorted(per_step.items()) if n},
            "before the first step": dict(sorted(calls[0].items())),
            "median step (ms)": 1e3 * statistics.median(b - a for a, b in zip(starts[warm:], starts[warm + 1 :])),
            "CPU per step (ms)": 1e3 * (marks["cpu_at"][-1] - marks["cpu_at"][warm]) / steady,
            "first step from start (s)": max(rank["from start"] for rank in gathered),
            # the clocks are one machine's: the last fit call, and the first step that every rank has reached
            "first step from the last fit call (s)": max(r["first"] for r in gathered) - max(fit_calls),
            "fit calls spread (s)": max(fit_calls) - min(fit_calls),
            # what a rank's start costs where each rank has cores of its own (a cluster), whatever shares them here
            "CPU from fit to the first step (s)": max(r["CPU to first"] for r in gathered),
            "flag all_reduce (us)": 1e6 * flag_latency,
        }
        Path(os.environ["SCALE_OUT"]).write_text(json.dumps(result))
    if dist.is_initialized():  # every rank ends its group before it exits (gloo aborts a process that does not)
        dist.barrier()
        dist.destroy_process_group()


def flag_all_reduce_seconds(repeats: int = 50) -> float:
    """The median time of an all-reduce of 5 integers on the job's gloo group: what a per-step agreement of a few
    flags costs at this world size (the cost model in ``docs/benchmarks.md`` reads its growth with the ranks)."""
    import torch
    import torch.distributed as dist

    flags, times = torch.zeros(5, dtype=torch.int64), []
    dist.barrier()
    for _ in range(repeats):
        started = time.perf_counter()
        dist.all_reduce(flags)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(variant: str, world: int, options: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        out = Path(root) / "result.json"
        extra = {"SCALE_T0": str(time.time()), "SCALE_DIR": root, "SCALE_OUT": str(out)}
        run_ranks([sys.executable, __file__, "--as-variant", variant, *sys.argv[1:]], world, options.timeout, extra)
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def markdown(results: list[dict[str, Any]]) -> str:
    bare = {r["ranks"]: r["median step (ms)"] for r in results if r["variant"] == "bare"}
    lines = [
        (
            "| ranks | variant | step (ms) | to bare | CPU per step (ms) | first step from start / last fit call (s) "
            "| fit calls spread (s) | CPU from fit to step 1 (s) "
            "| per step, own | before step 1 | 5-int all_reduce (us) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["median step (ms)"] / bare[r["ranks"]] if r["ranks"] in bare else float("nan")
        own = ", ".join(f"{k} {v:.2f}" for k, v in r["per step"].items()) or "none"
        start = ", ".join(f"{k} {v}" for k, v in r["before the first step"].items()) or "none"
        lines.append(
            f"| {r['ranks']} | {r['variant']} | {r['median step (ms)']:.1f} | {ratio:.2f}x | "
            f"{r['CPU per step (ms)']:.2f} | "
            f"{r['first step from start (s)']:.1f} / {r['first step from the last fit call (s)']:.2f} | "
            f"{r['fit calls spread (s)']:.2f} | {r['CPU from fit to the first step (s)']:.2f} | {own} | {start} | "
            f"{r['flag all_reduce (us)']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-up", type=int, default=5)
    parser.add_argument("--width", type=int, default=256, help="the hidden layer's width (the gradient's size)")
    parser.add_argument("--sleep", type=float, default=0.04, help="seconds each step sleeps (the accelerator)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", help="a folder for scale.json and scale.md")
    parser.add_argument("--as-variant", help=argparse.SUPPRESS)
    parser.add_argument("--as-rank", help=argparse.SUPPRESS)  # run_ranks names each rank; LOCAL_RANK says the same
    options = parser.parse_args()
    if options.as_variant:
        rank_main(options.as_variant, options)
        return
    results = [run(variant, world, options) for world in options.ranks for variant in options.variants]
    table = markdown(results)
    print(table)
    if options.out:
        Path(options.out).mkdir(parents=True, exist_ok=True)
        (Path(options.out) / "scale.json").write_text(json.dumps(results, indent=1))
        (Path(options.out) / "scale.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
