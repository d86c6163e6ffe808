"""What a survivors' save cannot make, refuses or must agree on, after a rank's death: one real job each (the popen
launcher, a rank SIGKILLed or ending on an error; 3 ranks, 2 nodes or a full filesystem where the case needs them).
The cases whose save is made and resumed are ``test_rank_death.py``'s."""

import json
import re
import shutil
import subprocess
import threading

import pytest

from tests.helpers import free_port, mount_unavailable_reason, python_script, run_job, small_filesystem


@pytest.mark.multiprocess
def test_under_optimizer_sharding_nothing_is_saved_the_error_says_why_and_the_periodic_file_is_whole(tmp_path):
    import torch

    case = {"to": 1, "at": "backward", "save_every": 2, "sharding": True}
    result = run_job(python_script("rank_death_job.py") + ["kill", str(tmp_path), json.dumps(case)], timeout=200)
    assert result.returncode == 1, result.stdout[-4000:]
    outcome = json.loads((tmp_path / "outcome-rank0.json").read_text())
    assert outcome["step"] is None and outcome["gone"] == [1]
    for words in ("rank 1 is gone", "nothing was saved", "optimizer_sharding", "periodic checkpoint"):
        assert words in outcome["error"], (words, outcome["error"])
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()
    periodic = torch.load(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", weights_only=False)
    assert periodic["global_step"] == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "words"),
    [
        # rank 2 of 3 dies; the writer's save runs a collective (a gather in `on_save_checkpoint`) that fails
        # against it: the failure is announced, so the other survivor ends with it (before: it waited 300 s for a
        # save that never came, then said rank 0 "did not say it had")
        (
            {"to": 2, "at": "backward", "world": 3, "gather_in_save": True},
            ["rank 2 is gone", "nothing was saved: writing", "failed"],
        ),
        # issue 57, item 5: manual optimization with two optimizers (a GAN); rank 1 dies in the second optimizer's
        # backward, after the first one stepped: a save would hold half a batch (before: saved, the counters a
        # step off the data for the rest of the epoch)
        (
            {"to": 1, "at": "second_backward", "gan": True, "step": 6},
            ["rank 1 is gone", "nothing was saved", "1 of its optimizer steps", "half a batch"],
        ),
        # issue 57, item 9: with `preemption_signals=[]` Lightning's SIGTERM handler broadcasts inside the handler;
        # a SIGTERM lands half-way through the survivor's optimizer step, after rank 1 died, and the broadcast fails
        # there (before: that half-applied step was saved as "optimizer step 3")
        (
            {"to": 1, "at": "optimizer_step", "step": 3, "signals": [], "by_group": True},
            ["rank 1 is gone", "nothing was saved", "signal handler", "SIGTERM"],
        ),
        # issue 57 (lower severity): rank 1's own exception after step 4 (a NaN check) ends its process; that is not
        # a death to save after (before: rank 0 saved that step over last.ckpt, NaN weights and all)
        (
            {"to": 1, "at": "own_error", "step": 3},
            ["nothing was saved", "rank 1 ended with an error of its own", "AssertionError: the loss is nan"],
        ),
    ],
)
def test_what_cannot_be_saved_without_the_dead_rank_is_refused_and_every_survivor_says_so(tmp_path, case, words):
    result = run_job(python_script("rank_death_job.py") + ["kill", str(tmp_path), json.dumps(case)], timeout=200)
    assert result.returncode == 1, result.stdout[-4000:]
    survivors = [rank for rank in range(case.get("world", 2)) if rank != case["to"]]
    for rank in survivors:
        assert (tmp_path / f"outcome-rank{rank}.json").exists(), (rank, result.stdout[-4000:])
        outcome = json.loads((tmp_path / f"outcome-rank{rank}.json").read_text())
        assert outcome["step"] is None, (rank, outcome["error"])
        for said in words:
            assert said in outcome["error"], (rank, said, outcome["error"])
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()


@pytest.mark.multiprocess
def test_on_two_nodes_the_children_of_a_nodes_dead_launcher_agree_through_the_job_store(tmp_path):
    """Issue 57, item 11: 2 nodes of 2 ranks started by Lightning's popen launcher, one command per node; node 1's
    launching process (global rank 2) is SIGKILLed. Its child (rank 3) took its parent for global rank 0, the store's
    host, and decided alone (writing its own file, racing the writer the store chose); the store lives on node 0."""
    case = {"to": 2, "at": "backward", "nodes": 2}
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = python_script("rank_death_job.py") + ["kill", str(tmp_path), json.dumps(case)]
    results: dict[int, subprocess.CompletedProcess] = {}
    nodes = [
        threading.Thread(target=lambda n=node: results.update({n: run_job(args, 200, {**env, "NODE_RANK": str(n)})}))
        for node in (0, 1)
    ]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join()
    said = {}
    for rank in (0, 1, 3):
        assert (tmp_path / f"outcome-rank{rank}.json").exists(), (rank, results[rank // 2].stdout[-3000:])
        outcome = json.loads((tmp_path / f"outcome-rank{rank}.json").read_text())
        assert 2 in outcome["gone"] and 3 not in outcome["gone"], (rank, outcome["error"])
        assert "decided alone" not in outcome["error"], (rank, outcome["error"])
        said[rank] = re.search(r"saved optimizer step (\d+) to .* \(written by rank (\d+)", outcome["error"]).groups()
    assert len(set(said.values())) == 1, said  # one writer, one step, the same in every survivor's report


@pytest.mark.multiprocess
def test_a_full_disk_during_the_survivors_save_keeps_the_previous_file_whole_and_says_so(tmp_path):
    reason = mount_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with small_filesystem(tmp_path, "1m") as checkpoints:
        previous = checkpoints / "last.ckpt"
        previous.write_bytes(b"the previous checkpoint, whole")
        room = shutil.disk_usage(checkpoints).free
        (checkpoints / "filler").write_bytes(b"\0" * (room - 4096))  # 4 KiB left; a checkpoint is about 10 KiB
        case = {"to": 1, "at": "backward", "checkpoints": str(checkpoints)}
        result = run_job(python_script("rank_death_job.py") + ["kill", str(tmp_path), json.dumps(case)], timeout=200)
        assert result.returncode == 1, result.stdout[-4000:]
        outcome = json.loads((tmp_path / "outcome-rank0.json").read_text())
        assert outcome["step"] is None and outcome["gone"] == [1]
        for words in ("rank 1 is gone", "nothing was saved: writing", "No space left on device", "is whole"):
            assert words in outcome["error"], (words, outcome["error"])
        assert previous.read_bytes() == b"the previous checkpoint, whole"
        assert sorted(path.name for path in checkpoints.iterdir()) == ["filler", "last.ckpt"]  # no temporary file


def test_a_users_zero_redundancy_optimizer_is_refused_before_the_survivors_write(tmp_path):
    """Issue 57, item 8: a user's ``ZeroRedundancyOptimizer`` holds each rank's shard of its state on that rank only,
    and saving it gathers them (``consolidate_state_dict``), which fails against the dead rank (before: unannounced,
    as above). The survivors' save is refused before any write, naming what to resume from. A real optimizer on a
    real one-rank gloo group, and the strategy's own survivor save."""
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_ddp_plus import DDPPlusStrategy
    from lightning_ddp_plus.frontends.after_death import survivor_save_of
    from tests.helpers import process_group_ended_after

    written: list[bool] = []
    with process_group_ended_after():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        strategy = DDPPlusStrategy(process_group_backend="gloo")
        model = torch.nn.Linear(4, 2)
        strategy.optimizers = [ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)]
        path = str(tmp_path / "last.ckpt")
        save = survivor_save_of(
            strategy, "zero", step=3, cause="gone", path=path, write=lambda: written.append(True), resume_from="X"
        )
    assert save.not_savable is not None
    assert "ZeroRedundancyOptimizer" in save.not_savable and "resume from X" in save.not_savable
    assert written == []
