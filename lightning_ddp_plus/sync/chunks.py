"""Micro-batches: a training batch split into chunks of ``chunk_size`` rows, one optimizer step per batch.

Each chunk runs forward and backward; only the last one's backward all-reduces (the accumulation window's rule,
inside one batch), and each chunk's loss is weighted by its share of the batch's rows, so for a loss that is a mean
over rows the gradient is the whole batch's. The global batch, the learning-rate schedule and ``global_step`` do not
change.

With ``chunk_size="auto"`` an out-of-memory error on any rank makes every rank drop the batch's gradients,
halve the size and run the same batch again. The pure parts live here (what a batch's rows are, how it is split,
which errors are out-of-memory, the size after a failure, the messages); ``chunk_runner`` runs a batch's
chunks and attempts, and the agreement rides on the per-step guard's (``step_agreement``): a rank that failed tells
the others there, after issuing the bucket all-reduces the others' backward waits for, so no rank is left waiting
inside its backward.

The batch walkers (``batch_rows``, ``split_batch``) are written here rather than taken from Lightning:
``extract_batch_size`` takes a 0-d tensor that comes first for a batch of 1 row (and warns of an ambiguous batch), and
its error for a batch without any tensor is about ``self.log``, where a chunk size must skip scalars and refuse that
batch, naming its fix; ``apply_to_collection`` maps each leaf alone, so it can neither slice a list of per-row strings
with the tensors nor say which part of the batch could not be split.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, describe_bad_value
from lightning_ddp_plus.pipeline.component import StepComponent

#: ``DDPPlusStrategy(chunk_size=...)``: rows per chunk, ``"auto"``, or ``None`` (the whole batch at once).
ChunkSize = int | Literal["auto"] | None
#: The agreement flag of ``"auto"``: some rank ran out of memory in this batch's attempt.
OUT_OF_MEMORY = "out of memory"

#: What the messages of the CPU allocator, cuBLAS and cuDNN say when an allocation fails (torch raises a plain
#: ``RuntimeError`` for them; CUDA's caching allocator raises ``torch.OutOfMemoryError``).
_OUT_OF_MEMORY_MESSAGES = (
    "can't allocate memory",  # DefaultCPUAllocator
    "out of memory",  # CUDA's own wording, also inside cuDNN/cuBLAS errors
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
)


def check_chunk_size(argument: str, value: Any) -> ChunkSize:
    """``None``, ``"auto"`` or an integer of at least 1.

    >>> check_chunk_size("chunk_size", 0)
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentValueError: `chunk_size=0` is not valid: it must be at least 1 row per chunk. Fix: write e.g. `chunk_size=8`, `chunk_size='auto'` (halve on out-of-memory), or None (the whole batch).
    """
    fix = f"write e.g. `{argument}=8`, `{argument}='auto'` (halve on out-of-memory), or None (the whole batch)."
    if value is None or value == "auto":
        return cast(ChunkSize, value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(
            describe_bad_value(
                argument, value, f"expected an integer, 'auto' or None, got {type(value).__name__}.", fix
            )
        )
    if value < 1:
        raise ArgumentValueError(describe_bad_value(argument, value, "it must be at least 1 row per chunk.", fix))
    return value


class Refusals(list[str]):
    """Why a ``chunk_size`` cannot run with the other settings (empty: it can), and the fix."""

    fix = ""


def chunk_refusals(
    setting: ChunkSize,
    sync_guard: bool,
    static_graph: bool,
    accumulation_steps: int | None,
    overlapped_optimizer: bool,
) -> Refusals:
    """The settings ``chunk_size`` cannot run with, each with its reason.

    >>> list(chunk_refusals("auto", sync_guard=False, static_graph=False, accumulation_steps=None, overlapped_optimizer=False))
    ['the ranks agree on an out-of-memory error inside the per-step guard, which `sync_guard=False` turns off.']
    """
    found = Refusals()
    if setting is None:
        return found
    if overlapped_optimizer:
        found.append(
            "`optimizer_sharding='overlap'` steps the optimizer inside the backward, so the chunks of a batch would "
            "each step it."
        )
        found.fix = "use `optimizer_sharding=True` with chunks."
    if setting != "auto":
        return found
    if not sync_guard:
        found.append(
            "the ranks agree on an out-of-memory error inside the per-step guard, which `sync_guard=False` turns off."
        )
    if static_graph:
        found.append("a static graph cannot drop a backward that failed half way (torch's reducer keeps its state).")
    if accumulation_steps is not None and accumulation_steps > 1:
        found.append(
            f"with `gradient_accumulation_steps={accumulation_steps}` a failed attempt would have to give back the "
            "gradients the window accumulated before it, which are not kept."
        )
    if not found.fix and found:
        found.fix = (
            "use a fixed `chunk_size` (it composes with all of these), or change the settings named "
            "(`sync_guard=True`, `static_graph=False`, a larger batch instead of accumulation)."
        )
    return found


def is_out_of_memory(error: BaseException) -> bool:
    """torch's ``OutOfMemoryError``, or a ``RuntimeError`` whose message is an allocator's failure (the CPU's
    ``DefaultCPUAllocator: can't allocate memory``, cuBLAS's and cuDNN's allocation failures).

    >>> is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    True
    >>> is_out_of_memory(RuntimeError("Connection closed by peer"))
    False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, MemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY_MESSAGES)


class UnsplittableBatchError(TypeError):
    """A training batch that ``chunk_size`` cannot split; the message names the part and the hook to write."""


@dataclass(frozen=True)
class Chunk:
    """One chunk of a training batch: what ``training_step`` receives, and how many of the batch's rows it holds
    (its loss is weighted by ``rows / batch rows``). A LightningModule's ``split_batch(batch, size)`` returns these
    for batches the strategy cannot split itself."""

    data: Any
    rows: int


_SCALARS = (int, float, bool, str, bytes, type(None))


def _hook_fix(where: str) -> str:
    return (
        f"{where} Fix: give your LightningModule a `split_batch(self, batch, size)` method that returns a list of "
        "`lightning_ddp_plus.Chunk(data, rows)` (each `data` what `training_step` takes), or set "
        "`chunk_size=None`."
    )


def batch_rows(batch: Any, path: str = "batch") -> int | None:
    """The rows of a batch: the first dimension of its first tensor with one (``None`` when it holds none)."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    for name, part in _parts(batch, path):
        rows = batch_rows(part, name)
        if rows is not None:
            return rows
    return None


def _parts(batch: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(batch, Mapping) or _is_batch_encoding(batch):
        return [(f"{path}[{key!r}]", value) for key, value in batch.items()]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [(f"{path}.{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(batch) if f.init]
    if isinstance(batch, (list, tuple)):
        return [(f"{path}[{index}]", value) for index, value in enumerate(batch)]
    return []


def _is_batch_encoding(batch: Any) -> bool:
    """Hugging Face's ``BatchEncoding`` (a ``UserDict``), recognized without importing ``transformers``."""
    return type(batch).__name__ == "BatchEncoding" and hasattr(batch, "data") and hasattr(batch, "items")


def split_batch(batch: Any, size: int) -> list[Chunk]:
    """``batch`` in chunks of at most ``size`` rows along the first dimension: tensors are split, mappings, lists,
    tuples, namedtuples, dataclasses and ``BatchEncoding`` split part by part, scalars (and 0-d tensors) copied into
    every chunk, and a list of scalars with one item per row sliced. Anything else, or a tensor whose first dimension
    is not the batch's rows, raises ``UnsplittableBatchError`` naming it.

    >>> [chunk.rows for chunk in split_batch({"x": torch.zeros(5, 2), "y": torch.zeros(5)}, 2)]
    [2, 2, 1]
    """
    rows = batch_rows(batch)
    if rows is None:
        raise UnsplittableBatchError(
            _hook_fix(
                f"chunk_size cannot split a training batch of type {type(batch).__name__}: it holds no "
                "tensor with a first dimension to split along."
            )
        )
    starts = range(0, rows, size)
    return [
        Chunk(_slice(batch, start, min(start + size, rows), rows, "batch"), min(size, rows - start)) for start in starts
    ]


def _slice(batch: Any, start: int, stop: int, rows: int, path: str) -> Any:
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            return batch
        if batch.shape[0] != rows:
            raise UnsplittableBatchError(
                _hook_fix(
                    f"chunk_size cannot split {path}: its first dimension is {batch.shape[0]} where the "
                    f"batch has {rows} rows."
                )
            )
        return batch[start:stop]
    if isinstance(batch, _SCALARS):
        return batch
    if _is_batch_encoding(batch):
        return type(batch)({key: _slice(value, start, stop, rows, f"{path}[{key!r}]") for key, value in batch.items()})
    if isinstance(batch, Mapping):
        items = {key: _slice(value, start, stop, rows, f"{path}[{key!r}]") for key, value in batch.items()}
        try:
            return cast(Any, type(batch))(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: _slice(getattr(batch, f.name), start, stop, rows, f"{path}.{f.name}")
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    if isinstance(batch, (list, tuple)):
        per_row = not hasattr(batch, "_fields") and len(batch) == rows
        if per_row and all(isinstance(item, _SCALARS) for item in batch):  # e.g. one string per row
            return type(batch)(batch[start:stop])
        parts = [_slice(value, start, stop, rows, f"{path}[{index}]") for index, value in enumerate(batch)]
        if hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*parts)
        return type(batch)(parts)
    raise UnsplittableBatchError(_hook_fix(f"chunk_size cannot split {path} of type {type(batch).__name__}."))


def size_after_out_of_memory(size: int) -> int | None:
    """The chunk size to try after an out-of-memory error at ``size`` rows: half of it (rounded up, so that
    3 rows become 2), or ``None`` when a single row did not fit.

    >>> size_after_out_of_memory(32), size_after_out_of_memory(3), size_after_out_of_memory(1)
    (16, 2, None)
    """
    return None if size <= 1 else (size + 1) // 2


def free_memory(device: torch.device) -> None:
    """Return what the failed attempt held. Its tensors go with their last reference (the error's traceback, left
    behind by then); a full collection (about 150 ms in a process with torch and Lightning loaded) is only worth it
    before giving the CUDA caching allocator's free blocks back, elsewhere the young generation is collected."""
    if device.type == "cuda" and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    else:
        gc.collect(0)


#: The phases an out-of-memory error is reported in, by the code that travels in the agreement.
PHASES = ("forward", "backward", "optimizer step")


@dataclass(frozen=True)
class OutOfMemory:
    """One rank's out-of-memory error in a training batch."""

    rank: int
    phase: str  # one of ``PHASES``
    rows: int  # the rows it was running (the chunk's, or the batch's)
    batch_rows: int


def describe_failures(failures: Sequence[OutOfMemory]) -> str:
    """Every rank's failure, in words.

    >>> describe_failures([OutOfMemory(1, "backward", 16, 32)])
    'rank 1 in the backward of 16 rows'
    """
    return "; ".join(f"rank {f.rank} in the {f.phase} of {f.rows} rows" for f in failures)


def shrink_message(failures: Sequence[OutOfMemory], old: int, new: int) -> str:
    return (
        f"chunk_size='auto': out of memory on {describe_failures(failures)}; every rank now splits each batch "
        f"into chunks of {new} rows (was {old}), keeping the batch of {failures[0].batch_rows} rows per rank and one "
        "optimizer step per batch."
    )


class ChunkOutOfMemoryError(torch.OutOfMemoryError):
    """Out of memory on some rank that ``chunk_size`` cannot get around (the message says why and what to
    change); raised on every rank."""

    #: On a rank whose collective broke because the rank that ran out of memory ended: that collective's error (its
    #: peer is gone, so a survivor saves the last step, ``crash.peer_death``); ``None`` on the rank that ran out.
    broken_collective: BaseException | None = None


def single_row_message(failures: Sequence[OutOfMemory]) -> str:
    return (
        f"chunk_size='auto': out of memory on {describe_failures(failures)} with chunks of a single row, so no "
        "chunk size fits. Fix: free memory on the device (activation checkpointing, a smaller model or "
        "sequence, `optimizer_sharding=True`), or shard the model (FSDP)."
    )


def default_mode_message(failure: OutOfMemory, chunk_size: ChunkSize) -> str:
    """What every rank raises when a rank ran out of memory and ``chunk_size`` is not ``"auto"``."""
    chunk = f" (a chunk of {failure.rows} rows of chunk_size={chunk_size})" if chunk_size else ""
    if failure.phase == "optimizer step":
        fix = (
            "the optimizer step does not depend on the batch: shard the optimizer state "
            "(`optimizer_sharding=True`), use a lighter optimizer, or free memory elsewhere."
        )
    else:
        fix = (
            "set `chunk_size='auto'` (every rank halves its chunks together until they fit, the global batch "
            f"unchanged) or a fixed `chunk_size` below {failure.rows}; or lower the batch size."
        )
    return (
        f"Out of memory on rank {failure.rank} in the {failure.phase}, training a batch of {failure.batch_rows} "
        f"rows{chunk}. Every rank stops here. Fix: {fix}"
    )


@dataclass(frozen=True)
class SizeChange:
    """One change ``"auto"`` made after the ranks agreed on an out-of-memory error."""

    old: int
    new: int
    failures: tuple[OutOfMemory, ...]
    #: From the failed attempt's start to the ranks' agreement and the recovery (what the error cost this rank).
    attempt_seconds: float


class ChunkSizer(StepComponent):
    """Owns ``chunk_size``: the size in effect, how a batch is split, and the size after an out-of-memory
    error that every rank agreed on.

    Args:
        setting: ``chunk_size`` as given.
        info: how the one line about a change reaches the user (rank 0 only).
    """

    def __init__(self, setting: ChunkSize, info: Any) -> None:
        self.setting = setting
        #: Rows per chunk in effect; ``None``: the whole batch (``"auto"`` before its first out-of-memory error).
        self.size: int | None = setting if isinstance(setting, int) else None
        self._info = info
        #: Every change ``"auto"`` made.
        self.changes: list[SizeChange] = []
        #: ``"auto"``: every agreement carries whether some rank ran out of memory in the batch's attempt (the
        #: setting is the same on every rank, so the flags are the same everywhere).
        self.agreement_flags = (OUT_OF_MEMORY,) if self.auto else ()
        #: This rank's out-of-memory error in the running attempt, for the agreement (``None``: none).
        self.failure: OutOfMemory | None = None

    def agreement_values(self) -> dict[str, int]:
        return {OUT_OF_MEMORY: int(self.failure is not None)} if self.auto else {}

    @property
    def active(self) -> bool:
        return self.setting is not None

    @property
    def auto(self) -> bool:
        return self.setting == "auto"

    def chunks(self, batch: Any, split_hook: Any = None) -> list[Chunk]:
        """The batch in chunks of the size in effect (``split_hook``: the LightningModule's ``split_batch``)."""
        if split_hook is not None:
            rows = batch_rows(batch)
            chunks = list(split_hook(batch, self.size or rows or 1))
            if not chunks or not all(isinstance(chunk, Chunk) for chunk in chunks):
                raise UnsplittableBatchError(
                    "split_batch(batch, size) must return a non-empty list of `lightning_ddp_plus.Chunk(data, "
                    f"rows)`, got {type(chunks[0]).__name__ if chunks else 'an empty list'}. Fix: wrap each chunk "
                    "as `Chunk(data=chunk, rows=its rows)`."
                )
            return chunks
        rows = batch_rows(batch)
        return split_batch(batch, self.size if self.size is not None else (rows or 1))

    def shrink(self, failures: Sequence[OutOfMemory], attempt_seconds: float) -> int:
        """After the ranks agreed on an out-of-memory error: the new size (logged once), or
        ``ChunkOutOfMemoryError`` when a single row did not fit."""
        old = min(f.rows for f in failures)
        new = size_after_out_of_memory(old)
        if new is None:
            raise ChunkOutOfMemoryError(single_row_message(failures))
        self.changes.append(SizeChange(old, new, tuple(failures), attempt_seconds))
        self.size = new
        self._info(shrink_message(failures, old, new))
        return new

    def start_from(self, size: int | None, message: str | None = None) -> None:
        """``"auto"`` before its first out-of-memory error: the size to start from (a memory plan's suggestion), and
        the line that says where it came from."""
        if not self.auto or self.size is not None:
            return
        if size is not None:
            self.size = size
        if message is not None:
            self._info(message)

    def state_dict(self) -> dict[str, Any]:
        return {"chunk_size": self.size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A resumed fit starts from the size saved (``"auto"`` only: a fixed size stays as given)."""
        size = state.get("chunk_size", state.get("micro_batch_size"))  # its name before 0.2.0
        if self.auto and isinstance(size, int):
            self.size = size


#: torch's batch normalizations (their shared base class is private).
_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)

#: Where a Trainer checkpoint keeps the size in effect.
CHECKPOINT_KEY = "ddp_plus_micro_batches"


def refuse_chunks(setting: ChunkSize, manual: bool, accumulation_steps: int, module: Any) -> None:
    """Before launch, once the Trainer and the LightningModule are known: what ``chunk_size`` cannot do with
    them raises; a model with batch normalization gets a warning."""
    if setting is None:
        return
    if manual:
        raise ArgumentValueError(
            describe_bad_value(
                "chunk_size",
                setting,
                "it needs automatic optimization: with `automatic_optimization = False` your `training_step` runs the "
                "backward itself, so the strategy cannot run it once per chunk.",
                "split the batch in your `training_step` and call `self.manual_backward` per chunk (the strategy's "
                "`gradient_accumulation_steps` syncs only the last), or use automatic optimization.",
            )
        )
    if setting == "auto" and accumulation_steps > 1:
        raise ArgumentValueError(
            describe_bad_value(
                "chunk_size",
                setting,
                f"it cannot run with `accumulate_grad_batches={accumulation_steps}`: a failed attempt would have to "
                "give back the gradients the window accumulated before it, which are not kept.",
                f"give the loader {accumulation_steps}x the batch size and `accumulate_grad_batches=1` (the same "
                "global batch: 'auto' then splits it as memory allows), or use a fixed `chunk_size`.",
            )
        )
    if module is not None and any(isinstance(m, _BATCH_NORMS) for m in module.modules()):
        rank_zero_warn(
            f"chunk_size={setting!r}: the model has batch normalization, whose statistics are then computed "
            "per chunk, not per batch (its running statistics too); the gradients differ from the whole batch's.",
        )
