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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_ddp_plus._messages import closest_name, describe_bad_value
from lightning_ddp_plus.accumulation import ShortWindow
from lightning_ddp_plus.options import ConflictMode, StartMethod
from lightning_ddp_plus.strategy import DDPPlusStrategy

#: The Hugging Face names this port reads, with the Hugging Face default.
HF_DEFAULTS: dict[str, Any] = {
    "gradient_accumulation_steps": 1,
    "ddp_backend": None,
    "ddp_find_unused_parameters": None,
    "ddp_bucket_cap_mb": None,
    "ddp_broadcast_buffers": None,
    "ddp_static_graph": None,
    "ddp_timeout": 1800,
    "gradient_checkpointing": None,
    "activation_checkpointing": None,
}


@dataclass(frozen=True)
class TrainingArgumentsPort:
    """What ``TrainingArguments`` mean here: ``DDPPlusStrategy(**strategy_kwargs)``, ``Trainer(**trainer_kwargs)``."""

    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def _values(args: Any) -> dict[str, Any]:
    if isinstance(args, Mapping):
        for key in args:
            if isinstance(key, str) and key.startswith("ddp_") and key not in HF_DEFAULTS:
                suggestion = closest_name(key, HF_DEFAULTS)
                raise ValueError(
                    describe_bad_value(
                        key,
                        args[key],
                        f"not a Hugging Face DDP setting this port knows; it reads {', '.join(HF_DEFAULTS)}.",
                        f"did you mean `{suggestion}`?"
                        if suggestion
                        else "remove it, or set the DDPPlusStrategy argument directly.",
                    )
                )
        return {name: args.get(name, default) for name, default in HF_DEFAULTS.items()}
    if args is None or isinstance(args, (str, bytes, int, float, bool)):
        raise TypeError(
            describe_bad_value(
                "args",
                args,
                "expected a transformers.TrainingArguments, an object with its ddp_* attributes, or a mapping.",
                "pass your TrainingArguments.",
            )
        )
    return {name: getattr(args, name, default) for name, default in HF_DEFAULTS.items()}


def _is_hf_model(model: Any) -> bool:
    return hasattr(model, "is_activation_checkpointing") or hasattr(model, "is_gradient_checkpointing")


def _model_checkpointing(model: Any) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if isinstance(getattr(model, name, None), bool):
            return getattr(model, name)
    return False


def port_training_arguments(args: Any, model: Any | None = None) -> TrainingArgumentsPort:
    """The strategy and Trainer arguments with the meaning ``args`` has in the Hugging Face Trainer.

    ``model``: the model you train, when you have it, so that ``ddp_find_unused_parameters=None`` follows Hugging Face
    exactly (``not checkpointing`` for a ``PreTrainedModel``, ``True`` for other models); without it, a Hugging Face
    model is assumed.

    >>> port = port_training_arguments({"gradient_accumulation_steps": 4, "ddp_timeout": 600, "gradient_checkpointing": True})
    >>> port.strategy_kwargs["find_unused_parameters"], port.strategy_kwargs["timeout"], port.trainer_kwargs
    (False, 600, {'accumulate_grad_batches': 4})
    """
    values = _values(args)
    checkpointing = bool(values["activation_checkpointing"] or values["gradient_checkpointing"])
    find_unused = values["ddp_find_unused_parameters"]
    if find_unused is None:
        if model is None or _is_hf_model(model):
            find_unused = not (checkpointing or _model_checkpointing(model))
        else:
            find_unused = True
    steps = values["gradient_accumulation_steps"]
    strategy_kwargs: dict[str, Any] = {
        "process_group_backend": values["ddp_backend"],
        "timeout": values["ddp_timeout"],
        "find_unused_parameters": find_unused,
        "gradient_accumulation_steps": steps,
    }
    for hf_name, name in (
        ("ddp_bucket_cap_mb", "bucket_cap_mb"),
        ("ddp_broadcast_buffers", "broadcast_buffers"),
        ("ddp_static_graph", "static_graph"),
    ):
        if values[hf_name] is not None:
            strategy_kwargs[name] = values[hf_name]
    return TrainingArgumentsPort(strategy_kwargs, {"accumulate_grad_batches": steps})


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
            class_path: lightning_ddp_plus.hf.HFStyleDDPPlusStrategy
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
        checkpointing_conflict, ddp_comm_hook, short_window, verify_replicas_every_n_steps, telemetry, start_method:
            as in ``DDPPlusStrategy`` (its other arguments are not taken here, so that no setting has two names).
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
