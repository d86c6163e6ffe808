"""Checkpoints and resumes in real 2-rank jobs (gloo): a torn ``last.ckpt`` (copy and ``"link"`` forms), nothing
readable, a small system temp dir, and the checkpoint directory's disk filling up during a save."""

import json
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    mount_unavailable_reason,
    python_script,
    run_case_job,
    small_filesystem,
    start_ranks,
)

pytestmark = pytest.mark.multiprocess
needs_mount = pytest.mark.skipif(mount_unavailable_reason() is not None, reason=str(mount_unavailable_reason()))

TORN = "is torn or not a torch checkpoint"


def largest_difference(a: list, b: list) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


@needs_mount
def test_resume_skips_torn_checkpoints_and_a_small_temp_dir_does_not_stop_saving(tmp_path):
    directory = {name: str(tmp_path / name) for name in "ABCDE"}
    with small_filesystem(tmp_path, "20m") as small_tmp:
        cases = [
            {"name": "uninterrupted", "dir": directory["A"], "max_steps": 10},
            {"name": "first", "dir": directory["B"], "max_steps": 6},
            # the case: last.ckpt cut to half its size, the job run again with resume_from_last="always"
            {
                "name": "torn",
                "dir": directory["B"],
                "max_steps": 10,
                "tear": ["last.ckpt"],
                "resume_from_last": "always",
            },
            {"name": "first_link", "dir": directory["C"], "max_steps": 6, "save_last": "link"},
            # save_last="link": tearing last.ckpt tears the file it points to, so both are skipped
            {"name": "torn_link", "dir": directory["C"], "max_steps": 10, "tear": ["last.ckpt"], "ckpt_path": "last"},
            {"name": "first_none", "dir": directory["D"], "max_steps": 2},
            {
                "name": "none_always",
                "dir": directory["D"],
                "max_steps": 4,
                "tear": ["last.ckpt", "epoch=0-step=2.ckpt"],
                "resume_from_last": "always",
            },
            {"name": "none_last", "dir": directory["D"], "max_steps": 4, "ckpt_path": "last"},
            # Python's temp dir (where Lightning's own checkpoint IO stages a save) on a 20 MB filesystem, 34 MB saves
            {"name": "small_tmp", "dir": directory["E"], "max_steps": 2, "ballast_mb": 34, "tempdir": str(small_tmp)},
        ]
        results = {case["name"]: case for case in run_case_job("checkpoint_job.py", cases, tmp_path / "out.json")}
        assert list(small_tmp.iterdir()) == []
    reference = results["uninterrupted"]["params"][0]
    for name in ("torn", "torn_link", "none_last", "uninterrupted"):
        assert results[name]["error"] is None, results[name]["message"]
        assert results[name]["params"][0] == results[name]["params"][1]  # every rank loaded the same file

    # only rank 0 calls torch.save, once for each of Lightning's saves, as Lightning's own test asks of DDP
    rank0, rank1 = results["uninterrupted"]["save_calls"]
    assert rank0["checkpoint"] > 0
    assert rank0["torch"] == rank0["checkpoint"]
    assert rank1["torch"] == 0

    torn = results["torn"]
    assert torn["start_step"] == [6, 6] and torn["global_step"] == 10  # epoch=0-step=6.ckpt, nothing redone
    assert largest_difference(torn["params"][0], reference) <= 1e-6
    (warning,) = torn["warnings"]
    assert f"{directory['B']}/last.ckpt {TORN}" in warning
    assert f"Resuming from {directory['B']}/epoch=0-step=6.ckpt, the newest readable checkpoint" in warning

    link = results["torn_link"]
    assert results["first_link"]["links"] == {"last.ckpt": "epoch=0-step=6.ckpt"}
    assert link["start_step"] == [4, 4]  # two steps redone from epoch=0-step=4.ckpt
    assert largest_difference(link["params"][0], reference) <= 1e-6
    assert "last.ckpt" in link["warnings"][0] and "epoch=0-step=6.ckpt is torn" in link["warnings"][0]

    always = results["none_always"]
    assert always["error"] == "CheckpointResumeError" and always["start_step"] == [None, None]
    assert f"none of the 2 checkpoints in {directory['D']} is readable" in always["message"]
    assert "resume_from_last='on_restart'" in always["message"]
    last = results["none_last"]
    assert last["start_step"] == [0, 0] and "Starting from scratch" in last["warnings"][0]

    small = results["small_tmp"]
    assert small["error"] is None, small["message"]
    assert small["files"] == {"epoch=0-step=2.ckpt": None, "last.ckpt": None}


@needs_mount
def test_a_full_checkpoint_disk_ends_the_job_keeps_what_was_saved_and_a_later_resume_works(tmp_path):
    case = {"dir": None, "ballast_mb": 6, "save_last": False, "timeout": "30s"}
    with small_filesystem(tmp_path, "20m") as directory:
        fill = {**case, "name": "fill", "dir": str(directory), "max_steps": 10, "reraise": True}
        started = time.monotonic()
        outputs = start_ranks(python_script("checkpoint_job.py") + [str(tmp_path / "fill.json"), json.dumps([fill])])
        elapsed = time.monotonic() - started
        assert [result.returncode for result in outputs] == [1, 1], outputs[0].stdout[-3000:]
        assert elapsed < 120, elapsed
        rank0 = outputs[0].stdout
        assert f"CheckpointSaveError: [Errno 28] Saving the checkpoint {directory}/epoch=0-step=8.ckpt failed" in rank0
        assert "No space left on device" in rank0 and f"on the filesystem of {directory})" in rank0
        assert "rank 1 ends with" in outputs[1].stdout
        from lightning_ddp_plus.persistence.files import unreadable_reason

        kept = {path.name: unreadable_reason(path) for path in directory.iterdir()}
        assert kept == {f"epoch=0-step={step}.ckpt": None for step in (2, 4, 6)}  # whole, and no temporary file

        (directory / "epoch=0-step=2.ckpt").unlink()  # the user frees space
        cases = [
            {**case, "name": "uninterrupted", "dir": str(tmp_path / "A"), "max_steps": 8},
            {**case, "name": "resume", "dir": str(directory), "max_steps": 8, "resume_from_last": "always"},
        ]
        uninterrupted, resumed = run_case_job("checkpoint_job.py", cases, tmp_path / "out.json")
    assert resumed["error"] is None, resumed["message"]
    assert resumed["start_step"] == [6, 6] and resumed["global_step"] == 8
    assert largest_difference(resumed["params"][0], uninterrupted["params"][0]) <= 1e-6
    assert Path(tmp_path / "A").exists()
