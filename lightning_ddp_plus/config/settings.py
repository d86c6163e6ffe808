"""The DDP knobs as one dataclass that validates itself and turns into ``DistributedDataParallel`` kwargs."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.config.checks import require_bool, require_positive_number
from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, closest_name, describe_bad_value

# Arguments the strategy owns or sets itself; passing them through ``**kwargs`` would fight the strategy.
_MANAGED_BY_STRATEGY = {
    "module": "the strategy wraps the LightningModule itself",
    "device_ids": "the strategy derives it from the accelerator and local rank",
    "output_device": "the strategy derives it from the accelerator and local rank",
    "process_group": "the strategy uses the process group it creates",
    "forward_sync_buffers": "use the `broadcast_buffers` argument, which maps onto it",
    "check_reduction": "it is deprecated in torch and has no effect",
}
_EXPLICIT_KNOBS = (
    "find_unused_parameters",
    "bucket_cap_mb",
    "broadcast_buffers",
    "static_graph",
    "gradient_as_bucket_view",
)
_DDP_PARAMETERS = tuple(inspect.signature(DistributedDataParallel.__init__).parameters)[1:]


def require_bool_or_auto(argument: str, value: Any) -> bool | str:
    """``True``, ``False`` or ``"auto"`` (``broadcast_buffers``)."""
    return "auto" if value == "auto" else require_bool(argument, value)


def require_bucket_cap(value: Any) -> float | str | None:
    """``None``, ``"auto"`` or a positive number of MiB.

    >>> require_bucket_cap("Auto")
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentTypeError: `bucket_cap_mb='Auto'` is not valid: expected a positive number of MiB, None (torch's default) or 'auto'. Fix: did you mean 'auto'?
    """
    if value is None or value == "auto":
        return None if value is None else "auto"
    if isinstance(value, str):
        raise ArgumentTypeError(
            describe_bad_value(
                "bucket_cap_mb",
                value,
                "expected a positive number of MiB, None (torch's default) or 'auto'.",
                "did you mean 'auto'?" if value.strip().lower() == "auto" else "write e.g. `bucket_cap_mb=25`.",
            )
        )
    return require_positive_number("bucket_cap_mb", value, "25")


@dataclass
class DDPSettings:
    """The knobs of :class:`torch.nn.parallel.DistributedDataParallel` that ``DDPPlusStrategy`` exposes.

    Args:
        find_unused_parameters: traverse the autograd graph after each forward to find parameters that will get no
            gradient. Needed when some parameters are unused (unless ``static_graph``); costs time otherwise.
        bucket_cap_mb: size in MiB of the gradient buckets all-reduced together. ``None`` (the default): torch's
            default, 25 MiB with a 1 MiB first bucket so that the all-reduce of the last gradients starts early
            (what stock ``DDPStrategy`` gets). A number: every bucket that size (torch drops the small first bucket
            when a size is given). ``"auto"``: start with torch's default, time the candidate sizes in
            ``AUTO_BUCKET_CANDIDATES_MB`` during the first optimizer steps and keep the fastest (see
            ``lightning_ddp_plus.sync.buckets``).
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm running statistics) at the start of every
            forward and when DDP wraps the model. ``False`` keeps every rank's buffers local, at wrap time too.
            ``"auto"``: on when the model has buffers that training changes, off otherwise (see ``resolve_auto``).
        static_graph: promise that the set of used parameters and the graph do not change between iterations.
        gradient_as_bucket_view: let gradients be views into the communication buckets (saves memory).
        extra: any further ``DistributedDataParallel`` keyword arguments, checked against its signature.

    >>> DDPSettings(bucket_cap_mb=50).to_ddp_kwargs()["bucket_cap_mb"]
    50
    >>> "bucket_cap_mb" in DDPSettings().to_ddp_kwargs(), "bucket_cap_mb" in DDPSettings(bucket_cap_mb="auto").to_ddp_kwargs()
    (False, False)
    >>> DDPSettings(broadcast_buffers=False).to_ddp_kwargs()["forward_sync_buffers"]
    False
    >>> DDPSettings(broadcast_buffers="auto").resolve_auto(has_changing_buffers=True).to_ddp_kwargs()["forward_sync_buffers"]
    True
    """

    find_unused_parameters: bool = False
    bucket_cap_mb: float | Literal["auto"] | None = None
    broadcast_buffers: bool | Literal["auto"] = True
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
            require_bool(name, getattr(self, name))
        require_bool_or_auto("broadcast_buffers", self.broadcast_buffers)
        require_bucket_cap(self.bucket_cap_mb)
        for name, value in self.extra.items():
            self._check_extra_argument(name, value)

    @staticmethod
    def _check_extra_argument(name: str, value: Any) -> None:
        if name in _MANAGED_BY_STRATEGY:
            raise ArgumentValueError(
                describe_bad_value(
                    name,
                    value,
                    f"this DistributedDataParallel argument cannot be passed to DDPPlusStrategy: {_MANAGED_BY_STRATEGY[name]}.",
                    "remove it.",
                )
            )
        if name not in _DDP_PARAMETERS:
            suggestion = closest_name(name, _EXPLICIT_KNOBS + _DDP_PARAMETERS)
            raise ArgumentTypeError(
                f"DDPPlusStrategy got an unexpected keyword argument `{name}`: it is neither a strategy argument nor an "
                f"argument of torch's DistributedDataParallel. Fix: "
                + (
                    f"did you mean `{suggestion}`?"
                    if suggestion
                    else "check the spelling against the strategy's documented arguments."
                )
            )

    def resolve_auto(self, has_changing_buffers: bool) -> DDPSettings:
        """``broadcast_buffers="auto"`` decided for a model: on when training changes some of its buffers.

        >>> DDPSettings(broadcast_buffers="auto").resolve_auto(has_changing_buffers=False).broadcast_buffers
        False
        """
        if self.broadcast_buffers != "auto":
            return self
        return dataclasses.replace(self, broadcast_buffers=has_changing_buffers)

    def to_ddp_kwargs(self, forward_sync_buffers: bool = True) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel``.

        ``broadcast_buffers`` goes to torch 2.13's ``forward_sync_buffers`` so that no deprecation warning is printed
        (``forward_sync_buffers=False`` for a torch without it); the one difference in meaning (the new argument always
        syncs buffers at wrap time) is undone when wrapping, which restores rank-local buffers after wrapping when
        ``broadcast_buffers=False``.
        """
        if self.broadcast_buffers == "auto":
            raise RuntimeError(
                "broadcast_buffers='auto' must be resolved for the model (DDPSettings.resolve_auto) first."
            )
        # torch tells an unset size from an explicit 25: only the former keeps the 1 MiB first bucket
        sized = {} if self.bucket_cap_mb in (None, "auto") else {"bucket_cap_mb": self.bucket_cap_mb}
        return {
            "find_unused_parameters": self.find_unused_parameters,
            **sized,
            ("forward_sync_buffers" if forward_sync_buffers else "broadcast_buffers"): self.broadcast_buffers,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            **self.extra,
        }
