"""``optimizer_sharding=True``: each rank steps its chunk of every gradient bucket, then the buckets' parameters are
all-gathered, so every replica holds the same parameters after every step (ZeRO-1 at DDP's bytes).

``BucketShardedOptimizer`` wraps the user's optimizer. It keeps the optimizer's class, hyperparameters and parameter
groups (the same dicts: a learning-rate scheduler built on the original keeps working), and builds an inner optimizer
of that class over this rank's pieces only (``bucket_shards``), views of the parameters that it updates in place: the
optimizer state is 1/N of the model's, padding apart, and no copy of the pieces is kept. The hook
(``reduce_scatter``) leaves each rank's chunk of the averaged gradient in the parameters' ``.grad``.

DDP may rebuild its buckets (after the first step, and with ``bucket_cap_mb="auto"``); the pieces then move, and the
state moves with them: the first step on a new layout gathers the state and slices it again, once per layout.

Checkpoints hold the plain optimizer ``state_dict`` (gathered on rank 0 by ``consolidate_state_dict``, a collective
that Lightning and Fabric call on every rank at a save): a file loads into an unsharded run, stock ``DDPStrategy``, or
any world size, and a plain file loads here.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddp_plus.private_apis.torch_distributed import mark_stepped
from lightning_ddp_plus.sharding.bucket_shards import BucketLayout, Piece, flat_in_memory_order, pieces_of, shard_size
from lightning_ddp_plus.sharding.exchange import finish_all_gather, post_all_gather
from lightning_ddp_plus.sharding.reduce_scatter import GradientShards

#: Buckets whose all-gather is in flight at once: the next bucket's transfers start while one arrives, and the
#: gathered copies take two buckets' bytes, not the model's (all at once, a 2-rank step peaked at 3.5x the parameters'
#: bytes above a plain DDP step).
GATHER_WINDOW = 2
#: One rank's optimizer state for the full state: parameter -> (per-element state by start, the rest of its state).
StateParts = dict[int, tuple[list[tuple[int, dict[str, Tensor]]], dict[str, Any]]]


class BucketShardedOptimizer(Optimizer):
    """The user's ``optimizer``, stepped on this rank's chunk of every gradient bucket; see the module's docstring.

    Args:
        optimizer: the optimizer it replaces (its class is built again over this rank's pieces).
        shards: the reduce-scatter hook's state: the bucket layout, the group, the bytes sent.
    """

    def __init__(self, optimizer: Optimizer, shards: GradientShards, constructor: Callable[..., Optimizer]) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # the same dicts: a scheduler's changes reach the step
        self.replaced, self.shards, self.constructor = optimizer, shards, constructor
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.inner: Optimizer | None = None
        self.layout: BucketLayout | None = None
        self.pieces: list[Piece] = []  # this rank's pieces of this optimizer's parameters (``Piece.parameter`` local)
        self.tensors: list[Tensor] = []  # the inner optimizer's parameter for each piece: a view of the parameter
        self.inner_groups: list[int] = []  # the parameter group of each inner group
        self.dtypes: list[torch.dtype] = []  # each parameter's dtype when the pieces were built
        self.pending = optimizer.state_dict() if optimizer.state else None  # a full state to slice at the next layout
        self.gathered: dict[str, Any] | None = None
        self.regrouped = False  # a group was added: the pieces are built again at the next step, the state kept

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group added after setup (Lightning's ``BaseFinetuning`` unfreezing layers) is stepped from the next step
        on; the state of the others is kept."""
        super().add_param_group(param_group)
        if "replaced" in vars(self):  # not while ``Optimizer.__init__`` adds the groups it was given
            self.parameters = [p for group in self.param_groups for p in group["params"]]
            self.regrouped = True

    # ------------------------------------------------------------------ the step

    @override
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        mark_stepped(self.replaced)  # a scheduler on it checks this
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():  # gloo's all-gather writes views of its output
            self._refuse_another_dtype()
            self.follow_layout()
            self._step_pieces()
            self.shards.consumed()
            self._all_gather()
        return loss

    def _step_pieces(self) -> None:
        """The inner optimizer's step on this rank's pieces (views of the parameters), with the gradients' chunks and
        the groups' current hyperparameters."""

        if self.inner is None:
            return
        for tensor, piece in zip(self.tensors, self.pieces):
            parameter = self.parameters[piece.parameter]
            current = self._slice(parameter.detach(), piece)
            if current.data_ptr() != tensor.data_ptr():  # the parameter's storage was replaced (``param.data = ...``)
                # the same tensor object: the inner optimizer's state stays keyed to it
                tensor.set_(current.untyped_storage(), current.storage_offset(), current.size(), current.stride())
            tensor.grad = None if parameter.grad is None else self._slice(parameter.grad, piece)
        for inner_group, group in zip(self.inner.param_groups, self.inner_groups):
            inner_group.update({k: v for k, v in self.param_groups[group].items() if k != "params"})
        self.inner.step()
        for tensor in self.tensors:
            tensor.grad = None

    def _refuse_another_dtype(self) -> None:
        """Every rank checks every parameter (not only its pieces), so that all raise together: ``set_`` would read
        a new dtype's bytes as the old one's."""
        changed = [
            f"{index} ({self.dtypes[index]} -> {parameter.dtype})"
            for index, parameter in enumerate(self.parameters)
            if index < len(self.dtypes) and parameter.dtype != self.dtypes[index]
        ]
        if changed:
            raise ValueError(
                f"optimizer_sharding=True: the dtype of parameters {', '.join(changed)} changed after DDP wrapped the "
                "module. DDP's gradient buckets keep the dtype they were built with, and stock DDP then lets the "
                "replicas drift apart (measured: its all-reduce no longer reaches those gradients). Fix: cast the "
                "model before the strategy sets it up (in the LightningModule's `__init__` or `configure_model`, or "
                "before `fabric.setup`), or use a precision plugin (`precision='bf16-mixed'`)."
            )

    @staticmethod
    def _slice(tensor: Tensor, piece: Piece) -> Tensor:
        return flat_in_memory_order(tensor)[piece.start : piece.start + piece.length]

    def _all_gather(self) -> None:
        """Every bucket holding one of this optimizer's parameters, gathered from its owners, ``GATHER_WINDOW``
        buckets in flight at once; each bucket is copied into its parameters as it arrives."""
        assert self.layout is not None
        world, group = self.shards.world_size, self.shards.process_group
        mine = {self.shards.index_of(p) for p in self.parameters}
        owned = pieces_of(self.layout, self.shards.rank, world)
        in_flight: deque[tuple[tuple[tuple[int, int], ...], Tensor, Callable[[], Any]]] = deque()
        for index, bucket in enumerate(self.layout.buckets):
            if not any(parameter in mine for parameter, _ in bucket):
                continue
            if len(in_flight) == GATHER_WINDOW:
                self._gathered(*in_flight.popleft())
            chunk = shard_size(self.layout.size(index), world)
            first = self.shards.parameters[bucket[0][0]]
            shard = first.new_zeros(chunk)
            for piece in (p for p in owned if p.bucket == index):
                start = piece.offset - self.shards.rank * chunk
                shard[start : start + piece.length].copy_(self._slice(self.shards.parameters[piece.parameter], piece))
            full = first.new_empty(chunk * world)
            self.shards.count(chunk * world, first.element_size())
            if self.shards.uses_exchange:
                wait: Callable[[], Any] = partial(finish_all_gather, post_all_gather(full, shard, group))
            else:
                work = dist.all_gather_into_tensor(full, shard, group=group, async_op=True)
                assert work is not None
                wait = work.wait
            in_flight.append((bucket, full, wait))
        while in_flight:
            self._gathered(*in_flight.popleft())

    def _gathered(self, bucket: tuple[tuple[int, int], ...], full: Tensor, wait: Callable[[], Any]) -> None:
        wait()
        offset = 0
        for parameter, numel in bucket:
            flat_in_memory_order(self.shards.parameters[parameter].detach()).copy_(full[offset : offset + numel])
            offset += numel

    # ------------------------------------------------------------------ the layout

    def follow_layout(self) -> None:
        """Build the pieces for the reducer's latest buckets, the state moving with them (collective)."""
        layout = self.shards.layout
        if layout is None:
            raise RuntimeError(
                "optimizer_sharding=True: the optimizer stepped before any backward reduce-scattered its gradients. "
                "Fix: step only after a backward of the DDP-wrapped module."
            )
        if layout == self.layout and not self.regrouped:
            return
        # a group is only ever added at the end: the pieces' parameter indices stay valid for the state gathered
        full = self._full_state(everyone=True) if self.layout is not None else self.pending
        self.layout, self.pending, self.regrouped = layout, None, False
        local = {self.shards.index_of(p): i for i, p in enumerate(self.parameters)}
        missing = [
            i
            for i, p in enumerate(self.parameters)
            if p.requires_grad
            and self.shards.index_of(p) not in {parameter for bucket in layout.buckets for parameter, _ in bucket}
        ]
        if missing:
            raise ValueError(
                f"optimizer_sharding=True steps what DDP's buckets hold, and parameters {missing} of this optimizer "
                "are in none: they are not in the DDP-wrapped module, or did not require grad when DDP wrapped it "
                "(Lightning's `BaseFinetuning` freezes in `setup`, before the wrap; DDP leaves those out). Fix: "
                "give the optimizer the module's parameters only; for layers unfrozen later, use "
                "`optimizer_sharding='all_reduce'` (whole tensors after the all-reduce, which the strategy extends "
                "to them), or freeze them after the wrap (in `on_fit_start`, with `find_unused_parameters=True`)."
            )
        self.pieces = [
            Piece(local[piece.parameter], piece.start, piece.length, piece.bucket, piece.offset)
            for piece in pieces_of(layout, self.shards.rank, self.shards.world_size)
            if piece.parameter in local
        ]
        # views: the inner optimizer updates the parameters in place, and a rank holds no copy of its pieces
        self.tensors = [self._slice(self.parameters[p.parameter].detach(), p) for p in self.pieces]
        self.dtypes = [parameter.dtype for parameter in self.parameters]
        self._build_inner()
        if full is not None:
            self._slice_state(full)

    def _build_inner(self) -> None:
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        groups: dict[int, list[Tensor]] = {}
        for tensor, piece in zip(self.tensors, self.pieces):
            groups.setdefault(group_of[id(self.parameters[piece.parameter])], []).append(tensor)
        self.inner_groups = sorted(groups)
        inner_groups = [
            {**{k: v for k, v in self.param_groups[g].items() if k != "params"}, "params": groups[g]}
            for g in self.inner_groups
        ]
        self.inner = self.constructor(inner_groups) if inner_groups else None

    # ------------------------------------------------------------------ the state, full and sliced

    def _parts(self) -> StateParts:
        """This rank's state, by parameter: per-element tensors by their start, and the rest (``step``)."""
        parts: StateParts = {}
        if self.inner is None:
            return parts
        for tensor, piece in zip(self.tensors, self.pieces):
            state = self.inner.state.get(tensor)
            if not state:
                continue
            elements, rest = parts.setdefault(piece.parameter, ([], {}))
            per_element = {k: v.detach().cpu() for k, v in state.items() if _per_element(v, piece.length)}
            elements.append((piece.start, per_element))
            rest.update({k: _to_cpu(v) for k, v in state.items() if k not in per_element})
        return parts

    def _full_state(self, everyone: bool) -> dict[str, Any] | None:
        """The plain optimizer ``state_dict`` of every rank's pieces, on every rank or on rank 0 only (collective)."""
        mine = self._parts()
        world, group = self.shards.world_size, self.shards.process_group
        if everyone:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine, group=group)
        else:
            gathered = [None] * world if self.shards.rank == 0 else []
            dist.gather_object(mine, gathered if self.shards.rank == 0 else None, dst=0, group=group)
            if self.shards.rank != 0:
                return None
        state: dict[int, dict[str, Any]] = {}
        for parts in gathered:
            for parameter, (elements, rest) in parts.items():
                full = state.setdefault(parameter, {})
                full.update({k: v for k, v in rest.items()})
                shape = self.parameters[parameter].shape
                for start, per_element in elements:
                    for key, value in per_element.items():
                        whole = full.setdefault(key, value.new_zeros(math.prod(shape)))
                        whole[start : start + value.numel()].copy_(value)
        for parameter, full in state.items():
            like = self.parameters[parameter]
            for key, value in full.items():
                if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == like.numel():
                    # the flat state is in the parameter's memory order (the buckets'): laid out as the parameter is
                    laid_out = torch.empty_strided(like.shape, like.stride(), dtype=value.dtype)
                    flat_in_memory_order(laid_out).copy_(value)
                    full[key] = laid_out.to(like.device)
        return {"state": state, "param_groups": self._packed_groups()}

    def _packed_groups(self) -> list[dict[str, Any]]:
        packed, start = [], 0
        for group in self.param_groups:
            count = len(group["params"])
            packed.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + count))}
            )
            start += count
        return packed

    def _slice_state(self, full: dict[str, Any]) -> None:
        assert self.inner is not None or not self.pieces
        if self.inner is None:
            return
        states = {int(k): v for k, v in full.get("state", {}).items()}
        on_device = {  # torch keeps "step" with the parameters for capturable and fused steps, else on the CPU
            id(tensor)
            for group in self.inner.param_groups
            if group.get("capturable") or group.get("fused")
            for tensor in group["params"]
        }
        for tensor, piece in zip(self.tensors, self.pieces):
            state = states.get(piece.parameter)
            if not state:
                continue
            like = self.parameters[piece.parameter]
            self.inner.state[tensor] = {
                key: (
                    self._slice(_laid_out_as(value, like), piece).to(tensor.device, copy=True)
                    if _per_element(value, like.numel())
                    else _scalar_state(value, tensor.device if id(tensor) in on_device else None)
                )
                for key, value in state.items()
            }

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank 0 for ``state_dict`` (a collective: every rank calls it)."""
        if self.shards.layout is not None:
            self.follow_layout()
        # the same condition on every rank: a rank that owns no piece still takes part in the gather
        self.gathered = self._full_state(everyone=False) if self.layout is not None else self.pending

    @override
    def state_dict(self) -> dict[str, Any]:
        """The plain optimizer's ``state_dict`` (after ``consolidate_state_dict``, on rank 0)."""
        gathered, self.gathered = self.gathered, None
        if gathered is None:
            gathered = self.pending or {"state": {}, "param_groups": self._packed_groups()}
        return {"state": gathered["state"], "param_groups": self._packed_groups()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A plain optimizer's ``state_dict`` (any world size's): the hyperparameters now, the state at the next
        layout (or now, when the layout is known)."""
        for group, loaded in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        self.pending, self.layout, self.inner = state_dict, None, None
        if self.shards.layout is not None:
            self.follow_layout()

    # ------------------------------------------------------------------ clipping

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole gradient: each rank's chunks hold a part of it, so their
        norms are combined (one all-reduce of one number) before every gradient is scaled."""
        self.follow_layout()
        grads = [
            self._slice(self.parameters[p.parameter].grad, p)
            for p in self.pieces
            if self.parameters[p.parameter].grad is not None
        ]
        first = next((p for p in self.parameters if p.grad is not None), None)
        if first is None:
            return torch.tensor(0.0)
        local = torch.zeros((), dtype=torch.float32, device=first.device)
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
            local = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
        infinite = math.isinf(norm_type)
        dist.all_reduce(local, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=self.shards.process_group)
        total = local if infinite else local.pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} of the gradients is non-finite: {total.item()}.")
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for parameter in self.parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(coefficient.to(parameter.grad.dtype))
        return total

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds."""
        if self.inner is None:
            return 0
        return sum(
            value.numel() * value.element_size()
            for state in self.inner.state.values()
            for value in state.values()
            if isinstance(value, Tensor)
        )


def _laid_out_as(value: Tensor, like: Tensor) -> Tensor:
    """``value`` (a per-element state of ``like``'s shape, or flat) with ``like``'s strides: a state saved by another
    run may be laid out otherwise."""
    if value.shape == like.shape and value.stride() == like.stride():
        return value
    if value.shape != like.shape:
        value = value.reshape(like.shape)  # a flat state of a contiguous layout
    return torch.empty_strided(like.shape, like.stride(), dtype=value.dtype, device=value.device).copy_(value)


def _per_element(value: Any, numel: int) -> bool:
    """Whether a state value holds one number per element (Adam's moments, SGD's momentum), not one per tensor."""
    return isinstance(value, Tensor) and value.dim() >= 1 and value.numel() == numel


def _scalar_state(value: Any, device: torch.device | None) -> Any:
    """A copy of a per-tensor state value (Adam's ``step``), on ``device`` when the step needs it there."""
    if not isinstance(value, Tensor):
        return value
    return value.to(device, copy=True) if device is not None else value.clone()


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def route_norm_clipping(precision: Any) -> None:
    """Make Lightning's precision plugin clip a ``BucketShardedOptimizer``'s gradients by their whole norm (its
    ``clip_grad_by_norm`` would take one rank's chunks for the whole); other optimizers clip as before."""
    if precision in ROUTED_PRECISIONS:
        return
    plain = precision.clip_grad_by_norm

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        if isinstance(optimizer, BucketShardedOptimizer):
            optimizer.clip_grad_norm_(float(clip_val))
        else:
            plain(optimizer, clip_val)

    precision.clip_grad_by_norm = clip_grad_by_norm
    ROUTED_PRECISIONS.add(precision)


#: The precision plugins ``route_norm_clipping`` changed (each once).
ROUTED_PRECISIONS: weakref.WeakSet[Any] = weakref.WeakSet()
