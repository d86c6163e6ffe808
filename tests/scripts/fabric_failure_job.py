"""A 2-rank Fabric loop with ``ddp_plus`` (Fabric's own launcher) in which one rank misbehaves at a given step.

``fabric_failure_job.py MODE RANK STEP TIMEOUT TAG STALL_REPORT_AFTER``: ``hang`` sleeps for 120 s before the step's
forward, ``extra_all_reduce`` calls ``fabric.all_reduce`` on that rank only, ``sigterm`` sends that rank a SIGTERM
(the loop never reads ``preemption_agreed``). TAG only marks the command line.
"""

import os
import signal
import sys
import time

import lightning as L
import torch
from torch import nn

from lightning_ddp_plus import DDPPlusFabricStrategy
from tests.helpers import regression_data

HANG_S = 120


def main() -> None:
    mode, bad_rank, bad_step, timeout, stall = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[6]
    strategy = DDPPlusFabricStrategy(timeout=timeout, stall_report_after=stall, setup_timeout="60s")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = regression_data(64).tensors
    rank = fabric.global_rank
    for step, start in enumerate(range(0, 32, 4)):
        xb, yb = x[rank::2][start : start + 4], y[rank::2][start : start + 4]
        if rank == bad_rank and step == bad_step:
            print(f"failure starts at {time.time():.3f}", flush=True)
            if mode == "hang":
                time.sleep(HANG_S)
            elif mode == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                fabric.all_reduce(torch.tensor(1.0))
        fabric.backward(nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
