"""Elastic restart under ``torchrun --max-restarts 1``: rank 1 is killed with SIGKILL mid-epoch (at optimizer step 3 of
5, k=2 accumulation); the restarted attempt forms its process group, resumes by itself from the last checkpoint at
the batch where it was taken, and ends with the parameters and ``global_step`` of an uninterrupted run (real
processes, gloo). Also with one agent per node: where the node whose rank is slow to end is restarted by its agent as
a membership change, and where a node is lost for good and a new one joins later (the optimizer state sharded)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import REPO_ROOT, clean_environment, free_port, kill_process_groups, run_job, torchrun_command

pytestmark = pytest.mark.multiprocess


def torchrun_job(tmp_path, name: str, kill_at: int, k: int, env: dict | None = None) -> tuple[dict, str]:
    out, ckpt = tmp_path / f"{name}.json", tmp_path / f"{name}-ckpt"
    result = run_job(torchrun_command("restart_job.py", out, ckpt, kill_at, k), timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    shutil.rmtree(ckpt, ignore_errors=True)
    return json.loads(out.read_text()), result.stdout


@pytest.fixture(scope="module")
def whole_runs(tmp_path_factory):
    """The uninterrupted run for each accumulation ``k``, made once."""
    runs: dict[int, dict] = {}

    def whole(k: int) -> dict:
        if k not in runs:
            runs[k], _ = torchrun_job(tmp_path_factory.mktemp(f"whole-{k}"), "whole", kill_at=-1, k=k)
        return runs[k]

    return whole


@pytest.mark.parametrize(("kill_at", "k"), [(3, 2)])  # mid-epoch, mid-window; one agent (see below for two)
def test_killed_rank_restarts_resumes_mid_epoch_and_matches_an_uninterrupted_run(tmp_path, whole_runs, kill_at, k):
    whole = whole_runs(k)
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


def start_agent(
    tmp_path, node: int, agents: list, env: dict, port: int, *, nnodes: str, backend: str, conf: str = ""
) -> None:
    """One torchrun agent of a one-rank node running ``restart_job.py`` (kill at step 3, k=2), its output in
    ``nodeN.log``; node 0 hosts the rendezvous. Appended to ``agents``, which the caller kills in ``finally``."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [
        torchrun, "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", backend,
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={int(node == 0)}{conf}",
        str(REPO_ROOT / "tests" / "scripts" / "restart_job.py"), str(tmp_path / "out.json"), str(tmp_path / "ckpt"),
        "3", "2",
    ]  # fmt: skip
    log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 (closed with the process)
    agents.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    log.close()


def test_two_agents_agree_on_the_attempt_when_one_restarts_for_a_membership_change(tmp_path, whole_runs):
    """Rank 1 (node 1) is killed; rank 0 (node 0) takes 4 s to end, so node 1's agent is back in the rendezvous
    first and node 0's agent restarts its worker as a membership change, without counting a restart: its
    ``TORCHELASTIC_RESTART_COUNT`` stays 0 while node 1's is 1. Before the ranks agreed through the store, they formed
    their groups under different prefixes and the job hung (reproduced)."""
    port, out = free_port(), tmp_path / "out.json"
    env = {**clean_environment(), "PYTHONPATH": str(REPO_ROOT), "DDP_PLUS_NODES": "2", "DDP_PLUS_LINGER_S": "4"}
    agents: list[subprocess.Popen] = []
    try:
        for node in range(2):
            start_agent(tmp_path, node, agents, env, port, nnodes="2", backend="c10d")
        for agent in agents:
            agent.wait(timeout=200)
    finally:
        kill_process_groups(agents)
    node0, node1 = ((tmp_path / f"node{node}.log").read_text() for node in range(2))
    assert [agent.returncode for agent in agents] == [0, 0], node0[-3000:] + node1[-3000:]
    assert "rank 1 kills itself at step 3" in node1
    assert "Sending process" in node0  # node 0's agent stopped its lingering worker: the membership restart
    assert "attempt 1 rank 0 trains from step 3" in node0 and "attempt 1 rank 1 trains from step 3" in node1
    restarted, whole = json.loads(out.read_text()), whole_runs(2)
    assert restarted["global_step"] == whole["global_step"] == 5
    diff = (torch.tensor(restarted["params"]) - torch.tensor(whole["params"])).abs().max()
    assert diff <= 1e-6, diff


def test_an_elastic_job_loses_a_node_for_good_continues_alone_with_the_same_global_batch_and_takes_a_new_node_back(
    tmp_path, whole_runs
):
    """Issue 29: ``torchrun --nnodes=1:2 --rdzv-backend ddp-plus``, one agent per node, the optimizer state sharded;
    at optimizer step 3 node 1 is lost for good (its agent and its worker SIGKILLed). Node 0's worker fails on the
    dead peer, its agent restarts it once node 1 has missed its heartbeats, and the attempt runs alone on 1 rank: it
    resumes the 2-rank checkpoint's consolidated state with the global batch kept (accumulation 2 -> 4). At step 4 a
    new node's agent joins: node 0's agent restarts its worker as a membership change, and the third attempt resumes
    on 2 ranks (accumulation 4 -> 2), each rank given its share again. The job ends where the uninterrupted 2-rank
    run (unsharded) ends. Stock ``c10d`` cannot take the new node: its agent waits for the workers' store address
    that rank 0 published only in its first round (``processes.rendezvous``)."""
    import re

    port, out, marker = free_port(), tmp_path / "out.json", tmp_path / "alone"
    env = {
        **clean_environment(),
        "PYTHONPATH": str(REPO_ROOT),
        "DDP_PLUS_NODES": "2",
        "DDP_PLUS_KILL_NODE": "1",
        "DDP_PLUS_GROW_MARKER": str(marker),
        "DDP_PLUS_SHARDING": "1",
    }
    # quick to notice a lost node (a heartbeat every second, dead after 4 missed: a node writes one only when the last
    # is a whole interval old, so fewer would count healthy nodes dead) and to close a round once one is in
    rendezvous = ",last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=4"
    agents: list[subprocess.Popen] = []
    elastic = {"nnodes": "1:2", "backend": "ddp-plus", "conf": rendezvous}
    try:
        start_agent(tmp_path, 0, agents, env, port, **elastic)
        start_agent(tmp_path, 1, agents, env, port, **elastic)
        deadline = time.monotonic() + 150
        while not marker.exists() and agents[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        start_agent(tmp_path, 2, agents, env, port, **elastic)  # a new node, once node 0 trains alone
        agents[0].wait(timeout=150)
        agents[2].wait(timeout=30)
        agents[1].wait(timeout=10)  # killed long ago
    finally:
        kill_process_groups(agents)
    node0, node1, node2 = ((tmp_path / f"node{node}.log").read_text() for node in range(3))
    assert [agent.returncode for agent in agents] == [0, -9, 0], node0[-4000:] + node1[-2000:] + node2[-3000:]
    assert "rank 1 kills its node's agent" in node1 and "optimizer_sharding=True" in node0
    assert "attempt 1 rank 0 trains from step 3" in node0 and "attempt 1 rank 1" not in node0 + node1 + node2
    assert "torchrun started this attempt on 1 node(s) of 1 rank(s) each, where `Trainer(num_nodes=2)` says 2" in node0
    assert "world size changed 2 -> 1: keeping the global batch of 16 (accumulation 2 -> 4)" in node0
    assert "rank 0 trains alone at step 4, waits for a node" in node0
    grown = node0 + node2
    assert "attempt 2 rank 0 trains from step 4" in grown and "attempt 2 rank 1 trains from step 4" in grown
    assert "world size changed 1 -> 2: keeping the global batch of 16 (accumulation 4 -> 2)" in grown
    restarted, whole = json.loads(out.read_text()), whole_runs(2)
    assert restarted["attempt"] == 2
    assert restarted["global_step"] == whole["global_step"] == 5
    diff = (torch.tensor(restarted["params"]) - torch.tensor(whole["params"])).abs().max()
    assert diff <= 1e-5, diff
    lost = float(re.search(r"\[([0-9.]+)\] rank 1 kills itself", node1).group(1))
    again = float(re.search(r"\[([0-9.]+)\] attempt 1 rank 0 trains", node0).group(1))
    alone = float(re.search(r"\[([0-9.]+)\] rank 0 trains alone", node0).group(1))
    back = float(re.search(r"\[([0-9.]+)\] attempt 2 rank 0 trains", grown).group(1))
    # for the closing note
    print(
        f"from the node's loss to training again on 1 rank: {again - lost:.1f} s; from a new node's start to 2 ranks: "
        f"{back - alone:.1f} s"
    )
