"""Failure behaviour with real processes: a hung or crashed rank ends the whole job in bounded time with a
non-zero status and a useful error, and leaves no process behind."""

import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers import REPO_ROOT, clean_environment, free_port

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 6


def processes_with(tag: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if tag in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def run_failing_job(mode: str, rank: int, step: int, limit: float = 90) -> tuple[int, str, float, str]:
    tag = f"tag-{uuid.uuid4().hex}"
    args = [
        sys.executable,
        str(REPO_ROOT / "tests" / "scripts" / "failure_job.py"),
        mode,
        str(rank),
        str(step),
        f"{TIMEOUT_S}s",
        tag,
    ]
    env = {**clean_environment(), "PYTHONPATH": str(REPO_ROOT), "MASTER_PORT": str(free_port())}
    started = time.perf_counter()
    # Not in a new session: the job must clean up after itself, the test only kills survivors at the very end.
    process = subprocess.Popen(
        args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        output += f"\n[test] job still running after {limit} s"
    elapsed = time.perf_counter() - started
    time.sleep(1.0)
    return process.returncode, output, elapsed, tag


def assert_nothing_left(tag: str) -> None:
    survivors = processes_with(tag)
    for line in survivors:
        os.kill(int(line.split(":")[0]), 9)
    assert not survivors, f"processes left behind: {survivors}"


@pytest.mark.parametrize("rank", [0, 1])
def test_hung_rank_ends_the_job_within_the_timeout(rank):
    code, output, elapsed, tag = run_failing_job("hang", rank, step=3)
    assert code != 0, output[-3000:]
    assert f"rank {rank} hangs at step 3" in output
    # start-up (a few s) + 3 steps + the timeout + Lightning's 5 s child observer + margin; the hang itself is 120 s
    assert elapsed < TIMEOUT_S + 40, (elapsed, output[-3000:])
    assert f"timeout ({TIMEOUT_S}s, set by `DDPPlusStrategy(timeout=...)`)" in output, output[-3000:]
    assert_nothing_left(tag)


@pytest.mark.parametrize("rank", [0, 1])
def test_crashed_rank_ends_the_job_with_the_original_error(rank):
    code, output, elapsed, tag = run_failing_job("crash", rank, step=2)
    assert code != 0
    assert f"deliberate failure on rank {rank} at step 2" in output
    assert elapsed < 40, (elapsed, output[-3000:])  # not the collective timeout: the crash is noticed at once
    assert_nothing_left(tag)
