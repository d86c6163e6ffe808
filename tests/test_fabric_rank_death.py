"""A rank's death in a Fabric loop (``fabric.strategy.save_after_rank_death``): real 2-rank jobs with Fabric's popen
launcher, one rank SIGKILLed at a moment of a step; the survivor saves the last step, the loop ends with ``RankDied``,
and a resume from ``fabric.load`` loses nothing."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from lightning_ddp_plus import ArgumentTypeError, ArgumentValueError, DDPPlusFabricStrategy
from tests.helpers import python_script, records, run_job, start_ranks, times_each_row_trained

EPOCHS, BATCHES = 2, 8  # tests/scripts/fabric_rank_death_job.py: 8 micro-batches a rank an epoch
SCRIPT = "fabric_rank_death_job.py"

#: Who dies where. In CI: rank 1 and rank 0 (the launcher and the store's host) alternating; "logged" is the loop's
#: own all-reduce after ``optimizer.step()`` and before the loop counts the step.
CASES = [
    {"to": 1, "at": "backward"},
    {"to": 0, "at": "logged"},
    {"to": 1, "at": "forward", "k": 2},
    {"to": 0, "at": "all_reduce"},
]
#: Outside CI (``DDP_PLUS_EVERY_DEATH=1``): every moment on both ranks, with and without accumulation.
EVERY_CASE = [
    {"to": rank, "at": at, "k": k}
    for at in ("forward", "backward", "all_reduce", "optimizer_step", "logged")
    for k in (1, 2)
    for rank in (0, 1)
]


def check_case(case: dict, resumed: dict) -> dict:
    """Every promise for one case, from the files its two runs wrote; returns its figures."""
    directory, dead, k = Path(case["dir"]), case["to"], case.get("k", 1)
    survivor = 1 - dead
    where = f"rank {dead} killed at {case['at']} (k={k}): {directory}"
    killed = json.loads((directory / "killed.json").read_text())
    outcome = json.loads((directory / f"outcome-rank{survivor}.json").read_text())
    # the job ends with an error naming the dead rank, the step, the file and how to resume
    assert case["rc"] == (-9 if dead == 0 else 1), where  # rank 0's process: killed, or ended by RankDied
    assert outcome["gone"] == [dead] and outcome["step"] is not None, where
    saved, path = outcome["step"], directory / "ckpt" / "last.ckpt"
    for words in (f"rank {dead} is gone", f"optimizer step {saved}", str(path), "fabric.load"):
        assert words in outcome["error"], (where, words, outcome["error"])
    # the saved step is at most one behind the most steps any rank applied (counted by the strategy: a death learnt
    # in the loop's logging all-reduce comes after `optimizer.step()` and before the loop counts the step)
    run1 = {rank: records(directory / f"run1-rank{rank}.jsonl") for rank in (0, 1)}
    applied = {
        rank: max([r["step"] for r in lines if r["kind"] == "applied"], default=0) for rank, lines in run1.items()
    }
    assert max(applied.values()) - 1 <= saved <= max(applied.values()), (where, applied, saved)
    assert saved == applied[survivor], (where, applied, saved)  # the survivor's state, as it stood
    # each sample trained once an epoch, across both runs (run 1's micro-batches of the steps saved)
    run2 = {rank: records(directory / f"run2-rank{rank}.jsonl") for rank in (0, 1)}
    assert times_each_row_trained(run1, run2, saved) == dict.fromkeys(range(64), EPOCHS), where
    # the loop's step-end code once per step across both runs; the saved step's may be missing where the death came
    # after its optimizer step (the code after the failed collective never ran), on the dead rank the step it died in
    steps = EPOCHS * BATCHES // k
    for rank in (0, 1):
        ends = [r["step"] for r in run1[rank] if r["kind"] == "step_end" and r["step"] <= saved]
        ends += [r["step"] for r in run2[rank] if r["kind"] == "step_end"]
        assert len(ends) == len(set(ends)) and set(ends) <= set(range(1, steps + 1)), (where, rank, ends)
        assert set(range(1, steps + 1)) - set(ends) <= {saved}, (where, rank, sorted(ends))
    # the same parameters as an uninterrupted run, and the resume trains to the end
    assert resumed["loaded"] == saved and resumed["step"] == steps, (where, resumed)
    assert resumed["distance"] <= 1e-5, (where, resumed)
    left = subprocess.run(["pgrep", "-f", str(directory)], check=False, capture_output=True, text=True).stdout.split()
    assert left == [], where
    return {
        "steps_applied": applied,
        "saved": saved,
        "killed_at_step": killed["step"],
        "seconds_to_save": path.stat().st_mtime - killed["time"],
        "seconds_to_end": case["end"] - killed["time"],
    }


@pytest.fixture(scope="module")
def fabric_deaths(tmp_path_factory):
    """Each case's job (a launch each: a killed rank does not come back), then every resume on one 2-rank job."""
    base = tmp_path_factory.mktemp("fabric-deaths")
    cases = EVERY_CASE if os.environ.get("DDP_PLUS_EVERY_DEATH") else [dict(case) for case in CASES]
    for index, case in enumerate(cases):
        directory = base / f"case-{index}"
        directory.mkdir()
        result = run_job(python_script(SCRIPT) + ["kill", str(directory), json.dumps(case)], timeout=200)
        (directory / "log.txt").write_text(result.stdout)
        case.update(dir=str(directory), rc=result.returncode, end=time.time())
    out = base / "resumed.json"
    for result in start_ranks(python_script(SCRIPT) + ["resume", str(out), json.dumps(cases)], timeout=400):
        assert result.returncode == 0, result.stdout[-4000:]
    return cases, json.loads(out.read_text())


@pytest.mark.multiprocess
def test_a_killed_rank_in_a_fabric_loop_costs_at_most_the_step_in_progress(fabric_deaths):
    cases, resumed = fabric_deaths
    figures = {f"{c['to']}@{c['at']}/k={c.get('k', 1)}": check_case(c, r) for c, r in zip(cases, resumed, strict=True)}
    print(json.dumps(figures, indent=1))  # the closing note's figures (pytest -s)


@pytest.mark.multiprocess
def test_under_optimizer_sharding_a_fabric_loop_saves_nothing_and_says_why(tmp_path):
    case = {"to": 1, "at": "backward", "sharding": True}
    result = run_job(python_script(SCRIPT) + ["kill", str(tmp_path), json.dumps(case)], timeout=200)
    assert result.returncode == 1, result.stdout[-4000:]
    outcome = json.loads((tmp_path / "outcome-rank0.json").read_text())
    assert outcome["step"] is None and outcome["gone"] == [1]
    for words in ("rank 1 is gone", "nothing was saved", "optimizer_sharding", "fabric.save"):
        assert words in outcome["error"], (words, outcome["error"])
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()


BAD_BLOCKS = [
    ({"path": 3, "state": {"step": 0}}, ArgumentTypeError, r"save_after_rank_death\(path\)=3.*file path.*Fix"),
    ({"path": "a.ckpt", "state": [1]}, ArgumentTypeError, r"\(state\)='list'.*dict `fabric.save` takes.*Fix"),
    ({"path": "a.ckpt", "state": {"model": 1}}, ArgumentValueError, r"\(step_key\)='step'.*it is absent.*Fix"),
    (
        {"path": "a.ckpt", "state": {"iteration": 1.5}, "step_key": "iteration"},
        ArgumentValueError,
        r"\(step_key\)='iteration'.*must be an int.*it is 1.5.*Fix",
    ),
]


@pytest.mark.parametrize(("arguments", "error", "message"), BAD_BLOCKS)
def test_bad_arguments_of_the_block_are_refused_before_the_loop(arguments, error, message):
    with pytest.raises(error, match=message):
        DDPPlusFabricStrategy().save_after_rank_death(**arguments)


def test_outside_a_death_the_block_changes_nothing(tmp_path):
    """Outside a death the block changes nothing: another error passes through as it was, and a normal end writes
    nothing."""
    strategy = DDPPlusFabricStrategy()
    state = {"step": 0}
    with strategy.save_after_rank_death(tmp_path / "last.ckpt", state):
        pass
    with pytest.raises(ValueError, match="the loop's own"), strategy.save_after_rank_death(tmp_path / "a.ckpt", state):
        raise ValueError("the loop's own error")
    outer = strategy.save_after_rank_death(tmp_path / "last.ckpt", state)
    inner = strategy.save_after_rank_death(tmp_path / "other.ckpt", state)
    with outer, pytest.raises(RuntimeError, match="one block at a time"), inner:
        pass
    assert list(tmp_path.iterdir()) == []
