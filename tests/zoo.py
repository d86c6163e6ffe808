"""Tiny configurations of real Hugging Face ``transformers`` and ``peft`` models, built from config objects (no
downloads), as LightningModules: the models users train with DDP and gradient checkpointing.

Dropout is off so that runs are deterministic and two runs can be compared exactly.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, WIDTH = 64, 8, 32

#: name -> (what it is, the expectation torch's reducer gives it); see ``build``.
MODELS = {
    "gpt2_reentrant": "GPT-2 causal LM, gradient_checkpointing_enable(use_reentrant=True)",
    "gpt2_non_reentrant": "GPT-2 causal LM, gradient_checkpointing_enable(use_reentrant=False)",
    "bert_unused_pooler": "BERT encoder, loss on last_hidden_state (the pooler gets no gradient)",
    "llama_lora_reentrant": "Llama + PEFT LoRA (q, v, lm_head) on a frozen base, reentrant checkpointing, input grads on (PEFT's default)",
    "llama_lora_reentrant_no_input_grads": "Llama + LoRA, reentrant checkpointing, embedding hooks removed: layer inputs need no grad",
    "llama_lora_non_reentrant": "Llama + LoRA, non-reentrant checkpointing",
    "llama_lora_non_reentrant_no_input_grads": "Llama + LoRA, non-reentrant checkpointing, embedding hooks removed",
    "vit_reentrant": "ViT image classifier, reentrant checkpointing",
    "vit_non_reentrant": "ViT image classifier, non-reentrant checkpointing",
}


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*")
    warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")


def build(name: str) -> torch.nn.Module:
    """The model called ``name`` in ``MODELS``, with seeded weights."""
    _quiet_transformers()
    torch.manual_seed(0)
    family, _, variant = name.partition("_")
    reentrant = "non_reentrant" not in variant and "reentrant" in variant
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2,
            n_embd=WIDTH,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = GPT2LMHeadModel(config)
    elif family == "bert":
        from transformers import BertConfig, BertModel

        config = BertConfig(
            num_hidden_layers=2,
            hidden_size=WIDTH,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return BertModel(config)
    elif family == "llama":
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            num_hidden_layers=2,
            hidden_size=WIDTH,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        base = LlamaForCausalLM(config)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model = get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0)
        )
        if variant.endswith("no_input_grads"):
            # transformers and PEFT both hook the embedding to make its output require grad; without that, the
            # checkpointed layers' inputs need no grad (as in code that checkpoints layers of a frozen base itself)
            base.get_input_embeddings()._forward_hooks.clear()
        return model
    elif family == "vit":
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=3,
            hidden_size=WIDTH,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = ViTForImageClassification(config)
    else:
        raise ValueError(name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Turn Hugging Face's per-layer checkpointing flags off (the values computed are the same, only memory differs)."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = False


def batch_inputs(name: str, count: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if name.startswith("vit"):
        return torch.randn(count, 3, 8, 8, generator=generator), torch.randint(0, 3, (count,), generator=generator)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=generator)
    return ids, ids


class ZooModule(L.LightningModule):
    """A zoo model trained with plain SGD on random data: 3 optimizer steps per rank per epoch with 2 ranks."""

    def __init__(self, name: str, num_samples: int = 12, batch_size: int = 2, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build(name)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        name = self.hparams.name
        if name.startswith("vit"):
            return self.model(pixel_values=inputs, labels=targets).loss
        if name.startswith("bert"):
            return self.model(input_ids=inputs).last_hidden_state.pow(2).mean()
        return self.model(input_ids=inputs, labels=targets).loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            TensorDataset(*batch_inputs(self.hparams.name, self.hparams.num_samples)),
            batch_size=self.hparams.batch_size,
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


# ---------------------------------------------------------------- the cases and how a run is judged

_SETTINGS = {"default": {}, "find_unused": {"find_unused_parameters": True}, "static": {"static_graph": True}}

#: What stock ``DDPStrategy`` does with each model and setting (torch 2.13, measured): the truth the zoo re-checks.
#: "error": torch or Lightning raises; "wrong": trains without error to a result that differs from the exact
#: reference (here: LoRA adapters that never learn); "correct": matches the reference.
STOCK_TRUTH = {
    ("gpt2_reentrant", "find_unused"): "error",  # R1: marked ready twice
    ("bert_unused_pooler", "default"): "error",  # R4: expected to have finished reduction
    ("llama_lora_reentrant", "find_unused"): "error",  # R1
    ("llama_lora_reentrant_no_input_grads", "default"): "error",  # R5 surfaces as R4's error
    ("llama_lora_reentrant_no_input_grads", "find_unused"): "wrong",  # R5: adapters silently never learn
    ("llama_lora_reentrant_no_input_grads", "static"): "wrong",  # R5
    ("vit_reentrant", "find_unused"): "error",  # R1
}


def zoo_cases() -> list[dict]:
    """Every model crossed with the three settings, plus accumulation cases (full windows of k=2)."""
    cases = [
        {"model": model, "setting": setting, **values, "truth": STOCK_TRUTH.get((model, setting), "correct")}
        for model in MODELS
        for setting, values in _SETTINGS.items()
    ]
    cases += [
        # R3: Lightning runs the first micro-batch under no_sync and torch asserts (Lightning #19354)
        {
            "model": "gpt2_reentrant",
            "setting": "static",
            "static_graph": True,
            "k": 2,
            "num_samples": 16,
            "truth": "error",
        },
        {
            "model": "llama_lora_non_reentrant",
            "setting": "find_unused",
            "find_unused_parameters": True,
            "k": 2,
            "num_samples": 16,
            "truth": "correct",
        },
        {"model": "vit_reentrant", "setting": "default", "k": 2, "num_samples": 16, "truth": "correct"},
    ]
    return [{**case, "runs": ["stock", "ddp_plus", "resolve"]} for case in cases]


def outcome(run: dict, tolerance: float = 1e-5) -> str:
    """``"refused"`` (ddp_plus's error before training), ``"error"``, ``"diverged"`` (replicas differ), ``"wrong"``
    (differs from the exact reference) or ``"correct"``."""
    if run["error"] == "DDPConflictError":
        return "refused"
    if run["error"]:
        return "error"
    if not run["replicas_equal"]:
        return "diverged"
    return "correct" if run["max_diff_to_reference"] <= tolerance else "wrong"
