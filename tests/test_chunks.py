"""``chunk_size``: batches split into chunks with one all-reduce and one optimizer step per batch, and
``"auto"``, where an out-of-memory error on any rank makes every rank halve its chunks and run the batch again.

The jobs are real: 2 gloo ranks, torch's ``OutOfMemoryError`` raised where CUDA's allocator raises it (forward, or
backward through an autograd function), and the CPU allocator failing under an address-space limit on one rank."""

import dataclasses
import json
from collections import namedtuple

import pytest
import torch
from lightning import Trainer

from lightning_ddp_plus import Chunk, DDPPlusStrategy
from lightning_ddp_plus.sync.chunks import (
    CHECKPOINT_KEY,
    ChunkSizer,
    OutOfMemory,
    UnsplittableBatchError,
    default_mode_message,
    is_out_of_memory,
    size_after_out_of_memory,
    split_batch,
)
from tests.helpers import QUIET_TRAINER, TinyRegressionManual, run_case_job

# ------------------------------------------------------------------ splitting, pure


Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Sample:
    ids: torch.Tensor
    labels: torch.Tensor
    name: str = "train"


def rows_of(chunks):
    return [chunk.rows for chunk in chunks]


def test_tensors_and_every_container_split_along_the_first_dimension():
    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    for batch, rebuild in [
        (x, lambda c: c),
        ({"x": x, "y": y, "scale": 2.0}, lambda c: c["x"]),
        ([x, y], lambda c: c[0]),
        ((x, y), lambda c: c[0]),
        (Pair(x, y), lambda c: c.x),
        (Sample(x, y), lambda c: c.ids),
    ]:
        chunks = split_batch(batch, 2)
        assert rows_of(chunks) == [2, 2, 1]
        assert type(chunks[0].data) is type(batch)
        assert torch.equal(torch.cat([rebuild(c.data) for c in chunks]), x)
    dict_chunks = split_batch({"x": x, "y": y, "scale": 2.0}, 2)
    assert [c.data["scale"] for c in dict_chunks] == [2.0] * 3  # scalars reach every chunk
    assert split_batch(Sample(x, y), 4)[1].data.name == "train"


def test_a_hugging_face_batch_encoding_stays_one():
    from transformers import BatchEncoding

    batch = BatchEncoding({"input_ids": torch.ones(6, 4, dtype=torch.long), "attention_mask": torch.ones(6, 4)})
    chunks = split_batch(batch, 4)
    assert rows_of(chunks) == [4, 2]
    assert isinstance(chunks[1].data, BatchEncoding)
    assert chunks[1].data["input_ids"].shape == (2, 4)


def test_a_list_of_one_string_per_row_is_sliced_and_a_0d_tensor_copied():
    batch = {"x": torch.zeros(3, 2), "text": ["a", "b", "c"], "temperature": torch.tensor(0.5)}
    chunks = split_batch(batch, 2)
    assert [c.data["text"] for c in chunks] == [["a", "b"], ["c"]]
    assert all(c.data["temperature"].item() == 0.5 for c in chunks)


@pytest.mark.parametrize(
    ("batch", "named"),
    [
        (object(), "type object"),
        (
            {"x": torch.zeros(4, 2), "mask": torch.zeros(3)},
            "batch['mask']: its first dimension is 3 where the batch has 4",
        ),
        ({"x": torch.zeros(4, 2), "other": object()}, "batch['other'] of type object"),
    ],
)
def test_a_batch_that_cannot_be_split_names_the_part_and_the_hook_to_write(batch, named):
    with pytest.raises(UnsplittableBatchError) as raised:
        split_batch(batch, 2)
    message = str(raised.value)
    assert named in message
    assert "Fix: give your LightningModule a `split_batch(self, batch, size)` method" in message


def test_a_split_hook_must_return_micro_batches():
    sizer = ChunkSizer(2, info=print)
    x = torch.zeros(4, 2)
    chunks = sizer.chunks(x, lambda batch, size: [Chunk(batch[:size], size), Chunk(batch[size:], 2)])
    assert rows_of(chunks) == [2, 2]
    with pytest.raises(UnsplittableBatchError, match=r"must return a non-empty list of .*Chunk.*got Tensor"):
        sizer.chunks(x, lambda batch, size: [batch[:size]])


def test_out_of_memory_in_each_of_its_forms():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"
        )
    )
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not is_out_of_memory(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an allocator's error type


def test_an_out_of_memory_error_in_the_optimizer_step_is_not_halved_away_and_says_why():
    """Smaller chunks free activations, which are gone by the optimizer step: there ``"auto"`` has nothing to
    halve, so the error names the step and the fixes that do change its memory."""
    in_step = default_mode_message(OutOfMemory(1, "optimizer step", 8, 32), "auto")
    assert in_step.startswith("Out of memory on rank 1 in the optimizer step, training a batch of 32 rows")
    assert "does not depend on the batch: shard the optimizer state (`optimizer_sharding=True`)" in in_step
    in_backward = default_mode_message(OutOfMemory(0, "backward", 32, 32), None)
    assert "set `chunk_size='auto'`" in in_backward and "below 32" in in_backward


def test_sizes_halve_down_to_one_row():
    sizes = [32]
    while (following := size_after_out_of_memory(sizes[-1])) is not None:
        sizes.append(following)
    assert sizes == [32, 16, 8, 4, 2, 1]
    assert size_after_out_of_memory(5) == 3


@pytest.mark.multiprocess
def test_manual_optimization_is_refused_before_anything_is_launched():
    strategy = DDPPlusStrategy(chunk_size=8)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, **QUIET_TRAINER)
    with pytest.raises(ValueError, match=r"`chunk_size=8` is not valid: it needs automatic optimization.*Fix"):
        trainer.fit(TinyRegressionManual())
    assert strategy.launcher.procs == []


# ------------------------------------------------------------------ real jobs

SAVED = "micro_batches.ckpt"
CASES = [
    {"name": "reference"},
    {"name": "fixed 8", "chunk_size": 8},
    {"name": "reference, accumulate 2", "accumulate": 2},
    {"name": "fixed 8, accumulate 2", "chunk_size": 8, "accumulate": 2},
    {"name": "auto, rank 1 in the forward", "chunk_size": "auto", "limits": {"1": 8}, "phase": "forward"},
    {
        "name": "auto, both ranks in the backward",
        "chunk_size": "auto",
        "limits": {"0": 16, "1": 8},
        "phase": "backward",
    },
    {  # chunks of 16 from the plan; rank 1's second chunk (the synced one, after the first chunk's gradients) fails
        # before any gradient of its own is ready, while rank 0's backward waits for every bucket
        "name": "auto, rank 1 in a synced backward after a chunk",
        "chunk_size": "auto",
        "limits": {"1": 0},
        "at_calls": [1],
        "phase": "backward",
        "plan": {"chunk_size": 16, "world_size": 2},
    },
    {"name": "auto, a later batch", "chunk_size": "auto", "limits": {"0": 8}, "from_step": 2, "save_to": SAVED},
    {
        "name": "fixed 8, with sharding, telemetry and the replica guard",
        "chunk_size": 8,
        "strategy": {"optimizer_sharding": True, "telemetry": True, "verify_replicas_every_n_steps": 1},
    },
    {"name": "fixed 8, static graph", "chunk_size": 8, "strategy": {"static_graph": True}},
    {"name": "fixed 8, uneven inputs joined", "chunk_size": 8, "strategy": {"uneven_inputs": "join"}},
    # `ddp-plus check`'s suggestion in the run's folder: "auto" starts from it, and never runs out of memory here
    {
        "name": "auto, from the memory plan",
        "chunk_size": "auto",
        "limits": {"1": 8},
        "plan": {"chunk_size": 8, "world_size": 2},
    },
    {  # a plan made for another world size is not used: the whole batch first, as without one
        "name": "auto, a plan of another world size",
        "chunk_size": "auto",
        "limits": {"1": 8},
        "plan": {"chunk_size": 8, "world_size": 4},
    },
    {"name": "auto, no row fits", "chunk_size": "auto", "limits": {"1": 0}, "phase": "forward"},
    {"name": "reference, wide", "wide": True},
    {
        "name": "auto, address-space limit",
        "chunk_size": "auto",
        "limits": {"1": 224},
        "phase": "rlimit",
        "wide": True,
    },
]
#: The reference each case must equal, and the size it must end at (``None``: the whole batch).
EXPECTED = {
    "reference": ("reference", None),
    "fixed 8": ("reference", 8),
    "reference, accumulate 2": ("reference, accumulate 2", None),
    "fixed 8, accumulate 2": ("reference, accumulate 2", 8),
    "auto, rank 1 in the forward": ("reference", 8),
    "auto, both ranks in the backward": ("reference", 8),
    "auto, rank 1 in a synced backward after a chunk": ("reference", 8),
    "auto, a later batch": ("reference", 8),
    "auto, from the memory plan": ("reference", 8),
    "auto, a plan of another world size": ("reference", 8),
    "fixed 8, with sharding, telemetry and the replica guard": ("reference", 8),
    "fixed 8, static graph": ("reference", 8),
    "fixed 8, uneven inputs joined": ("reference", 8),
    "reference, wide": ("reference, wide", None),
    "auto, address-space limit": ("reference, wide", None),  # the size the allocator allows: checked below
}


@pytest.fixture(scope="module")
def chunk_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("micro_batches")
    cases = [{**case, "save_to": str(folder / case["save_to"])} if "save_to" in case else case for case in CASES]
    cases = [{**case, "plan_root": str(folder / "runs" / case["name"])} if "plan" in case else case for case in cases]
    # one arena: a thread's own malloc arena would reserve 64 MiB of the address space the limit case measures
    results = run_case_job("chunk_job.py", cases, folder / "results.json", env={"MALLOC_ARENA_MAX": "1"})
    return {result["name"]: result for result in results}, folder


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_case_equals_its_reference_on_identical_replicas(chunk_results, name):
    results, _ = chunk_results
    result = results[name]
    assert result["error"] is None, result["error"]
    reference_name, size = EXPECTED[name]
    reference = torch.tensor(results[reference_name]["params"][0])
    rank0, rank1 = (torch.tensor(p) for p in result["params"])
    assert torch.equal(rank0, rank1)  # identical replicas
    assert torch.allclose(rank0, reference, atol=1e-5, rtol=0), float((rank0 - reference).abs().max())
    # one all-reduce and one optimizer step per batch (or window): the global batch did not change
    assert result["optimizer_steps"] == results[reference_name]["optimizer_steps"] == result["global_step"]
    if not result.get("wide"):  # one gradient bucket: one all-reduce per step, and one per failed attempt
        extra = 1 if result.get("strategy", {}).get("static_graph") else 0  # R3: the run's first chunk syncs
        assert result["hook_calls"] == result["optimizer_steps"] + len(result["changes"]) + extra
        assert result["size"] == size


@pytest.mark.multiprocess
def test_auto_halves_on_every_rank_and_names_the_rank_that_failed(chunk_results):
    results, _ = chunk_results
    assert results["auto, rank 1 in the forward"]["changes"] == [[32, 16, [1]], [16, 8, [1]]]
    assert results["auto, both ranks in the backward"]["changes"] == [[32, 16, [0, 1]], [16, 8, [1]]]
    assert results["auto, a later batch"]["changes"] == [[32, 16, [0]], [16, 8, [0]]]
    assert results["auto, from the memory plan"]["changes"] == []  # started from the plan's 8 rows
    assert results["auto, a plan of another world size"]["changes"] == [[32, 16, [1]], [16, 8, [1]]]
    limited = results["auto, address-space limit"]
    assert limited["changes"] and all(ranks == [1] for _, _, ranks in limited["changes"])
    assert limited["size"] == limited["changes"][-1][1] < 32  # a real allocation failure, and a size that held


@pytest.mark.multiprocess
def test_when_not_even_one_row_fits_every_rank_ends_with_an_error_that_says_so(chunk_results):
    results, _ = chunk_results
    failed = results["auto, no row fits"]
    assert failed["error"].startswith(
        "ChunkOutOfMemoryError: chunk_size='auto': out of memory on rank 1 in the forward of 1 rows with "
        "chunks of a single row, so no chunk size fits. Fix:"
    )
    assert [change[:2] for change in failed["changes"]] == [[32, 16], [16, 8], [8, 4], [4, 2], [2, 1]]
    assert failed["global_step"] == 0  # no optimizer step was applied
    assert torch.equal(*(torch.tensor(p) for p in failed["params"]))  # and the replicas still agree


def test_a_model_with_batch_normalization_is_warned_that_its_statistics_are_per_chunk():
    from torch import nn

    from lightning_ddp_plus.sync.chunks import refuse_chunks

    with pytest.warns(UserWarning, match=r"chunk_size=8: the model has batch normalization.*per chunk"):
        refuse_chunks(8, manual=False, accumulation_steps=1, module=nn.Sequential(nn.BatchNorm1d(4)))


def test_an_attempt_run_again_starts_from_the_running_statistics_before_it():
    """BatchNorm's kernel updates its running statistics without moving their version counter: the batch retried
    after an out-of-memory error must still start from the statistics as they were (before: only
    ``num_batches_tracked`` was put back)."""
    from torch import nn

    from lightning_ddp_plus.sync.chunk_runner import BufferSnapshot

    torch.manual_seed(0)
    model, snapshot = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), BufferSnapshot()
    first = snapshot.take(model)
    model(torch.randn(8, 4))
    snapshot.learn(model, first)
    assert snapshot.changing == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    saved = snapshot.take(model)
    model(torch.randn(8, 4))  # the attempt that fails after its forward
    BufferSnapshot.restore(model, saved)
    assert {name: torch.equal(buffer, before[name]) for name, buffer in model.named_buffers()} == dict.fromkeys(
        before, True
    )


@pytest.mark.multiprocess
def test_the_size_reached_is_saved_and_a_resume_starts_from_it(chunk_results):
    _, folder = chunk_results
    path = folder / SAVED
    assert torch.load(path, weights_only=False)[CHECKPOINT_KEY] == {"chunk_size": 8}
    resumed = DDPPlusStrategy(chunk_size="auto")
    resumed.load_checkpoint(path)
    assert resumed.engine.chunks.size == 8
    fixed = DDPPlusStrategy(chunk_size=4)  # a size the user fixed stays theirs
    fixed.load_checkpoint(path)
    assert fixed.engine.chunks.size == 4


# ------------------------------------------------------------------ the former names, kept as deprecated aliases


def test_the_former_argument_name_still_sets_the_chunk_size_and_says_it_was_renamed():
    with pytest.warns(
        DeprecationWarning, match=r"`micro_batch_size` is renamed `chunk_size`.*Fix: write `chunk_size=8`"
    ):
        strategy = DDPPlusStrategy(micro_batch_size=8)
    assert strategy.arguments.chunk_size == 8


def test_fabric_takes_the_former_argument_name_too():
    from lightning_ddp_plus import DDPPlusFabricStrategy

    with pytest.warns(DeprecationWarning, match=r"`micro_batch_size` is renamed `chunk_size`"):
        strategy = DDPPlusFabricStrategy(micro_batch_size="auto")
    assert strategy.arguments.chunk_size == "auto"


def test_both_names_given_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"`micro_batch_size=8`.*`chunk_size=4` is given too.*Fix: keep `chunk_size`"):
        DDPPlusStrategy(chunk_size=4, micro_batch_size=8)


def test_the_former_class_names_are_the_new_classes_with_a_warning():
    import lightning_ddp_plus

    with pytest.warns(DeprecationWarning, match=r"`MicroBatch` is renamed `Chunk`"):
        former = lightning_ddp_plus.MicroBatch
    assert former is lightning_ddp_plus.Chunk
    with pytest.warns(DeprecationWarning, match=r"`MicroBatchOutOfMemoryError` is renamed `ChunkOutOfMemoryError`"):
        former_error = lightning_ddp_plus.MicroBatchOutOfMemoryError
    assert former_error is lightning_ddp_plus.ChunkOutOfMemoryError


def test_a_checkpoint_saved_under_the_former_key_resumes_its_size(tmp_path):
    path = tmp_path / "before-the-rename.ckpt"
    torch.save({CHECKPOINT_KEY: {"micro_batch_size": 8}}, path)
    resumed = DDPPlusStrategy(chunk_size="auto")
    resumed.load_checkpoint(path)
    assert resumed.engine.chunks.size == 8


def test_a_memory_plan_written_under_the_former_key_is_read(tmp_path):
    from lightning_ddp_plus.memory.suggestion import SUGGESTION_FILE, read_suggestion

    former = {"micro_batch_size": 8, "world_size": 2, "device_memory": 2**30, "parameters": 1000}
    (tmp_path / SUGGESTION_FILE).write_text(json.dumps(former))
    assert read_suggestion(tmp_path).chunk_size == 8


def test_fabrics_former_method_name_warns_and_runs_the_new_one():
    from lightning_ddp_plus import DDPPlusFabricStrategy

    strategy = DDPPlusFabricStrategy()
    with (
        pytest.warns(DeprecationWarning, match=r"`train_micro_batches` is renamed `train_in_chunks`"),
        pytest.raises(RuntimeError, match=r"train_in_chunks needs the module set up first"),
    ):
        strategy.train_micro_batches(torch.nn.Linear(2, 1), torch.zeros(4, 2), lambda module, chunk: module(chunk))
