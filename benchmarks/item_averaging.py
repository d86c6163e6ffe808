"""Per-item averaging (``num_items``): stock Lightning and ``ddp_plus`` against one process training the global
batch, side by side; and what it costs per step.

    python benchmarks/item_averaging.py                  # both parts, about 2 minutes on 2 CPU cores
    python benchmarks/item_averaging.py --only cost --steps 100

``table``: 64 token sequences of 1-24 valid tokens (or all 24: the control), padded to 24 with label -100; 2 ranks,
each training its interleaved half in order, so that every optimizer step covers the same sequences as one
process's batch of 16. The loss is a token-level cross entropy (a mean over the micro-batch's valid tokens), on a toy
embedding model and on a tiny ``transformers`` ``LlamaForCausalLM`` built from its config. Reported per run: the
largest parameter difference to the one-process reference after the epoch (4 optimizer steps, SGD).

``cost``: one process group, a Llama model of width 128 and 2 layers on batches of 8 sequences of up to 128 tokens,
accumulation 2: stock,
``ddp_plus`` without ``num_items`` and with it, alternately; the median time per optimizer step and the ratios.
Results go to ``benchmarks/results/item_averaging.json``.

The same workload (``run_case``) is what ``tests/test_item_averaging.py`` checks on every feature it combines with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from benchmarks.ranks import run_ranks, step_ratios
from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy

#: Trainer arguments that keep the runs free of files and console noise.
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}

VOCAB = 16

#: Counts a training step may return in place of the right one (``None``: no ``num_items`` at all).
OVERRIDES = {
    "zero": 0,
    "float": 2.5,
    "negative": -3,
    "negative tensor": torch.tensor(-3),
    "two elements": torch.tensor([1, 2]),
    "missing": None,
}


def token_data(case: dict) -> TensorDataset:
    """``case["sequences"]`` (64) sequences of 1 to ``case["length"]`` (24) valid tokens (all of them: ``equal``)."""
    sequences, length = case.get("sequences", 64), case.get("length", 24)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (sequences, length), generator=generator)
    labels = torch.randint(0, VOCAB, (sequences, length), generator=generator)
    valid = torch.randint(1, length + 1, (sequences,), generator=generator)
    lengths = torch.full((sequences,), length) if case.get("equal") else valid
    labels[torch.arange(length)[None, :] >= lengths[:, None]] = -100
    return TensorDataset(ids, labels, (labels != -100).long())


def make_net(case: dict) -> nn.Module:
    torch.manual_seed(7)
    if case.get("hf"):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=case.get("hidden", 16),
            intermediate_size=2 * case.get("hidden", 16),
            num_hidden_layers=case.get("layers", 1),
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=case.get("length", 24),
        )
        return LlamaForCausalLM(config)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def loss_and_items(net: nn.Module, batch, case: dict):
    """The loss, a mean over the batch's valid tokens (times ``case["loss_scale"]``: large gradients), and their
    number (the causal LM predicts the next token)."""
    ids, labels, mask = batch
    scale = case.get("loss_scale", 1.0)
    if case.get("hf"):
        loss = net(input_ids=ids, attention_mask=mask, labels=labels).loss
        return loss * scale, (labels[:, 1:] != -100).sum()
    loss = nn.functional.cross_entropy(net(ids).reshape(-1, VOCAB), labels.reshape(-1))
    return loss * scale, (labels != -100).sum()


def plan(case: dict) -> list[list[int]]:
    """The sequences of each rank, in order: interleaved, or (``uneven``) rank 1 with fewer."""
    sequences = case.get("sequences", 64)
    if case.get("uneven"):
        return [list(range(sequences * 5 // 8)), list(range(sequences * 5 // 8, sequences))]
    return [list(range(0, sequences, 2)), list(range(1, sequences, 2))]


class TokenModel(L.LightningModule):
    def __init__(self, case: dict) -> None:
        super().__init__()
        self.case, self.net = case, make_net(case)
        self.automatic_optimization = not case.get("manual", False)
        self.limit = case.get("rows_that_fit")  # rank 1 runs out of memory above it (chunk_size="auto")

    def training_step(self, batch, batch_idx):
        if self.limit and self.global_rank == 1 and batch[0].shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({batch[0].shape[0]} rows)")
        loss, items = loss_and_items(self.net, batch, self.case)
        override = self.case.get("override")
        mine = override and self.global_rank in override.get("ranks", (0, 1))
        if mine and batch_idx in override["batches"]:  # a count a user might get wrong, on every rank (or some)
            items = OVERRIDES[override["value"]]
            if items is None:
                return loss
        if not self.case.get("num_items", True):
            return loss
        if self.automatic_optimization:
            return {"loss": loss, "num_items": items}
        self.manual_backward(loss, num_items=items)
        if self.trainer.strategy.sync_gradients:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.case.get("lr", 0.5), momentum=self.case.get("momentum", 0.0))

    def train_dataloader(self):
        data = token_data(self.case)
        return DataLoader(Subset(data, plan(self.case)[self.global_rank]), batch_size=self.case["batch_size"])


def reference(case: dict) -> tuple[list[torch.Tensor], float, int]:
    """One process, one batch per optimizer step holding every sequence of that step; the loss a mean over all of
    its valid tokens. Returns the parameters, the last step's loss and the number of steps."""
    data, shards, k, size = token_data(case), plan(case), case["k"], case["batch_size"]
    net = make_net(case)
    optimizer = torch.optim.SGD(net.parameters(), lr=case.get("lr", 0.5), momentum=case.get("momentum", 0.0))
    steps = max(-(-len(shard) // (size * k)) for shard in shards)
    loss = torch.tensor(0.0)
    for step in range(steps):
        if step in case.get("skipped_steps", []):
            continue
        window = [shard[step * size * k : (step + 1) * size * k] for shard in shards]
        if case.get("strategy", {}).get("average_items_across_ranks") is False:  # each rank's mean, then their mean
            loss = sum(loss_and_items(net, data[rows], case)[0] for rows in window) / len(window)
        else:
            loss, _ = loss_and_items(net, data[[i for rows in window for i in rows]], case)
        optimizer.zero_grad()
        loss.backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(net.parameters(), case["clip"])
        optimizer.step()
    return [p.detach() for p in net.parameters()], float(loss), steps


def fabric_run(case: dict) -> tuple[nn.Module, DDPPlusFabricStrategy]:
    strategy = DDPPlusFabricStrategy(gradient_accumulation_steps=case["k"], timeout="60s", **case.get("strategy", {}))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = make_net(case)
    optimizer = torch.optim.SGD(net.parameters(), lr=case.get("lr", 0.5))
    model, optimizer = fabric.setup(net, optimizer)
    loader = DataLoader(Subset(token_data(case), plan(case)[fabric.global_rank]), batch_size=case["batch_size"])
    for batch in strategy.micro_batches(loader):
        loss, items = loss_and_items(model, batch, case)
        fabric.backward(loss, num_items=items)
        if strategy.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()
    return net, strategy


def run_case(case: dict) -> dict:
    error = None
    if case.get("fabric"):
        net, strategy = fabric_run(case)
        steps = strategy.sync_stats.optimizer_steps
    else:
        if case.get("stock"):
            strategy = DDPStrategy(timeout=timedelta(seconds=60))
        else:
            strategy = DDPPlusStrategy(timeout="60s", **case.get("strategy", {}))
        model = TokenModel(case)
        k = case["k"]
        manual = case.get("manual", False)
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            accumulate_grad_batches=1 if manual else k,
            gradient_clip_val=case.get("clip"),
            # fp16 with a gradient scaler: Lightning gives the CPU bf16 for "16-mixed", so the plugin is explicit
            plugins=[MixedPrecision("16-mixed", "cpu")] if case.get("fp16_scaler") else None,
            use_distributed_sampler=False,
            **QUIET,
        )
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(model)
        except Exception as raised:  # noqa: BLE001 - the outcome is what the test checks
            error = f"{type(raised).__name__}: {raised}"
        said = [str(warning.message) for warning in caught if "num_items" in str(warning.message)]
        net, steps = model.net, trainer.global_step
        scaler = getattr(trainer.precision_plugin, "scaler", None)
    result = {"name": case["name"], "error": error, "steps": steps}
    if not case.get("fabric"):
        result["num_items_warnings"] = said
    if not case.get("fabric") and scaler is not None:  # 16-mixed: each skipped (overflowed) step halved it
        result["scaler_scale"] = float(scaler.get_scale())
    if isinstance(strategy, (DDPPlusStrategy, DDPPlusFabricStrategy)):
        result["size_changes"] = len(strategy.engine.chunks.changes)
    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    result["replicas_equal"] = bool(torch.equal(gathered[0], gathered[1]))
    if dist.get_rank() == 0 and error is None:
        expected, last_loss, expected_steps = reference(case)
        result["max_difference"] = max(float((p.detach() - q).abs().max()) for p, q in zip(net.parameters(), expected))
        result["reference_steps"] = expected_steps
        result["reference_loss"] = last_loss
        result["loss_per_item"] = getattr(strategy, "loss_per_item", None)
    return result


#: The issue's table: each run on the toy model and on the causal LM.
TABLE = [
    {"name": "stock DDPStrategy, 2 ranks x 4 rows x accumulate_grad_batches=2", "stock": True, "num_items": False},
    {"name": "ddp_plus without num_items, the same", "num_items": False},
    {"name": "ddp_plus with num_items, the same"},
    {"name": "ddp_plus without num_items, 2 ranks x 8 rows, chunk_size=2", "k": 1, "batch_size": 8,
     "num_items": False, "strategy": {"chunk_size": 2}},
    {"name": "ddp_plus with num_items, 2 ranks x 8 rows, chunk_size=2", "k": 1, "batch_size": 8,
     "strategy": {"chunk_size": 2}},
    {"name": "control (every sequence full length), stock", "stock": True, "num_items": False, "equal": True},
    {"name": "control, ddp_plus with num_items", "equal": True},
]  # fmt: skip


def table_cases() -> list[dict]:
    return [
        {"k": 2, "batch_size": 4, **row, "name": f"{model}: {row['name']}", "hf": hf, "lr": 0.1 if hf else 0.5}
        for model, hf in (("toy", False), ("LlamaForCausalLM", True))
        for row in TABLE
    ]


def cost_rank(steps: int, repeats: int, width: int) -> None:
    """One rank of the cost part: the variants alternately on one process group, optimizer steps timed."""

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_before_optimizer_step(self, *args) -> None:
            self.times.append(time.perf_counter())

    variants = {
        "stock": {"stock": True, "num_items": False},
        "ddp_plus": {"num_items": False},
        "ddp_plus + num_items": {},
    }
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fields in variants.items():
            case = {"name": name, "k": 2, "batch_size": 8, "hf": True, "lr": 0.01, "length": 128, **fields}
            case.update(hidden=width, layers=2)
            case["sequences"] = steps * 2 * 2 * 8  # ranks x k x rows
            clock = StepClock()
            model = TokenModel(case)
            strategy = (
                DDPStrategy(timeout=timedelta(seconds=60)) if case.get("stock") else DDPPlusStrategy(timeout="60s")
            )
            trainer = L.Trainer(
                strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, accumulate_grad_batches=2,
                use_distributed_sampler=False, callbacks=[clock], **QUIET,
            )  # fmt: skip
            trainer.fit(model)
            gaps = [b - a for a, b in zip(clock.times[3:], clock.times[4:])]
            medians[name].append(statistics.median(gaps))
    if dist.get_rank() == 0:
        Path(os.environ["DDP_PLUS_BENCH_OUT"]).write_text(json.dumps(medians))


def table_rank(cases: list[dict]) -> None:
    results = [run_case(case) for case in cases]
    if dist.get_rank() == 0:
        Path(os.environ["DDP_PLUS_BENCH_OUT"]).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=["table", "cost"], default=["table", "cost"])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per cost run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=128, help="the cost part's model width")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "item_averaging.json")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--as-rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank is not None:
        table_rank(table_cases()) if args.part == "table" else cost_rank(args.steps, args.repeats, args.width)
        return
    results: dict = {}
    for part in args.only:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            os.environ["DDP_PLUS_BENCH_OUT"] = out.name
            command = [
                sys.executable,
                __file__,
                "--part",
                part,
                "--steps",
                str(args.steps),
                "--repeats",
                str(args.repeats),
                "--width",
                str(args.width),
            ]
            run_ranks(command, 2, 1800)
            found = json.loads(Path(out.name).read_text())
        if part == "table":
            results["table"] = {row["name"]: row["max_difference"] for row in found}
            for name, difference in results["table"].items():
                print(f"{difference:10.2e}  {name}")
        else:
            results["cost"] = step_ratios(found, ("stock", "ddp_plus"))
            print(json.dumps(results["cost"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
