"""Elastic restart under ``torchrun --max-restarts 1``: rank 1 is killed with SIGKILL mid-epoch; the restarted attempt
forms its process group, resumes by itself from the last checkpoint at the batch where it was taken, and ends with the
parameters and ``global_step`` of an uninterrupted run (real processes, gloo)."""

import json
import shutil

import pytest
import torch

from tests.helpers import run_job, torchrun_command

pytestmark = pytest.mark.multiprocess


def torchrun_job(tmp_path, name: str, kill_at: int, k: int) -> tuple[dict, str]:
    out, ckpt = tmp_path / f"{name}.json", tmp_path / f"{name}-ckpt"
    result = run_job(torchrun_command("restart_job.py", out, ckpt, kill_at, k), timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    shutil.rmtree(ckpt, ignore_errors=True)
    return json.loads(out.read_text()), result.stdout


@pytest.mark.parametrize(("kill_at", "k"), [(5, 1), (3, 2)])
def test_killed_rank_restarts_resumes_mid_epoch_and_matches_an_uninterrupted_run(tmp_path, kill_at, k):
    whole, _ = torchrun_job(tmp_path, "whole", kill_at=-1, k=k)
    restarted, output = torchrun_job(tmp_path, "restarted", kill_at=kill_at, k=k)
    assert f"rank 1 kills itself at step {kill_at}" in output
    assert restarted["attempt"] == 1 and f"attempt 1 rank 0 trains from step {kill_at}" in output
    assert "resumes from the newest readable checkpoint" in output and f"skipping the {kill_at * k} batches" in output
    assert restarted["global_step"] == whole["global_step"] == 10 // k
    # the restarted attempt trained exactly the micro-batches after the checkpoint, in the uninterrupted order
    after_restart = [value for attempt, value in restarted["seen"] if attempt == 1]
    assert after_restart == [value for _, value in whole["seen"]][kill_at * k :]
    diff = (torch.tensor(restarted["params"]) - torch.tensor(whole["params"])).abs().max()
    assert diff <= 1e-6, diff
