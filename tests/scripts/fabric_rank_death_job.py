"""A rank's death in a 2-rank Fabric loop with ``ddp_plus``, for real.

- ``fabric_rank_death_job.py kill DIR CASE_JSON``: one run with Fabric's popen launcher (this process is rank 0,
  Fabric starts rank 1 by running this script again), the loop inside ``fabric.strategy.save_after_rank_death``;
  the rank the case names (``"to"``) SIGKILLs itself at the case's moment (``"at"``) of optimizer step ``"step"``.
  Each rank appends what it trains and each step's end to ``DIR/run1-rank{r}.jsonl`` as it happens, and a survivor
  writes the ``RankDied`` that ended its loop to ``DIR/outcome-rank{r}.json``.
- ``fabric_rank_death_job.py resume OUT_JSON CASES_JSON`` (started on every rank by ``start_ranks``): an
  uninterrupted run per accumulation, then for each case's ``DIR`` the loop again from ``fabric.load`` of the saved
  file to the end (``DIR/run2-rank{r}.jsonl``), and the parameters' distance to the uninterrupted run.

Every step the loop logs its loss with ``fabric.all_reduce`` after ``optimizer.step()`` and before counting the step:
a death learnt there saves the step under the strategy's count, not the loop's.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp_plus import DDPPlusFabricStrategy, RankDied

SAMPLES, BATCH, EPOCHS = 64, 4, 2
BATCHES = SAMPLES // 2 // BATCH  # per rank and epoch


def rows_of(epoch: int, rank: int) -> list[int]:
    """This rank's samples of an epoch, in order: a seeded shuffle, split between the two ranks."""
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch)).tolist()
    return order[rank::2]


class Run:
    """One run of the loop on this rank: the model, the optimizer, the state ``fabric.save`` takes, the data."""

    def __init__(self, case: dict, log: Path | None) -> None:
        strategy = DDPPlusFabricStrategy(
            process_group_backend="gloo",
            timeout="60s",
            gradient_accumulation_steps=case.get("k", 1),
            optimizer_sharding=case.get("sharding", False),
        )
        self.fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        self.fabric.launch()
        self.rank, self.k, self.log = self.fabric.global_rank, case.get("k", 1), log
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=generator)
        self.y = self.x @ torch.randn(8, 1, generator=generator)
        self.state = {"model": self.model, "optimizer": self.optimizer, "step": 0}

    def record(self, **values) -> None:
        if self.log is not None:
            with self.log.open("a") as file:
                file.write(json.dumps(values) + "\n")

    def train(self, kill: "Kill | None" = None) -> None:
        """From ``state["step"]`` (its windows' micro-batches skipped) to the end."""
        for index in range(self.state["step"] * self.k, EPOCHS * BATCHES):
            epoch, batch = divmod(index, BATCHES)
            rows = rows_of(epoch, self.rank)[batch * BATCH : (batch + 1) * BATCH]
            step = self.state["step"]
            self.record(kind="trained", epoch=epoch, step_before=step, rows=rows)
            closes = index % self.k == self.k - 1
            if kill is not None:
                kill.before_micro_batch(self, step, closes)
            loss = nn.functional.mse_loss(self.model(self.x[rows]), self.y[rows])
            self.fabric.backward(loss)
            if self.fabric.strategy.sync_gradients:
                if kill is not None:
                    kill.at_moment(self, "optimizer_step", step)
                self.optimizer.step()
                self.optimizer.zero_grad()
                self.record(kind="applied", step=step + 1)
                if kill is not None:
                    kill.at_moment(self, "logged", step)
                self.fabric.all_reduce(loss.detach())  # the loop's logging, before it counts the step
                self.state["step"] += 1
                self.record(kind="step_end", epoch=epoch, batch=batch, step=self.state["step"])


class Kill:
    """SIGKILLs this rank at the case's moment, if the case names it."""

    def __init__(self, case: dict, rank: int, directory: Path) -> None:
        self.at, self.step, self.mine, self.directory = case["at"], case.get("step", 3), case["to"] == rank, directory

    def die(self, run: Run, moment: str) -> None:
        record = {"rank": run.rank, "at": moment, "step": run.state["step"], "time": time.time()}
        (self.directory / "killed.json").write_text(json.dumps(record))
        os.kill(os.getpid(), signal.SIGKILL)

    def before_micro_batch(self, run: Run, step: int, closes: bool) -> None:
        if not self.mine or step != self.step or not closes:  # with k=2: the window's second micro-batch
            return
        net = run.model.module
        if self.at == "forward":
            net.register_forward_hook(lambda *_: self.die(run, "forward"))
        elif self.at == "backward":
            net[2].weight.register_hook(lambda grad: self.die(run, "backward"))
        elif self.at == "all_reduce":  # the other rank reaches the gradient all-reduce and waits in it
            net[0].weight.register_hook(lambda grad: (time.sleep(1.0), self.die(run, "all_reduce")))

    def at_moment(self, run: Run, moment: str, step: int) -> None:
        if self.mine and self.at == moment and step == self.step:
            self.die(run, moment)


def kill(directory: Path, case: dict) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Fabric's launcher sets it in the child it starts
    run = Run(case, directory / f"run1-rank{rank}.jsonl")
    try:
        with run.fabric.strategy.save_after_rank_death(directory / "ckpt" / "last.ckpt", run.state):
            run.train(Kill(case, rank, directory))
    except RankDied as error:
        outcome = {"error": str(error), "time": time.time(), "step": error.save.step, "gone": list(error.save.gone)}
        (directory / f"outcome-rank{rank}.json").write_text(json.dumps(outcome))
        raise


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def resume(out: str, cases: list) -> None:
    references = {}
    for k in sorted({case.get("k", 1) for case in cases}):
        whole = Run({"k": k}, None)
        whole.train()
        references[k] = flat(whole.model)
    results = []
    for case in cases:
        directory = Path(case["dir"])
        run = Run(case, directory / f"run2-rank{run_rank()}.jsonl")
        run.fabric.load(directory / "ckpt" / "last.ckpt", run.state)
        loaded = run.state["step"]
        run.train()
        distance = float((flat(run.model) - references[case.get("k", 1)]).abs().max())
        results.append({"dir": case["dir"], "distance": distance, "loaded": loaded, "step": run.state["step"]})
    if run_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def run_rank() -> int:
    return int(os.environ["LOCAL_RANK"])


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill(Path(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        resume(sys.argv[2], json.loads(sys.argv[3]))
