"""A termination notice, stock Lightning against ``ddp_plus``, side by side; and what notice handling costs per step.

    python benchmarks/preemption.py                       # both parts, about 5 minutes on 2 CPU cores
    python benchmarks/preemption.py --only cost --steps 400

``notice``: 2 ranks, 256 samples, 8 rows per rank per batch (16 optimizer steps), a ``ModelCheckpoint`` every 1000
steps, SIGTERM at batch 5 to every rank or to rank 1 only, for stock ``DDPStrategy``, stock with
``OnExceptionCheckpoint``, and ``ddp_plus``; then the resume (``ckpt_path="last"``) to the end. Reported per case:
notice to the end of every process (s), the step saved, the steps lost, whether every sample of the epoch was
trained exactly once across both runs, the distance of the resumed parameters to an uninterrupted run, and the exit
codes. Every variant runs with the same collective timeout (``--timeout``).

``cost``: one process group, steps without any notice: stock (Lightning broadcasts a flag from rank 0 before every
batch), ``ddp_plus`` (notices on: nothing per step), and ``ddp_plus(preemption_signals=[])`` (Lightning's own
handling, broadcast included), alternately; median time per step and the ratios. Results go to
``benchmarks/results/preemption.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ranks import base_environment, step_ratios

SAMPLES, ROWS, NOTICE_AT = 256, 8, 5
VARIANTS = ("stock", "stock+OnExceptionCheckpoint", "ddp_plus")


def model_and_data():
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.net = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))
            generator = torch.Generator().manual_seed(0)
            self.x = torch.randn(SAMPLES, 16, generator=generator)
            self.y = self.x @ torch.randn(16, 1, generator=generator)
            self.trained: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            self.trained += index.tolist()
            return nn.functional.mse_loss(self.net(x), y)

        def train_dataloader(self):
            return DataLoader(TensorDataset(self.x, self.y, torch.arange(SAMPLES)), batch_size=ROWS, shuffle=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Regression


def strategy_for(variant: str, timeout: float, signals: list[str] | None = None):
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ddp_plus import DDPPlusStrategy

    if variant.startswith("stock"):
        return DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=timeout))
    extra = {} if signals is None else {"preemption_signals": signals}
    return DDPPlusStrategy(process_group_backend="gloo", timeout=f"{timeout}s", **extra)


def trainer_for(variant: str, root: Path, timeout: float, callbacks: list, **extra):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    callbacks = [*callbacks, ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1000)]
    if variant == "stock+OnExceptionCheckpoint":
        callbacks.append(OnExceptionCheckpoint(root / "ckpt"))
    return L.Trainer(
        strategy=strategy_for(variant, timeout, extra.pop("signals", None)),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
        **{"max_epochs": 1, **extra},
    )


def notice_rank(variant: str, target: str, root: Path, mode: str, timeout: float) -> None:
    """One rank of one case: ``first`` (the notice at batch 5), ``resume`` or ``whole``."""
    import lightning as L
    import torch

    rank = int(os.environ["LOCAL_RANK"])

    class Notice(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == NOTICE_AT and target in ("all", str(rank)):
                (root / f"sent-{rank}").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGTERM)

    model = model_and_data()()
    callbacks = [Notice()] if mode == "first" else []
    trainer = trainer_for(variant, root / ("whole" if mode == "whole" else ""), timeout, callbacks)
    try:
        trainer.fit(model, ckpt_path="last" if mode == "resume" else None)
    finally:
        steps = trainer.global_step
        (root / f"{mode}-{rank}.json").write_text(json.dumps({"trained": model.trained, "steps": steps}))
        if mode != "first":
            torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), root / f"{mode}-{rank}.pt")


def start(args: list[str], timeout: float) -> tuple[list[int | None], float]:
    """The two ranks of ``args``; their exit codes (``None``: killed at ``timeout``) and the time they ended."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes, logs = [], []
    for rank in range(2):
        environment = {
            **base_environment(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": "2",
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        }
        log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read and closed below
        processes.append(subprocess.Popen(args, env=environment, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    codes: list[int | None] = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            codes.append(None)
    ended = time.time()
    for log in logs:
        log.seek(0)
        if os.environ.get("DDP_PLUS_BENCH_VERBOSE"):
            print(log.read()[-3000:])
        log.close()
    return codes, ended


def notice_case(variant: str, target: str, timeout: float) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        me = [sys.executable, __file__, "--as-rank", variant, target, str(root), "--timeout", str(timeout)]
        codes, ended = start([*me, "first"], timeout * 3 + 120)
        sent = min(float(path.read_text()) for path in root.glob("sent-*"))
        saved = sorted(path.name for path in (root / "ckpt").glob("*.ckpt")) if (root / "ckpt").exists() else []
        first = [json.loads((root / f"first-{rank}.json").read_text()) for rank in range(2)]
        start([*me, "resume"], 600)
        start([*me, "whole"], 600)
        resumed = [json.loads((root / f"resume-{rank}.json").read_text()) for rank in range(2)]
        whole_steps = json.loads((root / "whole-0.json").read_text())["steps"]
        trained_before = [i for rank in range(2) for i in first[rank]["trained"][: first[rank]["steps"] * ROWS]]
        trained_after = [i for rank in range(2) for i in resumed[rank]["trained"]]
        counts = torch.bincount(torch.tensor(trained_before + trained_after), minlength=SAMPLES).tolist()
        resumed_from = whole_steps - len(resumed[0]["trained"]) // ROWS  # the resume trained the steps after it
        distance = float((torch.load(root / "resume-0.pt") - torch.load(root / "whole-0.pt")).abs().max())
        return {
            "variant": variant,
            "notice to": "every rank" if target == "all" else f"rank {target}",
            "notice to end (s)": round(ended - sent, 1),
            "checkpoint": ", ".join(saved) or "none",
            "step saved": resumed_from if saved else 0,
            "steps completed in the first run": first[0]["steps"],
            "steps lost": first[0]["steps"] - (resumed_from if saved else 0),
            "samples trained once": sum(1 for count in counts if count == 1),
            "samples never trained": sum(1 for count in counts if count == 0),
            "samples trained twice": sum(1 for count in counts if count > 1),
            "parameter difference": distance,
            "exit codes": codes,
        }


def step_clock():
    """A callback that notes the time at each batch's start (``.times``)."""
    import lightning as L

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.times.append(time.perf_counter())

    return StepClock()


def cost_medians(script: str, steps: int, repeats: int) -> dict[str, list[float]]:
    """``script --as-cost-rank`` on two ranks; each variant's median step time (s) of each of its runs."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        os.environ["DDP_PLUS_BENCH_OUT"] = out.name
        start([sys.executable, script, "--as-cost-rank", "--steps", str(steps), "--repeats", str(repeats)], 900)
        medians: dict[str, list[float]] = json.loads(Path(out.name).read_text())
    return medians


def cost_rank(steps: int, repeats: int) -> None:
    """One rank of the cost part: the variants alternately on one process group, steps timed by a callback."""
    import torch.distributed as dist

    variants = [("stock", None), ("ddp_plus", None), ("ddp_plus, preemption_signals=[]", [])]
    medians: dict[str, list[float]] = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(repeats):
            for name, signals in variants:
                clock = step_clock()
                model = model_and_data()()
                trainer = trainer_for(
                    name.split(",")[0], Path(folder), 60, [clock], signals=signals, max_steps=steps, max_epochs=None
                )
                trainer.fit(model)
                gaps = [b - a for a, b in zip(clock.times[5:], clock.times[6:])]
                medians[name].append(statistics.median(gaps))
    if dist.get_rank() == 0:
        Path(os.environ["DDP_PLUS_BENCH_OUT"]).write_text(json.dumps(medians))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=["notice", "cost"], default=["notice", "cost"])
    parser.add_argument("--timeout", type=float, default=60.0, help="every variant's collective timeout (s)")
    parser.add_argument("--steps", type=int, default=200, help="steps per cost run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "preemption.json")
    parser.add_argument("--as-rank", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--as-cost-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("mode", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank:
        variant, target, root = args.as_rank
        notice_rank(variant, target, Path(root), args.mode, args.timeout)
        return
    if args.as_cost_rank:
        cost_rank(args.steps, args.repeats)
        return
    results: dict = {}
    if "notice" in args.only:
        results["notice"] = [notice_case(v, t, args.timeout) for t in ("all", "1") for v in VARIANTS]
        for row in results["notice"]:
            print(json.dumps(row))
    if "cost" in args.only:
        medians = cost_medians(__file__, args.steps, args.repeats)
        results["cost"] = step_ratios(medians)
        print(json.dumps(results["cost"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
