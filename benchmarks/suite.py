"""ddp_plus against stock Lightning DDP, side by side in one run, on this machine's CPU with gloo.

    python benchmarks/suite.py [--repeats 5] [--width 1024] [--layers 3] [--batches 40] [--only NAME ...]

Benchmarks (each alternates its variants A B A B ... on one process group, reports medians, min/max and ratios):
  overhead   automatic optimization, time per optimizer step: stock, ddp_plus (conflict check on, off; per-step
             sync guard off; uneven_inputs="join"), +telemetry, +replica guard (every step), and ddp_plus with the
             collective ledger, stall watchdog and phase timings off (or the phase timings alone)
  hooks      ddp_plus with none / fp16 / bf16 / powersgd: bytes and time per step (telemetry on for all)
  setup      time from Trainer.fit to the end of the first optimizer step: stock, ddp_plus validator on / off
  scaling    samples per second with 1 and 2 processes (ddp_plus), and the ratio to 1 process
  micro_batches   the same global batch per optimizer step (32 rows per rank) as stock Lightning's accumulate_grad_batches=4
             over batches of 8, ddp_plus's the same, and ddp_plus with batches of 32 split by chunk_size=8,
             and by chunk_size="auto" with memory to spare: samples per second, and the ratio to stock
  manual_accumulation   runs benchmarks/bench_manual_accumulation.py (k=4, manual optimization)
Writes benchmarks/results/suite.json and, with matplotlib (the `bench` extra), suite.png.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.ranks import run_ranks
from lightning_ddp_plus import DDPPlusStrategy

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
BENCHMARKS = ("overhead", "hooks", "setup", "scaling", "micro_batches", "manual_accumulation")
#: micro_batches: each variant's loader batch size and accumulate_grad_batches (32 rows per rank per optimizer step)
MICRO_BATCH_SHAPES = {
    "stock_accumulate_4": (8, 4),
    "ddp_plus_accumulate_4": (8, 4),
    "ddp_plus_micro_batch_8": (32, 1),
    "ddp_plus_micro_batch_auto": (32, 1),
}


class MLP(L.LightningModule):
    def __init__(self, width: int, layers: int, batches: int, batch_size: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
        self.width, self.batches, self.batch_size = width, batches, batch_size

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def train_dataloader(self):
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        return DataLoader(
            TensorDataset(torch.randn(self.batches * world * self.batch_size, self.width)), batch_size=self.batch_size
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class Clock(L.Callback):
    """Times every optimizer step (the end of every ``every``-th batch: an accumulation window's last), and the first
    one from the moment fit was called."""

    def __init__(self, fit_called: float, every: int = 1) -> None:
        self.fit_called, self.ends, self.first_step_s, self.every = fit_called, [], None, every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.every:
            return
        now = time.perf_counter()
        self.ends.append(now)
        if self.first_step_s is None:
            self.first_step_s = now - self.fit_called

    def step_seconds(self) -> float:
        steps = [b - a for a, b in zip(self.ends, self.ends[1:])][2:]  # the first steps are warm-up
        return statistics.median(steps)


def fit(strategy, args, devices: int = 2, batch_size: int = 32, accumulate: int = 1) -> dict:
    clock = Clock(time.perf_counter(), every=accumulate)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        callbacks=[clock],
        accumulate_grad_batches=accumulate,
        **QUIET,
    )
    trainer.fit(MLP(args.width, args.layers, args.batches * 32 // batch_size, batch_size=batch_size))
    telemetry = getattr(strategy, "telemetry", None)
    steps = max(1, trainer.global_step)
    checks = getattr(strategy, "replica_check_seconds", None)
    return {
        "replica_check_ms": 1e3 * statistics.median(checks) if checks else None,
        "step_s": clock.step_seconds(),
        "first_step_s": clock.first_step_s,
        "bytes_per_step": telemetry.totals.bytes_sent / steps if telemetry else None,
        "samples_per_s": batch_size * accumulate * devices / clock.step_seconds(),
    }


def variants(name: str):
    stock = lambda: L.pytorch.strategies.DDPStrategy(process_group_backend="gloo")
    plus = lambda **kw: lambda: DDPPlusStrategy(process_group_backend="gloo", **kw)
    if name == "overhead":
        return {
            "stock": stock,
            "ddp_plus": plus(),
            "ddp_plus_check_off": plus(checkpointing_conflict="off"),
            "ddp_plus_sync_guard_off": plus(sync_guard=False),
            "ddp_plus_uneven_join": plus(uneven_inputs="join"),
            "ddp_plus_telemetry": plus(telemetry=True),
            "ddp_plus_guard_every_step": plus(verify_replicas_every_n_steps=1),
            # the collective ledger, the stall watchdog and the phase timings off: what they cost per step
            "ddp_plus_ledger_off": plus(stall_report_after=None, ledger_length=0, find_stragglers_every_n_steps=None),
            "ddp_plus_stragglers_off": plus(find_stragglers_every_n_steps=None),
        }
    if name == "hooks":
        return {hook or "none": plus(telemetry=True, ddp_comm_hook=hook) for hook in (None, "fp16", "bf16", "powersgd")}
    if name == "setup":
        return {
            "stock": stock,
            "ddp_plus_validator_on": plus(),
            "ddp_plus_validator_off": plus(checkpointing_conflict="off"),
        }
    if name == "micro_batches":
        return {
            "stock_accumulate_4": stock,
            "ddp_plus_accumulate_4": plus(),
            "ddp_plus_micro_batch_8": plus(chunk_size=8),
            "ddp_plus_micro_batch_auto": plus(chunk_size="auto"),
        }
    raise ValueError(name)


def rank_main(args) -> None:
    raw: dict = {}
    for bench in args.bench.split(","):  # the benchmarks of one launch, one after another on its process group
        runs: dict = raw.setdefault(bench, {})
        if bench == "scaling":
            runs[f"{args.world}_processes"] = [
                fit(DDPPlusStrategy(process_group_backend="gloo"), args, devices=args.world)
                for _ in range(args.repeats)
            ]
            continue
        factories = variants(bench)
        for _ in range(args.repeats):
            for label, factory in factories.items():  # alternating: A B C A B C ...
                batch_size, accumulate = MICRO_BATCH_SHAPES.get(label, (32, 1))
                runs.setdefault(label, []).append(fit(factory(), args, batch_size=batch_size, accumulate=accumulate))
    if int(os.environ["LOCAL_RANK"]) == 0:
        Path(args.raw).write_text(json.dumps(raw))
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(args, benches: list[str], world: int) -> dict:
    """The raw runs of ``benches`` (by benchmark, then variant), all from one launch of ``world`` ranks: a rank's start
    (importing torch and Lightning) costs more than a tiny benchmark."""
    raw = Path(args.out) / f".{'_'.join(benches)}_{world}.raw.json"  # --out exists (main makes it); results/ may not
    command = [
        sys.executable,
        __file__,
        "--repeats",
        str(args.repeats),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--batches",
        str(args.batches),
    ]
    bench = ",".join(benches)
    run_ranks([*command, "--bench", bench, "--world", str(world), "--raw", str(raw)], world=world, timeout=args.timeout)
    data = json.loads(raw.read_text())
    raw.unlink()
    return data


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(bench: str, raw: dict, baseline: str, metric: str) -> dict:
    summary = {
        label: {k: stats([run[k] for run in runs]) for k in runs[0] if runs[0][k] is not None}
        for label, runs in raw.items()
    }
    base = summary[baseline][metric]["median"]
    for values in summary.values():
        values[f"ratio_to_{baseline}"] = values[metric]["median"] / base
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batches", type=int, default=40, help="batches per rank per run")
    parser.add_argument("--only", nargs="*", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--as-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bench", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--raw", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank is not None:
        rank_main(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, lightning {L.__version__}, gloo",
        "config": {
            "width": args.width,
            "layers": args.layers,
            "parameters": args.layers * (args.width**2 + args.width),
            "repeats": args.repeats,
            "batches_per_rank": args.batches,
            "batch_size": 32,
        },
    }
    started = time.perf_counter()
    on_two_ranks = [bench for bench in args.only if bench in ("overhead", "hooks", "setup", "micro_batches")]
    launched = launch(args, on_two_ranks, 2) if on_two_ranks else {}
    for bench in args.only:
        if bench == "overhead":
            results[bench] = summary = summarize(bench, launched[bench], "stock", "step_s")
            for off in ("ddp_plus_ledger_off", "ddp_plus_stragglers_off"):  # the ratios issue 27 bounds (< 1 %)
                ratio = summary["ddp_plus"]["step_s"]["median"] / summary[off]["step_s"]["median"]
                summary["ddp_plus"][f"ratio_to_{off}"] = ratio
        elif bench == "hooks":
            results[bench] = summarize(bench, launched[bench], "none", "step_s")
        elif bench == "setup":
            results[bench] = summarize(bench, launched[bench], "stock", "first_step_s")
        elif bench == "micro_batches":
            results[bench] = summarize(bench, launched[bench], "stock_accumulate_4", "samples_per_s")
        elif bench == "scaling":
            raw = {**launch(args, [bench], 1)[bench], **launch(args, [bench], 2)[bench]}
            results[bench] = summarize(bench, raw, "1_processes", "samples_per_s")
        elif bench == "manual_accumulation":
            target = out / "manual_accumulation.json"
            command = [
                sys.executable,
                str(ROOT / "benchmarks" / "bench_manual_accumulation.py"),
                "--repeats",
                str(args.repeats),
                "--width",
                str(args.width),
                "--layers",
                str(args.layers),
                "--batches",
                str(max(8, args.batches)),
                "--out",
                str(target),
                "--timeout",
                str(args.timeout),
            ]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[bench] = json.loads(target.read_text())
        print(f"{bench}: done at {time.perf_counter() - started:.0f} s", flush=True)
    (out / "suite.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    chart(results, out / "suite.png")


def chart(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart drawn")
        return
    panels = [name for name in ("overhead", "hooks", "setup", "scaling", "micro_batches") if name in results]
    if "manual_accumulation" in results:
        panels.append("manual_accumulation")
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for axis, name in zip(axes[0], panels):
        if name == "manual_accumulation":
            data = results[name]
            labels, values = ["stock", "ddp_plus"], [1.0, data["ratio_ddp_plus_over_stock"]]
            axis.set_title("manual accumulation k=4\nstep time / stock")
        else:
            data = results[name]
            ratio_key = next(k for k in next(iter(data.values())) if k.startswith("ratio_to_"))
            labels = list(data)
            values = [data[label][ratio_key] for label in labels]
            axis.set_title(f"{name}\n{ratio_key.replace('_', ' ')}")
        axis.bar(range(len(labels)), values, color="#4a7ab7")
        axis.set_xticks(
            range(len(labels)),
            [label.replace("ddp_plus_", "+").replace("_", " ") for label in labels],
            rotation=30,
            ha="right",
            fontsize=8,
        )
        axis.axhline(1.0, color="gray", linewidth=0.8)
        for index, value in enumerate(values):
            axis.text(index, value, f"{value:.2f}", ha="center", va="bottom", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"chart: {path}")


if __name__ == "__main__":
    main()
