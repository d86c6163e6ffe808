"""Checkpoint/resume with accumulation, and multi-node training (2 nodes x 1 process on localhost) started the
two ways users start it, with real processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import (
    REPO_ROOT,
    clean_environment,
    console_script,
    free_port,
    kill_process_groups,
    python_script,
    start_ranks,
)

pytestmark = pytest.mark.multiprocess


def run_resume_job(tmp_path: Path, modes: str) -> dict:
    """Each of ``modes`` (joined by commas) on one pair of processes: its parameters and ``global_step``."""
    out = tmp_path / f"{modes}.json"
    args = python_script("resume_job.py") + [
        str(out),
        modes,
        str(tmp_path / "first.ckpt"),
        str(tmp_path / "writes.log"),
    ]
    for result in start_ranks(args, timeout=240):
        assert result.returncode == 0, result.stdout[-3000:]
    return json.loads(out.read_text())


def test_resume_matches_an_uninterrupted_run_and_checkpoints_are_written_once(tmp_path):
    runs = run_resume_job(tmp_path, "full,first")  # the uninterrupted run writes no checkpoint
    full, first = runs["full"], runs["first"]
    assert first["global_step"] == 3  # 8 micro-batches per epoch, k=3: windows 3, 3, 2
    assert (tmp_path / "writes.log").read_text().split() == ["0"]  # one write, by rank 0
    resumed = run_resume_job(tmp_path, "resume")["resume"]
    assert resumed["global_step"] == full["global_step"] == 6
    for report in (full, resumed):
        assert report["params"][0] == report["params"][1]
    difference = (torch.tensor(resumed["params"][0]) - torch.tensor(full["params"][0])).abs().max()
    assert difference <= 1e-6, difference


def multinode_config(tmp_path: Path, out: Path) -> Path:
    """configs/multinode.yaml as shipped, made small and given a replica report."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "multinode.yaml").read_text())
    assert config["trainer"]["num_nodes"] == 2 and config["trainer"]["devices"] == 1
    config["trainer"].update(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    config["trainer"]["callbacks"] = [
        {"class_path": "tests.helpers.ReplicaReport", "init_args": {"out_path": str(out)}}
    ]
    config["data"]["init_args"].update(num_train=512, num_val=256)
    path = tmp_path / "multinode.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_nodes(commands: list[list[str]], envs: list[dict], timeout: float = 240) -> list[str]:
    processes = [
        subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for command, env in zip(commands, envs)
    ]
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=timeout)
            outputs.append(output)
            assert process.returncode == 0, output[-3000:]
    finally:
        kill_process_groups(processes)
    return outputs


def assert_identical_replicas(out: Path) -> None:
    report = json.loads(out.read_text())
    assert report["world_size"] == 2
    assert report["params"][0] == report["params"][1]


def test_two_nodes_started_by_two_commands(tmp_path):
    out = tmp_path / "report.json"
    config = multinode_config(tmp_path, out)
    port = str(free_port())
    base = {**clean_environment(), "PYTHONPATH": str(REPO_ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    command = [console_script("ddp-plus"), "fit", "--config", str(config)]
    run_nodes([command, command], [{**base, "NODE_RANK": "0"}, {**base, "NODE_RANK": "1"}])
    assert_identical_replicas(out)


def test_two_nodes_started_by_torchrun(tmp_path):
    out = tmp_path / "report.json"
    config = multinode_config(tmp_path, out)
    port = str(free_port())
    env = {**clean_environment(), "PYTHONPATH": str(REPO_ROOT)}
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "-m",
            "lightning_ddp_plus",
            "fit",
            "--config",
            str(config),
        ]
        for node in (0, 1)
    ]
    run_nodes(commands, [env, env])
    assert_identical_replicas(out)
