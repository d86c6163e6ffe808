"""torch's private names outside ``DistributedDataParallel`` that the package uses.

| what | torch names used | checked on | probe, and what happens without it |
|---|---|---|---|
| the job's store (``default_store``) | ``distributed_c10d._get_default_store`` | 2.13.0, 2.14.1, 2.15.0 | ``None`` where it raises: the step guard agrees by all-reduce, no host is published |
| the default group, held until exit (``default_group``) | ``distributed_c10d._get_default_group`` | the same | none |
| a group's timeout after its creation (``set_group_timeout``) | ``distributed_c10d._set_pg_timeout`` (gloo and NCCL) | the same | ``CAN_SET_GROUP_TIMEOUT``: without it ``setup_timeout`` is refused before launch |
| the moment a backward's graph is computed (``queue_backward_callback``) | ``Variable._execution_engine.queue_callback``, which DDP's reducer itself uses | the same | none |
| the leaves of nested outputs (``tree_leaves``) | ``torch.utils._pytree.tree_leaves`` (``torch.utils.pytree`` where public) | the same | the public module first |
| counting allocations (``TorchDispatchMode``) | ``torch.utils._python_dispatch.TorchDispatchMode`` | the same | none: the memory plan needs it |
| the devices with foreach kernels (``foreach_devices``) | ``torch.utils._foreach_utils._get_foreach_kernels_supported_devices`` | the same | ``{"cuda"}`` where it is missing |
| ZeRO's overlap flag and a scheduler's step check (``zero_overlaps_with_ddp``, ``mark_stepped``) | ``ZeroRedundancyOptimizer._overlap_with_ddp``, ``Optimizer._opt_called`` | the same | ``getattr`` with the default torch sets |
| whether a tensor was changed in place (``tensor_version``) | ``Tensor._version`` | the same | none |
| a gloo group that connects a pair of ranks at its first exchange (``lazy_gloo_group``) | the variable ``TORCH_GLOO_LAZY_INIT``, which gloo reads when a group is created | 2.13.0 | a torch that does not read it connects every pair at the creation, as any group (N - 1 connections per rank); a value the user set is kept |
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils._python_dispatch import TorchDispatchMode

try:  # public from torch 2.? on; the private module is the same code
    from torch.utils.pytree import tree_leaves  # type: ignore[import-not-found,unused-ignore]  # older torch lacks it
except ImportError:
    from torch.utils._pytree import tree_leaves

__all__ = [
    "CAN_SET_GROUP_TIMEOUT",
    "GROUP_TIMEOUT_BACKENDS",
    "TorchDispatchMode",
    "default_group",
    "default_store",
    "foreach_devices",
    "lazy_gloo_group",
    "mark_stepped",
    "queue_backward_callback",
    "set_group_timeout",
    "tensor_version",
    "tree_leaves",
    "zero_overlaps_with_ddp",
]


def default_store() -> Any:
    """The job's store (the default process group's), or ``None`` where this torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def default_group() -> Any:
    """The default process group object."""
    return dist.distributed_c10d._get_default_group()


#: Whether this torch can change a process group's timeout once the group exists (``setup_timeout`` needs it).
CAN_SET_GROUP_TIMEOUT = hasattr(dist.distributed_c10d, "_set_pg_timeout")
#: The backends whose groups ``_set_pg_timeout`` changes (it warns and does nothing on the others).
GROUP_TIMEOUT_BACKENDS = ("gloo", "nccl")


def set_group_timeout(timeout: timedelta, group: Any = None) -> None:
    """The timeout of the collectives ``group`` (default: the default group) runs from now on."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward's graph is computed (called from an autograd hook, during the
    backward). Callbacks run in the order queued: one queued at the start of a backward runs before the reducer's
    own, which waits for the gradient all-reduce."""
    Variable._execution_engine.queue_callback(callback)


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter: torch adds one for every in-place change (autograd's own check)."""
    return int(tensor._version)


def foreach_devices() -> frozenset[str]:
    """The device types on which torch runs an optimizer's ``foreach`` implementation when ``foreach`` is unset."""
    from torch.utils import _foreach_utils

    published = getattr(_foreach_utils, "_get_foreach_kernels_supported_devices", None)
    return frozenset(published()) if callable(published) else frozenset({"cuda"})


def zero_overlaps_with_ddp(optimizer: Any) -> bool:
    """Whether a ``ZeroRedundancyOptimizer`` steps inside DDP's backward (``overlap_with_ddp=True``)."""
    return bool(getattr(optimizer, "_overlap_with_ddp", False))


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """What ``Optimizer.step`` records, so that a learning-rate scheduler on ``optimizer`` does not warn that it
    stepped before the optimizer did."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # set by torch's step wrapper, not declared


#: gloo's switch for groups that connect a pair of ranks at its first exchange (read when a group is created).
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def lazy_gloo_group(timeout: timedelta) -> Any:
    """A gloo group of every rank (a collective: every rank calls it at the same point) that connects a pair of
    ranks at their first exchange, not at its creation: a group used rarely costs no full mesh at the start. A value
    of ``TORCH_GLOO_LAZY_INIT`` the user set is kept (and then applies to every gloo group, as torch reads it)."""
    if GLOO_LAZY_INIT in os.environ:
        return dist.new_group(backend="gloo", timeout=timeout)
    os.environ[GLOO_LAZY_INIT] = "1"
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    finally:
        del os.environ[GLOO_LAZY_INIT]
