"""What a steady training step issues, counted on a 2-rank ``ddp_plus`` job: ``step_cost_job.py OUT_JSON CASES_JSON``
(started on every rank by ``tests.helpers.run_case_job``; one process group for every case).

A case is the strategy's arguments (``strategy``), the Trainer's accumulation (``k``) and a validation every
``validate_every`` batches. The fit trains
``TinyRegression`` for 16 optimizer steps; every collective the strategy issues passes through its collective ledger,
whose records carry a sequence number, so each batch's new records are counted by name. Rank 0 reports each name's
count per optimizer step over the steady steps (after the first ``WARM_UP`` steps, which may agree once on what the
fit's first window decides), and how many replica checks ran.
"""

from collections import Counter

import lightning as L

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, TinyRegression, job_main

WARM_UP = 2


class CountCollectives(L.Callback):
    """The ledger's new records at every batch's end, by name, once the warm-up steps are done."""

    def __init__(self) -> None:
        self.seen, self.counts, self.steps = 0, Counter(), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ledger = trainer.strategy.engine.ledger
        new = [record for record in ledger.records if record.sequence > self.seen]
        self.seen = ledger.sequence
        if trainer.global_step > WARM_UP:
            self.counts.update(record.op for record in new)
            self.steps = trainer.global_step - WARM_UP


class Validated(TinyRegression):
    """With a validation set: Lightning puts the wrapper in eval mode for each validation."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def val_dataloader(self):
        return self.train_dataloader()


def run_case(case: dict) -> dict:
    counter = CountCollectives()
    k, validate = case.get("k", 1), case.get("validate_every")
    trainer = L.Trainer(
        strategy=DDPPlusStrategy(process_group_backend="gloo", timeout="60s", **case.get("strategy", {})),
        accelerator="cpu",
        devices=2,
        max_steps=16,
        accumulate_grad_batches=k,
        callbacks=[counter],
        val_check_interval=validate,
        limit_val_batches=2 if validate else 0,
        **QUIET_TRAINER,
    )
    trainer.fit((Validated if validate else TinyRegression)(num_samples=16 * 4 * 2 * k, batch_size=4))
    per_step = {op: n / counter.steps for op, n in counter.counts.items()}
    replica_checks = len(trainer.strategy.replica_check_seconds)
    return {**case, "steps": counter.steps, "per_step": per_step, "replica_checks": replica_checks}


if __name__ == "__main__":
    job_main(run_case)
