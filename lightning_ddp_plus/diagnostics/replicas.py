"""Replica-drift guard: every N optimizer steps, check that all ranks hold identical parameters (and buffers).

A check reads every tensor's bits once and costs one small all-reduce. Each tensor is folded into ``LANES`` integers
by XOR-ing its raw bits (element ``i`` lands in lane ``i % LANES``): exact, and the same whatever the reduction order,
thread count or device, so equal replicas always compare equal and a single changed bit anywhere is seen. The
per-tensor lanes are folded once more into one vector (each tensor's lanes rotated by its index, so two tensors'
changes do not cancel), and the ranks reduce that vector with MAX of ``[v, -v]``: the replicas agree exactly when the
maximum equals the minimum. Only on a mismatch are the per-tensor lanes gathered, to name the tensor and the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_ddp_plus.config.checks import require_positive_int_or_none
from lightning_ddp_plus.pipeline.component import EpochEnd, FitStart, StepComponent

#: Integers a tensor is folded into.
LANES = 64
# Widest first; at most 4 bytes, so that a lane widened to int64 can always be negated exactly.
_LANE_DTYPES = ((4, torch.int32), (2, torch.int16), (1, torch.int8))


def check_every_n_steps(value: Any) -> int | None:
    """Validate ``verify_replicas_every_n_steps``."""
    return require_positive_int_or_none("verify_replicas_every_n_steps", value, "100", "optimizer steps")


class ReplicaDriftError(RuntimeError):
    """The ranks no longer hold identical parameters (or buffers) although DDP promises they do."""


def fingerprint(tensor: Tensor, lanes: int = LANES) -> Tensor:
    """``lanes`` int64 numbers: the XOR of the raw bits of the tensor's elements, element ``i`` in lane ``i % lanes``.

    >>> a = torch.tensor([1.0, 2.0, 3.0])
    >>> torch.equal(fingerprint(a), fingerprint(a.clone())), torch.equal(fingerprint(a), fingerprint(a.flip(0)))
    (True, False)
    >>> b = a.clone(); b[1] = torch.nextafter(b[1], torch.tensor(9.0))  # one bit of one element
    >>> torch.equal(fingerprint(a), fingerprint(b))
    False
    """
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    dtype = next(d for w, d in _LANE_DTYPES if raw.numel() % w == 0)
    bits = raw.view(dtype)
    rows = bits.numel() // lanes
    block = bits[: rows * lanes].view(rows, lanes)
    while block.shape[0] > 1:  # halving: about one pass over the tensor in all
        half = block.shape[0] // 2
        folded = block[:half] ^ block[half : 2 * half]
        if block.shape[0] % 2:
            folded[0] ^= block[-1]
        block = folded
    result = torch.zeros(lanes, dtype=torch.int64, device=bits.device)
    if rows:
        result ^= block[0].to(torch.int64)
    tail = bits[rows * lanes :]
    if tail.numel():
        result[: tail.numel()] ^= tail.to(torch.int64)
    return result


def fingerprints(tensors: Iterable[Tensor]) -> Tensor:
    """Per-tensor fingerprints, shape ``(tensors, LANES)``."""
    return torch.stack([fingerprint(t) for t in tensors])


def combined(per_tensor: Tensor) -> Tensor:
    """One ``LANES``-long vector for all tensors: each tensor's lanes rotated by its index, XOR-ed together.

    >>> prints = torch.tensor([[1, 0], [1, 0]])
    >>> combined(prints).tolist()  # without the rotation these two would cancel
    [1, 1]
    """
    lanes = per_tensor.shape[1]
    index = (
        torch.arange(lanes, device=per_tensor.device)[None, :]
        - torch.arange(len(per_tensor), device=per_tensor.device)[:, None]
    ) % lanes
    rotated = torch.gather(per_tensor, 1, index)
    result = rotated[0].clone()
    for row in rotated[1:]:
        result ^= row
    return result


def first_mismatch(gathered: Tensor, names: list[str]) -> tuple[str, list[int]] | None:
    """The first tensor whose fingerprint differs between ranks, and the ranks that differ from rank 0.

    ``gathered`` has shape (world_size, tensors, lanes).

    >>> prints = torch.zeros(3, 2, 2); prints[2, 1, 0] = 1.0
    >>> first_mismatch(prints, ["a", "b"])
    ('b', [2])
    """
    differs = (gathered != gathered[0:1]).any(dim=2)  # (world, tensors)
    for index, name in enumerate(names):
        ranks = [rank for rank in range(gathered.shape[0]) if bool(differs[rank, index])]
        if ranks:
            return name, ranks
    return None


def verify_replicas(named_tensors: list[tuple[str, Tensor]], step: int) -> None:
    """Raise ``ReplicaDriftError`` on every rank if any tensor differs between ranks (a collective: all ranks call it)."""
    if not named_tensors:
        return
    names = [name for name, _ in named_tensors]
    per_tensor = fingerprints(t for _, t in named_tensors)
    local = combined(per_tensor)
    extremes = torch.cat([local, -local])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if torch.equal(extremes[:LANES], -extremes[LANES:]):
        return
    gathered = [torch.empty_like(per_tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, per_tensor)
    mismatch = first_mismatch(torch.stack(gathered), names) or (names[0], [])
    name, ranks = mismatch
    raise ReplicaDriftError(
        f"Replicas differ at optimizer step {step}: `{name}` on rank(s) {', '.join(map(str, ranks))} differs from "
        f"rank 0 (first of {len(names)} tensors checked). DDP keeps replicas identical only if every rank applies the "
        "same all-reduced gradients: look for code that changes weights on some ranks only (rank-dependent "
        "updates, an optimizer step on unreduced gradients, non-deterministic custom ops), or unsynced buffers."
    )


class ReplicaGuard(StepComponent):
    """Schedules the checks: after every N-th optimizer step, at the start of the next training forward (parameters
    as the step left them, buffers just broadcast), or at the end of training (parameters only)."""

    def __init__(self, every_n_steps: int | None) -> None:
        self.every_n_steps = every_n_steps
        #: Seconds each check took on this rank.
        self.check_seconds: list[float] = []
        self._module: Module | None = None
        self._with_buffers = False
        self._due_step: int | None = None
        self._handle: Any = None

    @property
    def on(self) -> ReplicaGuard | None:
        """This guard, or ``None`` when ``verify_replicas_every_n_steps`` is off (the pipeline leaves it out)."""
        return self if self.every_n_steps is not None else None

    def attach(self, ddp: Module, module: Module, with_buffers: bool) -> None:
        self.detach()
        self.check_seconds = []
        if self.every_n_steps is None:
            return
        self._module, self._with_buffers = module, with_buffers
        self._handle = ddp.register_forward_pre_hook(self._before_forward)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._due_step = None

    def fit_starts(self, fit: FitStart) -> None:
        self.attach(fit.ddp, fit.module, with_buffers=fit.broadcast_buffers)

    def fit_ends(self, failed: bool) -> None:
        self.detach()

    def epoch_ends(self, end: EpochEnd) -> None:
        if end.training_ends:  # no forward follows: parameters only (buffers are not broadcast yet)
            self.check_due(with_buffers=False)

    def step_done(self, step: int) -> None:
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            self._due_step = step

    def _before_forward(self, ddp: Module, args: Any) -> None:
        if torch.is_grad_enabled():  # a training forward, as DDP tells it (the wrapper may be in eval mode)
            self.check_due(with_buffers=self._with_buffers)

    def check_due(self, with_buffers: bool) -> None:
        """Run the pending check, if any (a collective: every rank reaches it at the same step)."""
        step, self._due_step = self._due_step, None
        if step is None or self._module is None or not dist.is_initialized():
            return
        started = time.perf_counter()
        tensors: list[tuple[str, Tensor]] = list(self._module.named_parameters())
        if with_buffers:
            tensors += list(self._module.named_buffers())
        verify_replicas(tensors, step)
        self.check_seconds.append(time.perf_counter() - started)
