"""A rank's death on a 2-rank ``ddp_plus`` job, for real.

- ``rank_death_job.py kill DIR CASE_JSON``: one fit with the popen launcher (this process is rank 0, Lightning starts
  rank 1 by running this script again); the rank the case names (``"to"``) SIGKILLs itself at the case's moment
  (``"at"``) of optimizer step ``"step"``. Each rank appends what it trains and each ``on_train_batch_end`` to
  ``DIR/run1-rank{r}.jsonl`` as it happens, and a survivor writes the error that ended its fit to
  ``DIR/outcome-rank{r}.json``.
- ``rank_death_job.py torchrun DIR`` (under ``torchrun --max-restarts 1``): in the first attempt rank 1 dies in the
  backward of step 3; the survivor saves, torchrun restarts both ranks, and the second attempt resumes by itself
  (``resume_from_last="on_restart"``, the default) and trains to the end; then, in the same processes, an
  uninterrupted run; rank 0 writes ``DIR/result.json``.
- ``rank_death_job.py resume OUT_JSON CASES_JSON`` (started on every rank by ``start_ranks``): for each case's
  ``DIR``, the fit again with ``ckpt_path="last"`` to the end (``DIR/run2-rank{r}.jsonl``), and the parameters'
  distance to an uninterrupted run of the same accumulation.
"""

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn

from lightning_ddp_plus import DDPPlusStrategy, RankDied
from tests.scripts.preemption_end_job import SlowCheckpointIO
from tests.scripts.preemption_job import EPOCHS, flat
from tests.scripts.preemption_job import IndexedRegression as PreemptionRegression

ACCELERATOR = os.environ.get("DDP_PLUS_TEST_ACCELERATOR", "cpu")  # the GPU check: "gpu" (NCCL)


def die(directory: Path, rank: int, trainer: L.Trainer, moment: str, applied: int = 0) -> None:
    """``applied``: optimizer steps this rank applied that Lightning has not counted yet."""
    record = {"rank": rank, "at": moment, "global_step": trainer.global_step + applied, "time": time.time()}
    (directory / "killed.json").write_text(json.dumps(record))
    if moment == "out_of_memory":  # the process ends on the error, as a rank that runs out of memory does
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test)")
    os.kill(os.getpid(), signal.SIGKILL)


class IndexedRegression(PreemptionRegression):
    """The preemption job's regression, each trained batch and each batch end appended to ``log`` as it happens (a
    killed rank keeps what it wrote; ``None``: not recorded)."""

    def __init__(self, log: Path | None = None) -> None:
        super().__init__()
        self.log_path = log
        self.step_before = 0

    def record(self, **values) -> None:
        if self.log_path is not None:
            with self.log_path.open("a") as file:
                file.write(json.dumps(values) + "\n")

    def training_step(self, batch, batch_idx):
        rows = batch[2].tolist()
        self.record(kind="trained", epoch=self.current_epoch, step_before=self.trainer.global_step, rows=rows)
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch, batch_idx):
        self.step_before = self.trainer.global_step

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        step = self.trainer.global_step
        self.record(
            kind="batch_end", epoch=self.current_epoch, batch=batch_idx, step_before=self.step_before, step=step
        )


class Kill(L.Callback):
    """SIGKILLs this rank at the case's moment, if the case names it."""

    def __init__(self, case: dict, rank: int, directory: Path) -> None:
        self.at, self.step, self.k = case["at"], case.get("step", 3), case.get("k", 1)
        self.seed = case.get("seed", 0)
        self.mine, self.directory, self.rank = case["to"] == rank, directory, rank

    def die(self, trainer, moment: str, applied: int = 0) -> None:
        if self.mine:
            die(self.directory, self.rank, trainer, moment, applied)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step or not self.mine:
            return
        last_of_window = batch_idx % self.k == self.k - 1
        if self.at == "forward" and last_of_window:  # with k=2: the window's second micro-batch (mid-window)
            pl_module.net.register_forward_hook(lambda *_: self.die(trainer, "forward"))
        elif self.at == "backward" and last_of_window:
            pl_module.net[2].weight.register_hook(lambda grad: self.die(trainer, "backward"))
        elif self.at == "random":  # a timer lands anywhere in this step or the next (seeded: "seed")
            delay = random.Random(self.seed).uniform(0.0, 0.02)
            threading.Timer(
                delay, self.die, (trainer, f"random ({delay * 1e3:.1f} ms into step {self.step + 1})")
            ).start()
        elif self.at == "second_backward":  # the second optimizer's backward of this batch (two optimizers)
            calls: list[int] = []

            def dies(grad):
                calls.append(1)
                if len(calls) == 2:
                    self.die(trainer, "second_backward")

            pl_module.net[0].weight.register_hook(dies)
        elif self.at == "out_of_memory" and last_of_window:  # torch's error in the forward; the process ends
            pl_module.net.register_forward_hook(lambda *_: self.die(trainer, "out_of_memory"))
        elif self.at == "all_reduce" and last_of_window:
            # the other rank reaches the gradient all-reduce and waits in it; this one dies then
            pl_module.net[0].weight.register_hook(lambda grad: (time.sleep(1.0), self.die(trainer, "all_reduce")))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.at == "optimizer_step" and trainer.global_step == self.step:
            self.die(trainer, "optimizer_step")
            if isinstance(optimizer, GroupByGroupSGD):  # the survivor's step: a SIGTERM half-way
                self.wait_for_the_death()  # else Lightning's handler passes the signal on to a rank still alive
                optimizer.signal_halfway = True
        elif self.at == "after_step" and trainer.global_step == self.step and self.mine:
            # right after optimizer.step() returns, before Lightning counts the step: the other rank learns of the
            # death in a collective the strategy runs after the step (the straggler comparison, here)
            optimizer.register_step_post_hook(lambda *_: self.die(trainer, "after_step", applied=1))

    def wait_for_the_death(self, seconds: float = 30.0) -> None:
        """Until the rank the case kills has written its record and had time to end (a SIGKILL lands at once)."""
        deadline = time.monotonic() + seconds
        while not (self.directory / "killed.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.at == "own_error" and self.mine and trainer.global_step == self.step + 1:
            # an ordinary exception of the user's, after a step: a NaN check, say (the process ends on it)
            raise AssertionError("the loss is nan (raised by the test)")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.at == "validation" and trainer.global_step >= self.step and not trainer.sanity_checking:
            self.die(trainer, "validation")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.at == "save" and trainer.global_step >= self.step:
            self.die(trainer, "save")

    def on_train_epoch_end(self, trainer, pl_module):
        if self.at == "between_epochs":
            self.die(trainer, "between_epochs")


class GroupByGroupSGD(torch.optim.SGD):
    """SGD stepped one parameter group after the other; with ``signal_halfway``, this process gets a SIGTERM after
    the first group's update (torchrun's agent stopping the survivors of a worker's failure, say)."""

    signal_halfway = False

    def step(self, closure=None):
        if closure is not None:  # Lightning's closure: the forward and the backward
            with torch.enable_grad():
                closure()
        groups = self.param_groups
        try:
            for index, group in enumerate(groups):
                self.param_groups = [group]
                super().step()
                if index == 0 and self.signal_halfway:
                    os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler here, between the groups
        finally:
            self.param_groups = groups


class NormRegression(IndexedRegression):
    """Running statistics (a ``BatchNorm1d``) and random draws (noise on rank 0's inputs; rank 1, which dies, draws
    none, so its generators, lost with it, do not matter): a step redone after a death is exact only when both are
    saved as they stood at the step's boundary."""

    def __init__(self, log: Path | None = None) -> None:
        super().__init__(log)
        self.net.append(nn.BatchNorm1d(1))

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        if self.global_rank == 0:
            x = x + 0.1 * torch.randn_like(x)
        return super().training_step((x, y, index), batch_idx)


def model_for(case: dict, log: Path | None = None) -> IndexedRegression:
    if case.get("gan"):
        return TwoOptimizers(log)
    if case.get("by_group"):
        return GroupByGroupRegression(log)
    return NormRegression(log) if case.get("norm") else IndexedRegression(log)


def state(module: nn.Module) -> torch.Tensor:
    """The parameters and the buffers (running statistics), flat."""
    return torch.cat([value.detach().double().flatten() for value in module.state_dict().values()])


class GroupByGroupRegression(IndexedRegression):
    def configure_optimizers(self):
        return GroupByGroupSGD([{"params": self.net[0].parameters()}, {"params": self.net[2].parameters()}], lr=0.05)


class GatherInSave(L.Callback):
    """A collective in ``on_save_checkpoint`` (every rank's loss gathered into the checkpoint, say): a survivor's
    save cannot run it without the dead rank."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["every_ranks_step"] = trainer.strategy.all_gather(torch.tensor(trainer.global_step)).tolist()


def ema() -> list:
    """Lightning's ``EMAWeightAveraging`` (2.6 on; CI's lowest Lightning imports this job without running it)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return [EMAWeightAveraging(decay=0.9)]


def trainer_for(case: dict, directory: Path, callbacks: list) -> L.Trainer:
    checkpoints = case.get("checkpoints", directory / "ckpt")  # "checkpoints": elsewhere (a full filesystem)
    return L.Trainer(
        strategy=DDPPlusStrategy(
            process_group_backend="nccl" if ACCELERATOR == "gpu" else "gloo",
            timeout=os.environ.get("DDP_PLUS_TEST_TIMEOUT", "60s"),  # the GPU check: longer than it takes to end
            optimizer_sharding=case.get("sharding", False),
            find_stragglers_every_n_steps=case.get("stragglers", 50),
            preemption_signals=case.get("signals", ["SIGTERM"]),
        ),
        accelerator=ACCELERATOR,
        devices=case.get("world", 2),
        num_nodes=case.get("nodes", 1),
        plugins=[AsyncCheckpointIO(SlowCheckpointIO())] if case.get("async_io") else [],  # a write of 1 s
        max_epochs=EPOCHS,
        accumulate_grad_batches=case.get("k", 1),
        val_check_interval=4 if "validation" in (case["at"], case.get("killed_at")) else None,
        num_sanity_val_steps=0,
        default_root_dir=directory,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            *callbacks,
            *(ema() if case.get("ema") else []),  # swaps the average in for validation
            *([GatherInSave()] if case.get("gather_in_save") else []),
            ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=case.get("save_every", 1000)),
        ],
    )


class Outcome(L.Callback):
    """A survivor writes the ``RankDied`` that ended its fit to ``DIR/outcome-rank{r}.json`` from Lightning's
    ``on_exception``: before the fit's teardown hands SIGTERM back to its default handler, after which the SIGTERM
    that torchrun's agent sends the survivors of a worker's death ends the process at once."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory, self.rank = directory, rank

    def on_exception(self, trainer, pl_module, exception):
        if isinstance(exception, RankDied):
            save = exception.save
            outcome = {"error": str(exception), "time": time.time(), "step": save.step, "gone": list(save.gone)}
            outcome["save_seconds"] = save.save_seconds
            (self.directory / f"outcome-rank{self.rank}.json").write_text(json.dumps(outcome))


def fit_until_death(trainer: L.Trainer, model: IndexedRegression, directory: Path, rank: int) -> None:
    """The fit; a survivor writes the ``RankDied`` that ended it to ``DIR/outcome-rank{r}.json`` (``Outcome``)."""
    trainer.callbacks.append(Outcome(directory, rank))
    trainer.fit(model)


class TwoOptimizers(IndexedRegression):
    """Manual optimization with two optimizers, a step of each per batch (a GAN's generator and discriminator):
    ``global_step`` moves twice inside each training step."""

    def __init__(self, log: Path | None = None) -> None:
        super().__init__(log)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.record(kind="trained", epoch=self.current_epoch, step_before=self.trainer.global_step, rows=index.tolist())
        for optimizer in self.optimizers():
            self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y))
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        first, second = self.net[0].parameters(), self.net[2].parameters()
        return torch.optim.SGD(first, lr=0.05), torch.optim.SGD(second, lr=0.05)


def kill(directory: Path, case: dict) -> None:
    # the popen launcher sets LOCAL_RANK in the child it starts; NODE_RANK is the node's (several nodes: "nodes")
    rank = int(os.environ.get("NODE_RANK", "0")) * case.get("world", 2) + int(os.environ.get("LOCAL_RANK", "0"))
    model = model_for(case, directory / f"run1-rank{rank}.jsonl")
    fit_until_death(trainer_for(case, directory, [Kill(case, rank, directory)]), model, directory, rank)


def under_torchrun(directory: Path) -> None:
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    case = {"to": 1, "at": "backward"} if attempt == 0 else {"to": -1, "at": "none"}
    model = IndexedRegression(directory / f"run{attempt + 1}-rank{rank}.jsonl")
    trainer = trainer_for(case, directory, [Kill(case, rank, directory)])
    fit_until_death(trainer, model, directory, rank)
    whole = IndexedRegression()
    trainer_for({"at": "none"}, directory / "whole", []).fit(whole)
    if rank == 0:
        result = {"distance": float((flat(model) - flat(whole)).abs().max()), "global_step": trainer.global_step}
        (directory / "result.json").write_text(json.dumps(result))


def resume(out: str, cases: list) -> None:
    rank = int(os.environ["LOCAL_RANK"])  # set by start_ranks; the process group starts with the first fit
    references = {}
    kinds = sorted({(case.get("k", 1), bool(case.get("ema")), bool(case.get("norm"))) for case in cases})
    for k, ema, norm in kinds:
        model = model_for({"norm": norm})
        directory = Path(cases[0]["dir"]) / f"whole-{k}-{ema}-{norm}"
        trainer_for({"at": "none", "k": k, "ema": ema}, directory, []).fit(model)
        references[k, ema, norm] = state(model)
    results = []
    for case in cases:
        directory = Path(case["dir"])
        model = model_for({"norm": case.get("norm")}, directory / f"run2-rank{rank}.jsonl")
        # the same Trainer as the killed run, as a user resumes (its validation interval included)
        trainer = trainer_for({**case, "at": "none", "killed_at": case["at"]}, directory, [])
        trainer.fit(model, ckpt_path="last")
        reference = references[case.get("k", 1), bool(case.get("ema")), bool(case.get("norm"))]
        distance = float((state(model) - reference).abs().max())
        batch_ends = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step loggers log at
        results.append(
            {"dir": case["dir"], "distance": distance, "global_step": trainer.global_step, "batch_ends": batch_ends}
        )
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill(Path(sys.argv[2]), json.loads(sys.argv[3]))
    elif sys.argv[1] == "torchrun":
        under_torchrun(Path(sys.argv[2]))
    else:
        resume(sys.argv[2], json.loads(sys.argv[3]))
