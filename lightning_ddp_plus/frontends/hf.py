"""Coming from the Hugging Face Trainer: its DDP settings (``TrainingArguments``) as a ``DDPPlusStrategy``.

``DDPPlusStrategy.from_training_arguments(args)`` (or ``port_training_arguments``) reads the names below from a
``transformers.TrainingArguments``, any object with those attributes, or a mapping, and resolves Hugging Face's
``None`` defaults as its Trainer does (transformers 5, ``Trainer._build_accelerator_args``). ``transformers`` is not
imported. In YAML, ``HFStyleDDPPlusStrategy`` takes the same names as ``init_args``.

| TrainingArguments | DDPPlusStrategy / Trainer | ``None`` means |
|---|---|---|
| ``gradient_accumulation_steps`` | ``gradient_accumulation_steps`` and ``Trainer(accumulate_grad_batches=...)`` | (default 1) |
| ``ddp_backend`` | ``process_group_backend`` | from the accelerator |
| ``ddp_find_unused_parameters`` | ``find_unused_parameters`` | ``not checkpointing`` for Hugging Face models, else ``True`` |
| ``ddp_bucket_cap_mb`` | ``bucket_cap_mb`` | 25 (torch's default) |
| ``ddp_broadcast_buffers`` | ``broadcast_buffers`` | ``True`` (torch's default; HF's docs say ``False`` with checkpointing, its code does not) |
| ``ddp_static_graph`` | ``static_graph`` | ``False`` |
| ``ddp_timeout`` (seconds) | ``timeout`` | (default 1800) |
| ``gradient_checkpointing`` / ``activation_checkpointing`` | decides ``find_unused_parameters=None`` | ``False`` |
| ``average_tokens_across_devices`` | ``average_items_across_ranks`` | (default ``True``) |

The Trainer's ``num_items_in_batch`` (a causal LM's loss divided by the tokens of the whole accumulation window) is
what ``training_step`` returning ``{"loss": loss, "num_items": (labels[:, 1:] != -100).sum()}`` gives: the loss stays
the model's mean, and the strategy divides the window's gradient by its items (``sync/item_averaging.py``).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import Unpack

from lightning_ddp_plus.config.messages import ArgumentTypeError
from lightning_ddp_plus.config.training_arguments import (
    HF_DEFAULTS,
    PORTED_ARGUMENTS,
    TrainingArgumentsPort,
    port_training_arguments,
)
from lightning_ddp_plus.engine.arguments import takes_declared_arguments
from lightning_ddp_plus.engine.keywords import HFStyleKeywords
from lightning_ddp_plus.frontends.strategy import DDPPlusStrategy

__all__ = [
    "HF_DEFAULTS",
    "HFStyleDDPPlusStrategy",
    "TrainingArgumentsPort",
    "port_training_arguments",
    "training_arguments_strategy",
]


def training_arguments_strategy(
    args: Any, model: Any | None = None, **overrides: Any
) -> tuple[DDPPlusStrategy, dict[str, Any]]:
    """``(DDPPlusStrategy, Trainer kwargs)`` for ``args``; ``overrides`` are further ``DDPPlusStrategy`` arguments."""
    return DDPPlusStrategy.from_training_arguments(args, model, **overrides)


class HFStyleDDPPlusStrategy(DDPPlusStrategy):
    """``DDPPlusStrategy`` that takes the Hugging Face ``TrainingArguments`` names, for YAML files::

        trainer:
          strategy:
            class_path: lightning_ddp_plus.frontends.hf.HFStyleDDPPlusStrategy
            init_args: {gradient_accumulation_steps: 4, ddp_find_unused_parameters: null, ddp_timeout: 3600,
                        gradient_checkpointing: true}

    It takes every other argument of ``DDPPlusStrategy`` too (``checkpointing_conflict``, ``telemetry`` ...), but
    not those the Hugging Face names set (``process_group_backend``, ``timeout``, ``find_unused_parameters``,
    ``bucket_cap_mb``, ``broadcast_buffers``, ``static_graph``, ``average_items_across_ranks``), so that no setting
    has two names.
    """

    @takes_declared_arguments("DDPPlusStrategy", without=tuple(PORTED_ARGUMENTS), ddp_kwargs=False)
    def __init__(
        self,
        gradient_accumulation_steps: int = 1,
        ddp_backend: str | None = None,
        ddp_find_unused_parameters: bool | None = None,
        ddp_bucket_cap_mb: float | None = None,
        ddp_broadcast_buffers: bool | None = None,
        ddp_static_graph: bool | None = None,
        ddp_timeout: int = 1800,
        gradient_checkpointing: bool = False,
        average_tokens_across_devices: bool = True,
        **arguments: Unpack[HFStyleKeywords],
    ) -> None:
        """The Hugging Face names, then every other argument ``DDPPlusArguments`` declares.

        Args:
            gradient_accumulation_steps: micro-batches per optimizer step.
            ddp_backend: ``process_group_backend``; ``None`` follows the accelerator.
            ddp_find_unused_parameters: ``None``: ``not gradient_checkpointing`` (Hugging Face's rule for its models).
            ddp_bucket_cap_mb: ``None``: 25 MiB.
            ddp_broadcast_buffers: ``None``: ``True``.
            ddp_static_graph: ``None``: ``False``.
            ddp_timeout: collective timeout in seconds.
            gradient_checkpointing: whether the model checkpoints (decides only ``ddp_find_unused_parameters=None``).
            average_tokens_across_devices: ``average_items_across_ranks`` (with ``num_items`` from the training step).
        """
        port = port_training_arguments(
            {
                "gradient_accumulation_steps": gradient_accumulation_steps,
                "ddp_backend": ddp_backend,
                "ddp_find_unused_parameters": ddp_find_unused_parameters,
                "ddp_bucket_cap_mb": ddp_bucket_cap_mb,
                "ddp_broadcast_buffers": ddp_broadcast_buffers,
                "ddp_static_graph": ddp_static_graph,
                "ddp_timeout": ddp_timeout,
                "gradient_checkpointing": gradient_checkpointing,
                "average_tokens_across_devices": average_tokens_across_devices,
            }
        )
        for name in sorted(arguments.keys() & set(PORTED_ARGUMENTS))[:1]:
            raise ArgumentTypeError(
                f"HFStyleDDPPlusStrategy takes `{name}` by its Hugging Face name, so that no setting has two names. "
                f"Fix: use `{PORTED_ARGUMENTS[name]}`."
            )
        super().__init__(**arguments, **port.strategy_kwargs)
