"""The prepared CUDA check of the package's per-step path, for one GPU and a few minutes. It is not part of the CPU
suite (its name is not ``test_*``) and says "skipped" without a CUDA device:

    python tests/gpu/cuda_path_check.py                    # one GPU, NCCL with one rank
    python tests/gpu/cuda_path_check.py --accelerator cpu  # the same fits on gloo (a dry run of the script)

1. **Host syncs per step**: fits under ``torch.cuda.set_sync_debug_mode("warn")``, ``ddp_plus`` and stock
   ``DDPStrategy``, of 8 and of 24 steps: the synchronizing calls per step (the difference over 16 steps) of
   ``ddp_plus`` are no more than stock's.
2. **CUDA contexts**: after the fits, ``nvidia-smi`` lists this process on one GPU only.
3. **Phase timings on CUDA events**: a ``PhaseClock`` following the GPU times 20 steps of a known matmul as compute;
   every step settles without the host waiting, and its compute is within 20 % of CUDA events around the same work.
4. **Step time**: ``ddp_plus`` against stock, 3 alternating rounds of 24 steps of a model whose step is some 10 ms:
   the median ratio (PASS under 1.10).

Each check prints PASS or FAIL with its figures; the exit code is the failures.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import run_checks


def fit(strategy_name: str, steps: int, sync_debug: bool = False, wide: bool = False) -> tuple[float, int]:
    """One fit of ``steps`` steps; returns its seconds (the device synchronized at the end) and the synchronizing
    calls it made (with ``sync_debug``). ``wide``: on the GPU, a model whose step is some 10 ms (4 layers of
    4096x4096, batches of 2048), as a real model's would be, instead of the tiny regression."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ddp_plus import DDPPlusStrategy
    from tests.helpers import TinyRegression

    gpu = os.environ["DDP_PLUS_TEST_ACCELERATOR"] == "gpu"
    backend = "nccl" if gpu else "gloo"
    strategy = (
        DDPPlusStrategy(process_group_backend=backend)
        if strategy_name == "ddp_plus"
        else DDPStrategy(process_group_backend=backend)
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = wide_model(steps) if wide and gpu else TinyRegression(num_samples=4 * steps, batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if gpu and sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        started = time.perf_counter()
        try:
            trainer.fit(model)
            if gpu:
                torch.cuda.synchronize()
        finally:
            if gpu:
                torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchronizing" in str(warning.message) for warning in caught)
    return time.perf_counter() - started, syncs


def wide_model(steps: int):
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class WideModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(layer for _ in range(4) for layer in (nn.Linear(4096, 4096), nn.ReLU())))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).square().mean()

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(2048 * steps, 4096)), batch_size=2048)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return WideModel()


def host_syncs_per_step() -> tuple[bool, str]:
    per_step = {}
    for name in ("stock", "ddp_plus"):
        short, long = fit(name, 8, sync_debug=True)[1], fit(name, 24, sync_debug=True)[1]
        per_step[name] = (long - short) / 16
    return per_step["ddp_plus"] <= per_step["stock"], f"synchronizing calls per step: {per_step}"


def contexts() -> tuple[bool, str]:
    if os.environ["DDP_PLUS_TEST_ACCELERATOR"] != "gpu":
        return True, "no GPU: nothing to count (dry run)"
    listed = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()
    mine = [line for line in listed if line.split(",")[0].strip() == str(os.getpid())]
    return len(mine) == 1, f"this process on the GPUs: {mine}"


def phase_timings_on_events() -> tuple[bool, str]:
    import torch

    from lightning_ddp_plus.diagnostics.phase_timings import PhaseClock

    if os.environ["DDP_PLUS_TEST_ACCELERATOR"] != "gpu":
        return True, "no GPU: host time (dry run)"
    device = torch.device("cuda", 0)
    a = torch.randn(4096, 4096, device=device)
    clock = PhaseClock(window=20)
    clock.follow_device(device)
    reference = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        clock.switch("compute")
        start.record()
        for _ in range(4):
            a = torch.tanh(a @ a / 4096)
        end.record()
        clock.switch("optimizer step")
        clock.end_step()
        reference.append((start, end))
    unsettled_after_queueing = 20 - len(clock.steps)
    torch.cuda.synchronize()
    medians = clock.medians(rank=0)
    expected = statistics.median(start.elapsed_time(end) for start, end in reference)
    ok = len(clock.steps) == 20 and abs(medians.compute_ms - expected) <= 0.2 * expected
    return ok, (
        f"compute {medians.compute_ms:.2f} ms against {expected:.2f} ms by events; {unsettled_after_queueing} of 20 "
        "steps were not yet settled when queued (the host did not wait)"
    )


def step_time() -> tuple[bool, str]:
    ratios = []
    for _ in range(3):
        stock, ours = fit("stock", 24, wide=True)[0], fit("ddp_plus", 24, wide=True)[0]
        ratios.append(ours / stock)
    ratio = statistics.median(ratios)
    figures = f"ddp_plus / stock fit time: {ratio:.3f} (rounds {[round(r, 3) for r in ratios]})"
    if os.environ["DDP_PLUS_TEST_ACCELERATOR"] != "gpu":
        return True, f"{figures}; not judged on the dry run's tiny model, whose step is a few ms of Python"
    return ratio < 1.10, figures


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    return run_checks(
        __doc__.split("\n\n")[0],
        [
            ("host syncs per step", host_syncs_per_step),
            ("one CUDA context", contexts),
            ("phase timings on CUDA events", phase_timings_on_events),
            ("step time against stock", step_time),
        ],
        devices_needed=1,
    )


if __name__ == "__main__":
    sys.exit(main())
