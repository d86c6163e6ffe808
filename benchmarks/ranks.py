"""Start a benchmark's ranks the way torchrun would (LOCAL_RANK, WORLD_SIZE, MASTER_PORT ...), wait, clean up."""

import os
import socket
import subprocess
import sys
import tempfile

LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def run_ranks(command: list[str], world: int, timeout: float) -> None:
    """Run ``command + ["--as-rank", N]`` for every rank; exit with the ranks' output if one fails or times out."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]  # noqa: SIM115 - closed below; files, not pipes: a full pipe would block a rank
    processes = []
    for rank in range(world):
        env = {
            **base,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world),
        }
        processes.append(
            subprocess.Popen([*command, "--as-rank", str(rank)], env=env, stdout=logs[rank], stderr=subprocess.STDOUT)
        )
    try:
        codes = [process.wait(timeout=timeout) for process in processes]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    if codes is None or any(codes):
        tails = []
        for rank, log in enumerate(logs):
            log.seek(0)
            tails.append(f"--- rank {rank} ---\n{log.read()[-3000:]}")
        reason = f"did not finish within {timeout} s" if codes is None else f"failed with exit codes {codes}"
        sys.exit(f"{' '.join(command[:2])} {reason}\n" + "\n".join(tails))
