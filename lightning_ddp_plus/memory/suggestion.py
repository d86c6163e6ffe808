"""What ``ddp-plus check`` leaves for a run with ``chunk_size="auto"``: the memory plan's suggested chunk size.

When a whole batch's activations do not fit and smaller chunks would, ``ddp-plus check --device-memory ...`` writes
its suggestion to ``ddp_plus_memory_plan.json`` in the run's ``default_root_dir``. A run of the same model at the same
world size with ``chunk_size="auto"`` starts from that size instead of the whole batch, which spares the
out-of-memory errors and retries on the way down; an out-of-memory error still halves it. A checkpoint's size comes
first on a resume. The plan of another model or world size is not used, and the run says so.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from torch.nn import Module

#: In the run's ``default_root_dir``.
SUGGESTION_FILE = "ddp_plus_memory_plan.json"


@dataclass(frozen=True, kw_only=True)
class ChunkSuggestion:
    """The plan's ``chunk_size`` and what it was made for."""

    chunk_size: int
    """Rows per chunk whose step peak fits the device memory below."""
    world_size: int
    """The world size the plan was made for (optimizer sharding divides by it)."""
    device_memory: int
    """The device memory the plan was made against, in bytes."""
    parameters: int
    """The planned model's number of parameters: a plan of another model is not used."""


def parameter_count(module: Module) -> int:
    """What a suggestion is matched on: the model's number of parameters."""
    return sum(parameter.numel() for parameter in module.parameters())


def write_suggestion(folder: str | Path, suggestion: ChunkSuggestion) -> Path:
    path = Path(folder) / SUGGESTION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(suggestion), indent=2) + "\n")
    return path


def read_suggestion(folder: str | Path) -> ChunkSuggestion | None:
    """The suggestion in ``folder``; ``None`` where there is none. A file that does not hold one raises
    ``ValueError`` naming it."""
    path = Path(folder) / SUGGESTION_FILE
    if not path.is_file():
        return None
    try:
        fields = json.loads(path.read_text())
        if "micro_batch_size" in fields:  # written before 0.2.0
            fields["chunk_size"] = fields.pop("micro_batch_size")
        return ChunkSuggestion(**fields)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{path} does not hold a memory plan's suggestion ({error}). Fix: run `ddp-plus check --device-memory "
            "...` again, or delete the file."
        ) from error


def starting_size(
    suggestion: ChunkSuggestion | None, parameters: int, world_size: int, where: str
) -> tuple[int | None, str | None]:
    """The size ``"auto"`` starts from (``None``: the whole batch) and the line that says why.

    >>> plan = ChunkSuggestion(chunk_size=8, world_size=2, device_memory=2**30, parameters=1000)
    >>> starting_size(plan, 1000, 2, "runs/plan.json")[0]
    8
    >>> print(starting_size(plan, 1000, 4, "runs/plan.json")[1])
    chunk_size='auto' starts from the whole batch: the memory plan in runs/plan.json was made for world size 2, and this run has 4.
    >>> starting_size(None, 1000, 2, "runs/plan.json")
    (None, None)
    """
    if suggestion is None:
        return None, None
    if suggestion.parameters != parameters:
        made_for = f"a model of {suggestion.parameters:,} parameters, and this one has {parameters:,}"
    elif suggestion.world_size != world_size:
        made_for = f"world size {suggestion.world_size}, and this run has {world_size}"
    else:
        return suggestion.chunk_size, (
            f"chunk_size='auto' starts from {suggestion.chunk_size} rows per chunk, the memory plan's "
            f"suggestion in {where} (made against {suggestion.device_memory / 2**30:.2f} GiB of device memory); an "
            "out-of-memory error still halves it."
        )
    return (
        None,
        f"chunk_size='auto' starts from the whole batch: the memory plan in {where} was made for {made_for}.",
    )


def starting_size_in_folder(folder: str | Path, module: Module, world_size: int) -> tuple[int | None, str | None]:
    """The size a run of ``module`` on ``world_size`` ranks starts from, read from the suggestion in ``folder`` (the
    run's ``default_root_dir``), and the line that says which."""
    where = str(Path(folder) / SUGGESTION_FILE)
    return starting_size(read_suggestion(folder), parameter_count(module), world_size, where)
