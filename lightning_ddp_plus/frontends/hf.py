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
"""

from __future__ import annotations

from typing import Any

from lightning_ddp_plus.config.training_arguments import (
    HF_DEFAULTS,
    TrainingArgumentsPort,
    port_training_arguments,
)
from lightning_ddp_plus.engine.options import ConflictMode, StartMethod
from lightning_ddp_plus.frontends.strategy import DDPPlusStrategy
from lightning_ddp_plus.sync.accumulation import ShortWindow

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
    port = port_training_arguments(args, model)
    return DDPPlusStrategy(**{**port.strategy_kwargs, **overrides}), dict(port.trainer_kwargs)


class HFStyleDDPPlusStrategy(DDPPlusStrategy):
    """``DDPPlusStrategy`` that takes the Hugging Face ``TrainingArguments`` names, for YAML files::

        trainer:
          strategy:
            class_path: lightning_ddp_plus.frontends.hf.HFStyleDDPPlusStrategy
            init_args: {gradient_accumulation_steps: 4, ddp_find_unused_parameters: null, ddp_timeout: 3600,
                        gradient_checkpointing: true}

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step.
        ddp_backend: ``process_group_backend``; ``None`` follows the accelerator.
        ddp_find_unused_parameters: ``None``: ``not gradient_checkpointing`` (Hugging Face's rule for its models).
        ddp_bucket_cap_mb: ``None``: 25 MiB.
        ddp_broadcast_buffers: ``None``: ``True``.
        ddp_static_graph: ``None``: ``False``.
        ddp_timeout: collective timeout in seconds.
        gradient_checkpointing: whether the model checkpoints (decides only ``ddp_find_unused_parameters=None``).
        checkpointing_conflict: as in ``DDPPlusStrategy``.
        ddp_comm_hook: as in ``DDPPlusStrategy``.
        short_window: as in ``DDPPlusStrategy``.
        verify_replicas_every_n_steps: as in ``DDPPlusStrategy``.
        telemetry: as in ``DDPPlusStrategy``.
        start_method: as in ``DDPPlusStrategy``.

    ``DDPPlusStrategy``'s other arguments are not taken here, so that no setting has two names.
    """

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
        checkpointing_conflict: ConflictMode = "error",
        ddp_comm_hook: str | None = None,
        short_window: ShortWindow = "mean",
        verify_replicas_every_n_steps: int | None = None,
        telemetry: bool = False,
        start_method: StartMethod = "popen",
    ) -> None:
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
            }
        )
        super().__init__(
            checkpointing_conflict=checkpointing_conflict,
            ddp_comm_hook=ddp_comm_hook,
            short_window=short_window,
            verify_replicas_every_n_steps=verify_replicas_every_n_steps,
            telemetry=telemetry,
            start_method=start_method,
            **port.strategy_kwargs,
        )
