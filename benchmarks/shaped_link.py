"""Two nodes on a shaped link: ``ddp_plus`` against stock Lightning ``DDPStrategy`` where the network is the bottleneck,
next to the physical limit of every figure.

    sudo python benchmarks/shaped_link.py [--rates 1gbit 10gbit] [--repeats 3] [--batches 40]

Each rank runs in its own network namespace (2 nodes x 1 device, ``NODE_RANK`` 0/1, ``MASTER_ADDR`` on a veth pair
shaped with ``tc tbf``), with one intra-op thread, as two one-core nodes would. On one process group per link rate, the
variants run alternately (A B C ... A B C ...) and each reports the median time per optimizer step after its warm-up
(after ``bucket_cap_mb="auto"`` has chosen, for every variant alike). Next to each figure:

- compute: the same per-rank batch in one process, no communication (measured first, here, by this script);
- bytes each rank sends per optimizer step for a ring all-reduce of the gradients after compression
  (``2 (n-1)/n`` times the gradient bytes; for 2 ranks the gradient bytes), and link time = bytes / rate;
- the bounds ``compute + link`` (no overlap) and ``max(compute, link)`` (perfect overlap), per optimizer step.

``stock_no_sigterm`` is stock with Lightning's per-step SIGTERM broadcast off (bare DDP under Lightning, the floor);
``ddp_plus_side_channel`` is ``ddp_plus`` with nothing riding in the gradient buckets (as with a ``ddp_comm_hook``):
the step's flags take an all-reduce of their own, and torch's reducer all-reduces the buckets in C++.

Writes ``benchmarks/results/shaped_link.json`` and ``shaped_link.png``; without root it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.netns import tcp_throughput_mbit, two_nodes, unavailable_reason
from benchmarks.ranks import base_environment, run_processes
from benchmarks.recipes import K, flags_on_side_channel, no_sigterm_broadcast, plus_manual_step, stock_manual_step

BATCH = 8
FEATURES = 64
OUTPUTS = 16
AUTO_WARMUP_STEPS = 14  # bucket_cap_mb="auto" times 4 sizes for 3 steps each, then rebuilds once more
VARIANTS = (
    "stock",
    "stock_no_sigterm",
    "ddp_plus",
    "ddp_plus_side_channel",
    "ddp_plus_check_off",
    "fp16",
    "bf16",
    "powersgd_r1",
    "powersgd_r4",
    "bucket_1",
    "bucket_25",
    "bucket_100",
    "bucket_auto",
    "stock_accumulate_k4",
    "ddp_plus_accumulate_k4",
    "stock_manual_recipe_k4",
    "ddp_plus_manual_k4",
)
BASELINE = {"stock_accumulate_k4": None, "ddp_plus_accumulate_k4": "stock_accumulate_k4"}
BASELINE.update({"stock_manual_recipe_k4": None, "ddp_plus_manual_k4": "stock_manual_recipe_k4"})


def accumulation(variant: str) -> int:
    return K if variant.endswith("_k4") else 1


def baseline_of(variant: str) -> str | None:
    return BASELINE.get(variant, None if variant == "stock" else "stock")


# ---------------------------------------------------------------------------------------------- the model and runs


def build_modules():
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class MLP(L.LightningModule):
        def __init__(self, width: int, layers: int, batches: int, layernorm: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            block = (
                (lambda: (nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()))
                if layernorm
                else (lambda: (nn.Linear(width, width), nn.ReLU()))
            )
            hidden = [m for _ in range(layers) for m in block()]
            self.net = nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), *hidden, nn.Linear(width, OUTPUTS))
            self.batches = batches

        def loss(self, batch):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def training_step(self, batch, batch_idx):
            return self.loss(batch)

        def train_dataloader(self):
            world = dist.get_world_size() if dist.is_initialized() else 1
            n = self.batches * BATCH * world
            return DataLoader(TensorDataset(torch.randn(n, FEATURES), torch.randn(n, OUTPUTS)), batch_size=BATCH)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class StockManualRecipe(MLP):
        """Lightning's documented manual accumulation: every backward all-reduces, a step every K batches."""

        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            stock_manual_step(self, self.loss(batch), batch_idx)

    class PlusManual(StockManualRecipe):
        """ddp_plus: only the window's last backward all-reduces."""

        def training_step(self, batch, batch_idx):
            plus_manual_step(self, self.loss(batch))

    return MLP, StockManualRecipe, PlusManual


class StepClock:
    """Times between optimizer steps (``global_step`` changes), as a Lightning callback."""

    def __init__(self) -> None:
        import lightning as L

        clock = self

        class _Callback(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step != clock.last_step:
                    clock.last_step = trainer.global_step
                    clock.ends.append(time.perf_counter())

        self.callback, self.ends, self.last_step = _Callback(), [], 0

    def median_step_ms(self, skip: int) -> float:
        steps = [b - a for a, b in zip(self.ends, self.ends[1:])][skip:]
        return 1e3 * statistics.median(steps)


def strategy_for(variant: str):
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from lightning_ddp_plus import DDPPlusStrategy

    if variant.startswith("stock"):
        return DDPStrategy(process_group_backend="gloo")
    kwargs: dict = {}
    if variant == "ddp_plus_check_off":
        kwargs["checkpointing_conflict"] = "off"
    elif variant in ("fp16", "bf16"):
        kwargs["ddp_comm_hook"] = variant
    elif variant.startswith("powersgd_r"):
        rank = int(variant.removeprefix("powersgd_r"))
        state = PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        kwargs.update(ddp_comm_hook="powersgd", ddp_comm_state=state)
    elif variant.startswith("bucket_"):
        size = variant.removeprefix("bucket_")
        kwargs["bucket_cap_mb"] = "auto" if size == "auto" else float(size)
    if variant.startswith("ddp_plus") and variant.endswith("_k4"):
        kwargs["gradient_accumulation_steps"] = K
    return DDPPlusStrategy(process_group_backend="gloo", **kwargs)


def fit_variant(variant: str, args, devices: int = 1, num_nodes: int = 2) -> dict:
    import lightning as L

    MLP, StockManualRecipe, PlusManual = build_modules()
    k = accumulation(variant)
    model_class = {"stock_manual_recipe_k4": StockManualRecipe, "ddp_plus_manual_k4": PlusManual}.get(variant, MLP)
    batches = args.batches * (2 if k > 1 else 1)
    model = model_class(args.width, args.layers, batches, args.layernorm)
    clock = StepClock()
    strategy = strategy_for(variant) if num_nodes > 1 else "auto"
    callbacks = [clock.callback]
    if variant == "stock_no_sigterm":  # bare DDP under Lightning: its per-step SIGTERM broadcast off
        callbacks.append(no_sigterm_broadcast())
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_epochs=1,
        accumulate_grad_batches=k if variant == "stock_accumulate_k4" else 1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with flags_on_side_channel(variant == "ddp_plus_side_channel"):
        trainer.fit(model)
    skip = AUTO_WARMUP_STEPS if k == 1 else 3
    choice = getattr(strategy, "bucket_choice", None)
    return {
        "step_ms": clock.median_step_ms(skip),
        "steps": trainer.global_step,
        "auto_choice": None if choice is None else {"chosen_mb": choice.chosen_mb, "medians_ms": choice.medians_ms},
    }


def node_main(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    raw: dict[str, list] = {variant: [] for variant in args.variants}
    for _ in range(args.repeats):
        for variant in args.variants:  # alternating: A B C ... A B C ...
            raw[variant].append(fit_variant(variant, args))
    if int(os.environ["NODE_RANK"]) == 0:
        Path(args.raw).write_text(json.dumps(raw))
    if dist.is_initialized():
        dist.destroy_process_group()


def compute_main(args) -> None:
    """One process, no process group: the per-rank compute of one optimizer step (and of one micro-batch)."""
    import torch

    torch.set_num_threads(args.threads)
    figures = {"step_ms": [], "manual_micro_batch_ms": []}
    for _ in range(args.repeats):
        figures["step_ms"].append(fit_variant("stock", args, num_nodes=1)["step_ms"])
        figures["manual_micro_batch_ms"].append(fit_variant("stock_manual_recipe_k4", args, num_nodes=1)["step_ms"] / K)
    Path(args.raw).write_text(json.dumps({name: statistics.median(v) for name, v in figures.items()}))


# ---------------------------------------------------------------------------------------------- the physical limit


def gradient_shapes(width: int, layers: int, layernorm: bool = False) -> list[tuple[int, ...]]:
    """Parameter shapes of the benchmark's MLP, in ``parameters()`` order.

    >>> gradient_shapes(4, 1)
    [(4, 64), (4,), (4, 4), (4,), (16, 4), (16,)]
    >>> gradient_shapes(4, 1, layernorm=True)[2:6]
    [(4, 4), (4,), (4,), (4,)]
    """
    shapes = [(width, FEATURES), (width,)]
    for _ in range(layers):
        shapes += [(width, width), (width,)] + ([(width,), (width,)] if layernorm else [])
    return shapes + [(OUTPUTS, width), (OUTPUTS,)]


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = 2) -> int:
    """Elements PowerSGD all-reduces per step (torch's rule: a matrix ``m x n`` is sent as ``P`` and ``Q``,
    ``(m + n) r`` elements, when that is ``min_compression_rate`` times smaller; vectors go uncompressed).

    >>> powersgd_elements([(1024, 1024), (1024,)], rank=1)
    3072
    """
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) <= 1:
            total += numel
            continue
        rows, cols = shape[0], numel // shape[0]
        r = min(rows, cols, rank)
        total += (rows + cols) * r if (rows + cols) * r * min_compression_rate < numel else numel
    return total


def bytes_per_step(variant: str, shapes: list[tuple[int, ...]], world: int = 2) -> float:
    """Bytes each rank sends per optimizer step: a ring all-reduce sends ``2 (n-1)/n`` of the buffer."""
    elements = sum(math.prod(shape) for shape in shapes)
    if variant in ("fp16", "bf16"):
        buffer = 2 * elements
    elif variant.startswith("powersgd_r"):
        buffer = 4 * powersgd_elements(shapes, int(variant.removeprefix("powersgd_r")))
    elif variant == "stock_manual_recipe_k4":
        buffer = 4 * elements * K  # every micro-batch all-reduces
    else:
        buffer = 4 * elements
    return 2 * (world - 1) / world * buffer


def rate_bits(rate: str) -> float:
    """Bits per second of a ``tc`` rate.

    >>> rate_bits("1gbit"), rate_bits("10gbit"), rate_bits("500mbit")
    (1000000000.0, 10000000000.0, 500000000.0)
    """
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * factor
    raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 1gbit or 500mbit")


def bounds(variant: str, compute: dict, link_ms: float) -> tuple[float, float]:
    """(``compute + link``, ``max(compute, link)``) per optimizer step; with k micro-batches the compute is k times
    one, and only the synced backward can overlap (for the stock recipe, every backward syncs)."""
    k = accumulation(variant)
    if k == 1:
        c = compute["step_ms"]
        return c + link_ms, max(c, link_ms)
    c = compute["manual_micro_batch_ms"] if "manual" in variant else compute["step_ms"]
    if variant == "stock_manual_recipe_k4":
        return k * c + link_ms, k * max(c, link_ms / k)
    return k * c + link_ms, (k - 1) * c + max(c, link_ms)


# ---------------------------------------------------------------------------------------------- orchestration


def run_nodes(args, rate: str, raw: Path) -> float:
    """Run the variants on two shaped nodes; returns the link's measured TCP rate in Mbit/s."""
    with two_nodes(rate) as nodes:
        measured = tcp_throughput_mbit(nodes, 64 if rate_bits(rate) <= 2e9 else 256)
        commands, environments = [], []
        for node_rank, node in enumerate(nodes):
            environments.append(
                {
                    **base_environment(),
                    "MASTER_ADDR": nodes[0].address,
                    "MASTER_PORT": "29500",
                    "NODE_RANK": str(node_rank),
                    "LOCAL_RANK": "0",
                    "WORLD_SIZE": "2",
                    "GLOO_SOCKET_IFNAME": node.interface,
                    "OMP_NUM_THREADS": str(args.threads),
                }
            )
            commands.append(
                ["ip", "netns", "exec", node.namespace, sys.executable, __file__, "--as-node", "--raw", str(raw),
                 "--repeats", str(args.repeats), "--batches", str(args.batches), "--width", str(args.width),
                 "--layers", str(args.layers), "--variants", *args.variants, *(["--layernorm"] if args.layernorm else []),
                 "--threads", str(args.threads)]
            )  # fmt: skip
        run_processes(commands, environments, args.timeout)
    return measured


def summarize(raw: dict, compute: dict, rate: str, measured_mbit: float, shapes) -> dict:
    rows = {}
    for variant, runs in raw.items():
        step_ms = statistics.median(run["step_ms"] for run in runs)
        sent = bytes_per_step(variant, shapes)
        link_ms = 1e3 * sent * 8 / rate_bits(rate)
        serial, overlapped = bounds(variant, compute, link_ms)
        rows[variant] = {
            "step_ms": step_ms,
            "step_ms_min": min(run["step_ms"] for run in runs),
            "step_ms_max": max(run["step_ms"] for run in runs),
            "per_micro_batch_ms": step_ms / accumulation(variant),
            "bytes_per_step": sent,
            "link_ms": link_ms,
            "bound_compute_plus_link_ms": serial,
            "bound_max_compute_link_ms": overlapped,
            "ratio_to_compute_plus_link": step_ms / serial,
            "ratio_to_max_compute_link": step_ms / overlapped,
            "auto_choices": [run["auto_choice"] for run in runs if run["auto_choice"]],
        }
    for variant, row in rows.items():
        base = baseline_of(variant)
        row["baseline"] = base
        row["ratio_to_baseline"] = row["step_ms"] / rows[base]["step_ms"] if base in rows else None
    return {"rate": rate, "measured_tcp_mbit": measured_mbit, "variants": rows}


def print_table(result: dict) -> None:
    print(f"\n{result['rate']} (one TCP stream: {result['measured_tcp_mbit']:.0f} Mbit/s)")
    header = f"{'variant':26} {'ms/step':>8} {'vs base':>8} {'MB/step':>8} {'link ms':>8} {'c+l ms':>8} {'max ms':>8} {'/c+l':>6} {'/max':>6}"
    print(header)
    for variant, row in result["variants"].items():
        ratio = f"{row['ratio_to_baseline']:.2f}" if row["ratio_to_baseline"] else "-"
        print(
            f"{variant:26} {row['step_ms']:8.1f} {ratio:>8} {row['bytes_per_step'] / 2**20:8.2f} {row['link_ms']:8.1f} "
            f"{row['bound_compute_plus_link_ms']:8.1f} {row['bound_max_compute_link_ms']:8.1f} "
            f"{row['ratio_to_compute_plus_link']:6.2f} {row['ratio_to_max_compute_link']:6.2f}"
        )


def markdown(report: dict) -> str:
    """The docs' (docs/benchmarks.md) tables: per rate, each variant's time per optimizer step against stock and the two bounds."""
    lines = []
    for result in report["results"]:
        lines += [
            f"**{result['rate']}** (one TCP stream through the shaping: {result['measured_tcp_mbit']:.0f} Mbit/s)",
            "",
            (
                "| variant | ms per optimizer step (min-max) | vs stock (same k) | MiB sent per step | link ms | "
                "compute + link | max(compute, link) | measured / (compute + link) |"
            ),
            "|---|---|---|---|---|---|---|---|",
        ]
        for variant, row in result["variants"].items():
            ratio = f"{row['ratio_to_baseline']:.2f}" if row["ratio_to_baseline"] else "1.00"
            lines.append(
                f"| `{variant}` | {row['step_ms']:.1f} ({row['step_ms_min']:.1f}-{row['step_ms_max']:.1f}) | {ratio} | "
                f"{row['bytes_per_step'] / 2**20:.2f} | {row['link_ms']:.1f} | {row['bound_compute_plus_link_ms']:.1f} | "
                f"{row['bound_max_compute_link_ms']:.1f} | {row['ratio_to_compute_plus_link']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def chart(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart drawn")
        return
    figure, axes = plt.subplots(len(results), 1, figsize=(12, 4.2 * len(results)), squeeze=False)
    for axis, result in zip(axes[:, 0], results):
        rows = result["variants"]
        names = list(rows)
        x = range(len(names))
        per = [accumulation(n) for n in names]
        axis.bar(x, [rows[n]["per_micro_batch_ms"] for n in names], color="#4a7ab7", label="measured")
        serial = [rows[n]["bound_compute_plus_link_ms"] / k for n, k in zip(names, per)]
        overlap = [rows[n]["bound_max_compute_link_ms"] / k for n, k in zip(names, per)]
        axis.scatter(x, serial, marker="_", s=400, color="black", label="compute + link", zorder=3)
        axis.scatter(x, overlap, marker="_", s=400, color="#d1615d", label="max(compute, link)", zorder=3)
        for index, name in enumerate(names):
            ratio = rows[name]["ratio_to_baseline"]
            if ratio:
                axis.text(
                    index, rows[name]["per_micro_batch_ms"], f"{ratio:.2f}x", ha="center", va="bottom", fontsize=8
                )
        axis.set_xticks(list(x), [n.replace("_", " ") for n in names], rotation=30, ha="right", fontsize=8)
        axis.set_ylabel("ms per micro-batch")
        axis.set_title(
            f"2 nodes x 1 rank, {result['rate']} tbf link ({result['measured_tcp_mbit']:.0f} Mbit/s TCP); "
            "labels: ratio to stock (same accumulation)",
            fontsize=10,
        )
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"chart: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=40, help="batches per rank per run (x2 for k=4 variants)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3, help="hidden width x width layers")
    parser.add_argument("--layernorm", action="store_true", help="a LayerNorm after each hidden layer")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (2 ranks share 2 cores)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--as-node", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--raw", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_node:
        node_main(args)
        return
    if args.compute:
        compute_main(args)
        return
    reason = unavailable_reason()
    if reason:
        print(f"shaped_link: skipped: {reason}.")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw_path = out / ".shaped_link.raw.json"
    common = ["--repeats", str(args.repeats), "--batches", str(args.batches), "--width", str(args.width)]
    common += ["--layers", str(args.layers), "--threads", str(args.threads)] + (
        ["--layernorm"] if args.layernorm else []
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run([sys.executable, __file__, "--compute", "--raw", str(raw_path), *common], check=True, env=env)
    compute = json.loads(raw_path.read_text())
    shapes = gradient_shapes(args.width, args.layers, args.layernorm)
    print(f"compute per step (1 process, 1 thread): {compute['step_ms']:.1f} ms", flush=True)
    results = []
    for rate in args.rates:
        started = time.perf_counter()
        measured = run_nodes(args, rate, raw_path)
        result = summarize(json.loads(raw_path.read_text()), compute, rate, measured, shapes)
        results.append(result)
        print_table(result)
        print(f"{rate}: done in {time.perf_counter() - started:.0f} s", flush=True)
    raw_path.unlink()
    import lightning
    import torch

    report = {
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, lightning {lightning.__version__}, gloo",
        "config": {
            "parameters": sum(math.prod(s) for s in shapes),
            "gradient_MB": 4 * sum(math.prod(s) for s in shapes) / 2**20,
            "width": args.width,
            "hidden_layers": args.layers,
            "layernorm": args.layernorm,
            "threads_per_rank": args.threads,
            "batch": BATCH,
            "repeats": args.repeats,
            "batches": args.batches,
            "k": K,
        },
        "compute": compute,
        "results": results,
    }
    (out / "shaped_link.json").write_text(json.dumps(report, indent=2))
    (out / "shaped_link.md").write_text(markdown(report))
    chart(results, out / "shaped_link.png")


if __name__ == "__main__":
    main()
