"""``optimizer_sharding``: ZeRO stage 1, each rank keeping the optimizer state of 1/N of the model.

- ``True``: DDP's gradient buckets are reduce-scattered during the backward, each rank steps its chunk of every
  bucket, and the updated parameters are all-gathered (``reduce_scatter``, ``sharded_step``): DDP's bytes, state
  split evenly to the element. Exact: the same arithmetic as the unsharded optimizer on every element.
- ``"all_reduce"``: torch's ``ZeroRedundancyOptimizer`` after DDP's full all-reduce; the updated parameters are then
  broadcast by their owners (1.5x DDP's bytes), and whole parameters are assigned to ranks (uneven on small models).
  The one to pick with a compressing ``ddp_comm_hook`` (fp16, bf16, PowerSGD), which compresses the all-reduce.
- ``"overlap"``: torch's ``ddp_zero_hook.hook_with_zero_step`` runs each rank's share of that step inside the
  backward, as soon as the gradient buckets it needs are all-reduced. torch skips the parameter update of the first
  two optimizer steps (three with ``static_graph``) while it learns DDP's buckets; it refuses gloo; and the step has
  run before anything after the backward can act, so what acts there (gradient clipping, the per-step guard, a
  short window's rescaling) cannot apply. ``refusals`` names each conflict at construction.

Checkpoints are consolidated: a save gathers every rank's share on rank 0 (``consolidate_state_dict``, a collective
Lightning calls on every rank), and the file holds the plain optimizer ``state_dict``, loadable by an unsharded run
and by stock ``DDPStrategy``; a load gives each rank its share, whatever the world size that saved it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar, cast

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, describe_bad_value
from lightning_ddp_plus.sharding.reduce_scatter import GradientShards
from lightning_ddp_plus.sharding.sharded_step import BucketShardedOptimizer

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_ddp_plus.sharding.zero_redundancy import ShardedOptimizer

OptimizerSharding = bool | Literal["all_reduce", "overlap"]
OptimizerType = TypeVar("OptimizerType", bound=Optimizer)
SHARDING_VALUES: tuple[object, ...] = (False, True, "all_reduce", "overlap")

#: torch refuses the overlap hook on these backends ("Gloo backend using Overlapping DDP with ZeRO may meet hangs").
OVERLAP_REFUSED_BACKENDS = ("gloo",)
#: The fix for what ``"overlap"`` refuses.
OVERLAP_FIX = (
    "use `optimizer_sharding=True` (the same memory saving, the step after the backward), or change the settings named."
)
#: Parameter updates torch skips at the start of a run with ``"overlap"`` (while DDP's buckets are not final).
OVERLAP_WARMUP_STEPS = {False: 2, True: 3}  # by static_graph


def check_optimizer_sharding(value: Any) -> OptimizerSharding:
    """Validate ``optimizer_sharding``.

    >>> check_optimizer_sharding("overlap")
    'overlap'
    >>> check_optimizer_sharding("zero1")
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentValueError: `optimizer_sharding='zero1'` is not valid: allowed: False, True, 'all_reduce', 'overlap'. Fix: ...
    """
    if value is True or value is False or value in ("all_reduce", "overlap"):
        return cast(OptimizerSharding, value)
    raise ArgumentValueError(
        describe_bad_value(
            "optimizer_sharding",
            value,
            "allowed: False, True, 'all_reduce', 'overlap'.",
            "use True (ZeRO-1 at DDP's bytes: each rank keeps 1/N of the optimizer state), 'all_reduce' (torch's "
            "ZeroRedundancyOptimizer, for a compressing comm hook), 'overlap' (the step overlaps the backward; "
            "NCCL/HCCL only) or False (plain DDP).",
        )
    )


def refusals(
    mode: OptimizerSharding,
    comm_hook: object | None,
    gradient_accumulation_steps: int | None,
    bucket_cap_mb: object,
    sync_guard: bool,
    uneven_inputs: str,
) -> list[str]:
    """Why ``mode`` cannot run with the other settings (empty: it can); the backend is judged later, once known."""
    if mode is True:
        return reduce_scatter_refusals(comm_hook)
    if mode != "overlap":
        return []
    found = []
    if comm_hook is not None:
        found.append(
            "`ddp_comm_hook` is set, and the overlap is itself DDP's communication hook (it wraps the plain "
            "all-reduce): remove `ddp_comm_hook`, or use `optimizer_sharding=True`."
        )
    if gradient_accumulation_steps not in (None, 1):
        found.append(
            f"`gradient_accumulation_steps={gradient_accumulation_steps}`: a short last window's gradients are "
            "rescaled after its backward, when the overlapped step has already run; use `optimizer_sharding=True`."
        )
    if bucket_cap_mb == "auto":
        found.append(
            "`bucket_cap_mb='auto'` rebuilds DDP's buckets while timing them, and the overlap assigns each bucket to "
            "a rank once; set a size (or None)."
        )
    if sync_guard:
        found.append(
            "`sync_guard=True` acts after the backward, and with the overlap the optimizer step of every bucket "
            "already all-reduced has run by then, so the guard could no longer keep a step from using gradients that "
            "were not all-reduced; use `optimizer_sharding=True`, or set `sync_guard=False` knowingly."
        )
    if uneven_inputs == "join":
        found.append("`uneven_inputs='join'` rescales the gradients after the backward; use `optimizer_sharding=True`.")
    return found


def reduce_scatter_refusals(comm_hook: object | None) -> list[str]:
    """``True`` is itself DDP's communication hook (the reduce-scatter)."""
    if comm_hook is None:
        return []
    reason = (
        "`ddp_comm_hook` is set, and `optimizer_sharding=True` is itself DDP's communication hook (a reduce-scatter "
        "of each bucket): remove `ddp_comm_hook`, or use `optimizer_sharding='all_reduce'` (torch's "
        "ZeroRedundancyOptimizer after the hook's all-reduce: 1.5x the bytes)."
    )
    return [reason]


def check_overlap_backend(mode: OptimizerSharding, backend: str) -> None:
    """Refuse ``"overlap"`` before launch on a backend torch refuses it on."""
    if mode == "overlap" and backend in OVERLAP_REFUSED_BACKENDS:
        raise ArgumentValueError(
            describe_bad_value(
                "optimizer_sharding",
                mode,
                f"torch's overlap hook refuses the {backend} backend (\"Gloo backend using Overlapping DDP with ZeRO "
                'may meet hangs", pytorch#62300); it runs on NCCL and HCCL.',
                "use `optimizer_sharding=True` on gloo (the same memory saving, the step after the backward).",
            )
        )


def refuse_clipping(mode: OptimizerSharding, clipping: str, clipper: str) -> None:
    """Gradient clipping acts after the backward, where ``"overlap"`` has already stepped with the gradients."""
    if mode == "overlap":
        raise ArgumentValueError(
            f"{clipping} with `optimizer_sharding='overlap'`: the overlapped optimizer step runs inside the backward, "
            f"before {clipper} clips, so the gradients it used can no longer be clipped. Fix: use "
            "`optimizer_sharding=True`."
        )


def is_zero_redundancy(optimizer: object) -> TypeGuard[ZeroRedundancyOptimizer]:
    """``optimizer`` is torch's ``ZeroRedundancyOptimizer`` (none can be before ``torch.distributed.optim`` is
    imported, which this does not do: see ``zero_redundancy.py``)."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def refuse_sharded_twice(optimizer: Optimizer) -> None:
    """The user's optimizer is already torch's sharded one: the strategy would shard it again."""
    if is_zero_redundancy(optimizer):
        raise ArgumentTypeError(
            describe_bad_value(
                "optimizer_sharding",
                True,
                "this optimizer is already a ZeroRedundancyOptimizer, and the strategy would shard it again.",
                "return the plain optimizer (e.g. `torch.optim.AdamW(...)`) and let `optimizer_sharding` wrap it.",
            )
        )


def shard(optimizer: Optimizer, overlap: bool = False) -> ShardedOptimizer:
    """Wrap ``optimizer`` in a ``ShardedOptimizer`` of its class, hyperparameters and parameter groups (the process
    group must exist). State it already has (it stepped before) is carried over, each rank keeping its share."""
    from lightning_ddp_plus.sharding.zero_redundancy import ShardedOptimizer

    if isinstance(optimizer, ShardedOptimizer):
        return optimizer
    refuse_sharded_twice(optimizer)
    state = optimizer.state_dict() if optimizer.state else None
    if overlap and len(optimizer.param_groups) != 1:
        raise ArgumentValueError(
            describe_bad_value(
                "optimizer_sharding",
                "overlap",
                f"the overlap steps torch's functional optimizers, which take one parameter group, and this "
                f"{type(optimizer).__name__} has {len(optimizer.param_groups)}.",
                "use `optimizer_sharding=True` (any number of groups), or one group.",
            )
        )
    try:
        sharded = ShardedOptimizer(
            optimizer.param_groups,
            optimizer_class=type(optimizer),
            overlap_with_ddp=overlap,
            **constructor_defaults(optimizer),
        )
    except (ValueError, TypeError) as error:
        raise type(error)(
            f"optimizer_sharding could not wrap {type(optimizer).__name__} in torch's ZeroRedundancyOptimizer: "
            f"{error}. It needs every parameter of one dense dtype and device type, and an optimizer class that "
            "takes `cls(param_groups, **hyperparameters)`. Fix: make the parameters one dtype (e.g. "
            "`model.float()`), or set `optimizer_sharding=False`."
        ) from error
    sharded.replaced = optimizer
    if state is not None:
        sharded.load_state_dict(state)
    return sharded


#: torch's optimizers whose update of each element reads only that element's gradient and state, and numbers shared
#: by the whole tensor that do not depend on its values (the step count): stepped on flat pieces of a tensor, they
#: compute what they compute on the whole. Adafactor (factored moments: a row and a column statistic per matrix),
#: Muon (an orthogonalized matrix), LBFGS (a line search over every parameter) and SparseAdam (sparse gradients) do not.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


def elementwise_optimizer(cls: type[OptimizerType]) -> type[OptimizerType]:
    """Declare an optimizer class element-wise, so that ``optimizer_sharding=True`` steps it on flat pieces of each
    tensor: its update of each element must read only that element's gradient and state (no norm, statistic or
    matrix product over a tensor: LAMB's and LARS's trust ratios, factored or preconditioned moments are not).

    >>> @elementwise_optimizer
    ... class SignSGD(torch.optim.SGD): ...
    >>> is_elementwise(SignSGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    True
    """
    cls.elementwise_update = True  # type: ignore[attr-defined]  # read by ``is_elementwise``
    return cls


def is_elementwise(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` steps flat pieces of a tensor as it steps the whole: declared so
    (``elementwise_optimizer``), or its ``step`` is one of ``ELEMENTWISE_OPTIMIZERS``' (a subclass that changes only
    its constructor or defaults is)."""
    cls = type(optimizer)
    if getattr(cls, "elementwise_update", False):
        return True
    return any(isinstance(optimizer, known) and cls.step is known.step for known in ELEMENTWISE_OPTIMIZERS)


def refuse_non_elementwise(optimizer: Optimizer) -> None:
    """``optimizer_sharding=True`` splits tensors into pieces: an optimizer that looks at a whole tensor would
    silently compute something else."""
    if is_elementwise(optimizer):
        return
    name = type(optimizer).__name__
    raise ArgumentValueError(
        describe_bad_value(
            "optimizer_sharding",
            True,
            f"it steps each rank's flat pieces of DDP's gradient buckets, and {name} is not known to update each "
            "element from that element alone (Adafactor's factored moments, Muon's orthogonalized matrices, LAMB's "
            "and LARS's per-tensor trust ratios, Shampoo's preconditioners need whole tensors): on pieces it would "
            "silently compute something else. Element-wise: "
            + ", ".join(k.__name__ for k in ELEMENTWISE_OPTIMIZERS)
            + ".",
            "use `optimizer_sharding='all_reduce'` (whole tensors per rank: exact for any optimizer), or, when "
            f"{name} is element-wise, declare it with `@lightning_ddp_plus.elementwise_optimizer`.",
        )
    )


def bucket_sharded(optimizer: Optimizer, shards: GradientShards) -> BucketShardedOptimizer:
    """``optimizer`` stepped on this rank's chunks of the gradient buckets (``optimizer_sharding=True``)."""
    if isinstance(optimizer, BucketShardedOptimizer):
        return optimizer
    refuse_sharded_twice(optimizer)
    refuse_non_elementwise(optimizer)
    defaults = constructor_defaults(optimizer)
    return BucketShardedOptimizer(optimizer, shards, lambda groups: type(optimizer)(groups, **defaults))


def constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes: some keep more (torch 2.13's AdamW records
    ``decoupled_weight_decay``, which only ``Adam`` accepts); the parameter groups still carry every key.

    >>> sorted(constructor_defaults(torch.optim.AdamW([torch.zeros(1, requires_grad=True)])))[:3]
    ['amsgrad', 'betas', 'capturable']
    """
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {name: value for name, value in optimizer.defaults.items() if name in parameters}


def register_overlap(ddp: DistributedDataParallel, optimizer: ShardedOptimizer) -> None:
    """Register torch's hook that runs ``optimizer``'s step inside the backward, around the plain all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp.register_comm_hook(ddp.process_group, hook_with_zero_step(allreduce_hook, ddp, optimizer))


def state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the optimizer state this rank holds (its local share for a sharded optimizer)."""
    if isinstance(optimizer, BucketShardedOptimizer):
        return optimizer.state_bytes()
    local = optimizer.optim if is_zero_redundancy(optimizer) else optimizer
    return sum(
        value.numel() * value.element_size()
        for per_parameter in local.state.values()
        if per_parameter
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    )


def shard_optimizers(
    optimizers: list[Optimizer],
    mode: OptimizerSharding,
    ddp: DistributedDataParallel | None,
    static_graph: bool,
    info: Callable[[str], None],
    shards: GradientShards | None = None,
) -> list[Optimizer]:
    """With ``optimizer_sharding``: each optimizer sharded (ZeRO-1): ``True`` steps the chunks ``shards`` (the
    reduce-scatter hook's state) leaves it; the others wrap ``ZeroRedundancyOptimizer``, with the overlap hook
    registered on ``ddp`` for ``"overlap"``. Without: ``optimizers`` itself."""
    if not mode:
        return optimizers
    if mode is True:
        assert shards is not None, "optimizer_sharding=True needs the reduce-scatter hook's state"
        return [bucket_sharded(optimizer, shards) for optimizer in optimizers]
    overlap = mode == "overlap"
    if overlap and len(optimizers) != 1:
        raise ValueError(
            f"`optimizer_sharding='overlap'` runs one optimizer inside DDP's backward, and {len(optimizers)} were "
            "given. Fix: use `optimizer_sharding=True` with several optimizers."
        )
    sharded = [shard(optimizer, overlap=overlap) for optimizer in optimizers]
    if overlap:
        if ddp is None:  # the step would then run nowhere: ShardedOptimizer.step only runs the closure
            raise RuntimeError(
                "optimizer_sharding='overlap' needs the module wrapped before its optimizer: set up the module "
                "first (`fabric.setup(model, optimizer)`, or `fabric.setup_module` before `setup_optimizers`)."
            )
        register_overlap(ddp, sharded[0])
        info(
            "DDPPlusStrategy: optimizer_sharding='overlap': torch applies no parameter update in the first "
            f"{OVERLAP_WARMUP_STEPS[static_graph]} optimizer steps, while it learns DDP's gradient buckets."
        )
    return list(sharded)
