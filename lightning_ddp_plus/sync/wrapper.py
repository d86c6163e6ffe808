"""Building ``DistributedDataParallel`` and changing its reducer in place: the one module that touches DDP internals.

Rebuilding the reducer in place (rather than wrapping the model again) keeps the wrapper object, so every reference
that Lightning, Fabric or a callback holds (``trainer.model``, a ``_FabricModule``) stays valid. torch itself rebuilds
the reducer this way when it unpickles a DDP module (``DistributedDataParallel.__setstate__``).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel.distributed import DistributedDataParallel, _DDPSink, _find_tensors

from lightning_ddp_plus.config.settings import DDPSettings

#: torch 2.13 added ``forward_sync_buffers`` and deprecated ``broadcast_buffers``; older releases only know the latter.
HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


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


def rebuild_reducer(ddp: DistributedDataParallel, find_unused_parameters: bool, static_graph: bool) -> None:
    """Give ``ddp`` a new reducer with these settings when no backward is pending (before the first one, or between
    optimizer steps); no collective is issued.

    The old reducer's autograd hooks are removed, communication hooks registered on the wrapper are registered again,
    and the buckets will be rebuilt from the first backward's order, as for a new wrapper.
    """
    ddp.reducer._remove_autograd_hooks()
    ddp.find_unused_parameters = find_unused_parameters
    ddp.static_graph = False
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, static_graph)
    if static_graph:
        ddp._set_static_graph()
    ddp._has_rebuilt_buckets = False
    hooks, ddp._comm_hooks = list(ddp._comm_hooks), []
    for hook, state in hooks:
        ddp.register_comm_hook(state, hook)


def set_bucket_cap(ddp: DistributedDataParallel, cap_mb: float | None) -> None:
    """Give ``ddp`` a new reducer whose buckets hold ``cap_mb`` MiB (``None``: torch's default, with its 1 MiB first
    bucket), between optimizer steps: no backward may be pending. The buckets are rebuilt from the next backward's
    order, as for a new wrapper."""
    if hasattr(ddp, "_bucket_config"):  # torch >= 2.13 keeps the sizes in one config object
        from torch.nn.parallel.distributed import _BucketCapacityConfig

        config = _BucketCapacityConfig.create(cap_mb, None, ddp._use_python_reducer)  # type: ignore[arg-type]
        ddp._bucket_config = config
        ddp.bucket_bytes_cap = config.bucket_bytes_cap
        ddp.bucket_bytes_cap_default = config.first_bucket_bytes_cap < config.bucket_bytes_cap
    else:
        ddp.bucket_bytes_cap = int((25 if cap_mb is None else cap_mb) * 1024 * 1024)
        ddp.bucket_bytes_cap_default = cap_mb is None
    rebuild_reducer(ddp, ddp.find_unused_parameters, ddp.static_graph)


def replay_forward(ddp: DistributedDataParallel, loss: Tensor, forward_synced: bool, post_forward: bool) -> Tensor:
    """Do for a rebuilt reducer what DDP's forward did for the old one, and return the loss to run backward on.

    Args:
        forward_synced: the forward ran with gradient sync on (not under ``no_sync``).
        post_forward: DDP's forward had finished before this backward (automatic optimization, Fabric); ``False``
            when the backward runs inside it (Lightning's manual optimization, whose ``pre_backward`` prepares the
            reducer itself).
    """
    if not forward_synced:
        return loss
    assert ddp.logger is not None
    ddp.logger.set_runtime_stats_and_log()
    ddp.reducer.prepare_for_forward()
    if not post_forward:
        return loss
    dynamic_unused = ddp.find_unused_parameters and not ddp.static_graph
    ddp.reducer.prepare_for_backward(list(_find_tensors(loss)) if dynamic_unused else [])
    if dynamic_unused or ddp.static_graph:
        # What DDP's forward does with its output: a static graph's first backward queues the delayed all-reduce.
        loss = _DDPSink.apply(weakref.ref(ddp), loss)[0]
    return loss
