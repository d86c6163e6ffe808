"""Building ``DistributedDataParallel`` from the settings, on the model's own device stream, with the buffers the
settings promise. Changing a built wrapper's reducer is ``private_apis.torch_ddp``'s.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.nn import Module
from torch.nn.parallel.distributed import DistributedDataParallel

from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.private_apis.torch_ddp import HAS_FORWARD_SYNC_BUFFERS

__all__ = ["HAS_FORWARD_SYNC_BUFFERS", "ddp_kwargs", "wrap_module", "wrapping_stream"]


def ddp_kwargs(settings: DDPSettings) -> dict[str, Any]:
    """The settings as keyword arguments for the installed torch's ``DistributedDataParallel``."""
    return settings.to_ddp_kwargs(forward_sync_buffers=HAS_FORWARD_SYNC_BUFFERS)


def wrapping_stream(device: torch.device, device_ids: list[int] | None) -> AbstractContextManager[Any]:
    """Where DDP is built: a side stream of the model's own device (torch's CUDA semantics notes: DDP's constructor
    broadcasts on it), for any accelerator whose torch module has streams (``torch.cuda``, ``torch.xpu``, ...); no
    stream on CPU. The device is named, not taken as current, so that a process whose current device is another
    one still builds on its own.

    >>> wrapping_stream(torch.device("cpu"), None)  # doctest: +ELLIPSIS
    <contextlib.nullcontext object at ...>
    """
    backend: Any = getattr(torch, device.type, None)
    if device_ids is None or not (hasattr(backend, "Stream") and hasattr(backend, "stream")):
        return nullcontext()
    stream: AbstractContextManager[Any] = backend.stream(backend.Stream(device=device))
    return stream


def wrap_module(module: Module, settings: DDPSettings, device_ids: list[int] | None) -> DistributedDataParallel:
    """Wrap ``module``; parameters (and buffers, when they are broadcast) start from rank 0's values."""
    with _local_buffers_kept(module, keep=not settings.broadcast_buffers and HAS_FORWARD_SYNC_BUFFERS):
        return DistributedDataParallel(module=module, device_ids=device_ids, **ddp_kwargs(settings))


@contextmanager
def _local_buffers_kept(module: Module, keep: bool) -> Generator[Any, None, None]:
    # `forward_sync_buffers=False` still broadcasts buffers when wrapping; the old `broadcast_buffers=False` kept each
    # rank's own values, which is what the strategy's `broadcast_buffers=False` promises, so put them back.
    local = [buffer.detach().clone() for buffer in module.buffers()] if keep else None
    yield None
    if local is not None:
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), local):
                buffer.copy_(value)
