"""Replica-drift guard: cheap per-tensor fingerprints exchanged across ranks, not a full gather of the weights."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


class ReplicaDriftError(RuntimeError):
    """The ranks no longer hold identical parameters (or buffers) although DDP promises they do."""


_WEIGHTS: dict[tuple[int, torch.device], Tensor] = {}


def fingerprint(tensor: Tensor) -> Tensor:
    """Two float64 numbers per tensor: its sum and a position-weighted sum (which also changes when elements move).

    >>> a = torch.tensor([1.0, 2.0, 3.0])
    >>> torch.equal(fingerprint(a), fingerprint(a.clone())), torch.equal(fingerprint(a), fingerprint(a.flip(0)))
    (True, False)
    """
    flat = tensor.detach().flatten().double()
    key = (flat.numel(), flat.device)
    weights = _WEIGHTS.get(key)
    if weights is None:
        weights = _WEIGHTS[key] = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), (flat * weights).sum()])


def fingerprints(tensors: Iterable[Tensor]) -> Tensor:
    return torch.stack([fingerprint(t) for t in tensors])


def first_mismatch(gathered: Tensor, names: list[str]) -> Optional[tuple[str, list[int]]]:
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
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    mismatch = first_mismatch(torch.stack(gathered), names)
    if mismatch is not None:
        name, ranks = mismatch
        raise ReplicaDriftError(
            f"Replicas differ at optimizer step {step}: `{name}` on rank(s) {', '.join(map(str, ranks))} differs from "
            f"rank 0 (first of {len(names)} tensors checked). DDP keeps replicas identical only if every rank applies the "
            "same all-reduced gradients: look for code that changes weights on some ranks only (rank-dependent "
            "updates, an optimizer step on unreduced gradients, non-deterministic custom ops), or unsynced buffers."
        )
