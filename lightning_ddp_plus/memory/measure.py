"""What one replica of a model takes: parameters, gradients, optimizer state and the activations of one forward.

Parameters, gradients and DDP's buckets follow from the parameters' shapes and dtypes; optimizer state from the
optimizer's class (a formula for torch's common optimizers, else one step of the class on zero-valued copies of the
parameters); activations are the tensors one training forward saves for its backward, counted once per storage with
``torch.autograd.graph.saved_tensors_hooks`` (parameters, buffers and the batch itself excluded: they exist anyway).
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_ddp_plus.memory.devices import rounded
from lightning_ddp_plus.private_apis.torch_distributed import TorchDispatchMode, tree_leaves
from lightning_ddp_plus.sharding.optimizer import constructor_defaults

#: Per optimizer class: how many tensors of each parameter's size its state keeps, given the group's settings, and
#: how many scalar tensors (Adam's ``step``), read off torch.optim.
_FULL_SIZE_STATE: dict[str, Callable[[dict[str, Any]], int]] = {
    "Adam": lambda group: 3 if group.get("amsgrad") else 2,
    "AdamW": lambda group: 3 if group.get("amsgrad") else 2,
    "SGD": lambda group: 1 if group.get("momentum", 0) else 0,
    "RMSprop": lambda group: 1 + bool(group.get("momentum", 0)) + bool(group.get("centered")),
    "Adagrad": lambda group: 1,
    "Adamax": lambda group: 2,
    "NAdam": lambda group: 2,
    "RAdam": lambda group: 2,
}
_SCALAR_STATE: dict[str, int] = {
    "Adam": 1,
    "AdamW": 1,
    "SGD": 0,
    "RMSprop": 1,
    "Adagrad": 1,
    "Adamax": 1,
    "NAdam": 2,
    "RAdam": 1,
}


#: Classes that create the state of every parameter in their constructor, frozen ones included.
_EAGER_STATE = frozenset({"Adagrad"})


def _scalar_bytes() -> int:
    # torch keeps ``step`` in the default float dtype's scalar type: float32, or float64 when that is the default
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def tensor_bytes(tensor: Tensor, granularity: int = 1) -> int:
    """What ``tensor``'s elements take, rounded as an allocator of ``granularity`` bytes hands them out."""
    return rounded(tensor.numel() * tensor.element_size(), granularity)


@dataclass(frozen=True)
class ParameterFigures:
    """One parameter as the plan sees it."""

    numel: int
    bytes: int
    trainable: bool
    optimizer_state: int  # bytes of its optimizer state once the optimizer has stepped


def optimizer_state_bytes(optimizer: Optimizer | None, granularity: int = 1) -> list[list[int]]:
    """Bytes of each parameter's optimizer state after a step, group by group (0 for frozen parameters), each
    tensor rounded to the device allocator's ``granularity`` (scalars such as ``step`` live on the CPU unless the
    optimizer is capturable or fused: they are counted as they are).

    Exact: a formula for the classes above (checked against real steps in the tests), else one real step of the
    class on zero-valued copies of the parameters (this costs one copy of the trainable parameters, briefly).
    """
    if optimizer is None:
        return []
    name = type(optimizer).__name__
    if name in _FULL_SIZE_STATE and type(optimizer).__module__.startswith("torch.optim"):
        return [
            [
                _FULL_SIZE_STATE[name](group) * tensor_bytes(p, granularity) + _SCALAR_STATE[name] * _scalar_bytes()
                if p.requires_grad or name in _EAGER_STATE
                else 0
                for p in group["params"]
            ]
            for group in optimizer.param_groups
        ]
    return stepped_copy(optimizer, granularity=granularity)[0]


def _group_runs_foreach(group: dict[str, Any], device_default: bool | None) -> bool:
    if "foreach" not in group or group.get("fused"):
        return False
    return bool(device_default) if group["foreach"] is None else bool(group["foreach"])


def runs_foreach(optimizer: Optimizer, device_default: bool | None = None) -> bool:
    """Whether ``optimizer``'s step runs torch's ``foreach`` implementation: each group's own choice, else
    ``device_default``, torch's pick on the job's device (``None``: a per-parameter loop, the CPU's pick). Classes
    without the option (the user's own) are taken as stepping parameter by parameter.

    >>> params = [torch.zeros(2, requires_grad=True)]
    >>> runs_foreach(torch.optim.AdamW(params), True), runs_foreach(torch.optim.AdamW(params, foreach=False), True)
    (True, False)
    """
    groups = optimizer.param_groups
    return bool(groups) and all(_group_runs_foreach(group, device_default) for group in groups)


def stepped_copy(
    optimizer: Optimizer, foreach: bool | None = None, granularity: int = 1
) -> tuple[list[list[int]], int]:
    """One step of ``optimizer``'s class on zero-valued copies of its parameters: the bytes of each parameter's
    state, and the step's temporaries (the peak of what the step allocates, less the state it keeps). Temporaries
    are what the class does: a ``foreach`` step holds intermediates the size of a whole group, a per-parameter loop
    those of one parameter. ``foreach``: the implementation torch would pick on the job's device, for groups that
    leave it unset (``None``: the one it picks here); a group that sets ``foreach`` or ``fused`` keeps its choice."""
    groups = []
    copies = []
    for group in optimizer.param_groups:
        params = [torch.zeros_like(p, requires_grad=p.requires_grad) for p in group["params"]]
        copies.append(params)
        settings = {k: v for k, v in group.items() if k != "params"}
        if foreach is not None and "foreach" in settings:
            settings["foreach"] = _group_runs_foreach(settings, foreach)
        groups.append({**settings, "params": params})
    probe = type(optimizer)(groups, **constructor_defaults(optimizer))
    for params in copies:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    with LiveTensorBytes([copies], granularity=granularity) as live:
        probe.step()
    # read while the state is alive: it stays after the step, so it is not a temporary (freeing it below would
    # take it off ``live`` and count it twice, once as state and once as the step's temporaries)
    temporaries = max(0, live.peak - live.live)
    figures = [
        [
            sum(
                tensor_bytes(v, granularity if v.dim() else 1) for v in probe.state[p].values() if isinstance(v, Tensor)
            )
            if p in probe.state
            else 0
            for p in params
        ]
        for params in copies
    ]
    del probe, copies, groups
    gc.collect()
    return figures, temporaries


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages that operations create inside the mode and that are still alive (``live``), and
    the most at any moment (``peak``). Each storage is counted once, from the operation that first returns it until
    it is freed; storages of ``existing`` (and views of them) are not counted. It counts what the device's allocator
    is asked for, each storage rounded up to ``granularity`` bytes as that allocator hands it out, so it reads the
    same on a CPU as on a GPU (the allocator's caching aside)."""

    def __init__(self, existing: Any = None, granularity: int = 1) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is untyped
        self.granularity = granularity
        self.live = 0
        self.peak = 0
        self._excluded: set[int] = set()
        _storages(existing, self._excluded)
        self._alive: dict[int, weakref.ref[Any]] = {}

    def _freed_storage(self, key: int, size: int, _reference: Any) -> None:
        self._alive.pop(key, None)
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            known = self._alive.get(key)
            if (known is not None and known() is storage) or storage.data_ptr() in self._excluded:
                continue
            size = rounded(storage.nbytes(), self.granularity)
            # the weak reference's callback runs when the storage is freed (torch keeps one Python object per
            # storage while it lives), which is when the allocator gets the bytes back
            self._alive[key] = weakref.ref(storage, functools.partial(self._freed_storage, key, size))
            self.live += size
            self.peak = max(self.peak, self.live)
        return out


def backward_peak_bytes(
    module: Module, training_forward: Callable[[], Any], inputs: Any = None, granularity: int = 1
) -> int:
    """The most bytes one forward and backward hold at once beyond the parameters, buffers and batch: the saved
    activations, the intermediates beside them, and the backward's temporaries (the gradients of the largest
    outputs, e.g. two logits-sized tensors for a language model's loss). Gradients are allocated before it and
    kept out of the count, as DDP's buckets hold them; the module's gradients are as before afterwards."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    before = [p.grad for p in trainable]
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    try:
        existing = [*module.parameters(), *module.buffers(), *(p.grad for p in trainable), inputs]
        with LiveTensorBytes(existing, granularity=granularity) as live:
            loss = training_forward()
            loss.backward()
            del loss
        return int(live.peak)
    finally:
        for p, grad in zip(trainable, before):
            p.grad = grad
        gc.collect()


def parameter_figures(
    module: Module, optimizer: Optimizer | None, granularity: int = 1
) -> list[list[ParameterFigures]]:
    """Every parameter, in the optimizer's groups (the order ZeRO partitions them in); parameters the optimizer does
    not hold form a last group with no state. Without an optimizer: one group, no state."""
    groups: list[list[Tensor]] = [list(group["params"]) for group in optimizer.param_groups] if optimizer else []
    states = optimizer_state_bytes(optimizer, granularity)
    held = {id(p) for group in groups for p in group}
    rest = [p for p in module.parameters() if id(p) not in held]
    figures = [
        [
            ParameterFigures(p.numel(), tensor_bytes(p, granularity), p.requires_grad, state)
            for p, state in zip(group, sizes)
        ]
        for group, sizes in zip(groups, states)
    ]
    if rest:
        figures.append([ParameterFigures(p.numel(), tensor_bytes(p, granularity), p.requires_grad, 0) for p in rest])
    return figures


def _storages(value: Any, found: set[int]) -> None:
    if isinstance(value, Tensor):
        found.add(value.untyped_storage().data_ptr())
    elif isinstance(value, dict):
        for item in value.values():
            _storages(item, found)
    elif isinstance(value, list | tuple):
        for item in value:
            _storages(item, found)


def saved_activation_bytes(
    module: Module, training_forward: Callable[[], Any], inputs: Any = None, granularity: int = 1
) -> int:
    """Bytes of the tensors one training forward saves for backward, each storage once; the forward's result is
    dropped without a backward. ``inputs``: the batch (its tensors are not counted)."""
    excluded: set[int] = set()
    _storages([*module.parameters(), *module.buffers()], excluded)
    _storages(inputs, excluded)
    seen: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in excluded and pointer not in seen:
            seen[pointer] = rounded(storage.nbytes(), granularity)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = training_forward()
    del result
    gc.collect()
    return sum(seen.values())


#: The switch's names, newest first (transformers 5 renamed ``gradient_checkpointing_*`` to ``activation_checkpointing_*``).
_SWITCHES = (
    ("activation_checkpointing_enable", "activation_checkpointing_disable", "is_activation_checkpointing"),
    ("gradient_checkpointing_enable", "gradient_checkpointing_disable", "is_gradient_checkpointing"),
)


def _switch(module: Module) -> tuple[Module, tuple[str, str, str]] | None:
    for names in _SWITCHES:
        for candidate in module.modules():
            if callable(getattr(candidate, names[0], None)) and getattr(
                candidate, "supports_gradient_checkpointing", True
            ):
                return candidate, names
    return None


def checkpointing_on(module: Module) -> bool:
    """Whether the model's own switch says activation checkpointing is on."""
    found = _switch(module)
    return found is not None and bool(getattr(found[0], found[1][2], False))


def checkpointing_toggle(module: Module) -> tuple[Callable[[], None], Callable[[], None]] | None:
    """(enable, disable) activation checkpointing, for models that switch it (Hugging Face ``PreTrainedModel``);
    ``None`` when the model has no such switch. Reentrant checkpointing is used for the count: it saves the inputs
    of each region through ``save_for_backward``, which the hooks see; the non-reentrant form keeps the same tensors
    (within a few per cent of each other)."""
    found = _switch(module)
    if found is None:
        return None
    target, (enable_name, disable_name, _) = found

    def enable() -> None:
        keyword = enable_name.replace("_enable", "_kwargs")  # activation_checkpointing_kwargs / gradient_...
        getattr(target, enable_name)(**{keyword: {"use_reentrant": True}})

    def disable() -> None:
        getattr(target, disable_name)()

    return enable, disable
