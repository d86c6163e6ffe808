"""What a steady training step issues, counted on a ``ddp_plus`` job of ``WORLD_SIZE`` ranks: ``step_cost_job.py
OUT_JSON CASES_JSON`` (started on every rank by ``tests.helpers.run_case_job``; one process group for every case).

A case is the strategy's arguments (``strategy``), the Trainer's accumulation (``k``) and a validation every
``validate_every`` batches. The fit trains ``TinyRegression`` for 16 optimizer steps, and two counts are taken per
optimizer step over the steady steps (after the first ``WARM_UP`` steps, which may agree once on what the fit's first
window decides):

- the collective ledger's new records by name (every collective the strategy issues passes through it);
- every Python-level collective of ``torch.distributed`` and every call on a ``torch.distributed.Store``, made by the
  rank's main thread, but the gradient buckets' own all-reduces where a Python communication hook issues them
  (counted apart);
- every call on a ``torch.distributed.Store`` made by another thread (the stall watchdog's), by the thread's name.

A case with ``num_items`` returns the count of its rows from each training step; ``precision`` is the Trainer's. A case with ``sleep`` sleeps that many seconds in each training step, as an accelerator's compute would take, so that
the steady steps span several of the stall watchdog's looks (``POLL_SECONDS``). Rank 0 reports the counts with how
many replica checks ran.
"""

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression, job_main

WARM_UP = 2
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "2"))  # read at the start: a fit's teardown may take it away
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")
COLLECTIVES += ("reduce", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_gather_into_tensor")
STORE_METHODS = ("get", "set", "check", "add", "wait", "compare_set", "delete_key", "multi_get", "multi_set")
#: Files whose ``dist.all_reduce`` is a gradient bucket's (a Python communication hook): the step's own all-reduce.
BUCKET_HOOK_FILES = ("flag_carrier.py", "default_hooks.py")


class PythonCalls:
    """Python-level collectives and store calls of this rank's main thread, by name (once ``install``ed)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        #: Store calls of the other threads, by thread name and method.
        self.thread_calls: Counter[str] = Counter()

    def install(self) -> None:
        for name in COLLECTIVES:
            setattr(dist, name, self._counted(f"collective {name}", getattr(dist, name)))
        for name in STORE_METHODS:
            setattr(dist.Store, name, self._counted(f"store {name}", getattr(dist.Store, name)))

    def _counted(self, key: str, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            thread = threading.current_thread()
            if thread is threading.main_thread():
                caller = Path(sys._getframe(1).f_code.co_filename).name
                self.calls["gradient bucket hook" if caller in BUCKET_HOOK_FILES else key] += 1
            elif key.startswith("store"):
                self.thread_calls[f"{thread.name}: {key}"] += 1
            return function(*args, **kwargs)

        return counted


CALLS = PythonCalls()


class CountCollectives(L.Callback):
    """The ledger's new records at every batch's end, by name, once the warm-up steps are done."""

    def __init__(self) -> None:
        self.seen, self.counts, self.steps = 0, Counter(), 0
        self.calls_seen: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.thread_calls_seen: Counter[str] = Counter()
        self.thread_calls: Counter[str] = Counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ledger = trainer.strategy.engine.ledger
        new = [record for record in ledger.records if record.sequence > self.seen]
        self.seen = ledger.sequence
        calls, self.calls_seen = CALLS.calls - self.calls_seen, Counter(CALLS.calls)
        thread_calls, self.thread_calls_seen = CALLS.thread_calls - self.thread_calls_seen, Counter(CALLS.thread_calls)
        if trainer.global_step > WARM_UP:
            self.counts.update(record.op for record in new)
            self.calls.update(calls)
            self.thread_calls.update(thread_calls)
            self.steps = trainer.global_step - WARM_UP


class HookOnTheWrapper(L.Callback):
    """A user's own communication hook, registered on the wrapper at the start of training (torch takes one per
    wrapper: it must take the flag carrier's place)."""

    def __init__(self) -> None:
        self.calls, self.guard = 0, ""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.guard = trainer.strategy.engine.sync_guard.describe()  # how the guard ran (detached after the fit)

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            self.calls += 1
            return allreduce_hook(state, bucket)

        trainer.strategy.model.register_comm_hook(None, counted)


class Sleeping(TinyRegression):
    """Each training step takes ``sleep`` seconds more, as an accelerator's compute would."""

    def __init__(self, sleep: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sleep = sleep

    def training_step(self, batch, batch_idx):
        time.sleep(self.sleep)
        return super().training_step(batch, batch_idx)


class Counted(TinyRegression):
    """Each training step returns the items its loss is a mean over (``num_items``): here, its rows."""

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "num_items": torch.tensor(len(batch[0]))}


class Validated(TinyRegression):
    """With a validation set: Lightning puts the wrapper in eval mode for each validation."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def val_dataloader(self):
        return self.train_dataloader()


def run_case(case: dict) -> dict:
    counter, user_hook = CountCollectives(), HookOnTheWrapper()
    k, validate = case.get("k", 1), case.get("validate_every")
    trainer = L.Trainer(
        strategy=DDPPlusStrategy(process_group_backend="gloo", timeout="60s", **case.get("strategy", {})),
        accelerator="cpu",
        devices=WORLD_SIZE,
        max_steps=16,
        accumulate_grad_batches=k,
        callbacks=[counter, user_hook] if case.get("hook_on_the_wrapper") else [counter],
        val_check_interval=validate,
        precision=case.get("precision", "32-true"),
        limit_val_batches=2 if validate else 0,
        **QUIET_TRAINER,
    )
    data = {"num_samples": 16 * 4 * WORLD_SIZE * k, "batch_size": 4}
    sleep = case.get("sleep")
    model = Sleeping(sleep, **data) if sleep else Validated(**data) if validate else TinyRegression(**data)
    trainer.fit(Counted(**data) if case.get("num_items") else model)
    per_step = {op: n / counter.steps for op, n in counter.counts.items()}
    calls = {name: n / counter.steps for name, n in counter.calls.items()}
    thread_calls = {name: n / counter.steps for name, n in counter.thread_calls.items()}
    replica_checks = len(trainer.strategy.replica_check_seconds)
    return {
        **case,
        "steps": counter.steps,
        "per_step": per_step,
        "calls": calls,
        "thread_calls": thread_calls,
        "replica_checks": replica_checks,
        "users_hook_calls": user_hook.calls,
        "guard": user_hook.guard,
    }


if __name__ == "__main__":
    CALLS.install()
    job_main(run_case)
