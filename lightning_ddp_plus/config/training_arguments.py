"""Hugging Face ``TrainingArguments`` DDP names translated into this package's arguments (pure: no strategy is
built here; ``frontends.hf`` builds one). The table of names is in ``lightning_ddp_plus.frontends.hf``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, closest_name, describe_bad_value

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
    "average_tokens_across_devices": True,
}


#: The strategy arguments the port sets, and the Hugging Face name each comes from (a front end that takes the
#: Hugging Face names does not take these).
PORTED_ARGUMENTS: dict[str, str] = {
    "process_group_backend": "ddp_backend",
    "timeout": "ddp_timeout",
    "find_unused_parameters": "ddp_find_unused_parameters",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "bucket_cap_mb": "ddp_bucket_cap_mb",
    "broadcast_buffers": "ddp_broadcast_buffers",
    "static_graph": "ddp_static_graph",
    "average_items_across_ranks": "average_tokens_across_devices",
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
                raise ArgumentValueError(
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
        raise ArgumentTypeError(
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
        flag = getattr(model, name, None)
        if isinstance(flag, bool):
            return flag
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
        "average_items_across_ranks": values["average_tokens_across_devices"],
    }
    for hf_name, name in (
        ("ddp_bucket_cap_mb", "bucket_cap_mb"),
        ("ddp_broadcast_buffers", "broadcast_buffers"),
        ("ddp_static_graph", "static_graph"),
    ):
        if values[hf_name] is not None:
            strategy_kwargs[name] = values[hf_name]
    return TrainingArgumentsPort(strategy_kwargs, {"accumulate_grad_batches": steps})
