"""The noise of the phase timings on balanced runs: what straggler attribution must not mistake for a straggler.

    python benchmarks/straggler_noise.py [--repeats 3] [--steps 200] [--every 50] [--width 1024] [--layers 3]

Two ranks train the suite's MLP with nothing slowed; every ``--every`` steps the ranks compare their phase medians
(``find_stragglers_every_n_steps``). For every comparison and phase this reports how far the slowest rank's median
is above the other's, in ms and as a share of the step, and how much longer the other waited in collectives. The
thresholds in ``lightning_ddp_plus.diagnostics.phase_timings.THRESHOLDS`` must sit well above the largest of these.
Then one rank is slowed by ``--delay-ms`` per batch in its data loading, to show the same figures for a straggler.
Writes benchmarks/results/straggler_noise.json.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning as L
import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from benchmarks.ranks import run_ranks
from benchmarks.suite import MLP, QUIET
from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.diagnostics.phase_timings import OWN_PHASES, THRESHOLDS, PhaseTimes


class SlowLoader(MLP):
    def __init__(self, *args, delay_s: float = 0.0, slow_rank: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s, self.slow_rank = delay_s, slow_rank

    def train_dataloader(self):
        loader = super().train_dataloader()
        delay, slow = self.delay_s, self.global_rank == self.slow_rank

        def collate(items):
            if slow and delay:
                time.sleep(delay)
            return default_collate(items)

        return DataLoader(loader.dataset, batch_size=loader.batch_size, collate_fn=collate)


class Comparisons(L.Callback):
    def __init__(self) -> None:
        self.times: list[list[PhaseTimes]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        latest = trainer.strategy.phase_times
        if latest and (not self.times or latest is not self.times[-1]):
            self.times.append(latest)

    def on_train_end(self, trainer, pl_module) -> None:  # the last step's comparison runs at the fit's end
        self.on_train_batch_end(trainer, pl_module, None, None, 0)


def margins(times: list[PhaseTimes]) -> dict:
    """Per own phase: the slowest rank's excess over the others' median (ms, share of the step), and how much longer
    the others waited than that rank."""
    step = statistics.median(rank_times.total_ms for rank_times in times)
    found = {"step_ms": step}
    for phase in OWN_PHASES:
        slowest = max(times, key=lambda rank_times: rank_times.of(phase))
        others = [rank_times for rank_times in times if rank_times.rank != slowest.rank]
        excess = slowest.of(phase) - statistics.median(rank_times.of(phase) for rank_times in others)
        waited = statistics.median(r.collective_wait_ms for r in others) - slowest.collective_wait_ms
        found[phase] = {"excess_ms": excess, "excess_share": excess / step if step else 0.0, "waited_for_ms": waited}
    return found


def rank_main(args) -> None:
    runs: dict[str, list] = {"balanced": [], "slow_data": []}
    for label, delay in (("balanced", 0.0), ("slow_data", args.delay_ms / 1000)):
        for _ in range(args.repeats if label == "balanced" else 1):
            comparisons = Comparisons()
            trainer = L.Trainer(
                strategy=DDPPlusStrategy(process_group_backend="gloo", find_stragglers_every_n_steps=args.every),
                accelerator="cpu",
                devices=2,
                max_steps=args.steps,
                callbacks=[comparisons],
                use_distributed_sampler=False,
                **QUIET,
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(SlowLoader(args.width, args.layers, args.steps, delay_s=delay))
            named = [str(w.message) for w in caught if "straggler" in str(w.message)]
            runs[label].append({"margins": [margins(times) for times in comparisons.times], "warnings": named})
    if int(os.environ["LOCAL_RANK"]) == 0:
        Path(args.raw).write_text(json.dumps(runs))
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=150.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--as-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--raw", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank is not None:
        rank_main(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "straggler_noise.raw.json"
    command = [sys.executable, __file__, *sys.argv[1:], "--raw", str(raw)]
    run_ranks(command, world=2, timeout=args.timeout)
    runs = json.loads(raw.read_text())
    raw.unlink()
    balanced = [m for run in runs["balanced"] for m in run["margins"]]
    summary = {
        "config": vars(args) | {"as_rank": None, "raw": None},
        "thresholds": vars(THRESHOLDS),
        "balanced_comparisons": len(balanced),
        "balanced_warnings": [w for run in runs["balanced"] for w in run["warnings"]],
        "balanced_step_ms_median": statistics.median(m["step_ms"] for m in balanced) if balanced else None,
        "balanced_largest_excess": {
            phase: {
                "ms": max(m[phase]["excess_ms"] for m in balanced),
                "share_of_step": max(m[phase]["excess_share"] for m in balanced),
            }
            for phase in OWN_PHASES
        }
        if balanced
        else None,
        "slow_data": runs["slow_data"],
    }
    (out / "straggler_noise.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "slow_data"}, indent=2))
    print("slow data:", json.dumps(runs["slow_data"][0]["warnings"]))


if __name__ == "__main__":
    main()
