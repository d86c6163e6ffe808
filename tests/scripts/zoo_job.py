"""Runs zoo cases on one 2-rank process group: ``zoo_job.py OUT_JSON CASES_JSON``.

A case is a zoo model (``tests/zoo.py``), DDP settings and a list of runs: ``stock`` (Lightning's ``DDPStrategy``, the
truth), ``ddp_plus`` (defaults), ``resolve`` and ``warn``. Each run trains one epoch from the same initial weights
and records its outcome, the optimizer steps taken, whether the replicas are identical, which trainable
parameters never changed, and the largest difference from the stock run's final parameters.
"""

import logging
import warnings

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, job_main
from tests.zoo import ZooModule, disable_checkpointing


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in module.named_parameters() if p.requires_grad]


def reference(case: dict) -> torch.Tensor:
    """The exact result of one epoch in one process: each step's gradient is the mean over both ranks' micro-batches
    of the window (their shuffled DistributedSampler shards), with checkpointing off, so every parameter that affects
    the loss learns, as intended."""
    module = ZooModule(case["model"], num_samples=case.get("num_samples", 12))
    disable_checkpointing(module.model)
    dataset = module.train_dataloader().dataset
    size, k, world = module.hparams.batch_size, case.get("k", 1), 2
    shards = [
        [dataset[i] for i in DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=True, seed=0)]
        for r in range(world)
    ]
    batches = [
        [torch.utils.data.default_collate(shard[b : b + size]) for b in range(0, len(shard), size)] for shard in shards
    ]
    optimizer = module.configure_optimizers()
    for start in range(0, len(batches[0]), k):
        optimizer.zero_grad()
        sum(
            module.training_step(rank_batches[b], b) / k / world
            for rank_batches in batches
            for b in range(start, min(start + k, len(batches[0])))
        ).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for _, p in trainable(module)])


def run(case: dict, kind: str) -> tuple[dict, torch.Tensor]:
    settings = {
        "find_unused_parameters": case.get("find_unused_parameters", False),
        "static_graph": case.get("static_graph", False),
    }
    if kind == "stock":
        strategy = L.pytorch.strategies.DDPStrategy(
            process_group_backend="gloo",
            timeout=L.fabric.plugins.collectives.torch_collective.default_pg_timeout,
            **settings,
        )
    else:
        mode = {"ddp_plus": "error", "resolve": "resolve", "warn": "warn"}[kind]
        strategy = DDPPlusStrategy(process_group_backend="gloo", timeout="2m", checkpointing_conflict=mode, **settings)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        accumulate_grad_batches=case.get("k", 1),
        **QUIET_TRAINER,
    )
    model = ZooModule(case["model"], num_samples=case.get("num_samples", 12))
    initial = trainable(model)
    outcome = {"kind": kind, "error": None, "message": None}
    lines = _Lines()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(lines)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model)
        except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
            outcome.update(error=type(error).__name__, message=str(error)[:1500])
    logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(lines)
    final = trainable(model)
    flat = torch.cat([p.flatten() for _, p in final])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    outcome.update(
        optimizer_steps=trainer.global_step,
        replicas_equal=torch.equal(gathered[0], gathered[1]),
        unchanged=[name for (name, before), (_, after) in zip(initial, final) if torch.equal(before, after)],
        trainable=len(final),
        findings=[finding.rule.id for finding in getattr(strategy, "findings", [])],
        settings=(
            {
                "find_unused_parameters": strategy.settings.find_unused_parameters,
                "static_graph": strategy.settings.static_graph,
            }
            if isinstance(strategy, DDPPlusStrategy)
            else None
        ),
        resolve_lines=[line for line in lines.lines if "resolved conflicts" in line],
        rule_warnings=sorted(
            {
                str(w.message).split("[")[1].split("]")[0]
                for w in caught
                if str(w.message).startswith("DDPPlusStrategy: [")
            }
        ),
        rule_warning_count=sum(str(w.message).startswith("DDPPlusStrategy: [") for w in caught),
    )
    return outcome, flat


def run_case(case: dict) -> dict:
    expected = reference(case)
    runs, stock_params = [], None
    for kind in case["runs"]:
        outcome, params = run(case, kind)
        outcome["max_diff_to_reference"] = float((params - expected).abs().max())
        if kind == "stock":
            stock_params = params
        elif stock_params is not None:
            outcome["max_diff_to_stock"] = float((params - stock_params).abs().max())
        runs.append(outcome)
    return {**case, "results": runs}


if __name__ == "__main__":
    job_main(run_case)
