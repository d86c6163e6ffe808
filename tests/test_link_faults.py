"""The link between two nodes goes down mid-training (two network namespaces, ``ip link set ... down``): both nodes
end with an error that says a peer is unreachable, within the collective timeout plus a stated bound; with the link
back up, torchrun's restarted attempt resumes from the last checkpoint and finishes."""

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import REPO_ROOT, clean_environment, free_port

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 12
#: What ending takes beyond the collective timeout: the reachability probes (2 s) and Lightning's teardown (~2 s).
BOUND_S = 6


def _two_nodes():
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.netns import two_nodes, unavailable_reason

    return two_nodes, unavailable_reason()


class Node:
    """One torchrun agent in a namespace; every line it prints is kept with the time it arrived."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.time(), line))

    def first(self, text: str) -> float | None:
        return next((at for at, line in self.lines if text in line), None)

    def wait_for(self, text: str, seconds: float) -> float:
        deadline = time.time() + seconds
        while time.time() < deadline:
            at = self.first(text)
            if at is not None:
                return at
            if self.process.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {seconds}s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, 9)
        except ProcessLookupError:
            pass
        self.process.wait()


def test_a_cut_link_ends_both_nodes_with_unreachable_and_the_restart_resumes(tmp_path):
    two_nodes, reason = _two_nodes()
    if reason:
        pytest.skip(f"two nodes cannot be made here: {reason}")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = str(free_port())
    with two_nodes("10gbit", prefix="ddpl") as nodes:  # its own names: a benchmark may run beside it
        agents = []
        try:
            for index, node in enumerate(nodes):
                command = [
                    "ip", "netns", "exec", node.namespace, torchrun, "--nnodes", "2", "--nproc-per-node", "1",
                    "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes[0].address}:{port}",
                    "--rdzv-conf", f"is_host={int(index == 0)}", "--local-addr", node.address,
                    str(REPO_ROOT / "tests" / "scripts" / "link_job.py"), str(tmp_path / "out.json"),
                    str(tmp_path / "ckpt"), "30",
                ]  # fmt: skip
                env = {
                    **clean_environment(),
                    "PYTHONPATH": str(REPO_ROOT),
                    "GLOO_SOCKET_IFNAME": node.interface,
                    "DDP_PLUS_TIMEOUT": f"{TIMEOUT_S}s",
                }
                agents.append(Node(command, env))
            agents[0].wait_for("rank 0 step 10", 120)
            subprocess.run(["ip", "-n", nodes[1].namespace, "link", "set", nodes[1].interface, "down"], check=True)
            cut = time.time()
            # gloo's own words depend on the collective cut off (a recv timeout, or "Application timeout caused pair
            # closure"); the explanation the strategy adds to either is the same
            waited = "a collective waited longer than the process group's timeout"
            ended = [agent.wait_for(waited, TIMEOUT_S + 30) for agent in agents]
            for agent in agents:
                agent.wait_for("A peer is unreachable", 10)
            subprocess.run(["ip", "-n", nodes[1].namespace, "link", "set", nodes[1].interface, "up"], check=True)
            for agent in agents:
                agent.process.wait(timeout=180)
                agent.reader.join(timeout=10)
        finally:
            for agent in agents:
                agent.stop()
    pgrep = ["pgrep", "-f", str(tmp_path / "out.json")]
    leftover = subprocess.run(pgrep, check=False, capture_output=True, text=True).stdout
    assert leftover == "", f"processes left: {leftover}"
    rank0, rank1 = (agent.output() for agent in agents)
    seconds_to_error = [at - cut for at in ended]
    print("seconds from the cut to each node's error:", seconds_to_error)
    assert all(TIMEOUT_S - 1 <= seconds <= TIMEOUT_S + BOUND_S for seconds in seconds_to_error), seconds_to_error
    assert "A peer is unreachable from rank 0 (host 10.231.0.1): 10.231.0.2 (rank 1:" in rank0
    assert "rank 1 (host 10.231.0.2) cannot reach the master node 10.231.0.1" in rank1
    # the restarted attempt resumed from the step-8 checkpoint (the link went down at step 10) and finished
    both = f"node 0:\n{rank0[-3000:]}\nnode 1:\n{rank1[-3000:]}"
    assert "attempt 1 rank 0 trains from step 8" in rank0 and "attempt 1 rank 1 trains from step 8" in rank1, both
    assert [agent.process.returncode for agent in agents] == [0, 0], both
    assert '"global_step": 30' in (tmp_path / "out.json").read_text()
