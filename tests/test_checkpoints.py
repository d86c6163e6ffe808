"""Atomic checkpoint writes, the readability check, and the choice of the checkpoint a resume uses: real files, real
faults (a small tmpfs as the temp dir, a full tmpfs, a SIGKILL during a save), no processes beyond a forked saver."""

import errno
import os
import signal
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins import AsyncCheckpointIO

from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy
from lightning_ddp_plus.persistence import resume
from lightning_ddp_plus.persistence.files import choose_resume, resume_candidates, unreadable_reason
from lightning_ddp_plus.persistence.io import (
    TEMPORARY_SUFFIX,
    AtomicCheckpointIO,
    CheckpointSaveError,
    remove_stale_temporaries,
)
from tests.helpers import REPO_ROOT, mount_unavailable_reason, process_group_ended_after, small_filesystem

needs_mount = pytest.mark.skipif(mount_unavailable_reason() is not None, reason=str(mount_unavailable_reason()))


def checkpoint_of(megabytes: float, step: int = 0) -> dict:
    return {"state_dict": {"w": torch.full((int(megabytes * 2**20 / 4),), float(step))}, "global_step": step}


def saved_step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


@pytest.fixture
def restore_tempdir():
    yield
    tempfile.tempdir = None


# ---------------------------------------------------------------------------------------------- atomic writes


def test_save_replaces_the_target_whole_and_leaves_no_temporary_file(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint_of(0.1, step=1), tmp_path / "sub" / "last.ckpt")
    io.save_checkpoint(checkpoint_of(0.1, step=2), tmp_path / "sub" / "last.ckpt")
    assert saved_step(tmp_path / "sub" / "last.ckpt") == 2
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["last.ckpt"]
    assert oct((tmp_path / "sub" / "last.ckpt").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failing_save_leaves_the_previous_file_and_no_temporary_file(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint_of(0.1, step=1), tmp_path / "last.ckpt")
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        io.save_checkpoint({**checkpoint_of(0.1, step=2), "bad": Unpicklable()}, tmp_path / "last.ckpt")
    assert saved_step(tmp_path / "last.ckpt") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_symlink_target_is_replaced_and_the_file_it_pointed_to_is_untouched(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint_of(0.1, step=4), tmp_path / "epoch=0-step=4.ckpt")
    (tmp_path / "last.ckpt").symlink_to("epoch=0-step=4.ckpt")  # ModelCheckpoint(save_last="link")
    io.save_checkpoint(checkpoint_of(0.1, step=6), tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink() and saved_step(tmp_path / "last.ckpt") == 6
    assert saved_step(tmp_path / "epoch=0-step=4.ckpt") == 4


def test_the_checkpoint_io_you_pass_stays_yours_and_plain_torch_saves_stay_atomic(tmp_path):
    class Recording(TorchCheckpointIO):
        def __init__(self) -> None:
            self.paths: list[Path] = []

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.paths.append(Path(path))
            super().save_checkpoint(checkpoint, path, storage_options)

    # Lightning's own IO: the same object, and the strategy's saves go through a temporary file beside the target
    plain = TorchCheckpointIO()
    strategy = DDPPlusStrategy(checkpoint_io=plain)
    assert strategy.checkpoint_io is plain
    written = []
    original = AtomicCheckpointIO.save_checkpoint

    def recording_save(self, checkpoint, path, storage_options=None):
        written.append(type(self).__name__)
        original(self, checkpoint, path, storage_options)

    AtomicCheckpointIO.save_checkpoint = recording_save
    try:
        strategy.save_checkpoint(checkpoint_of(0.1, step=3), tmp_path / "last.ckpt")
    finally:
        AtomicCheckpointIO.save_checkpoint = original
    assert written == ["AtomicCheckpointIO"] and strategy.checkpoint_io is plain
    assert saved_step(tmp_path / "last.ckpt") == 3 and len(list(tmp_path.iterdir())) == 1
    # your own class: kept, with its methods and attributes, saving where it saves, said once
    recording = Recording()
    strategy = DDPPlusStrategy(checkpoint_io=recording)
    assert strategy.checkpoint_io is recording and strategy.checkpoint_io.paths == []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in (4, 5):
            strategy.save_checkpoint(checkpoint_of(0.1, step=step), tmp_path / "own.ckpt")
    said = [str(w.message) for w in warned if "kept as you passed it" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("atomic_checkpoints: Recording is your checkpoint IO")
    assert recording.paths == [tmp_path / "own.ckpt"] * 2 and saved_step(tmp_path / "own.ckpt") == 5
    # wrapped by you: it writes to the temporary path, which is renamed over the target
    wrapped = DDPPlusStrategy(checkpoint_io=AtomicCheckpointIO(recording))
    wrapped.save_checkpoint(checkpoint_of(0.1, step=6), tmp_path / "wrapped.ckpt")
    assert recording.paths[-1].name.endswith(TEMPORARY_SUFFIX) and saved_step(tmp_path / "wrapped.ckpt") == 6
    # the defaults Lightning would create are the atomic ones; switching it off keeps Lightning's own IO
    async_io = AsyncCheckpointIO()
    assert DDPPlusStrategy(checkpoint_io=async_io).checkpoint_io is async_io
    assert isinstance(async_io.checkpoint_io, AtomicCheckpointIO)
    assert type(DDPPlusStrategy().checkpoint_io) is AtomicCheckpointIO
    assert type(DDPPlusStrategy(atomic_checkpoints=False).checkpoint_io) is TorchCheckpointIO
    assert isinstance(DDPPlusFabricStrategy().checkpoint_io, AtomicCheckpointIO)  # fabric.save writes atomically too


def test_temporaries_of_a_killed_save_are_removed_by_the_next_save_in_that_directory(tmp_path):
    stale = tmp_path / f".last.ckpt.0000{TEMPORARY_SUFFIX}"
    stale.write_bytes(b"half a checkpoint")
    os.utime(stale, (1, 1))  # older than this process
    fresh = tmp_path / f".last.ckpt.1111{TEMPORARY_SUFFIX}"
    fresh.write_bytes(b"a save in progress")
    AtomicCheckpointIO().save_checkpoint(checkpoint_of(0.1), tmp_path / "last.ckpt")
    assert not stale.exists() and fresh.exists()
    assert remove_stale_temporaries(tmp_path) == []


@needs_mount
def test_a_small_system_temp_dir_does_not_stop_checkpointing(tmp_path, restore_tempdir):
    """The issue's case: TMPDIR on a 20 MB filesystem, the checkpoint directory on a disk with room, 34 MB."""
    with small_filesystem(tmp_path, "20m") as small_tmp:
        tempfile.tempdir = str(small_tmp)
        checkpoint = checkpoint_of(34)
        with pytest.raises(OSError) as stock_error:  # Lightning's own checkpoint IO stages the save there
            TorchCheckpointIO().save_checkpoint(checkpoint, tmp_path / "stock" / "last.ckpt")
        assert stock_error.value.errno == errno.ENOSPC
        AtomicCheckpointIO().save_checkpoint(checkpoint, tmp_path / "ours" / "last.ckpt")
        assert unreadable_reason(tmp_path / "ours" / "last.ckpt") is None
        assert list(small_tmp.iterdir()) == []


@needs_mount
def test_a_full_disk_names_the_path_keeps_the_previous_checkpoint_and_leaves_no_temporary(tmp_path):
    with small_filesystem(tmp_path, "20m") as directory:
        io = AtomicCheckpointIO()
        io.save_checkpoint(checkpoint_of(12, step=2), directory / "last.ckpt")
        with pytest.raises(CheckpointSaveError) as error:
            io.save_checkpoint(checkpoint_of(12, step=4), directory / "last.ckpt")
        assert error.value.errno == errno.ENOSPC and isinstance(error.value, OSError)
        message = str(error.value)
        assert f"Saving the checkpoint {directory / 'last.ckpt'} failed" in message
        assert "No space left on device" in message and "MiB free of 20.0 MiB" in message
        assert "point `ModelCheckpoint(dirpath=...)` at a filesystem with room" in message
        assert saved_step(directory / "last.ckpt") == 2
        assert [p.name for p in directory.iterdir()] == ["last.ckpt"]


class _PausingFile:
    """The save's file, written a MiB at a time, pausing before each MiB (what ``_saved_with_events`` reports as
    ``w``)."""

    def __init__(self, handle: object, pause: object) -> None:
        self.handle, self.pause = handle, pause

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        for start in range(0, len(view), 2**20):
            self.pause(b"w")
            self.handle.write(view[start : start + 2**20])
        return len(view)

    def __getattr__(self, name: str) -> object:
        return getattr(self.handle, name)

    def __enter__(self) -> object:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def _saved_with_events(directory: Path, checkpoint: dict, io: object, kill_at: int | None) -> tuple[bool, list[bytes]]:
    """Fork a process that saves ``checkpoint`` to ``directory/last.ckpt`` and stops at each event of the save (a
    MiB written to the temporary file ``w``, an fsync ``f``, the rename ``r``) until told to go on; SIGKILL it at the
    ``kill_at``-th event (``None``: never). Returns whether the save finished, and the events reached."""
    events_read, events_write = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the saving process: the real save, paused at its events
        try:
            os.close(events_read)
            os.close(go_write)

            def pause(event: bytes) -> None:
                os.write(events_write, event)
                os.read(go_read, 1)

            fsync, replace, fdopen = os.fsync, os.replace, os.fdopen
            os.fsync = lambda fd: (pause(b"f"), fsync(fd))[1]
            os.replace = lambda a, b: (pause(b"r"), replace(a, b))[1]
            os.fdopen = lambda fd, *a, **k: _PausingFile(fdopen(fd, *a, **k), pause)
            io.save_checkpoint(checkpoint, directory / "last.ckpt")
            os.write(events_write, b"d")
        finally:
            os._exit(0)
    os.close(events_write)
    os.close(go_read)
    events: list[bytes] = []
    try:
        while (event := os.read(events_read, 1)) not in (b"", b"d"):
            events.append(event)
            if len(events) == kill_at:
                os.kill(pid, signal.SIGKILL)
                break
            os.write(go_write, b"g")
        os.waitpid(pid, 0)
        return event == b"d", events
    finally:
        os.close(events_read)
        os.close(go_write)


@needs_mount
def test_sigkill_at_every_stage_of_a_save_never_leaves_a_torn_checkpoint(tmp_path):
    """The checkpoint directory on a filesystem of its own (a tmpfs); 20 kills spread over the events a save reaches
    (each MiB written to the temporary file, its fsync, the rename, the directory's fsync), so each lands inside the
    save however loaded the machine is."""
    with small_filesystem(tmp_path, "200m") as directory:
        io = AtomicCheckpointIO()
        io.save_checkpoint(checkpoint_of(16, step=0), directory / "last.ckpt")
        finished, events = _saved_with_events(directory, checkpoint_of(16, step=0), io, kill_at=None)
        assert finished and events.count(b"r") == 1 and events.count(b"w") >= 10, events
        rename = events.index(b"r") + 1
        stages = sorted(
            {1 + (len(events) - 1) * attempt // 19 for attempt in range(20)} | {rename - 1, rename, rename + 1}
        )
        outcomes = []
        for attempt, kill_at in enumerate(stages, start=1):
            finished, reached = _saved_with_events(directory, checkpoint_of(16, step=attempt), io, kill_at)
            assert not finished and len(reached) == kill_at, (kill_at, reached)
            assert unreadable_reason(directory / "last.ckpt") is None, f"kill at event {kill_at}: torn"
            step = saved_step(directory / "last.ckpt")  # the previous file or the new one, never a part
            assert step == (attempt if kill_at > rename else attempt - 1), (kill_at, rename, step)
            outcomes.append((reached[-1].decode(), step == attempt))
            if step != attempt:  # killed before the rename: the previous file, whole; make it this try's
                io.save_checkpoint(checkpoint_of(16, step=attempt), directory / "last.ckpt")
            remove_stale_temporaries(directory)  # what the next run's first save does
        print("kills (event, renamed):", outcomes)
        assert len(outcomes) >= 20 and {event for event, _ in outcomes} == {"w", "f", "r"}


# ---------------------------------------------------------------------------------------------- readability


def test_unreadable_reason_tells_torn_empty_damaged_and_foreign_files(tmp_path):
    torch.save(checkpoint_of(0.5), tmp_path / "good.ckpt")
    data = (tmp_path / "good.ckpt").read_bytes()
    (tmp_path / "torn.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF  # inside the tensor's record
    (tmp_path / "damaged.ckpt").write_bytes(bytes(damaged))
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    assert unreadable_reason(tmp_path / "good.ckpt") is None
    assert unreadable_reason(tmp_path / "torn.ckpt").startswith("is torn or not a torch checkpoint")
    assert unreadable_reason(tmp_path / "empty.ckpt") == "is empty (0 bytes)"
    assert "fails its CRC-32 check" in unreadable_reason(tmp_path / "damaged.ckpt")
    assert unreadable_reason(tmp_path / "text.ckpt").startswith("is torn or not a torch checkpoint")
    assert unreadable_reason(tmp_path / "missing.ckpt") == "cannot be read (No such file or directory)"


def test_candidates_stay_inside_the_run_s_directories(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    torch.save(checkpoint_of(0.1), elsewhere / "foreign.ckpt")
    torch.save(checkpoint_of(0.1), run / "epoch=0-step=2.ckpt")
    os.utime(run / "epoch=0-step=2.ckpt", (100, 100))
    (run / "outside.ckpt").symlink_to(elsewhere / "foreign.ckpt")
    (run / "last.ckpt").symlink_to("gone.ckpt")  # dangling
    candidates = resume_candidates([run])
    assert [path.name for path in candidates] == ["last.ckpt", "epoch=0-step=2.ckpt"]
    choice = choose_resume(candidates)
    assert choice.path == str(run / "epoch=0-step=2.ckpt") and choice.candidates == 2
    assert choice.skipped == ((str(run / "last.ckpt"), "cannot be read (No such file or directory)"),)


@dataclass
class OwnConfig:
    width: int = 4


def test_the_resume_loads_weights_only_and_says_when_the_contents_need_more(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint_of(0.1, step=5), tmp_path / "plain.ckpt")
    io.save_checkpoint(
        {**checkpoint_of(0.1, step=6), "hyper_parameters": {"config": OwnConfig()}}, tmp_path / "own.ckpt"
    )
    warnings: list[str] = []
    assert resume.load(io, str(tmp_path / "plain.ckpt"), warnings.append)["global_step"] == 5
    assert warnings == []
    loaded = resume.load(io, str(tmp_path / "own.ckpt"), warnings.append)
    assert loaded["hyper_parameters"]["config"] == OwnConfig() and len(warnings) == 1
    assert "OwnConfig" in warnings[0] and "loaded with `weights_only=False`" in warnings[0]
    assert "add_safe_globals" in warnings[0]


def test_the_save_benchmark_runs_and_the_atomic_save_keeps_no_serialized_copy_in_memory(tmp_path):
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.checkpoint_save import compare

    result = compare(tmp_path / "bench", megabytes=2, repeats=1)
    assert set(result) == {"lightning", "atomic", "ratio_atomic_to_lightning"}
    # bytes, not times: Lightning's IO holds the serialized checkpoint in a BytesIO (and a copy of its value)
    assert result["lightning"]["python_heap_peak_mb"] >= 2
    assert result["atomic"]["python_heap_peak_mb"] < 0.5
    assert list((tmp_path / "bench").iterdir()) == []


class FirstStep(L.Callback):
    """Records the global step of a fit's first training batch (where a resume started)."""

    first: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first is None:
            self.first = trainer.global_step


def one_rank_trainer(root: Path, epochs: int, **kwargs):
    recorder = FirstStep()
    kwargs.setdefault("logger", None)
    trainer = L.Trainer(
        strategy=DDPPlusStrategy(process_group_backend="gloo"),
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        **kwargs,
    )
    return trainer, recorder


def test_last_finds_the_previous_runs_save_under_the_default_loggers_earlier_version(tmp_path, monkeypatch, caplog):
    """Issue 51, item 1: with the default logger and a ``ModelCheckpoint`` without ``dirpath`` a run saves in
    ``lightning_logs/version_K/checkpoints``; the next run writes to ``version_K+1`` and ``ckpt_path="last"`` looked
    only there, so it trained from scratch. A real first fit, then a real second one: the same job (its scheduler's
    job id, as a requeued SLURM job keeps it; issue 57, item 3 tells runs apart by it)."""
    from tests.helpers import TinyRegression

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with process_group_ended_after():
        first, _ = one_rank_trainer(tmp_path, epochs=1, logger=True)
        first.fit(TinyRegression(num_samples=32, batch_size=4))
        assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=8.ckpt").exists()
        second, started = one_rank_trainer(tmp_path, epochs=2, logger=True)
        with caplog.at_level("INFO"):
            second.fit(TinyRegression(num_samples=32, batch_size=4), ckpt_path="last")
    assert second.logger.version == 1 and started.first == 8 and second.global_step == 16
    said = [line for line in caplog.text.splitlines() if "resuming from" in line]
    assert len(said) == 1 and "version_0" in said[0], said  # one line: what was resumed
    assert "saved by this job (SLURM job 7)" in said[0], said  # and why it was chosen


@pytest.mark.parametrize("second_job", [None, "8"])
def test_last_leaves_another_experiments_save_under_an_earlier_version(tmp_path, monkeypatch, caplog, second_job):
    """Issue 57, item 3: a new experiment (another learning rate) shares ``default_root_dir`` with a finished one and
    calls ``fit(ckpt_path="last")``; it resumed the other run's ``version_0`` save at step 16 (stock starts at step
    0). A save of an earlier version is taken only when it records this run's own identity: no job id at all, or
    another job's, is another experiment."""
    from tests.helpers import TinyRegression

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with process_group_ended_after():
        first, _ = one_rank_trainer(tmp_path, epochs=2, logger=True)
        first.fit(TinyRegression(num_samples=32, batch_size=4))
        if second_job is None:
            monkeypatch.delenv("SLURM_JOB_ID")
        else:
            monkeypatch.setenv("SLURM_JOB_ID", second_job)
        second, started = one_rank_trainer(tmp_path, epochs=1, logger=True)
        with caplog.at_level("INFO"):
            second.fit(TinyRegression(num_samples=32, batch_size=4, lr=0.01), ckpt_path="last")
    assert second.logger.version == 1
    assert started.first == 0  # from scratch, as stock Lightning starts
    assert second.global_step == 8
    said = [line for line in caplog.text.splitlines() if "version_0" in line]
    assert len(said) == 1 and "another run's" in said[0], said  # the one line says why it was left


def test_last_finds_slurms_requeue_checkpoint(tmp_path, monkeypatch):
    """Issue 51, item 1: with SLURM's ``auto_requeue`` a preemption (or a survivor's) save goes to Lightning's
    ``hpc_ckpt_N.ckpt`` in ``default_root_dir``, where ``ckpt_path="last"`` did not look. SLURM is faked by its
    environment variables (Lightning's ``SLURMEnvironment`` reads them); the save and the resume are real."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from tests.helpers import TinyRegression

    with process_group_ended_after():
        first, _ = one_rank_trainer(tmp_path, epochs=1, enable_checkpointing=False, logger=False)
        first.fit(TinyRegression(num_samples=32, batch_size=4))
        first.save_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")  # what Lightning's requeue handler writes
    for name, value in {
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS_PER_NODE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    second, started = one_rank_trainer(
        tmp_path, epochs=2, enable_checkpointing=False, logger=False, plugins=[SLURMEnvironment(auto_requeue=True)]
    )
    with process_group_ended_after():
        second.fit(TinyRegression(num_samples=32, batch_size=4), ckpt_path="last")
    assert started.first == 8 and second.global_step == 16
