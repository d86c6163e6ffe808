"""DDP or ZeRO: optimizer-state sharding against plain DDP and stock Lightning, and what growing the job costs.

    sudo python benchmarks/sharding.py [--width 1024] [--layers 3] [--batches 24] [--repeats 3] [--nodes 2 3 4]

Every rank is a "node" of one device (``NODE_RANK``, ``MASTER_ADDR`` of node 0), with one intra-op thread, and
trains the same MLP with Adam. On one process group per setting, the variants run alternately (A B C ... A B C ...):

1. ``stock`` (Lightning's ``DDPStrategy``), ``ddp_plus``, ``ddp_plus_sharded`` (``optimizer_sharding=True``) and
   ``ddp_plus_overlap`` (``"overlap"``, which gloo refuses before launch: its row says so), on loopback and on two
   nodes joined by a 1 Gbit/s ``tc tbf`` link. Per variant: median time per optimizer step, each rank's real
   optimizer-state bytes, the bytes each node's interface really sent per step (shaped link), the bytes a ring
   all-reduce must send (``2 (n-1)/n`` x gradient bytes) and, with sharding, the parameter broadcast's share
   (``(n-1)/n`` x parameter bytes), and the time a checkpoint's consolidation takes on each rank.
2. ``ddp_plus`` on 2, 3 and 4 nodes on the 1 Gbit/s link: time per step and bytes sent per node, against the ring
   bound ``2 (n-1)/n x gradient bytes / rate``.

Writes ``benchmarks/results/sharding.json`` and ``sharding.md``; without root it runs the loopback part only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.netns import sent_bytes, shaped_nodes, unavailable_reason
from benchmarks.ranks import base_environment, run_processes
from benchmarks.shaped_link import StepClock, rate_bits

BATCH = 8
FEATURES = 64
OUTPUTS = 16
WARMUP_STEPS = 3
AUTO_WARMUP_STEPS = 14  # bucket_cap_mb="auto" times 4 sizes for 3 steps each, then rebuilds once more
VARIANTS = (
    "compute_only",
    "stock",
    "ddp_plus",
    "ddp_plus_sharded",
    "ddp_plus_sharded_all_reduce",
    "ddp_plus_overlap",
)
#: Also runnable (``benchmarks/overlap_bound.py`` runs them): ``ddp_plus`` with ``bucket_cap_mb="auto"``, and
#: ``step_in_hook``, a prototype measured here (not a feature): ``ddp_plus`` with a comm hook that steps the optimizer
#: for each bucket's parameters as soon as that bucket's all-reduce is done (Lightning's own step then only runs the
#: closure), so the step overlaps the later buckets' communication.
ALL_VARIANTS = (*VARIANTS, "ddp_plus_bucket_auto", "step_in_hook")
#: The variants whose bytes are one ring all-reduce of the gradients, bucket by bucket: the overlap bound is theirs.
ALL_REDUCE_VARIANTS = ("stock", "ddp_plus", "ddp_plus_bucket_auto", "step_in_hook")
#: Bytes a rank sends per step beyond the ring all-reduce, as fractions of the gradient bytes x (n-1)/n.
EXTRA_BROADCAST = {"ddp_plus_sharded_all_reduce": 1.0}


def build_model(width: int, layers: int, batches: int):
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            hidden = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
            self.net = nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), *hidden, nn.Linear(width, OUTPUTS))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def train_dataloader(self):
            n = batches * BATCH * dist.get_world_size()
            generator = torch.Generator().manual_seed(0)
            data = TensorDataset(
                torch.randn(n, FEATURES, generator=generator), torch.randn(n, OUTPUTS, generator=generator)
            )
            return DataLoader(data, batch_size=BATCH)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    return MLP()


def strategy_for(variant: str):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ddp_plus import DDPPlusStrategy

    if variant == "stock":
        return DDPStrategy(process_group_backend="gloo")
    if variant == "compute_only":  # the bound's compute: the same step, its gradients never sent
        return DDPPlusStrategy(process_group_backend="gloo", ddp_comm_hook=no_communication)
    if variant == "ddp_plus_bucket_auto":
        return DDPPlusStrategy(process_group_backend="gloo", bucket_cap_mb="auto")
    if variant == "step_in_hook":
        return DDPPlusStrategy(process_group_backend="gloo", ddp_comm_hook=all_reduce_then_step, bucket_cap_mb=1)
    sharding = {
        "ddp_plus": False,
        "ddp_plus_sharded": True,
        "ddp_plus_sharded_all_reduce": "all_reduce",
        "ddp_plus_overlap": "overlap",
    }[variant]
    return DDPPlusStrategy(process_group_backend="gloo", optimizer_sharding=sharding, sync_guard=sharding != "overlap")


def no_communication(state, bucket):
    """A comm hook that keeps each rank's own gradients: a step's compute without its communication."""
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class StepInHook:
    """The optimizer ``all_reduce_then_step`` steps with (set for a ``step_in_hook`` fit by ``step_in_hook_callback``)."""

    optimizer = None


def all_reduce_then_step(state, bucket):
    """A comm hook that averages the bucket, then steps the optimizer for the bucket's parameters only, in the
    all-reduce's callback (while the backward and the later buckets go on).

    Exact for an optimizer that acts per parameter (Adam, SGD) when every parameter is used and nothing rescales the
    gradients after the backward (no clipping, no GradScaler): what this prototype's MLP does.
    """
    import copy

    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    grads, params = bucket.gradients(), bucket.parameters()

    def step(future):
        optimizer = StepInHook.optimizer
        for param, grad in zip(params, grads, strict=True):  # views of the buffer, averaged in place
            param.grad = grad
        mine = {id(param) for param in params}
        part = copy.copy(optimizer)  # shares the optimizer's state: the same per-parameter entries get updated
        part.param_groups = [
            {**group, "params": [p for p in group["params"] if id(p) in mine]} for group in optimizer.param_groups
        ]
        part.step()
        return future.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(step)


def step_in_hook_callback():
    """For a ``step_in_hook`` fit: hands the hook the optimizer, and makes Lightning's step run only its closure."""
    import lightning as L

    class _StepInHook(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            optimizer = StepInHook.optimizer = trainer.optimizers[0]
            optimizer.step = lambda closure=None: closure() if closure is not None else None

        def on_train_end(self, trainer, pl_module) -> None:
            del trainer.optimizers[0].step
            StepInHook.optimizer = None

    return _StepInHook()


def bucket_layout_at_end():
    """A callback that keeps, at the end of training (Lightning unwraps DDP at teardown), the sizes of DDP's buckets
    and, for ``ddp_plus``, rank 0's median milliseconds per step in each phase its straggler watch times."""
    import lightning as L
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ddp_plus.diagnostics.phase_timings import TIMED_PHASES
    from lightning_ddp_plus.diagnostics.telemetry import bucket_layout
    from lightning_ddp_plus.private_apis.torch_ddp import logging_data

    class _BucketLayoutAtEnd(L.Callback):
        buckets: list[int] | None = None
        phases: dict[str, float] | None = None

        def on_train_end(self, trainer, pl_module) -> None:
            ddp = trainer.strategy.model
            if isinstance(ddp, DistributedDataParallel):
                self.buckets = bucket_layout(logging_data(ddp))
            watch = getattr(getattr(trainer.strategy, "engine", None), "stragglers", None)
            if watch is not None:
                times = watch.clock.medians(trainer.global_rank)
                self.phases = {phase: times.of(phase) for phase in TIMED_PHASES}

    return _BucketLayoutAtEnd()


def largest_difference(rows: list[dict]) -> float | None:
    """The largest ``max_abs_difference_to_ddp_plus`` of ``rows`` (ranks or runs), ``None`` where none has one.

    >>> largest_difference([{"max_abs_difference_to_ddp_plus": None}, {"max_abs_difference_to_ddp_plus": 2e-7}])
    2e-07
    """
    known = [r["max_abs_difference_to_ddp_plus"] for r in rows if r.get("max_abs_difference_to_ddp_plus") is not None]
    return max(known, default=None)


#: Rank 0's parameters after the first ``ddp_plus`` fit of this process.
FINAL_PARAMETERS: dict = {}


def fit_variant(variant: str, args, interface: str | None, nodes: int) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_ddp_plus.sharding.optimizer import state_bytes

    try:
        strategy = strategy_for(variant)
        clock, layout = StepClock(), bucket_layout_at_end()
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=1,
            num_nodes=nodes,
            max_epochs=1,
            callbacks=[clock.callback, layout] + ([step_in_hook_callback()] if variant == "step_in_hook" else []),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    except ValueError as error:  # "overlap" on gloo: refused before launch, as it should be
        return {"refused": str(error)}
    model = build_model(args.width, args.layers, args.batches)
    sent_before = sent_bytes(interface) if interface else None
    trainer.fit(model)
    # same seed, same data: each variant's parameters after its fit, against the first ddp_plus fit's
    final = torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])
    reference = (
        FINAL_PARAMETERS.setdefault(variant, final) if variant == "ddp_plus" else FINAL_PARAMETERS.get("ddp_plus")
    )
    difference = None if reference is None else float((final - reference).abs().max())
    sent = None if interface is None else (sent_bytes(interface) - sent_before) / trainer.global_step
    optimizer = trainer.strategy.optimizers[0]
    dist.barrier()
    started = time.perf_counter()
    state = trainer.strategy.optimizer_state(optimizer)  # what a checkpoint save does: consolidates when sharded
    consolidation_s = time.perf_counter() - started
    del state
    shards = getattr(getattr(trainer.strategy, "engine", None), "sharding", None)
    counted = shards.shards.sent_bytes / trainer.global_step if shards is not None and shards.shards else None
    row = {
        "step_ms": clock.median_step_ms(AUTO_WARMUP_STEPS if variant == "ddp_plus_bucket_auto" else WARMUP_STEPS),
        # in the order the reducer sends them: the last is what is left to send when the backward ends
        "bucket_bytes": layout.buckets,
        "phase_ms": layout.phases,
        "steps": trainer.global_step,
        "hook_bytes_per_step": counted,
        "sent_bytes_per_step": sent,
        "state_bytes": state_bytes(optimizer),
        "consolidation_s": consolidation_s,
        "max_abs_difference_to_ddp_plus": difference,
    }
    gathered: list = [None] * nodes
    dist.all_gather_object(gathered, row)
    return {
        "step_ms": gathered[0]["step_ms"],
        "steps": gathered[0]["steps"],
        "bucket_bytes": gathered[0]["bucket_bytes"],
        "phase_ms": gathered[0]["phase_ms"],
        "max_abs_difference_to_ddp_plus": largest_difference(gathered),
        "sent_bytes_per_step_by_node": [r["sent_bytes_per_step"] for r in gathered],
        "hook_bytes_per_step_by_rank": [r["hook_bytes_per_step"] for r in gathered],
        "state_bytes_by_rank": [r["state_bytes"] for r in gathered],
        "consolidation_s_by_rank": [r["consolidation_s"] for r in gathered],
    }


def node_main(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    interface = args.interface or None
    nodes = int(os.environ["WORLD_SIZE"])  # read before the first fit: Lightning's teardown may remove it
    raw: dict[str, list] = {variant: [] for variant in args.variants}
    for _ in range(args.repeats):
        for variant in args.variants:
            raw[variant].append(fit_variant(variant, args, interface, nodes))
    if int(os.environ["NODE_RANK"]) == 0:
        Path(args.raw).write_text(json.dumps(raw))
    if dist.is_initialized():
        dist.destroy_process_group()


def parameter_bytes(width: int, layers: int) -> int:
    """fp32 bytes of the MLP's parameters (= its gradients).

    >>> parameter_bytes(4, 1)
    1440
    """
    elements = width * FEATURES + width + layers * (width * width + width) + OUTPUTS * width + OUTPUTS
    return 4 * elements


def run_setting(args, variants: list[str], nodes: int, rate: str | None, raw: Path) -> None:
    common = ["--raw", str(raw), "--repeats", str(args.repeats), "--batches", str(args.batches)]
    common += ["--width", str(args.width), "--layers", str(args.layers), "--variants", *variants]
    commands, environments = [], []

    def environment(node_rank: int, address: str) -> dict[str, str]:
        return {
            **base_environment(),
            "MASTER_ADDR": address,
            "MASTER_PORT": str(29600 + nodes),
            "NODE_RANK": str(node_rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(nodes),
            "OMP_NUM_THREADS": "1",
        }

    if rate is None:
        for node_rank in range(nodes):
            environments.append(environment(node_rank, "127.0.0.1"))
            commands.append([sys.executable, __file__, "--as-node", *common])
        run_processes(commands, environments, args.timeout)
        return
    with shaped_nodes(nodes, rate) as shaped:
        for node_rank, node in enumerate(shaped):
            environments.append({**environment(node_rank, shaped[0].address), "GLOO_SOCKET_IFNAME": node.interface})
            commands.append(
                ["ip", "netns", "exec", node.namespace, sys.executable, __file__, "--as-node", *common,
                 "--interface", node.interface]
            )  # fmt: skip
        run_processes(commands, environments, args.timeout)


def summarize(raw: dict, nodes: int, rate: str | None, gradient_bytes: int) -> dict:
    rows = {}
    ring = 2 * (nodes - 1) / nodes * gradient_bytes
    for variant, runs in raw.items():
        if "refused" in runs[0]:
            rows[variant] = {"refused": runs[0]["refused"]}
            continue
        extra = EXTRA_BROADCAST.get(variant, 0.0) * (nodes - 1) / nodes * gradient_bytes
        expected = 0.0 if variant == "compute_only" else ring + extra
        sent = (
            None
            if rate is None
            else [statistics.median(r["sent_bytes_per_step_by_node"][i] for r in runs) for i in range(nodes)]
        )
        rows[variant] = {
            "step_ms": statistics.median(r["step_ms"] for r in runs),
            "step_ms_min": min(r["step_ms"] for r in runs),
            "step_ms_max": max(r["step_ms"] for r in runs),
            "state_bytes_by_rank": runs[0]["state_bytes_by_rank"],
            "consolidation_s_by_rank": [
                statistics.median(r["consolidation_s_by_rank"][i] for r in runs) for i in range(nodes)
            ],
            "expected_bytes_per_step": expected,
            "sent_bytes_per_step_by_node": sent,
            "hook_bytes_per_step_by_rank": runs[0]["hook_bytes_per_step_by_rank"],
            "link_bound_ms": None if rate is None else 1e3 * expected * 8 / rate_bits(rate),
            "bucket_bytes": runs[0].get("bucket_bytes"),
            "max_abs_difference_to_ddp_plus": largest_difference(runs),
            "phase_ms": None
            if not runs[0].get("phase_ms")
            else {phase: statistics.median(r["phase_ms"][phase] for r in runs) for phase in runs[0]["phase_ms"]},
        }
        buckets = rows[variant]["bucket_bytes"]
        if rate is not None and buckets and variant in ALL_REDUCE_VARIANTS:
            # the ring all-reduce of the last bucket cannot start before the backward ends
            rows[variant]["last_bucket_ms"] = 1e3 * 2 * (nodes - 1) / nodes * buckets[-1] * 8 / rate_bits(rate)
    base = rows.get("stock", {}).get("step_ms")
    plain = rows.get("ddp_plus", {}).get("step_ms")
    compute = rows.get("compute_only", {}).get("step_ms")
    for row in rows.values():
        if "step_ms" in row and base:
            row["ratio_to_stock"] = row["step_ms"] / base
        if "step_ms" in row and plain:
            row["ratio_to_ddp_plus"] = row["step_ms"] / plain
        if "step_ms" in row and compute is not None and row.get("link_bound_ms") is not None:
            row["overlap_bound_ms"] = max(compute, row["link_bound_ms"])
            row["ratio_to_bound"] = row["step_ms"] / row["overlap_bound_ms"]
            if "last_bucket_ms" in row:
                row["overlap_bound_with_last_bucket_ms"] = row["overlap_bound_ms"] + row["last_bucket_ms"]
                row["ratio_to_bound_with_last_bucket"] = row["step_ms"] / row["overlap_bound_with_last_bucket_ms"]
    return {"nodes": nodes, "rate": rate or "loopback", "variants": rows}


def markdown(report: dict) -> str:
    mib = 2**20
    lines = []
    for result in report["sharding"]:
        lines += [
            f"**{result['rate']}, {result['nodes']} nodes x 1 rank**",
            "",
            (
                "| variant | ms per step (min-max) | vs stock | vs ddp_plus | vs max(compute, link) | optimizer state "
                "per rank (MiB) | MiB sent per node per step (measured) | MiB counted by the hook | MiB a ring needs | "
                "link bound ms | consolidation s per rank |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for variant, row in result["variants"].items():
            if "refused" in row:
                lines.append(f"| `{variant}` | refused before launch: {row['refused'][:160]}... | | | | | | | | | |")
                continue
            sent = row["sent_bytes_per_step_by_node"]
            sent_text = "-" if sent is None else ", ".join(f"{s / mib:.2f}" for s in sent)
            bound = "-" if row["link_bound_ms"] is None else f"{row['link_bound_ms']:.1f}"
            hook = row.get("hook_bytes_per_step_by_rank") or []
            hook_text = ", ".join(f"{h / mib:.2f}" for h in hook if h is not None) or "-"
            to_bound = f"{row['ratio_to_bound']:.2f}" if "ratio_to_bound" in row else "-"
            lines.append(
                f"| `{variant}` | {row['step_ms']:.1f} ({row['step_ms_min']:.1f}-{row['step_ms_max']:.1f}) | "
                f"{row.get('ratio_to_stock', 1):.2f} | {row.get('ratio_to_ddp_plus', 1):.2f} | {to_bound} | "
                f"{', '.join(f'{s / mib:.2f}' for s in row['state_bytes_by_rank'])} | "
                f"{sent_text} | {hook_text} | {row['expected_bytes_per_step'] / mib:.2f} | {bound} | "
                f"{', '.join(f'{s:.3f}' for s in row['consolidation_s_by_rank'])} |"
            )
        lines.append("")
    if report["scaling"]:
        lines += [
            "**ddp_plus on the 1 Gbit/s link, growing the job**",
            "",
            (
                "| nodes | ms per step | MiB sent per node per step (measured) | ring bound 2(n-1)/n x G (MiB) | "
                "ring bound ms | measured / bound |"
            ),
            "|---|---|---|---|---|---|",
        ]
        for result in report["scaling"]:
            row = result["variants"]["ddp_plus"]
            sent = row["sent_bytes_per_step_by_node"]
            lines.append(
                f"| {result['nodes']} | {row['step_ms']:.1f} | {statistics.median(sent) / mib:.2f} | "
                f"{row['expected_bytes_per_step'] / mib:.2f} | {row['link_bound_ms']:.1f} | "
                f"{row['step_ms'] / row['link_bound_ms']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batches", type=int, default=24, help="batches per rank per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--nodes", nargs="+", type=int, default=[2, 3, 4], help="node counts of the scaling table")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=ALL_VARIANTS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--as-node", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--interface", default="", help=argparse.SUPPRESS)
    parser.add_argument("--raw", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_node:
        node_main(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / ".sharding.raw.json"
    gradient_bytes = parameter_bytes(args.width, args.layers)
    reason = unavailable_reason()
    settings: list[tuple[list[str], int, str | None]] = [(list(args.variants), 2, None)]
    # 2 nodes of the scaling table are the shaped setting's own `ddp_plus` runs: not run twice
    reused = 2 in args.nodes and "ddp_plus" in args.variants
    if reason is None:
        settings.append((list(args.variants), 2, args.rate))
        settings += [(["ddp_plus"], n, args.rate) for n in args.nodes if not (n == 2 and reused)]
    else:
        print(f"sharding: the shaped-link parts are skipped: {reason}.")
    report: dict = {"sharding": [], "scaling": []}
    for index, (variants, nodes, rate) in enumerate(settings):
        started = time.perf_counter()
        run_setting(args, variants, nodes, rate, raw)
        result = summarize(json.loads(raw.read_text()), nodes, rate, gradient_bytes)
        report["scaling" if index >= 2 else "sharding"].append(result)
        if index == 1 and reused:
            report["scaling"].append({**result, "variants": {"ddp_plus": result["variants"]["ddp_plus"]}})
        print(f"{result['rate']}, {nodes} nodes: done in {time.perf_counter() - started:.0f} s", flush=True)
    report["scaling"].sort(key=lambda result: result["nodes"])
    if raw.exists():
        raw.unlink()
    import lightning
    import torch

    report["machine"] = (
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, lightning {lightning.__version__}, gloo"
    )
    report["config"] = {
        "width": args.width,
        "hidden_layers": args.layers,
        "gradient_MiB": gradient_bytes / 2**20,
        "batch": BATCH,
        "batches": args.batches,
        "repeats": args.repeats,
        "optimizer": "Adam (fp32): state = 2 x parameters + a step counter per parameter",
    }
    (out / "sharding.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (out / "sharding.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
