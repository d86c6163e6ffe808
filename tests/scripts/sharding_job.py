"""Optimizer-state sharding cases on one 2-rank process group: ``sharding_job.py OUT_JSON CASES_JSON``.

Every case trains the same model twice on the same data, with ``optimizer_sharding`` as the case says and without,
and reports the parameters of both, every rank's optimizer-state bytes, and what a mid-run checkpoint held.
"""

import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy
from lightning_ddp_plus.sharding.optimizer import bucket_sharded, register_overlap, shard, state_bytes
from lightning_ddp_plus.sharding.reduce_scatter import GradientShards, reduce_scatter_hook
from lightning_ddp_plus.sharding.sharded_step import BucketShardedOptimizer
from lightning_ddp_plus.sharding.zero_redundancy import ShardedOptimizer
from tests.helpers import QUIET_TRAINER, TinyRegression, job_main, regression_data, tiny_llama


class Regression(TinyRegression):
    """TinyRegression with the optimizer, the scheduler and manual optimization a case names."""

    def __init__(self, optimizer: str = "adam", scheduler: bool = False, manual_k: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name, self.scheduler, self.manual_k = optimizer, scheduler, manual_k
        self.automatic_optimization = manual_k == 0
        self.state_bytes: int | None = None

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=lr)
        elif self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.1)
        elif self.optimizer_name == "sgd_momentum":
            optimizer = torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)
        else:  # two parameter groups with their own hyperparameters
            first, second = self.net[0], self.net[2]
            optimizer = torch.optim.AdamW(
                [{"params": first.parameters(), "lr": lr}, {"params": second.parameters(), "lr": lr / 2}],
                weight_decay=0.05,
            )
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if self.trainer.strategy.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()
            if self.scheduler:
                self.lr_schedulers().step()
        return loss

    def on_train_end(self) -> None:
        self.state_bytes = state_bytes(self.trainer.strategy.optimizers[0])


class StartStep(L.Callback):
    """The global step a fit starts training at (after a resume: the checkpoint's)."""

    step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step


def flat_parameters(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def fit(
    case: dict,
    sharding: Any,
    root: Path,
    epochs: int,
    resume: str | None = None,
    stock: bool = False,
    resume_from_last: str = "on_restart",
) -> dict:
    model = Regression(
        optimizer=case["optimizer"],
        scheduler=case.get("scheduler", False),
        manual_k=case.get("manual_k", 0),
        num_samples=48,
        batch_size=4,
        lr=0.01,
    )
    k = case.get("manual_k") or case.get("k", 1)
    if stock:
        strategy: Any = DDPStrategy(process_group_backend="gloo")
    else:
        strategy = DDPPlusStrategy(
            optimizer_sharding=case.get("mode", True) if sharding else False,
            gradient_accumulation_steps=k,
            resume_from_last=resume_from_last,
            **case.get("strategy", {}),
        )
    checkpoints = ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0)
    start = StartStep()
    options = {**QUIET_TRAINER, "enable_checkpointing": True}
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        callbacks=[checkpoints, start],
        default_root_dir=root,
        accumulate_grad_batches=k if stock else 1,
        gradient_clip_val=case.get("clip"),
        **options,
    )
    trainer.fit(model, ckpt_path=resume)
    optimizer = trainer.strategy.optimizers[0]
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, model.state_bytes)
    shards = getattr(getattr(getattr(trainer.strategy, "engine", None), "sharding", None), "shards", None)
    layout = shards.layout.buckets if shards is not None and shards.layout is not None else None
    sent: list[Any] = [None, None]
    dist.all_gather_object(sent, shards.sent_bytes if shards is not None else None)
    return {
        "params": flat_parameters(model),
        "sharded": isinstance(optimizer, (ShardedOptimizer, BucketShardedOptimizer)),
        "layout": layout,
        "sent_bytes": sent,
        "hook_bytes": trainer.strategy.engine.hooks.counter.bucket_bytes if not stock else None,
        "state_bytes": gathered,
        "steps": trainer.global_step,
        "started_at": start.step,
        "lr": optimizer.param_groups[0]["lr"],
        "numels": [[p.numel() for p in group["params"]] for group in optimizer.param_groups],
        "consolidations": consolidations(trainer.strategy),
    }


def consolidations(strategy: Any) -> int:
    """The consolidations of sharded optimizer state in the strategy's collective ledger (its last 64 collectives)."""
    ledger = getattr(getattr(strategy, "engine", None), "ledger", None)
    return sum(record.op == "optimizer state consolidation" for record in ledger.records) if ledger else 0


def fabric_fit(sharding: Any, root: Path, save_after: int | None = None, load: bool = False) -> dict:
    """Adam with a StepLR built before ``fabric.setup`` (the common Fabric idiom), 2-step accumulation over 12
    micro-batches; ``fabric.save`` after step ``save_after``, or ``fabric.load`` of that file and the steps left."""
    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy=DDPPlusFabricStrategy(optimizer_sharding=sharding, gradient_accumulation_steps=2),
    )
    fabric.launch()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if load:
        fabric.load(root / "fabric.ckpt", state)
    x, y = regression_data(48).tensors
    rank = fabric.global_rank
    batches = [(x[rank::2][i : i + 4], y[rank::2][i : i + 4]) for i in range(0, 24, 4)] * 2
    steps = started_at = state["step"]
    for xb, yb in fabric.strategy.micro_batches(batches[2 * steps :]):
        fabric.backward(nn.functional.mse_loss(model(xb), yb))
        if fabric.strategy.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            steps += 1
            if steps == save_after:
                fabric.save(root / "fabric.ckpt", {**state, "step": steps})
    return {
        "params": flat_parameters(model),
        "sharded": isinstance(optimizer.optimizer, (ShardedOptimizer, BucketShardedOptimizer)),
        "lr": optimizer.param_groups[0]["lr"],
        "state_bytes": state_bytes(optimizer.optimizer),
        "steps": steps,
        "started_at": started_at,
        "consolidations": consolidations(fabric.strategy),
    }


def run_fabric_case(case: dict) -> dict:
    root = Path(case["root"])
    return {
        **case,
        "plain": fabric_fit(False, root),
        "with_sharding": fabric_fit(True, root, save_after=3),
        "resumed_sharded": fabric_fit(True, root, load=True),
    }


def ensure_group() -> None:
    """The cases without a Trainer need the job's process group (a Trainer case creates it otherwise)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def run_overlap_case(case: dict) -> dict:
    """What torch itself does with the overlap hook on gloo, reached through the package's own wiring."""
    ensure_group()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    sharded = shard(torch.optim.Adam(model.parameters(), lr=0.01), overlap=True)
    try:
        register_overlap(ddp, sharded)
    except RuntimeError as error:
        return {**case, "error": str(error)}
    return {**case, "error": None}


def run_memory_case(case: dict) -> dict:
    """A tiny real Llama in DDP: the bucket bytes torch's reducer really all-reduces (a counting hook), whether the
    gradients are views of the buckets, and each rank's real ZeRO-1 optimizer state after a step, next to the plan."""
    from lightning_ddp_plus.memory.plan import measure_model

    ensure_group()
    model = tiny_llama(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64
    )
    ids = torch.randint(0, 500, (2, 32))
    figures = measure_model(
        model, torch.optim.AdamW(model.parameters()), lambda: model(input_ids=ids, labels=ids).loss, ids
    )
    result: dict = {
        **case,
        "plan_trainable": figures.trainable,
        "plan_state_by_rank": figures.optimizer_state_by_rank_whole_parameters(2),
        "plan_chunks_by_rank": figures.optimizer_state_by_rank(2),
    }
    for bucket_view in (False, True):
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.25)
        buffers: dict[int, int] = {}

        def hook(
            state: Any, bucket: dist.GradBucket, buffers: dict[int, int] = buffers
        ) -> torch.futures.Future[torch.Tensor]:
            tensor = bucket.buffer()
            buffers[tensor.untyped_storage().data_ptr()] = tensor.numel() * tensor.element_size()
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        optimizer = shard(torch.optim.AdamW(model.parameters()))
        ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        own_storage = sum(g.numel() * g.element_size() for g in grads if g.untyped_storage().data_ptr() not in buffers)
        result[f"bucket_view_{bucket_view}"] = {
            "bucket_bytes": sum(buffers.values()),
            "buckets": len(buffers),
            "gradient_bytes_outside_buckets": own_storage,
            "gradient_bytes": sum(g.numel() * g.element_size() for g in grads),
        }
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, state_bytes(optimizer))
        result[f"state_by_rank_{bucket_view}"] = gathered
        model.zero_grad(set_to_none=True)
        del ddp, optimizer
    # optimizer_sharding=True: DDP's buckets reduce-scattered, each rank's chunks stepped
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
    shards = GradientShards()
    ddp.register_comm_hook(shards, reduce_scatter_hook)
    chunked = bucket_sharded(torch.optim.AdamW(model.parameters()), shards)
    ddp(input_ids=ids, labels=ids).loss.backward()
    chunked.step()
    gathered = [None, None]
    dist.all_gather_object(gathered, state_bytes(chunked))
    result["state_by_rank_chunks"] = gathered
    result["chunk_buckets"] = len(shards.layout.buckets) if shards.layout else 0
    result["chunk_pieces"] = len(chunked.pieces)
    model.zero_grad(set_to_none=True)
    return result


def run_case(case: dict) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_any_case(case)
    result["scheduler_warnings"] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return result


def run_any_case(case: dict) -> dict:
    if case.get("memory"):
        return run_memory_case(case)
    if case.get("overlap"):
        return run_overlap_case(case)
    if case.get("fabric"):
        return run_fabric_case(case)
    root = Path(case["root"])
    epochs = case.get("epochs", 2)
    result: dict = {**case}
    result["plain"] = fit(case, False, root / "plain", epochs)
    result["with_sharding"] = fit(case, True, root / "sharded", epochs)
    if case.get("resume"):
        # a sharded run saved after epoch 1: resumed sharded, by an unsharded DDPPlusStrategy, by stock DDPStrategy
        first = fit(case, True, root / "half", 1)
        saved = root / "half" / "last.ckpt"
        result["half_steps"] = first["steps"]
        if dist.get_rank() == 0:
            # kept before the resumes below overwrite last.ckpt with their own later state
            (root / "after_epoch_1.ckpt").write_bytes(saved.read_bytes())
        dist.barrier()
        kept = root / "after_epoch_1.ckpt"
        result["resumed_sharded"] = fit(case, True, root / "resume_sharded", epochs, resume=str(kept))
        result["resumed_plain"] = fit(case, False, root / "resume_plain", epochs, resume=str(kept))
        result["resumed_stock"] = fit(case, False, root / "resume_stock", epochs, resume=str(kept), stock=True)
        # a plain checkpoint into a sharded run
        plain_saved = root / "plain_half"
        fit(case, False, plain_saved, 1)
        # the package's own resume path (resume_from_last, as a restarted attempt takes it) with a sharded file
        if dist.get_rank() == 0:
            (root / "always").mkdir()
            (root / "always" / "last.ckpt").write_bytes(kept.read_bytes())
        dist.barrier()
        result["resumed_from_last"] = fit(case, True, root / "always", epochs, resume_from_last="always")
        result["plain_into_sharded"] = fit(
            case, True, root / "plain_into_sharded", epochs, resume=str(plain_saved / "last.ckpt")
        )
        # the consolidated state into a ZeroRedundancyOptimizer of world size 1 (a group of rank 0 alone)
        alone = dist.new_group([0])
        if dist.get_rank() == 0:
            state = torch.load(kept, weights_only=False)["optimizer_states"][0]
            model = Regression(optimizer=case["optimizer"], num_samples=48, batch_size=4, lr=0.01)
            zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=alone, lr=0.01)
            zero.load_state_dict(state)
            result["world_size_1_loaded"] = state_bytes(zero)
            result["checkpoint_state_bytes"] = sum(
                value.numel() * value.element_size()
                for per_parameter in state["state"].values()
                for value in per_parameter.values()
                if isinstance(value, torch.Tensor)
            )
            dist.destroy_process_group(alone)
    return result


if __name__ == "__main__":
    job_main(run_case)
