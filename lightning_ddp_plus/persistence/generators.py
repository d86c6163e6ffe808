"""Each rank's random number generators, kept in the checkpoint and given back on resume.

Lightning checkpoints no generator state, so a resumed run draws other dropout masks and other random augmentations
than the uninterrupted run would have. The strategy gathers every rank's state when a checkpoint is saved (all ranks
take part in a save) and, on resume, gives each rank its own back just before its first training batch, where the
uninterrupted run stood. A rank that did not exist when the checkpoint was taken (a resume on more ranks) starts its
generators from ``seed + rank``: ``seed`` is the one ``seed_everything`` set (``PL_GLOBAL_SEED``), else the
sampler's seed of the checkpoint, else 0. A save after a rank's death holds the survivors' states as they stood at
the step saved (passed to the writer through the job's store); the dead rank's went with it, and that rank starts
from ``seed + rank`` too.

What is kept: torch's CPU generator, the accelerator's generators (CUDA's, where it is available), Python's
``random`` and NumPy's global generator, as tensors and plain lists (so the checkpoint still loads with
``weights_only=True``).
"""

from __future__ import annotations

import os
import pickle
import random
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_ddp_plus.private_apis.lightning import collect_rng_states, set_rng_states

#: Where the checkpoint holds the list of every rank's states, by rank.
GENERATORS_KEY = "ddp_plus_generator_states"


@dataclass(frozen=True)
class GeneratorSnapshot:
    """This process's generators as they stand, as Lightning's ``_collect_rng_states`` takes them (about 50 µs alone,
    most of it NumPy's ``get_state``, and 0.2 ms inside a 2-rank step on a slow CPU), so that a step boundary can keep
    one every step; ``states()`` converts them for a checkpoint."""

    taken: dict[str, Any]

    @classmethod
    def take(cls) -> GeneratorSnapshot:
        return cls(collect_rng_states(include_cuda=torch.cuda.is_available()))

    def states(self) -> dict[str, Any]:
        """The states in types ``torch.load(weights_only=True)`` reads (Lightning keeps NumPy's as an array and
        Python's as tuples, which it refuses); the keys stay those checkpoints hold: ``cuda`` for Lightning's
        ``torch.cuda``."""
        version, state, gauss = self.taken["python"]
        states: dict[str, Any] = {"torch": self.taken["torch"], "python": [version, list(state), gauss]}
        if self.taken.get("torch.cuda"):
            states["cuda"] = self.taken["torch.cuda"]
        if "numpy" in self.taken:
            name, keys, position, has_gauss, cached = self.taken["numpy"]
            states["numpy"] = [name, [int(k) for k in keys], int(position), int(has_gauss), float(cached)]
        return states


def generator_states() -> dict[str, Any]:
    """This process's generator states, in types ``torch.load(weights_only=True)`` reads."""
    return GeneratorSnapshot.take().states()


def packed(states: dict[str, Any]) -> bytes:
    """``generator_states()`` as bytes, to pass through the job's store (a survivor's to the writer after a death)."""
    return pickle.dumps(apply_to_collection(states, torch.Tensor, _tensor_bytes))


def unpacked(data: bytes) -> dict[str, Any]:
    """What ``packed`` took, from a rank of this job through its store (unpickled: only the job's ranks write it)."""
    states: dict[str, Any] = apply_to_collection(pickle.loads(data), bytes, _byte_tensor)
    return states


def every_ranks_generator_states() -> list[dict[str, Any]]:
    """Every rank's generator states, by rank (a gather: every rank calls it, as every rank takes part in a save)."""
    states = generator_states()
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [states]
    # pickling a tensor goes through torch.save, which a non-zero rank must not call during a fit (Lightning's own
    # checkpoint tests count it): the generators' byte tensors travel as bytes
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, packed(states))
    return [unpacked(rank_states) for rank_states in gathered]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().numpy().tobytes()


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def set_generator_states(states: dict[str, Any]) -> None:
    """Give this process the generator states of ``generator_states()`` (through Lightning's ``_set_rng_states``; the
    accelerator's only where it is available here)."""
    lightning_states = {"torch": states["torch"], "python": states["python"]}
    if "cuda" in states and torch.cuda.is_available():
        lightning_states["torch.cuda"] = states["cuda"]
    if "numpy" in states:
        name, keys, position, has_gauss, cached = states["numpy"]
        lightning_states["numpy"] = (name, keys, position, has_gauss, cached)  # NumPy takes the keys as a list
    set_rng_states(lightning_states)


def seed_generators(seed: int) -> None:
    """Every generator ``generator_states`` keeps, seeded with ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)  # the accelerators' generators too
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


@dataclass(frozen=True)
class GeneratorsGivenBack:
    """What a rank did with the checkpoint's generator states on resume."""

    rank: int
    #: ``"restored"`` (the rank's own states) or ``"seeded"`` (a new rank: ``seed + rank``)
    how: str
    seed: int | None = None


def give_generators_back(
    saved: list[dict[str, Any] | None], rank: int, sampler_seed: int | None
) -> GeneratorsGivenBack:
    """Rank ``rank``'s states from ``saved`` (every rank's, by rank), or, for a rank the checkpoint did not have (a new
    rank, or ``None``: a rank that died before a survivor's save), generators seeded with ``seed + rank`` (see the
    module's docstring for ``seed``)."""
    saved_states = saved[rank] if rank < len(saved) else None
    if saved_states is not None:
        set_generator_states(saved_states)
        return GeneratorsGivenBack(rank, "restored")
    seed = base_seed(sampler_seed) + rank
    seed_generators(seed)
    return GeneratorsGivenBack(rank, "seeded", seed)


def base_seed(sampler_seed: int | None) -> int:
    """The seed a new rank adds its rank to: ``seed_everything``'s, else the checkpoint's sampler's, else 0."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None else sampler_seed or 0
