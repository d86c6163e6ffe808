"""Start a benchmark's ranks the way torchrun would (LOCAL_RANK, WORLD_SIZE, MASTER_PORT ...), wait, clean up."""

import os
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Any

LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def base_environment() -> dict[str, str]:
    """This process's environment without any launcher's rank variables."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


def run_ranks(command: list[str], world: int, timeout: float, extra: dict[str, str] | None = None) -> None:
    """Run ``command + ["--as-rank", N]`` for every rank on this machine (``extra``: more environment variables for
    each); exit with the ranks' output if one fails or times out."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    environments = [
        {
            **base_environment(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world),
            **(extra or {}),
        }
        for rank in range(world)
    ]
    run_processes([[*command, "--as-rank", str(rank)] for rank in range(world)], environments, timeout)


def start_process(command: list[str], environment: dict[str, str], log: Any) -> Any:
    """``subprocess.Popen``; in the test suite's smoke runs (``tests/warm.py`` sets ``DDP_PLUS_WARM_SERVER``), a fork
    of an interpreter that has imported torch and Lightning instead, which saves CI about 8 s of CPU a rank. The
    figures of such a run then lack the imports; a user's run never sets the variable."""
    server = os.environ.get("DDP_PLUS_WARM_SERVER")
    if server:
        from tests import warm  # the smoke runs are the repository's own

        if warm.can_fork(command, environment):
            return warm.popen(command, environment, os.getcwd(), output_fd=log.fileno(), server=server)
    return subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)


def run_processes(commands: list[list[str]], environments: list[dict[str, str]], timeout: float) -> None:
    """Start one process per command, wait for all; kill the ones left after ``timeout`` seconds and exit with every
    process's output tail if one failed or timed out."""
    logs = [tempfile.TemporaryFile(mode="w+") for _ in commands]  # noqa: SIM115 - closed below; files, not pipes: a full pipe would block a rank
    processes = []
    try:
        for command, environment, log in zip(commands, environments, logs):
            processes.append(start_process(command, environment, log))
        codes = [process.wait(timeout=timeout) for process in processes]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    try:
        if codes is None or any(codes):
            tails = []
            for rank, log in enumerate(logs):
                log.seek(0)
                tails.append(f"--- rank {rank} ---\n{log.read()[-3000:]}")
            reason = f"did not finish within {timeout} s" if codes is None else f"failed with exit codes {codes}"
            sys.exit(f"{' '.join(commands[0][:2])} {reason}\n" + "\n".join(tails))
    finally:
        for log in logs:
            log.close()


def step_ratios(medians: dict[str, list[float]], baselines: tuple[str, ...] = ("stock",)) -> dict[str, dict]:
    """Per variant, from its runs' median step times (s): the median of those (ms) and its ratio to each baseline."""
    base = {name: statistics.median(medians[name]) for name in baselines}
    return {
        name: {
            "median step (ms)": round(1e3 * statistics.median(values), 3),
            **{f"ratio to {b}": round(statistics.median(values) / base[b], 3) for b in baselines},
        }
        for name, values in medians.items()
    }
