"""Termination notices (``preemption_signals``): a real signal on any rank, at any moment, stops every rank after the
same optimizer step, which is saved; the resume continues there and ends where an uninterrupted run ends, with every
sample trained once per epoch. Real processes and real signals: two ranks on gloo (many cases on one process group),
torchrun's agent forwarding its SIGTERM, and SLURM's requeue signal with a stub ``scontrol``."""

import json
import os
import re
import signal
import stat

import pytest

from lightning_ddp_plus import ArgumentTypeError, ArgumentValueError, DDPPlusFabricStrategy, DDPPlusStrategy
from lightning_ddp_plus.preemption.notice import Notice, NoticeWatch
from lightning_ddp_plus.preemption.report import Preempted, PreemptionReport
from lightning_ddp_plus.preemption.stop import StopDecision
from tests.helpers import python_script, run_case_job, run_job, start_ranks, torchrun_command


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("SIGTERM", ArgumentTypeError, "expected a list of signal names, got str"),
        (15, ArgumentTypeError, "expected a list of signal names, got int"),
        (["SIGKILL"], ArgumentValueError, "SIGKILL cannot be caught"),
        (["SIGTERM", "SIGSTOP"], ArgumentValueError, "SIGSTOP cannot be caught"),
        (["SIGTREM"], ArgumentValueError, "did you mean 'SIGTERM'?"),
    ],
)
def test_bad_signal_lists_are_refused_with_the_four_marks(value, error, words):
    for front_end in (DDPPlusStrategy, DDPPlusFabricStrategy):
        with pytest.raises(error) as raised:
            front_end(preemption_signals=value)
        message = str(raised.value)
        assert message.startswith("`preemption_signals=") and words in message and "Fix:" in message


def test_signal_names_are_normalized_and_the_default_is_sigterm():
    assert DDPPlusStrategy().arguments.preemption_signals == ("SIGTERM",)
    assert DDPPlusStrategy(preemption_signals=["sigusr1", "SIGTERM", "SIGUSR1"]).arguments.preemption_signals == (
        "SIGUSR1",
        "SIGTERM",
    )
    assert DDPPlusStrategy(preemption_signals=[]).arguments.preemption_signals == ()


def test_the_handler_records_a_real_signal_and_gives_the_previous_handler_back():
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        watch = NoticeWatch(["SIGUSR2"])
        watch.steps_done = 7
        watch.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)  # a second notice is counted and changes nothing
        assert watch.pending and watch.count == 2 and seen == []
        assert watch.notice(rank=1) == Notice("SIGUSR2", rank=1, step=7)
        watch.uninstall()
        watch.pass_on()  # a notice no step boundary took goes to the handler from before
        assert seen == [signal.SIGUSR2] and not watch.pending
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_the_report_and_the_exception():
    decision = StopDecision((Notice("SIGTERM", 1, 5), Notice("SIGTERM", 0, 5)), stop_after=6)
    report = PreemptionReport(decision, "/ckpt/last.ckpt", 0.31)
    assert report.line() == (
        "lightning-ddp-plus: received SIGTERM on ranks 1, 0 at step 5; every rank stopped after optimizer step 6; "
        'saved /ckpt/last.ckpt in 0.3 s; resume with ckpt_path="last"'
    )
    error = Preempted(report)
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    assert isinstance(error, SIGTERMException) and error.code == 143 and str(error) == report.line()
    early = PreemptionReport(StopDecision((Notice("SIGUSR1", 0, 0),), stop_after=None))
    assert "before the first optimizer step; nothing to save" in early.line()
    assert Preempted(early).code == 128 + signal.SIGUSR1


#: Where the notice lands, to whom: each is one case on the job's process group (see preemption_job.py).
CASES = [
    {"to": "all", "at": "forward", "step": 3},
    {"to": 0, "at": "backward", "step": 5},
    {"to": 1, "at": "optimizer_step", "step": 5},
    # a timer at a random point of the step (its thread may be late by a step or two: never near the last step)
    *(
        {"to": to, "at": "random", "step": step, "seed": seed}
        for to, step, seed in [("all", 6, 1), (1, 9, 2), (0, 7, 3)]
    ),
    {"to": 1, "at": "random", "step": 2, "seed": 4, "k": 2},
    {"to": 0, "at": "forward", "step": 2, "k": 2},
    {"to": "all", "at": "validation", "step": 4},
    {"to": 1, "at": "save", "step": 3, "save_every": 3},
    {"to": "all", "at": "second_signal", "step": 3},
    {"to": "all", "at": "between_epochs"},
    {"to": 1, "at": "before_first_step"},
    {"to": 1, "at": "forward", "step": 5, "sync_guard": False},
    {"to": 0, "at": "forward", "step": 6, "no_checkpoint_callback": True},
    {"to": 1, "at": "forward", "step": 3, "signals": ["SIGTERM", "SIGUSR1"], "signal": "SIGUSR1", "slurm": True},
    # synced backwards that close no window: a static graph's first micro-batch, and a manual loop accumulating in
    # its own code (before: saved mid-window as "step 1" at global step 0, and 0.04 / 0.15 away after the resume)
    {"to": "all", "at": "forward", "step": 0, "k": 2, "static_graph": True},
    {"to": 1, "at": "forward", "step": 2, "k": 2, "manual": True},
    # issue 57, item 2: Lightning's OneCycleLR recipe reads `estimated_stepping_batches`, which built the loader
    # before the resume restored the loop (before: the epoch's first batches trained again, its last ones never,
    # 160 distinct samples of 256 trained, 9.8e-3 away)
    {"to": "all", "at": "forward", "step": 5, "one_cycle": True},
    # issue 57, item 6: a notice at an epoch's last batch, no validation that epoch (before: the resume trained one
    # batch more, 17 steps, 0.74 away)
    {"to": "all", "at": "forward", "step": 7, "val_every": 2},
    # issue 57, item 6: the same with validation at that batch, and a ReduceLROnPlateau stepped at each batch's end
    # (before: the resume ran the batch's end again, counting `_batches_that_stepped` and the scheduler's step twice)
    {"to": "all", "at": "forward", "step": 7, "plateau": True},
]


@pytest.fixture(scope="module")
def preempted_job(tmp_path_factory):
    """Every case on one 2-rank job; then a last case whose ``Preempted`` nobody catches, so both processes end as a
    preempted process ends. ``scontrol`` is a stub on ``PATH`` that records its arguments."""
    tmp = tmp_path_factory.mktemp("preemption")
    stub = tmp / "bin" / "scontrol"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp / "scontrol.log"}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {
        "DDP_PLUS_TMP": str(tmp / "work"),
        "DDP_PLUS_END_WITH": json.dumps({"to": 1, "at": "forward", "step": 2}),
        "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}",
    }
    out = tmp / "out.json"
    ranks = start_ranks(python_script("preemption_job.py") + [str(out), json.dumps(CASES)], timeout=400, env=env)
    requeued = (tmp / "scontrol.log").read_text() if (tmp / "scontrol.log").exists() else ""
    return json.loads(out.read_text()), ranks, requeued


@pytest.mark.multiprocess
def test_a_notice_anywhere_stops_every_rank_after_one_step_saves_it_and_the_resume_loses_nothing(preempted_job):
    results, _, _ = preempted_job
    assert len(results) == len(CASES)
    for case in results:
        where = f"{case['at']} to {case['to']} (k={case.get('k', 1)}): {case['line']}"
        assert case["preempted"] and case["is_sigterm_exception"], where
        assert case["code"] == [128 + int(signal.Signals[case.get("signal", "SIGTERM")])], where
        assert case["handler_restored"] and case["torn"] == [], where  # the handler from before; no torn file
        assert case["passed_on"] == 0, where  # every notice was taken at a step boundary
        noticed = {rank for _, rank, _ in case["notices"]}
        assert noticed == ({0, 1} if case["to"] == "all" else {case["to"]}), where
        k = case.get("k", 1)
        if case["at"] == "before_first_step":
            assert case["stop_after"] is None and case["files"] == [] and "nothing to save" in case["line"], where
        else:
            received = min(step for _, _, step in case["notices"])
            # the bound: the step in progress (a window finished), or at most the next one
            assert case["stop_after"] == case["global_step"] and 1 <= case["stop_after"] - received <= 2, where
            assert case["path"] in case["line"], where
        # every completed step kept, nothing trained twice or skipped, and the same parameters as without a notice
        assert case["resumed_global_step"] == 16 // k, where
        # each batch's end counted once across both runs: the step loggers log at, and a step-interval scheduler's
        # steps (Lightning counts both at every batch end that closes a window; a manual loop's every batch)
        batch_ends = 16 if case.get("manual") else 16 // k
        assert case["batches_that_stepped"] == batch_ends, where
        if case.get("plateau"):
            assert case["scheduler_steps"] == [batch_ends], where
        assert set(case["sample_counts"]) == {2}, where  # 2 epochs: each sample trained once per epoch
        assert case["distance"] <= 1e-5, where
        # every save is a whole step: the module's on_train_batch_end (the last hook of a batch) ran once for each
        # batch across both runs, the saved one included
        every_batch = [[epoch, batch] for epoch in range(2) for batch in range(1, 9)]
        for ends in case["batch_ends_by_rank"]:
            assert sorted(ends) == every_batch, where


@pytest.mark.multiprocess
def test_where_the_save_goes_and_what_rank_0_says(preempted_job):
    results, _, requeued = preempted_job
    by_case = {
        (case["at"], json.dumps(case.get("slurm", False)), case.get("no_checkpoint_callback", False)): case
        for case in results
    }
    assert by_case[("forward", "false", False)]["files"] == ["ckpt/last.ckpt"]
    assert by_case[("forward", "false", True)]["files"] == ["checkpoints/last.ckpt"]  # no ModelCheckpoint
    slurm = by_case[("forward", "true", False)]
    assert slurm["files"] == ["hpc_ckpt_1.ckpt"] and "the requeued job resumes by itself" in slurm["line"]
    assert requeued.split() == ["requeue", "4242"]  # rank 0 requeued the job, once
    save = next(case for case in results if case["at"] == "save")  # a notice during a periodic save
    assert "ckpt/last.ckpt" in save["files"] and len(save["files"]) == 2
    for case in results:
        if case["stop_after"] is not None:
            assert f"every rank stopped after optimizer step {case['stop_after']}; saved " in case["line"]


@pytest.mark.multiprocess
def test_an_uncaught_preemption_ends_each_process_with_128_plus_the_signal_and_one_line(preempted_job):
    _, ranks, _ = preempted_job
    assert [rank.returncode for rank in ranks] == [143, 143], ranks[0].stdout[-3000:]
    said = [[line for line in rank.stdout.splitlines() if "lightning-ddp-plus: received" in line] for rank in ranks]
    assert len(said[0]) == len(CASES) + 1 and said[1] == []  # one line per preemption, from rank 0 only
    for rank in ranks:  # no stall report, no stack trace
        assert "Traceback" not in rank.stdout and "stall report" not in rank.stdout, rank.stdout[-3000:]


@pytest.mark.multiprocess
def test_torchruns_sigterm_is_saved_inside_its_window_and_the_next_attempt_resumes(tmp_path):
    first = run_job(torchrun_command("preemption_torchrun_job.py", tmp_path, "first", max_restarts=0), timeout=200)
    assert "rank 1 sends SIGTERM to its torchrun agent at step 3" in first.stdout, first.stdout[-3000:]
    assert "Received 15 death signal" in first.stdout  # the agent forwarded it
    assert "SIGKILL" not in first.stdout  # every worker ended inside the agent's window
    line = next(line for line in first.stdout.splitlines() if "every rank stopped after" in line)
    # the agent forwards to both ranks, when it gets to it (a few steps later under load), each copy at its own step
    both = (
        r"received SIGTERM on (ranks 0, 1 at step \d+|rank (0|1) at step \d+; received SIGTERM on rank (1|0) at step)"
    )
    assert re.search(both, line) and "ckpt/last.ckpt" in line, line
    second = run_job(torchrun_command("preemption_torchrun_job.py", tmp_path, "resume"), timeout=200)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "resuming from" in second.stdout and "last.ckpt" in second.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == 16 and result["distance"] <= 1e-5
    counts: dict[int, int] = {}
    for index in (i for rank in result["trained"] for i in rank):
        counts[index] = counts.get(index, 0) + 1
    assert set(counts.values()) == {2} and len(counts) == 64


@pytest.mark.multiprocess
def test_a_notice_after_the_last_step_waits_for_the_fits_end_and_a_save_for_its_file(tmp_path):
    cases = [{"at": "after_training", "root": str(tmp_path / "a")}, {"at": "async_save", "root": str(tmp_path / "b")}]
    after_training, async_save = run_case_job("preemption_end_job.py", cases, tmp_path / "out.json", timeout=200)
    # rank 1's notice came in on_train_end, after the last agreement: passed on once the fit is over (before: inside
    # the strategy's teardown, when only on_train_end had run, so the default handler skipped the rest of the fit)
    assert not after_training["preempted"] and after_training["global_step"] == 4
    assert after_training["passed_on_by_rank"] == [[], [["on_train_end", "on_fit_end", "teardown"]]]
    # the agreed step through AsyncCheckpointIO: the report (and SLURM's requeue) wait for the write of about 1 s
    # (before: "saved in 0.0 s", the file still being written)
    assert async_save["preempted"] and async_save["saved"]
    assert async_save["save_seconds"] >= 1.0


@pytest.mark.multiprocess
def test_post_local_sgd_agrees_every_step_where_a_backward_waits_for_no_other_rank(tmp_path):
    # nodes of one rank: after the warm-up a backward exchanges nothing, so a rank that finished its own knows nothing
    # of another's notice; rank 1 gets its notice and reaches its backward a second late (before: the job ended with
    # "the ranks are out of step" at the stall report, rank 1 alone in the agreement, nothing saved)
    case = {"to": 1, "at": "forward", "step": 5, "post_local_sgd": True, "late": 1.0}
    out = tmp_path / "out.json"
    ranks = start_ranks(
        python_script("preemption_job.py") + [str(out), json.dumps([case])],
        timeout=300,
        env={"DDP_PLUS_TMP": str(tmp_path / "work")},
    )
    assert [rank.returncode for rank in ranks] == [0, 0], ranks[1].stdout[-3000:]
    [result] = json.loads(out.read_text())
    assert result["preempted"] and result["notices"] == [["SIGTERM", 1, 5]]
    assert result["stop_after"] == result["global_step"] == 6
    assert result["resumed_global_step"] == 16 and set(result["sample_counts"]) == {2}
