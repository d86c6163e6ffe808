"""Every call the package makes into torch's ``DistributedDataParallel`` and its reducer beyond their public API.

The rest of the package calls these functions, never the underscored names themselves (``tests/test_layout.py``
checks that), so what depends on a torch release is listed here, and a torch that changes one of them breaks one
function, whose probe says so. torch's private names outside DDP are ``torch_distributed``'s.

| what | torch names used | probe, and what happens without it |
|---|---|---|
| rebuilding the reducer in place (``rebuild_reducer``, ``withdraw_comm_hooks``) | ``reducer._remove_autograd_hooks``, ``_build_params_for_reducer``, ``_build_debug_param_to_name_mapping``, ``_ddp_init_helper``, ``_set_static_graph``, ``_has_rebuilt_buckets``, ``_comm_hooks`` | none; used only by ``"resolve"``, ``bucket_cap_mb="auto"``, rule R6's resolution, and a hook the user registers on the wrapper (it takes the flag carrier's place) |
| bucket sizes (``set_bucket_cap``) | ``_bucket_config`` / ``_BucketCapacityConfig``, else ``bucket_bytes_cap`` | ``hasattr(ddp, "_bucket_config")`` picks the form |
| the forward's bookkeeping for a rebuilt reducer (``replay_forward``) | ``logger.set_runtime_stats_and_log``, ``reducer.prepare_for_forward/backward``, ``_DDPSink``, ``_find_tensors`` | none |
| did the reducer finish, and finishing it (``reducer_unfinished``, ``zeroed_buckets``, ``run_bucket_hook``) | ``reducer._check_reducer_finalized``, ``_get_zeros_like_grad_buckets``, ``_run_comm_hook`` | ``can_complete_reductions``: where it is False the per-step guard is off, with a warning that says so |
| a static graph's first delayed all-reduce (``flush_static_graph``) | ``reducer._delay_all_reduce`` | none |
| runtime timings (``logging_data``, ``record_runtime_stats``, ``set_timing_sample_rate``) | ``_get_ddp_logging_data``, ``logger.set_runtime_stats_and_log``, ``_set_ddp_runtime_logging_sample_rate`` | none |
| ``broadcast_buffers`` without a deprecation warning | ``forward_sync_buffers`` (public in torch 2.13) | ``HAS_FORWARD_SYNC_BUFFERS``: older releases get ``broadcast_buffers`` |

Tested on torch 2.13.0 (CI), 2.14.1 and 2.15.0 (``docs/install.md`` lists the runs); the package's range is
``torch>=2.4``, and on the releases in between these names were not checked.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.nn.parallel.distributed import DistributedDataParallel, _DDPSink, _find_tensors

#: torch 2.13 added ``forward_sync_buffers`` and deprecated ``broadcast_buffers``; older releases only know the latter.
HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def rebuild_reducer(ddp: DistributedDataParallel, find_unused_parameters: bool, static_graph: bool) -> None:
    """Give ``ddp`` a new reducer with these settings when no backward is pending (before the first one, or between
    optimizer steps); no collective is issued.

    The old reducer's autograd hooks are removed, communication hooks registered on the wrapper are registered again,
    and the buckets will be rebuilt from the first backward's order, as for a new wrapper. Rebuilding in place (rather
    than wrapping the model again) keeps the wrapper object, so every reference that Lightning, Fabric or a callback
    holds stays valid; torch rebuilds the reducer this way when it unpickles a DDP module (``__setstate__``).
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
    for hook, state in hooks:  # the class's method: the wrapper's own may stand for a user's later hook
        DistributedDataParallel.register_comm_hook(ddp, state, hook)


def withdraw_comm_hooks(ddp: DistributedDataParallel) -> None:
    """A new reducer for ``ddp`` without the communication hooks registered on it (torch takes one per reducer and
    has no call that removes it), between optimizer steps."""
    ddp._comm_hooks = []
    rebuild_reducer(ddp, ddp.find_unused_parameters, ddp.static_graph)


def set_bucket_cap(ddp: DistributedDataParallel, cap_mb: float | None) -> None:
    """Give ``ddp`` a new reducer whose buckets hold ``cap_mb`` MiB (``None``: torch's default, with its 1 MiB first
    bucket), between optimizer steps: no backward may be pending. The buckets are rebuilt from the next backward's
    order, as for a new wrapper."""
    if hasattr(ddp, "_bucket_config"):  # torch >= 2.13 keeps the sizes in one config object
        from torch.nn.parallel.distributed import _BucketCapacityConfig

        config = _BucketCapacityConfig.create(cap_mb, None, ddp._use_python_reducer)  # type: ignore[arg-type]  # torch annotates cap_mb as float only
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
    record_runtime_stats(ddp)
    ddp.reducer.prepare_for_forward()
    if not post_forward:
        return loss
    dynamic_unused = ddp.find_unused_parameters and not ddp.static_graph
    ddp.reducer.prepare_for_backward(list(_find_tensors(loss)) if dynamic_unused else [])
    if dynamic_unused or ddp.static_graph:
        # What DDP's forward does with its output: a static graph's first backward queues the delayed all-reduce.
        loss = _DDPSink.apply(weakref.ref(ddp), loss)[0]
    return loss


def flush_static_graph(ddp: DistributedDataParallel) -> None:
    """Queue a static graph's first delayed all-reduce, which DDP's forward queues when the loss passes through its
    output (not so in Lightning's manual optimization, whose backward runs inside the forward)."""
    ddp.reducer._delay_all_reduce()  # type: ignore[attr-defined]  # torch's stubs omit it


def can_complete_reductions(ddp: DistributedDataParallel) -> bool:
    """Whether this torch lets the guard ask a reducer if it finished, and complete one."""
    reducer = getattr(ddp, "reducer", None)
    return all(
        callable(getattr(reducer, name, None))
        for name in ("_check_reducer_finalized", "_get_zeros_like_grad_buckets", "_run_comm_hook")
    )


def reducer_unfinished(ddp: DistributedDataParallel) -> str | None:
    """Local and cheap: ``None`` when this rank's reducer launched every bucket and finalized the backward, else the
    reducer's message (it names the parameters that got no gradient)."""
    try:
        ddp.reducer._check_reducer_finalized()
    except RuntimeError as error:
        return str(error)
    return None


def reducer_parameters(ddp: DistributedDataParallel) -> list[Parameter]:
    """The parameters the reducer indexes (its messages name them by index)."""
    parameters, _ = ddp._build_params_for_reducer()
    return list(parameters)


def zeroed_buckets(ddp: DistributedDataParallel) -> list[dist.GradBucket]:
    """Every gradient bucket, in launch order, with a zeroed buffer."""
    return list(ddp.reducer._get_zeros_like_grad_buckets())


def has_comm_hook(ddp: DistributedDataParallel) -> bool:
    """Whether a communication hook is registered (without one the reducer divides by the world size itself)."""
    return bool(ddp._comm_hooks)


def run_bucket_hook(ddp: DistributedDataParallel, bucket: dist.GradBucket) -> Any:
    """All-reduce ``bucket`` through the reducer's own path (its hook, or the builtin all-reduce); a future."""
    return ddp.reducer._run_comm_hook(bucket)


def logging_data(ddp: DistributedDataParallel) -> dict[str, Any]:
    """torch's DDP logging data: bucket sizes, the iteration, and the timings of the last sampled one."""
    return dict(ddp._get_ddp_logging_data())


def record_runtime_stats(ddp: DistributedDataParallel) -> None:
    """Make the last iteration's timings readable now rather than at the next forward."""
    assert ddp.logger is not None
    ddp.logger.set_runtime_stats_and_log()


def set_timing_sample_rate(ddp: DistributedDataParallel, rate: int) -> None:
    """torch times the first 10 synced iterations, then every ``rate``-th."""
    ddp._set_ddp_runtime_logging_sample_rate(rate)
