"""Replica-drift guard: every N optimizer steps, check that all ranks hold identical parameters (and buffers).

A check costs one small all-reduce: each rank reduces per-tensor fingerprints with MAX of ``[f, -f]``, so a tensor is
identical everywhere exactly when its maximum equals its minimum; only on a mismatch are the fingerprints gathered
to name the ranks that differ.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module


class ReplicaDriftError(RuntimeError):
    """The ranks no longer hold identical parameters (or buffers) although DDP promises they do."""


_WEIGHTS: dict[tuple[int, torch.device], Tensor] = {}


def fingerprint(tensor: Tensor) -> Tensor:
    """Two float64 numbers per tensor: its sum and a position-weighted sum (which also changes when elements move).

    >>> a = torch.tensor([1.0, 2.0, 3.0])
    >>> torch.equal(fingerprint(a), fingerprint(a.clone())), torch.equal(fingerprint(a), fingerprint(a.flip(0)))
    (True, False)
    """
    flat = tensor.detach().flatten()
    key = (flat.numel(), flat.device)
    weights = _WEIGHTS.get(key)
    if weights is None:
        weights = _WEIGHTS[key] = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(dtype=torch.float64), torch.dot(flat.double(), weights)])


def fingerprints(tensors: Iterable[Tensor]) -> Tensor:
    return torch.stack([fingerprint(t) for t in tensors])


def first_mismatch(gathered: Tensor, names: list[str]) -> tuple[str, list[int]] | None:
    """The first tensor whose fingerprint differs between ranks, and the ranks that differ from rank 0.

    ``gathered`` has shape (world_size, tensors, 2).

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
    local = fingerprints(t for _, t in named_tensors)
    extremes = torch.cat([local, -local])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if torch.equal(extremes[: len(local)], -extremes[len(local) :]):
        return
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    mismatch = first_mismatch(torch.stack(gathered), names) or (names[0], [])
    name, ranks = mismatch
    raise ReplicaDriftError(
        f"Replicas differ at optimizer step {step}: `{name}` on rank(s) {', '.join(map(str, ranks))} differs from "
        f"rank 0 (first of {len(names)} tensors checked). DDP keeps replicas identical only if every rank applies the "
        "same all-reduced gradients: look for code that changes weights on some ranks only (rank-dependent "
        "updates, an optimizer step on unreduced gradients, non-deterministic custom ops), or unsynced buffers."
    )


class ReplicaGuard:
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

    def step_done(self, step: int) -> None:
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            self._due_step = step

    def _before_forward(self, ddp: Module, args: Any) -> None:
        if ddp.training and torch.is_grad_enabled():
            self.check_due(with_buffers=self._with_buffers)

    def check_due(self, with_buffers: bool) -> None:
        """Run the pending check, if any (a collective: every rank reaches it at the same step)."""
        step, self._due_step = self._due_step, None
        if step is None or self._module is None or not dist.is_initialized():
            return
        started = time.perf_counter()
        tensors = list(self._module.named_parameters())
        if with_buffers:
            tensors += list(self._module.named_buffers())
        verify_replicas(tensors, step)
        self.check_seconds.append(time.perf_counter() - started)
