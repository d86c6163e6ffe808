"""Termination notices on a 2-rank ``ddp_plus`` job: ``preemption_job.py OUT_JSON CASES_JSON`` (started on every
rank by ``tests.helpers.start_ranks``; one process group for every case).

Each case is a real signal (``os.kill``) sent by the ranks it names (``"to"``: ``"all"``, or a rank) to themselves at a
moment of the fit (``"at"``): in the forward, the backward or the optimizer step of step ``"step"``, at a random
point of that step (a timer), during validation, during a checkpoint save, between epochs, or before the first
step. The fit is expected to end with ``Preempted``; the case then resumes with ``ckpt_path="last"`` (or, on
SLURM, by itself) and trains to the end. Rank 0 reports, per case, what was saved and the resumed parameters' distance
to the uninterrupted run of the same accumulation, and every sample each rank trained in both runs.

With ``DDP_PLUS_END_WITH`` set to a case's JSON, that case runs last and its ``Preempted`` is not caught, so each
process exits as a process ended by the signal would.
"""

import itertools
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
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_plus import DDPPlusStrategy, Preempted
from lightning_ddp_plus.persistence.files import unreadable_reason

SAMPLES, BATCH, EPOCHS = 64, 4, 2  # per rank 8 batches an epoch, 16 in all


class IndexedRegression(L.LightningModule):
    """A small regression whose batches carry their sample indices, with a validation set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=generator)
        self.y = self.x @ torch.randn(8, 1, generator=generator)
        self.trained: list[int] = []
        #: (epoch, batch of the epoch) at each of the module's own ``on_train_batch_end``: each runs once per batch
        self.batch_ends: list[list[int]] = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_ends.append([self.current_epoch, self.trainer.fit_loop.epoch_loop.batch_progress.current.ready])

    #: Manual optimization that accumulates ``manual_k`` batches in its own code (the strategy's k stays 1, so every
    #: backward is synced, and only every ``manual_k``-th batch steps); 0: automatic optimization.
    manual_k = 0

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.trained += index.tolist()
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.plateau:
            self.log("train_loss", loss, sync_dist=True)  # the same rate on every rank
        if not self.manual_k:
            return loss
        self.manual_backward(loss / self.manual_k)
        if (batch_idx + 1) % self.manual_k == 0:
            self.optimizers().step()
            self.optimizers().zero_grad()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y, torch.arange(SAMPLES)), batch_size=BATCH, shuffle=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:16], self.y[:16], torch.arange(16)), batch_size=BATCH)

    #: Lightning's documented OneCycleLR recipe: its length from ``trainer.estimated_stepping_batches``, stepped every
    #: optimizer step (reading it builds the training loader before a resume restores the loop)
    one_cycle = False
    #: A ReduceLROnPlateau on the training loss, stepped at each batch's end (``interval="step"``), with a patience
    #: short enough that it lowers the rate during the fit
    plateau = False

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.plateau:
            reduce = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1, factor=0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": reduce, "interval": "step", "monitor": "train_loss"},
            }
        if not self.one_cycle:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Notify(L.Callback):
    """Sends the case's signal to this process at the case's moment (if this rank is one the case names)."""

    def __init__(self, case: dict, rank: int) -> None:
        self.case, self.at, self.step = case, case["at"], case.get("step", 3)
        self.mine = case["to"] == "all" or case["to"] == rank
        self.signum = int(signal.Signals[case.get("signal", "SIGTERM")])
        self.sent_at: float | None = None
        self.sent_step: int | None = None
        self.saves = 0

    def send(self, trainer) -> None:
        if self.mine and self.sent_at is None:
            self.sent_at, self.sent_step = time.monotonic(), trainer.global_step
            os.kill(os.getpid(), self.signum)
            time.sleep(self.case.get("late", 0.0))  # this rank reaches its backward after the others finished theirs

    def setup(self, trainer, pl_module, stage):
        if self.at == "before_first_step":
            self.send(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step or self.sent_at is not None or not self.mine:
            return
        if self.at in ("forward", "second_signal"):
            self.send(trainer)
        elif self.at == "backward":
            loss_hook = lambda grad: self.send(trainer)
            pl_module.net[0].weight.register_hook(loss_hook)  # fires inside the backward
        elif self.at == "random":  # a timer lands at a random point of this step (forward, backward, step)
            delay = random.Random(self.case.get("seed", 0)).uniform(0.0, 0.004)
            self.sent_at, self.sent_step = time.monotonic() + delay, trainer.global_step
            threading.Timer(delay, os.kill, (os.getpid(), self.signum)).start()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.at == "optimizer_step" and trainer.global_step == self.step:
            self.send(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.at == "validation" and trainer.global_step >= self.step and not trainer.sanity_checking:
            self.send(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saves += 1
        if self.at == "save" and trainer.global_step >= self.step:
            self.send(trainer)
        elif self.at == "second_signal" and self.sent_at is not None and self.mine:
            os.kill(os.getpid(), self.signum)  # during the preemption save itself: recorded, changes nothing

    def on_train_epoch_end(self, trainer, pl_module):
        if self.at == "between_epochs":
            self.send(trainer)


def post_local_sgd() -> dict:
    """Post-local SGD as on nodes of one rank each: after 2 warm-up steps a backward exchanges nothing with the other
    rank (its subgroup is itself), and the parameters are averaged every 2 steps."""
    subgroup, _ = dist.new_subgroups(group_size=1)
    state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=2)
    return {
        "ddp_comm_hook": post_localSGD_hook.post_localSGD_hook,
        "ddp_comm_state": state,
        "model_averaging_period": 2,
    }


def trainer_for(case: dict, root: Path, callbacks: list, slurm: bool) -> L.Trainer:
    plugins = [SLURMEnvironment(auto_requeue=True)] if slurm else []
    checkpoints = (
        []
        if case.get("no_checkpoint_callback")
        else [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=case.get("save_every", 1000))]
    )
    return L.Trainer(
        strategy=DDPPlusStrategy(
            process_group_backend="gloo",
            timeout="60s",
            sync_guard=case.get("sync_guard", True),
            static_graph=case.get("static_graph", False),
            **(post_local_sgd() if case.get("post_local_sgd") else {}),
            preemption_signals=case.get("signals", ["SIGTERM"]),
        ),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        accumulate_grad_batches=1 if case.get("manual") else case.get("k", 1),
        val_check_interval=4 if case["at"] == "validation" else None,
        check_val_every_n_epoch=case.get("val_every", 1),
        num_sanity_val_steps=0,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=not case.get("no_checkpoint_callback", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=plugins,
        callbacks=[*callbacks, *checkpoints],
    )


def slurm_environment(on: bool) -> None:
    names = {
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": str(dist.get_rank()),
        "SLURM_LOCALID": str(dist.get_rank()),
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "preemption-test",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_NTASKS_PER_NODE": "2",
    }
    for name, value in names.items():
        if on:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def every_ranks(values: list) -> list:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return gathered


def whole_run(k: int, one_cycle: bool, plateau: bool, root: Path) -> torch.Tensor:
    model = IndexedRegression()
    model.one_cycle, model.plateau = one_cycle, plateau
    trainer_for({"at": "none", "to": -1, "k": k}, root, [], slurm=False).fit(model)
    return flat(model)


def run_case(case: dict, root: Path, reference: torch.Tensor | None, catch: bool = True) -> dict:
    if not dist.is_initialized():  # no uninterrupted run created it (a Trainer's fit takes the existing one)
        dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    slurm = bool(case.get("slurm"))
    slurm_environment(slurm)
    # the handler from before the fit: a notice no step boundary took (a timer late past the last step) is passed on
    # to it, and recorded here instead of ending the process
    passed_on: list[int] = []
    before = lambda signum, frame: passed_on.append(signum)
    signal.signal(signal.SIGTERM, before)
    notify = Notify(case, rank)
    model = IndexedRegression()
    model.manual_k = case.get("k", 1) if case.get("manual") else 0
    model.automatic_optimization = not model.manual_k
    model.one_cycle, model.plateau = bool(case.get("one_cycle")), bool(case.get("plateau"))
    trainer = trainer_for(case, root, [notify], slurm)
    started = time.monotonic()
    preempted = None
    try:
        trainer.fit(model)
    except Preempted as error:
        if not catch:
            raise
        preempted = error
    ended = time.monotonic()
    handler_restored = signal.getsignal(signal.SIGTERM) is before
    decision = preempted.report.decision if preempted else None
    first = {
        "preempted": preempted is not None,
        "code": preempted.code if preempted else None,
        "is_sigterm_exception": isinstance(preempted, L.pytorch.utilities.exceptions.SIGTERMException),
        "line": str(preempted) if preempted else None,
        "path": preempted.report.path if preempted else None,
        "stop_after": decision.stop_after if decision else None,
        "notices": [[n.signal_name, n.rank, n.step] for n in decision.notices] if decision else [],
        "global_step": trainer.global_step,
        "sent_step": notify.sent_step,
        "seconds_to_end": ended - (notify.sent_at or started) if notify.mine else None,
        "handler_restored": handler_restored,
        "torn": [reason for path in root.rglob("*.ckpt") if (reason := unreadable_reason(path)) is not None],
    }
    trained_before, ends_before = list(model.trained), list(model.batch_ends)
    resumed = IndexedRegression()
    resumed.manual_k, resumed.automatic_optimization = model.manual_k, model.automatic_optimization
    resumed.one_cycle, resumed.plateau = model.one_cycle, model.plateau
    again = trainer_for({**case, "at": "none"}, root, [], slurm)
    again.fit(resumed, ckpt_path=None if slurm else "last")
    slurm_environment(False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    distance = float((flat(resumed) - reference).abs().max()) if reference is not None else None
    trained = every_ranks(trained_before + resumed.trained)
    counts = torch.bincount(torch.tensor(list(itertools.chain(*trained))), minlength=SAMPLES).tolist()
    return {
        **case,
        **{key: every_ranks([value])[0] if key == "code" else value for key, value in first.items()},
        "seconds_to_end_by_rank": every_ranks([first["seconds_to_end"]]),
        "resumed_global_step": again.global_step,
        # the step loggers log at: Lightning counts it at each batch's end that stepped
        "batches_that_stepped": again.fit_loop.epoch_loop._batches_that_stepped,
        # the calls of every scheduler's step() across both runs (a scheduler's state counts them)
        "scheduler_steps": [config.scheduler.last_epoch for config in again.lr_scheduler_configs],
        "distance": distance,
        "sample_counts": counts,
        "batch_ends_by_rank": every_ranks(ends_before + resumed.batch_ends),
        "files": sorted(str(p.relative_to(root)) for p in root.rglob("*.ckpt")),
        "passed_on": sum(n for (n,) in every_ranks([len(passed_on)])),
    }


def reference_of(case: dict) -> tuple[int, bool, bool]:
    """Which uninterrupted run a case ends like: its accumulation, and whether it schedules with OneCycleLR or with
    ReduceLROnPlateau."""
    return case.get("k", 1), bool(case.get("one_cycle")), bool(case.get("plateau"))


def main() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    base = Path(os.environ["DDP_PLUS_TMP"])
    # post-local SGD trains another model than plain DDP: no uninterrupted run to compare with
    compared = {reference_of(case) for case in cases if not case.get("post_local_sgd")}
    references = {key: whole_run(*key, base / f"whole-{key[0]}-{key[1]}") for key in sorted(compared)}
    results = []
    for index, case in enumerate(cases):
        root = base / f"case-{index}"
        results.append(run_case(case, root, references.get(reference_of(case))))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    final = os.environ.get("DDP_PLUS_END_WITH")
    if final:  # the process ends as a preempted process ends: nothing catches Preempted
        run_case(json.loads(final), base / "final", references[(1, False, False)], catch=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
