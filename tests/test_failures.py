"""Failure behaviour with real processes: a hung or crashed rank ends the whole job in bounded time with a
non-zero status and a useful error, and leaves no process behind."""

import os
import re
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tests.helpers import REPO_ROOT, clean_environment, free_port, start_process
from tests.scripts.failure_job import HANG_S, SETUP_S

pytestmark = pytest.mark.multiprocess

# The process group's timeout also bounds the start-up rendezvous: the popen launcher re-runs the script for rank 1,
# and importing torch and Lightning took 6-9 s on a slow machine (a 6 s timeout failed there with "1/2 clients
# joined"). `setup_timeout` covers the rendezvous and the setup, so the steps keep a short timeout.
STEP_TIMEOUT_S = 4
SETUP_TIMEOUT = "60s"
CRASH_TIMEOUT_S = 90  # far longer than a crash takes to end the job, so ending before it proves the crash was noticed


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


SCRIPT = REPO_ROOT / "tests" / "scripts" / "failure_job.py"


def site(text: str) -> str:
    """``failure_job.py:N in FUNCTION: TEXT``, as a report names the script's line that holds ``text``."""
    lines = SCRIPT.read_text().splitlines()
    number = next(index for index, line in enumerate(lines, 1) if text in line)
    function = next(
        line.split("def ")[1].split("(")[0] for line in reversed(lines[:number]) if line.lstrip().startswith("def ")
    )
    return f"failure_job.py:{number} in {function}: {text}"


def run_failing_job(
    mode: str,
    rank: int,
    step: int,
    timeout_s: float,
    stall: str = "auto",
    setup_timeout: str = "None",
    script: str = "failure_job.py",
) -> tuple[int, str, float, str]:
    """Run the job; return its exit code, output, seconds from the failure to the job's end, and its tag. Whatever
    the outcome, every process of the job is killed before this returns."""
    tag = f"tag-{uuid.uuid4().hex}"
    args = [
        sys.executable,
        str(REPO_ROOT / "tests" / "scripts" / script),
        mode,
        str(rank),
        str(step),
        f"{timeout_s:g}s",
        tag,
        stall,
        setup_timeout,
    ]
    env = {**clean_environment(), "PYTHONPATH": str(REPO_ROOT), "MASTER_PORT": str(free_port())}
    # The test kills no process group: the job must clean up after itself; survivors are found by their tag.
    # in a directory of its own: a survivor of a crashed rank saves the last step there (save_on_rank_death)
    with tempfile.TemporaryDirectory() as cwd:
        process = start_process(args, env, cwd)
        try:
            output, _ = process.communicate(timeout=HANG_S + 60)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            output += "\n[test] job still running after the hang would have ended"
        ended = time.time()
    time.sleep(1.0)
    survivors = processes_with(tag)
    for line in survivors:
        os.kill(int(line.split(":")[0]), 9)
    failed_at = re.search(r"failure starts at (\d+\.\d+)", output)
    since_failure = ended - float(failed_at.group(1)) if failed_at else float("inf")
    return process.returncode, output, since_failure, "\n".join(survivors)


@pytest.mark.parametrize(("rank", "mode"), [(0, "hang"), (1, "slow_setup")])
def test_hung_rank_ends_the_job_within_the_timeout_and_is_named_with_its_line(rank, mode):
    """With rank 1 hung, rank 0 first spends SETUP_S in ``setup`` while rank 1 waits in DDP's first broadcast, longer
    than the step timeout: the setup timeout lets it through, and the step timeout still ends the hang."""
    code, output, since_failure, survivors = run_failing_job(
        mode, rank, step=3, timeout_s=STEP_TIMEOUT_S, setup_timeout=SETUP_TIMEOUT
    )
    assert not survivors, f"processes left behind: {survivors}"
    assert code != 0, output[-3000:]
    assert f"rank {rank} hangs at step 3" in output
    assert "setup_timeout=1m" in output  # the setup line shows it
    if mode == "slow_setup":
        assert f"rank 0 prepares for {SETUP_S} s" in output
    # ended by the step's collective timeout, not the setup's minute, nor the hung rank waking up by itself
    assert f"timeout ({STEP_TIMEOUT_S}s, set by `DDPPlusStrategy(timeout=...)`)" in output, output[-3000:]
    assert since_failure < 30, (since_failure, output[-3000:])
    # Named while the other rank waits (after a quarter of the timeout), and again in the timeout's error: the stuck
    # rank, the line it is at with its source, the function, the step (as trainer.global_step counts), its stack.
    other = 1 - rank
    named = (
        f"Rank(s) {other} have waited",
        f"rank {rank} has not reached it",
        f"{site('time.sleep(HANG_S)')}, in its forward of step 3",
    )
    assert all(output.count(text) >= 2 for text in named), output[-4000:]
    line = site("time.sleep(HANG_S)").split(":")[1].split(" ")[0]
    assert "a collective has waited longer than 1 s" in output and f"line {line}, in training_step" in output


def test_a_hung_rank_is_named_while_the_collectives_run_behind_the_host():
    """As on NCCL: rank 0's gradient all-reduce returns before it completes and its host blocks later, at the
    batch's host sync, outside any collective's call. Its record stays open until the work completes, so the stall
    is still named, with the hung rank's line, well before the collective timeout."""
    code, output, since_failure, survivors = run_failing_job(
        "hang_behind_host", 1, step=3, timeout_s=8, stall="1s", setup_timeout=SETUP_TIMEOUT
    )
    assert not survivors, f"processes left behind: {survivors}"
    assert code != 0, output[-3000:]
    assert "a collective has waited longer than 1 s" in output, output[-4000:]
    assert re.search(r"Rank\(s\) 0 have waited \d+ s in gradient all_reduce", output), output[-4000:]
    assert (
        "rank 1 has not reached it: for" in output
        and f"{site('time.sleep(HANG_S)')}, in its forward of step 3" in output
    )
    assert since_failure < 40, (since_failure, output[-3000:])


@pytest.mark.parametrize(
    ("mode", "issued", "other"),
    [
        (
            "extra_log",
            site('self.log("only_here", torch.tensor(1.0), sync_dist=True)'),
            r"rank 1 issued gradient all_reduce",
        ),
        (
            "rank_barrier",
            site('self.trainer.strategy.barrier("only_here")'),
            r"rank 1 issued gradient all_reduce",
        ),
        # rank 0's third validation batch logs with sync_dist; rank 1, back in training, reaches its gradient
        # all-reduce (Lightning's per-batch SIGTERM broadcast does not run beside the strategy's notice handling)
        (
            "extra_val_batch",
            site('self.log("val_loss", loss, on_step=True, on_epoch=False, sync_dist=True)')
            + " (collective 18, step 4, validation)",
            r"rank 1 issued gradient all_reduce of \d+ B \(collective 18, step 4, backward\)",
        ),
    ],
)
def test_ranks_out_of_step_end_the_job_at_once_naming_each_ranks_collective(mode, issued, other):
    step = 4 if mode == "extra_val_batch" else 3  # validation every 4 steps, so training goes on after it
    code, output, since_failure, survivors = run_failing_job(mode, 0, step=step, timeout_s=120, stall="1s")
    assert not survivors, f"processes left behind: {survivors}"
    assert code != 0, output[-3000:]
    # well before the 120 s collective timeout: the threshold, one exchange through the store, and the ending
    assert since_failure < 30, (since_failure, output[-3000:])
    assert "The ranks are out of step" in output and issued in output, output[-4000:]
    assert re.search(other, output) and "sync_dist=True` on some ranks only" in output, output[-4000:]
    assert "the job ends now, without waiting for the collective timeout: the ranks are out of step" in output


FABRIC_SCRIPT = REPO_ROOT / "tests" / "scripts" / "fabric_failure_job.py"


def fabric_site(text: str) -> str:
    number = next(i for i, line in enumerate(FABRIC_SCRIPT.read_text().splitlines(), 1) if text in line)
    return f"fabric_failure_job.py:{number} in main: {text}"


def test_a_hung_rank_in_a_fabric_loop_is_named_and_its_parent_ending_ends_the_job():
    """Fabric: the stall report names the hung rank 1 at its line while rank 0 waits in ``fabric.backward``; rank 0's
    timeout ends its process, and rank 1, started by Fabric's launcher, ends as soon as its parent is gone."""
    code, output, since_failure, survivors = run_failing_job(
        "hang", 1, step=3, timeout_s=STEP_TIMEOUT_S, stall="auto", script=FABRIC_SCRIPT.name
    )
    assert not survivors, f"processes left behind: {survivors}"
    assert code != 0, output[-3000:]
    assert since_failure < 30, (since_failure, output[-3000:])  # not the 120 s of the hang
    backward = fabric_site("fabric.backward(nn.functional.mse_loss(model(xb), yb))")
    assert re.search(rf"Rank\(s\) 0 have waited \d+ s in gradient all_reduce of 644 B at {re.escape(backward)}", output)
    hung = re.escape(fabric_site("time.sleep(HANG_S)"))
    assert re.search(rf"rank 1 has not reached it: for \d+ s it has been at {hung}", output), output[-4000:]


def test_a_fabric_loop_that_never_reads_the_stop_is_still_ended_by_a_notice():
    """Issue 51: the strategy holds SIGTERM for an agreed stop, which a Fabric loop reads from
    ``preemption_agreed``; a loop that never reads it was no longer stopped by ``kill`` and trained to its end. It is
    now ended one step after the agreed one, with the shell's code for the signal, saying nothing was saved and how
    to save."""
    code, output, since_failure, survivors = run_failing_job(
        "sigterm", 1, step=3, timeout_s=60, script=FABRIC_SCRIPT.name
    )
    assert not survivors, f"processes left behind: {survivors}"
    assert code == 143, output[-3000:]
    assert since_failure < 30, (since_failure, output[-3000:])
    assert "received SIGTERM on rank 1 at step 3; every rank stopped after optimizer step 4; nothing saved" in output
    assert "does not check `fabric.strategy.preemption_agreed`" in output


def test_ranks_out_of_step_in_a_fabric_loop_end_the_job_at_once():
    code, output, since_failure, survivors = run_failing_job(
        "extra_all_reduce", 0, step=3, timeout_s=120, stall="1s", script=FABRIC_SCRIPT.name
    )
    assert not survivors, f"processes left behind: {survivors}"
    assert code != 0, output[-3000:]
    assert since_failure < 30, (since_failure, output[-3000:])
    assert f"rank 0 issued all_reduce of 4 B at {fabric_site('fabric.all_reduce(torch.tensor(1.0))')}" in output
    assert "rank 1 issued gradient all_reduce of 644 B at " + fabric_site("fabric.backward(") in output
    assert "the job ends now, without waiting for the collective timeout: the ranks are out of step" in output


@pytest.mark.parametrize("rank", [0, 1])
def test_crashed_rank_ends_the_job_with_the_original_error(rank):
    code, output, since_failure, survivors = run_failing_job("crash", rank, step=2, timeout_s=CRASH_TIMEOUT_S)
    assert not survivors, f"processes left behind: {survivors}"
    assert code != 0
    assert f"deliberate failure on rank {rank} at step 2" in output
    # noticed at once: the other rank did not wait for the collective timeout
    assert since_failure < CRASH_TIMEOUT_S, (since_failure, output[-3000:])
    assert "set by `DDPPlusStrategy(timeout=...)`" not in output


def test_out_of_memory_on_one_rank_ends_every_rank_with_an_error_that_names_it():
    """``chunk_size=None``: rank 1 runs out of memory in its forward; rank 0, waiting in the gradient
    all-reduce, ends as soon as rank 1's process is gone, and both say which rank, where, and what to change."""
    code, output, since_failure, survivors = run_failing_job("out_of_memory", 1, step=2, timeout_s=CRASH_TIMEOUT_S)
    assert not survivors, f"processes left behind: {survivors}"
    assert code != 0
    message = (
        "ChunkOutOfMemoryError: Out of memory on rank 1 in the forward, training a batch of 4 rows. Every rank "
        "stops here. Fix: set `chunk_size='auto'`"
    )
    assert f"[rank1]: lightning_ddp_plus.sync.chunks.{message}" in output, output[-3000:]
    assert f"[rank0]: lightning_ddp_plus.sync.chunks.{message}" in output, output[-3000:]
    assert "Connection closed" not in output and "Connection reset" not in output
    assert since_failure < CRASH_TIMEOUT_S, (since_failure, output[-3000:])
