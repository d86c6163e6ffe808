"""Per-item averaging (``num_items``) against one process training the global batch: ``item_average_job.py OUT_JSON
CASES_JSON``, started once per rank on one 2-rank process group.

The data are 64 token sequences of 1-24 valid tokens (or all 24: the control), padded to 24 with label -100. Rank r
trains the sequences ``plan[r]`` in order, in batches of ``batch_size``, ``k`` batches per optimizer step, so that
step s covers the sequences of batches ``s*k .. s*k+k-1`` of every rank. After the fit rank 0 trains the same
initial model in this process, one batch per step holding exactly those sequences, with the loss a mean over every
valid token of the batch, and reports the largest parameter difference and the reference's last loss.
"""

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, job_main

VOCAB, LENGTH, SEQUENCES = 16, 24, 64


def token_data(equal: bool) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    lengths = torch.full((SEQUENCES,), LENGTH) if equal else torch.randint(1, LENGTH + 1, (SEQUENCES,), generator=generator)
    labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = -100
    return TensorDataset(ids, labels, (labels != -100).long())


def make_net(hf: bool) -> nn.Module:
    torch.manual_seed(7)
    if hf:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=LENGTH,
        )
        return LlamaForCausalLM(config)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def loss_and_items(net: nn.Module, batch, hf: bool):
    """The loss, a mean over the batch's valid tokens, and their number (the causal LM predicts the next token)."""
    ids, labels, mask = batch
    if hf:
        return net(input_ids=ids, attention_mask=mask, labels=labels).loss, (labels[:, 1:] != -100).sum()
    logits = net(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), (labels != -100).sum()


def plan(case: dict) -> list[list[int]]:
    """The sequences of each rank, in order: interleaved, or (``uneven``) rank 1 with fewer."""
    if case.get("uneven"):
        return [list(range(0, 40)), list(range(40, SEQUENCES))]
    return [list(range(0, SEQUENCES, 2)), list(range(1, SEQUENCES, 2))]


class TokenModel(L.LightningModule):
    def __init__(self, case: dict) -> None:
        super().__init__()
        self.case, self.net = case, make_net(case.get("hf", False))
        self.automatic_optimization = not case.get("manual", False)
        self.limit = case.get("rows_that_fit")  # rank 1 runs out of memory above it (micro_batch_size="auto")

    def training_step(self, batch, batch_idx):
        if self.limit and self.global_rank == 1 and batch[0].shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({batch[0].shape[0]} rows)")
        loss, items = loss_and_items(self.net, batch, self.case.get("hf", False))
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
        data = token_data(self.case.get("equal", False))
        return DataLoader(Subset(data, plan(self.case)[self.global_rank]), batch_size=self.case["batch_size"])


def reference(case: dict) -> tuple[list[torch.Tensor], float, int]:
    """One process, one batch per optimizer step holding every sequence of that step; the loss a mean over all of
    its valid tokens. Returns the parameters, the last step's loss and the number of steps."""
    data, shards, k, size = token_data(case.get("equal", False)), plan(case), case["k"], case["batch_size"]
    net = make_net(case.get("hf", False))
    optimizer = torch.optim.SGD(net.parameters(), lr=case.get("lr", 0.5), momentum=case.get("momentum", 0.0))
    steps = max(-(-len(shard) // (size * k)) for shard in shards)
    loss = torch.tensor(0.0)
    for step in range(steps):
        rows = [i for shard in shards for i in shard[step * size * k : (step + 1) * size * k]]
        loss, _ = loss_and_items(net, data[rows], case.get("hf", False))
        optimizer.zero_grad()
        loss.backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(net.parameters(), case["clip"])
        optimizer.step()
    return [p.detach() for p in net.parameters()], float(loss), steps


def fabric_run(case: dict) -> tuple[nn.Module, DDPPlusFabricStrategy]:
    strategy = DDPPlusFabricStrategy(gradient_accumulation_steps=case["k"], timeout="60s")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = make_net(False)
    optimizer = torch.optim.SGD(net.parameters(), lr=case.get("lr", 0.5))
    model, optimizer = fabric.setup(net, optimizer)
    loader = DataLoader(Subset(token_data(False), plan(case)[fabric.global_rank]), batch_size=case["batch_size"])
    for batch in strategy.micro_batches(loader):
        loss, items = loss_and_items(model, batch, False)
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
            strategy = DDPStrategy(timeout=__import__("datetime").timedelta(seconds=60))
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
            use_distributed_sampler=False,
            **QUIET_TRAINER,
        )
        try:
            trainer.fit(model)
        except Exception as raised:  # noqa: BLE001 - the outcome is what the test checks
            error = f"{type(raised).__name__}: {raised}"
        net, steps = model.net, trainer.global_step
    result = {"name": case["name"], "error": error, "steps": steps}
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


if __name__ == "__main__":
    job_main(run_case)
