"""Manual optimization with gradient accumulation (k=4): ``ddp_plus`` against stock Lightning ``DDPStrategy`` with
Lightning's documented manual-accumulation recipe, side by side in one run on 2 processes (gloo).

    python benchmarks/bench_manual_accumulation.py [--repeats 5] [--width 1024] [--layers 3] [--batches 64]

The script starts its 2 ranks itself (as torchrun would) and runs the variants alternately (A B A B ...) on one
process group. Both variants get the same counting communication hook, so all-reduces are counted the same way.
Reports per-step time medians, min/max, the ratio ddp_plus / stock and all-reduces per optimizer step; writes JSON
to benchmarks/results/.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.ranks import run_ranks
from benchmarks.recipes import K, plus_manual_step, stock_manual_step
from lightning_ddp_plus import DDPPlusStrategy


class StockRecipe(L.LightningModule):
    """Lightning's documented manual accumulation: divide by k, step every k batches; DDP syncs every backward."""

    def __init__(self, width: int, layers: int, batches: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
        self.width, self.batches = width, batches

    def loss(self, batch):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def training_step(self, batch, batch_idx):
        stock_manual_step(self, self.loss(batch), batch_idx)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(self.batches * 2 * 32, self.width)), batch_size=32)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class PlusRecipe(StockRecipe):
    """The same with ddp_plus: manual_backward syncs only on the window's last micro-batch."""

    def training_step(self, batch, batch_idx):
        plus_manual_step(self, self.loss(batch))


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.window_ends: list[float] = []
        self.allreduces = 0  # all-reduce passes (backward passes that synced), counted at their last bucket
        self.bucket_allreduces = 0

    def hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.bucket_allreduces += 1
        self.allreduces += int(bucket.is_last())
        return default_hooks.allreduce_hook(state, bucket)

    def on_train_start(self, trainer, pl_module):
        # Both strategies have wrapped the model by now (ddp_plus as stock does), so the counting hook goes on the same way.
        trainer.strategy.model.register_comm_hook(None, self.hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % K == 0:
            self.window_ends.append(time.perf_counter())


def run_variant(name: str, args) -> dict:
    timer = StepTimer()
    if name == "stock":
        strategy, model = (
            L.pytorch.strategies.DDPStrategy(process_group_backend="gloo"),
            StockRecipe(args.width, args.layers, args.batches),
        )
    else:
        strategy = DDPPlusStrategy(process_group_backend="gloo", gradient_accumulation_steps=K)
        model = PlusRecipe(args.width, args.layers, args.batches)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model)
    steps = [b - a for a, b in zip(timer.window_ends, timer.window_ends[1:])]  # the first window is warm-up
    windows = len(timer.window_ends)
    return {
        "step_seconds": statistics.median(steps),
        "allreduces_per_step": timer.allreduces / windows,
        "bucket_allreduces_per_step": timer.bucket_allreduces / windows,
    }


def rank_main(args) -> None:
    results: dict[str, list[dict]] = {"stock": [], "ddp_plus": []}
    for _ in range(args.repeats):
        for name in ("stock", "ddp_plus"):
            results[name].append(run_variant(name, args))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def summarize(results: dict, args) -> dict:
    summary = {}
    for name, runs in results.items():
        times = [r["step_seconds"] * 1000 for r in runs]
        summary[name] = {
            "median_ms_per_step": statistics.median(times),
            "min_ms": min(times),
            "max_ms": max(times),
            "allreduces_per_step": statistics.median(r["allreduces_per_step"] for r in runs),
            "bucket_allreduces_per_step": statistics.median(r["bucket_allreduces_per_step"] for r in runs),
        }
    summary["ratio_ddp_plus_over_stock"] = (
        summary["ddp_plus"]["median_ms_per_step"] / summary["stock"]["median_ms_per_step"]
    )
    params = args.layers * (args.width * args.width + args.width)
    summary["config"] = {
        "k": K,
        "parameters": params,
        "repeats": args.repeats,
        "batches_per_rank": args.batches,
        "world_size": 2,
        "backend": "gloo",
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batches", type=int, default=64, help="micro-batches per rank per repeat")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "manual_accumulation.json"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the ranks are killed")
    parser.add_argument("--as-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher below
    args = parser.parse_args()
    if args.as_rank is not None:
        rank_main(args)
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    raw = args.out + ".raw"
    run_ranks([sys.executable, __file__, *sys.argv[1:], "--out", raw], world=2, timeout=args.timeout)
    summary = summarize(json.loads(Path(raw).read_text()), args)
    Path(raw).unlink()
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
