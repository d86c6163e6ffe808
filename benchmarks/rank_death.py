"""A rank's death, stock Lightning against ``ddp_plus``, side by side; and what ``save_on_rank_death`` costs per step.

    python benchmarks/rank_death.py                     # both parts, about 4 minutes on 2 CPU cores
    python benchmarks/rank_death.py --only cost --steps 400 --repeats 5

``death``: 2 ranks with the popen launcher (Lightning's default; rank 0 is the launching process), 256 samples, 8 rows
per rank per batch (16 optimizer steps), a ``ModelCheckpoint`` every 1000 steps; rank 1, then rank 0, SIGKILLs
itself in the forward of step 6, for stock ``DDPStrategy`` and ``ddp_plus``. Reported per case: the steps each rank
had completed, the step saved (0: nothing), the steps lost, the seconds from the kill to the file and to the end of
the last process, and the exit code of the launching process. Every variant runs with the same collective timeout.

``cost``: one process group, steps without a death: stock, ``ddp_plus`` and ``ddp_plus(save_on_rank_death=False)``,
alternately, each in each position of a round in turn; the median time per step and the ratios, and each run's
median. The work ``save_on_rank_death`` adds per optimizer step is also timed in one process (``--only work``),
where two processes' step times vary too much from run to run to resolve it. Results go to ``benchmarks/results/rank_death.json``.
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

from benchmarks.preemption import cost_medians, model_and_data, step_clock
from benchmarks.ranks import base_environment, step_ratios

KILL_AT = 6
VARIANTS = ("stock", "ddp_plus")


def trainer_for(variant: str, root: Path, timeout: float, callbacks: list, **extra):
    from datetime import timedelta

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ddp_plus import DDPPlusStrategy

    if variant == "stock":
        strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=timeout))
    else:
        save = variant != "ddp_plus, save_on_rank_death=False"
        strategy = DDPPlusStrategy(process_group_backend="gloo", timeout=f"{timeout}s", save_on_rank_death=save)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=extra.pop("devices", 2),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1000)],
        **{"max_epochs": 1, **extra},
    )


def death_job(variant: str, target: int, root: Path, timeout: float) -> None:
    """One rank of one case (rank 0 runs it; Lightning's launcher runs this script again for rank 1)."""
    import lightning as L

    rank = int(os.environ.get("LOCAL_RANK", "0"))

    class Kill(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            (root / f"steps-{rank}").write_text(str(trainer.global_step))
            if trainer.global_step == KILL_AT and rank == target:
                (root / "killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    trainer_for(variant, root, timeout, [Kill()]).fit(model_and_data()())


def death_case(variant: str, target: int, timeout: float) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        command = [sys.executable, __file__, "--as-job", variant, str(target), str(root), "--timeout", str(timeout)]
        environment = {**base_environment(), "MASTER_PORT": str(free_port())}
        process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output, _ = process.communicate(timeout=timeout * 3 + 120)  # EOF: every process of the job has ended
        ended = time.time()
        if os.environ.get("DDP_PLUS_BENCH_VERBOSE"):
            print(output.decode(errors="replace")[-3000:])
        killed = float((root / "killed").read_text())
        last = root / "ckpt" / "last.ckpt"
        saved = torch.load(last, weights_only=False)["global_step"] if last.exists() else 0
        steps = {rank: int((root / f"steps-{rank}").read_text()) for rank in range(2)}
        return {
            "variant": variant,
            "killed": f"rank {target}",
            "steps completed": steps,
            "step saved": saved,
            "steps lost": max(steps.values()) - saved,
            "kill to the file (s)": round(last.stat().st_mtime - killed, 2) if last.exists() else None,
            "kill to the end (s)": round(ended - killed, 1),
            "exit code": process.returncode,
        }


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cost_rank(steps: int, repeats: int) -> None:
    """One rank of the cost part: the variants alternately on one process group, steps timed by a callback."""
    import torch.distributed as dist

    variants = ("stock", "ddp_plus", "ddp_plus, save_on_rank_death=False")
    medians: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(repeats):
            shift = repeat % len(variants)  # each variant in each position of a repeat in turn
            for name in variants[shift:] + variants[:shift]:
                clock = step_clock()
                trainer = trainer_for(name, Path(folder), 60, [clock], max_steps=steps, max_epochs=None)
                trainer.fit(model_and_data()())
                gaps = [b - a for a, b in zip(clock.times[5:], clock.times[6:])]
                medians[name].append(statistics.median(gaps))
    if dist.get_rank() == 0:
        Path(os.environ["DDP_PLUS_BENCH_OUT"]).write_text(json.dumps(medians))


def added_work() -> dict:
    """In one process (world size 1): the time of the work ``save_on_rank_death`` adds before a batch whose step
    count changed (keeping the loop's state), against the step time of the same fit."""
    import lightning as L

    from lightning_ddp_plus.frontends.trainer_after_death import StepBoundaries

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    timed: dict = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            timed.setdefault("starts", []).append(time.perf_counter())
            if trainer.global_step == 20:
                boundaries = StepBoundaries.of(trainer)
                started = time.perf_counter()
                for _ in range(2000):
                    boundaries.last = None  # no step time between these calls (a death's wait is timed by steps)
                    boundaries.keep_now()
                timed["work"] = (time.perf_counter() - started) / 2000
                timed["starts"].clear()

    with tempfile.TemporaryDirectory() as folder:
        trainer = trainer_for("ddp_plus", Path(folder), 60, [Probe()], max_steps=60, max_epochs=None, devices=1)
        trainer.fit(model_and_data()())
    step = statistics.median(b - a for a, b in zip(timed["starts"], timed["starts"][1:]))
    return {
        "work per optimizer step (us)": round(timed["work"] * 1e6, 1),
        "step, 1 process (ms)": round(step * 1e3, 3),
        "share of the step": round(timed["work"] / step, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=["death", "cost", "work"], default=["death", "cost", "work"])
    parser.add_argument("--timeout", type=float, default=60.0, help="every variant's collective timeout (s)")
    parser.add_argument("--steps", type=int, default=200, help="steps per cost run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "rank_death.json")
    parser.add_argument("--as-job", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--as-cost-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_job:
        variant, target, root = args.as_job
        death_job(variant, int(target), Path(root), args.timeout)
        return
    if args.as_cost_rank:
        cost_rank(args.steps, args.repeats)
        return
    results: dict = {}
    if "death" in args.only:
        results["death"] = [death_case(v, t, args.timeout) for t in (1, 0) for v in VARIANTS]
        for row in results["death"]:
            print(json.dumps(row))
    if "cost" in args.only:
        medians = cost_medians(__file__, args.steps, args.repeats)
        results["cost"] = step_ratios(medians, baselines=("stock", "ddp_plus, save_on_rank_death=False"))
        results["cost runs (median step per run, ms)"] = {
            name: [round(1e3 * value, 3) for value in values] for name, values in medians.items()
        }
        off = medians["ddp_plus, save_on_rank_death=False"]
        paired = [on / base for on, base in zip(medians["ddp_plus"], off)]
        results["cost"]["ddp_plus"]["median of the rounds' ratios to save_on_rank_death=False"] = round(
            statistics.median(paired), 3
        )
        print(json.dumps(results["cost"], indent=1))
    if "work" in args.only:
        results["work"] = added_work()
        print(json.dumps(results["work"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
