"""A rank's death (``save_on_rank_death``): real 2-rank jobs with the popen launcher, one rank SIGKILLed at a moment
of a step; the survivor saves the last step, the job ends with an error, and a resume loses nothing."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from lightning_ddp_plus.crash.peer_death import peer_gone_in
from lightning_ddp_plus.crash.report import AfterDeathSave, RankDied
from lightning_ddp_plus.crash.survivors import SurvivorAgreement, choose_writer
from tests.helpers import (
    python_script,
    records,
    run_job,
    start_ranks,
    times_each_row_trained,
    torchrun_command,
)

EPOCHS, BATCHES = 2, 8  # tests/scripts/rank_death_job.py: 8 batches a rank an epoch

#: Who dies where. In CI: each moment once, rank 0 (the launcher and the store's host) and rank 1 alternating.
CASES = [
    {"to": 1, "at": "backward"},
    {"to": 0, "at": "forward"},
    {"to": 1, "at": "all_reduce"},
    {"to": 0, "at": "optimizer_step"},
    # issue 57, item 4: EMAWeightAveraging swaps the average in for validation, where rank 1 dies (before: the average
    # was saved as the training weights, resumed 0.56 away)
    {"to": 1, "at": "validation", "ema": True},
    {"to": 0, "at": "save", "save_every": 2},
    {"to": 1, "at": "forward", "k": 2},
    {"to": 0, "at": "between_epochs"},
    # issue 57, item 1: rank 1 dies right after its optimizer step 4, which rank 0 learns in the straggler comparison
    # that follows step 4 (before: "optimizer step 3" saved with step 4's weights, 1.65 away after the resume)
    {"to": 1, "at": "after_step", "step": 3, "stragglers": 4},
    # issue 57, item 7: rank 1 raises torch's out-of-memory error in step 5's forward and its process ends (before:
    # the survivor took its broken collective for the out-of-memory error, saved nothing, and the resume started at 0);
    # item 10: the survivor writes through AsyncCheckpointIO (a write of 1 s): "saved" is said once the bytes exist
    # (before: at once, the file still being written)
    {"to": 1, "at": "out_of_memory", "step": 4, "async_io": True},
    # issue 57, item 6: rank 1 dies in the next epoch's first step, after the epoch's validation: the boundary saved
    # is the epoch's end (before: the resume ran the last batch's end again, counting it twice)
    {"to": 1, "at": "forward", "step": BATCHES},
    # issue 57, a rewound step: rank 1 dies in the second micro-batch's forward of a window; rank 0 ran the window's
    # forwards, which moved its BatchNorm statistics and its generators (noise on its inputs): the step redone must
    # start from both as they stood at the window's start
    {"to": 1, "at": "forward", "k": 2, "norm": True},
]
#: Outside CI (``DDP_PLUS_EVERY_DEATH=1``): every moment on both ranks, and 10 random moments on each.
EVERY_CASE = [
    {**case, "to": rank}
    for case in [
        *CASES,
        {"at": "backward", "k": 2},
        {"at": "optimizer_step", "k": 2},
        *({"at": "random", "seed": seed} for seed in range(10)),
    ]
    for rank in (0, 1)
]


def check_case(case: dict, resumed: dict) -> dict:
    """Every promise for one case, from the files its two runs wrote; returns its figures."""
    directory, dead = Path(case["dir"]), case["to"]
    survivor = 1 - dead
    where = f"rank {dead} killed at {case['at']} (k={case.get('k', 1)}): {directory}"
    killed = json.loads((directory / "killed.json").read_text())
    log = (directory / "log.txt").read_text()
    assert (directory / f"outcome-rank{survivor}.json").exists(), (
        where,
        "the survivor raised no RankDied",
        log[-3000:],
    )
    outcome = json.loads((directory / f"outcome-rank{survivor}.json").read_text())
    # the job ends with an error naming the dead rank, the step, the file and how to resume
    assert case["rc"] == (-9 if dead == 0 else 1), where  # rank 0's process: killed, or ended by RankDied
    assert outcome["gone"] == [dead] and outcome["step"] is not None, where
    saved = outcome["step"]
    path = directory / "ckpt" / "last.ckpt"
    for words in (f"rank {dead} is gone", f"optimizer step {saved}", str(path), 'ckpt_path="last"'):
        assert words in outcome["error"], (where, words, outcome["error"])
    assert "RankDied" in log, where
    if case.get("async_io"):  # "saved" said once the bytes exist: the inner IO takes 1 s to write them
        assert outcome["save_seconds"] >= 1.0, (where, outcome["error"])
    # the saved step is at most one behind the most steps any rank completed
    run1 = {rank: records(directory / f"run1-rank{rank}.jsonl") for rank in (0, 1)}
    completed = {
        rank: max([r["step"] for r in lines if r["kind"] == "batch_end"], default=0) for rank, lines in run1.items()
    }
    completed[dead] = max(completed[dead], killed["global_step"])
    assert max(completed.values()) - 1 <= saved <= max(completed.values()), (where, completed, saved)
    # each sample trained once an epoch, across both runs (run 1's micro-batches of the steps saved)
    run2 = {rank: records(directory / f"run2-rank{rank}.jsonl") for rank in (0, 1)}
    assert times_each_row_trained(run1, run2, saved) == dict.fromkeys(range(64), EPOCHS), where
    # every on_train_batch_end once per batch across both runs: on the survivor exactly; the dead rank's can lack
    # only the batches of the step it died in
    # A death inside a step's end hooks (the periodic save runs in `ModelCheckpoint.on_train_batch_end`): the step
    # is applied and saved, and the hooks after the one that failed (the module's, here) never run for it.
    every_batch = sorted([epoch, batch] for epoch in range(EPOCHS) for batch in range(BATCHES))
    cut_in_end_hooks = {"save": (1, 1), "random": (0, 1)}.get(case["at"], (0, 0))
    for rank in (0, 1):
        kept = [r for r in run1[rank] if r["kind"] == "batch_end" and r["step_before"] < saved]
        ends = sorted([r["epoch"], r["batch"]] for r in kept + [r for r in run2[rank] if r["kind"] == "batch_end"])
        assert len(ends) == len({tuple(end) for end in ends}), (where, rank)  # none twice
        missing = len(every_batch) - len(ends)
        assert set(map(tuple, ends)) <= set(map(tuple, every_batch)), (where, rank)
        if rank == survivor:
            assert cut_in_end_hooks[0] <= missing <= cut_in_end_hooks[1], (where, rank, missing)
        else:
            assert missing <= max(case.get("k", 1), cut_in_end_hooks[1]), (where, rank, missing)
    # the same parameters as an uninterrupted run, and the resume trains to the end
    assert resumed["distance"] <= 1e-5 and resumed["global_step"] == EPOCHS * BATCHES // case.get("k", 1), where
    # nothing of the job is left running
    left = subprocess.run(["pgrep", "-f", str(directory)], check=False, capture_output=True, text=True).stdout.split()
    assert left == [], where
    return {
        "steps_completed": completed,
        "saved": saved,
        "seconds_to_save": path.stat().st_mtime - killed["time"],
        "seconds_to_end": case["end"] - killed["time"],
    }


@pytest.fixture(scope="module")
def deaths(tmp_path_factory):
    """Each case's job (a launch each: a killed rank does not come back), then every resume on one 2-rank job."""
    base = tmp_path_factory.mktemp("deaths")
    cases = EVERY_CASE if os.environ.get("DDP_PLUS_EVERY_DEATH") else CASES
    for index, case in enumerate(cases):
        directory = base / f"case-{index}"
        directory.mkdir()
        result = run_job(python_script("rank_death_job.py") + ["kill", str(directory), json.dumps(case)], timeout=200)
        (directory / "log.txt").write_text(result.stdout)
        case.update(dir=str(directory), rc=result.returncode, end=time.time())
    out = base / "resumed.json"
    for result in start_ranks(
        python_script("rank_death_job.py") + ["resume", str(out), json.dumps(cases)], timeout=400
    ):
        assert result.returncode == 0, result.stdout[-4000:]
    return cases, json.loads(out.read_text())


@pytest.mark.multiprocess
def test_a_killed_rank_costs_at_most_the_step_in_progress(deaths):
    cases, resumed = deaths
    figures = {
        f"{c['to']}@{c['at']}/k={c.get('k', 1)}/seed={c.get('seed')}": check_case(c, r)
        for c, r in zip(cases, resumed, strict=True)
    }
    print(json.dumps(figures, indent=1))  # the closing note's figures (pytest -s)


@pytest.mark.multiprocess
def test_each_batch_end_is_counted_once_across_both_runs(deaths):
    """The step loggers log at (``_batches_that_stepped``, counted at each batch end that steps) ends where an
    uninterrupted run ends: a save that Lightning's restore continues by running a batch's end again counts it twice
    (issue 57, item 6)."""
    cases, resumed = deaths
    counted = {
        f"{c['to']}@{c['at']}/k={c.get('k', 1)}": (r["batch_ends"], EPOCHS * BATCHES // c.get("k", 1))
        for c, r in zip(cases, resumed, strict=True)
    }
    assert {name: pair for name, pair in counted.items() if pair[0] != pair[1]} == {}


def test_a_peer_s_death_is_told_from_other_errors():
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:26019. This is typically ...")
    wrapped = RuntimeError("lightning-ddp-plus: the step failed")
    wrapped.__cause__ = closed
    assert peer_gone_in(wrapped) == "[pair.cc:553] Connection closed by peer [127.0.0.1]:26019"  # gloo's advice cut
    assert peer_gone_in(RuntimeError("Expected to have finished reduction in the prior iteration")) is None
    assert peer_gone_in(KeyboardInterrupt()) is None
    from lightning_ddp_plus import ChunkOutOfMemoryError

    explained = ChunkOutOfMemoryError("Out of memory on rank 1 in the forward ... Every rank stops here.")
    explained.__cause__ = closed  # the agreed error of a rank whose peer then ended: not a death to save after
    assert peer_gone_in(explained) is None
    # a survivor's collective that broke because the rank that ran out of memory ended: a death (issue 57, item 7)
    survivors = ChunkOutOfMemoryError("Out of memory on rank 1 in the forward. Every rank stops here.")
    survivors.broken_collective = closed
    assert peer_gone_in(survivors) == "Out of memory on rank 1 in the forward"


def test_the_survivors_choose_the_most_steps_and_the_lowest_rank_holding_them():
    assert choose_writer({0: 5, 1: 6, 2: 6}) == (1, 6)
    assert choose_writer({3: 2}) == (3, 2)


def test_survivors_agree_through_the_store_and_alone_without_it():
    from datetime import timedelta

    import torch.distributed as dist

    from tests.helpers import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=5))
    # rank 2 of 3 answers first; rank 1 answers; rank 0 is dead (known to the launcher): no wait for it
    third = SurvivorAgreement(store, 2, 3, "t", known_dead=lambda: {0}, answer_seconds=5)
    store.set("ddp_plus/after_death/t/step/1", "7")
    agreed = third.agree(6)
    assert (agreed.writer, agreed.step, agreed.answered, agreed.gone(3)) == (1, 7, (1, 2), (0,))
    assert agreed.through_store
    # a late survivor reads the decision made, whatever it holds
    late = SurvivorAgreement(store, 1, 3, "t", answer_seconds=0.1).agree(7)
    assert (late.writer, late.step) == (1, 7)
    # without a store (its host died): alone
    alone = SurvivorAgreement(None, 1, 2, "u").agree(4)
    assert (alone.writer, alone.step, alone.through_store) == (1, 4, False)
    gone_store = SurvivorAgreement(_DeadStore(), 1, 2, "u").agree(4)
    assert not gone_store.through_store


def test_each_survivor_hands_the_writer_its_generator_states_through_the_store():
    """With several survivors, the writer's file holds each survivor's generator states at the step saved: each sets
    them before its step, so the writer finds those of every survivor that answered (rank 0 is dead here)."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lightning_ddp_plus.persistence.generators import generator_states, packed, unpacked
    from tests.helpers import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=5))
    states = generator_states()
    second = SurvivorAgreement(store, 2, 3, "g", known_dead=lambda: {0}, answer_seconds=5)
    answered = threading.Thread(target=second.agree, args=(6, packed({"step": 6, "states": states})))
    answered.start()
    writer = SurvivorAgreement(store, 1, 3, "g", known_dead=lambda: {0}, answer_seconds=5)
    agreed = writer.agree(6, b"rank 1's")
    answered.join()
    shared = writer.shared_with_writer(agreed)
    assert sorted(shared) == [1, 2]
    assert shared[1] == b"rank 1's"
    assert torch.equal(unpacked(shared[2])["states"]["torch"], states["torch"])


class _CountingStore:
    """The real store, its ``check`` calls counted: what a survivor's wait costs the store's host."""

    def __init__(self, store) -> None:
        self.store, self.checks = store, 0

    def check(self, keys):
        self.checks += 1
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_survivor_waiting_for_a_lost_nodes_ranks_checks_the_store_once_a_poll(monkeypatch):
    """Issue 57 (lower severity): 16 ranks, node 1's 8 lost (never answering). Each poll of the wait asks the store
    once for every missing answer, not once per missing rank: one host takes one call a poll from each survivor."""
    import types
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_ddp_plus.crash import survivors
    from tests.helpers import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=5))
    world = 16
    for rank in range(1, 8):  # node 0's other survivors have answered
        store.set(f"ddp_plus/after_death/w/step/{rank}", "5")
    polls: list[float] = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(survivors, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    counted = _CountingStore(store)
    agreed = SurvivorAgreement(counted, 0, world, "w", answer_seconds=0.5).agree(5)
    assert agreed.gone(world) == tuple(range(8, 16))
    assert len(polls) >= 1
    # a look at each key before the wait and after it, and one call per poll between
    assert counted.checks <= 2 * world + len(polls), (counted.checks, len(polls))


PUBLISH_AND_WAIT = """
import os, sys, time
import torch.distributed as dist
from lightning_ddp_plus.processes.reachability import publish_host
publish_host(dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False), rank=1)
time.sleep(120)
"""


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_survivor_sees_a_dead_peer_on_its_host_without_waiting_out_the_answer_window(reaped, monkeypatch):
    # issue 57, item 9: under torchrun no launcher of the package sees a death, so a survivor polled the store for
    # the whole answer window (5 s) for the dead rank's step. That rank's process ran on this host: gone once the
    # agent has reaped it, a zombie until then.
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_ddp_plus.processes.reachability import ProcessesHere, publish_host
    from tests.helpers import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    environ = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    peer = subprocess.Popen([sys.executable, "-c", PUBLISH_AND_WAIT], env=environ)
    try:
        store.wait(["ddp_plus/host/1"], timedelta(seconds=60))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        publish_host(store, rank=0)
        assert ProcessesHere(store, 2, 0).gone() == set()  # alive: it is waited for
        peer.kill()
        if reaped:
            peer.wait()
        else:
            while not Path(f"/proc/{peer.pid}/stat").read_text().split(") ")[1].startswith("Z"):
                time.sleep(0.01)
        counted, here = _CountingStore(store), ProcessesHere(store, 2, 0)
        survivor = SurvivorAgreement(counted, 0, 2, "v", known_dead=here.gone, answer_seconds=5)
        agreed = survivor.agree(3)
    finally:
        peer.kill()
        peer.wait()
    assert agreed.gone(2) == (1,)
    assert agreed.answered == (0,)
    assert counted.checks <= 4  # one round of checks; waiting out 5 s polls the store about 100 times


class _DeadStore:
    def set(self, key, value):
        raise RuntimeError("Broken pipe")


def test_the_error_names_the_dead_rank_the_step_the_file_and_the_resume():
    error = RankDied(
        AfterDeathSave(gone=(1,), cause="Connection closed by peer", step=5, path="/c/last.ckpt", writer=0)
    )
    text = str(error)
    for words in ("rank 1 is gone", "optimizer step 5", "/c/last.ckpt", "rank 0", 'ckpt_path="last"'):
        assert words in text
    not_saved = RankDied(AfterDeathSave(gone=(0, 2), cause="x", not_saved="the shard is lost"))
    assert "ranks 0, 2 are gone" in str(not_saved) and "nothing was saved: the shard is lost" in str(not_saved)


@pytest.mark.multiprocess
def test_under_torchrun_the_survivor_saves_and_the_restarted_attempt_resumes_by_itself(tmp_path):
    # a popen launcher's variable inherited from further up (CI once leaked it from an in-process fit) says nothing
    stale = {"DDP_PLUS_LAUNCHER_PID": str(os.getpid())}
    command = torchrun_command("rank_death_job.py", "torchrun", tmp_path, max_restarts=1)
    result = run_job(command, timeout=300, env=stale)
    assert result.returncode == 0, result.stdout[-4000:]
    # under load the survivor once wrote no outcome while torchrun's agent was sending it SIGTERM: the job's output
    # says which of the two it took first
    assert (tmp_path / "outcome-rank0.json").exists(), result.stdout[-8000:]
    outcome = json.loads((tmp_path / "outcome-rank0.json").read_text())
    saved = outcome["step"]
    assert outcome["gone"] == [1] and saved == 3, (outcome, result.stdout[-6000:])  # rank 1 died in step 4's backward
    assert "resuming from" in result.stdout and "last.ckpt" in result.stdout
    final = json.loads((tmp_path / "result.json").read_text())
    assert final["global_step"] == EPOCHS * BATCHES and final["distance"] <= 1e-5, final
    counts: dict[int, int] = {}
    for rank in (0, 1):
        first = [r for r in records(tmp_path / f"run1-rank{rank}.jsonl") if r["kind"] == "trained"]
        second = [r for r in records(tmp_path / f"run2-rank{rank}.jsonl") if r["kind"] == "trained"]
        for record in [r for r in first if r["step_before"] < saved] + second:
            for row in record["rows"]:
                counts[row] = counts.get(row, 0) + 1
    assert counts == dict.fromkeys(range(64), EPOCHS)


@pytest.mark.parametrize("stateful_loader", [False, True])
def test_the_loop_state_kept_at_each_step_boundary_is_lightnings_own_state_dict(tmp_path, stateful_loader):
    """What ``StepBoundaries`` keeps each step (``LoopState``, a field-by-field copy) equals
    ``fit_loop.state_dict()`` at every batch of a fit with accumulation and validation, and holds no live object;
    with a stateful loader, the loader's state is in it too."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_ddp_plus.private_apis.lightning import LoopState, before_each_batch
    from tests.helpers import TinyRegression

    compared: list[bool] = []

    class WithValidation(TinyRegression):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.training_step(batch, batch_idx))

        def val_dataloader(self):
            return self.train_dataloader()

        def train_dataloader(self):
            return (
                CountingLoader(super().train_dataloader().dataset, batch_size=4)
                if stateful_loader
                else super().train_dataloader()
            )

    class CountingLoader(DataLoader):
        """A loader with a state (Lightning saves it in the fit loop's own state)."""

        def __iter__(self):
            for batch in super().__iter__():
                self.served = getattr(self, "served", 0) + 1
                yield batch

        def state_dict(self):
            return {"served": getattr(self, "served", 0)}

        def load_state_dict(self, state):
            self.served = state["served"]

    class Compare(L.Callback):
        def on_train_start(self, trainer, pl_module):
            loop_state = LoopState(trainer.fit_loop)

            def check():
                kept = loop_state()
                compared.append(kept == trainer.fit_loop.state_dict())
                trainer.fit_loop.epoch_loop.batch_progress.increment_ready()  # a later change does not reach it
                compared.append(kept != loop_state())
                trainer.fit_loop.epoch_loop.batch_progress.total.ready -= 1
                trainer.fit_loop.epoch_loop.batch_progress.current.ready -= 1

            self.undo = before_each_batch(trainer, check)

        def on_train_end(self, trainer, pl_module):
            self.undo()

    trainer = L.Trainer(
        max_epochs=2,
        accumulate_grad_batches=2,
        limit_val_batches=2,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[Compare()],
    )
    trainer.fit(WithValidation())
    assert len(compared) == 2 * 2 * 16 and all(compared)  # 16 batches an epoch, 2 comparisons each
    assert ("combined_loader" in trainer.fit_loop.state_dict()["state_dict"]) == stateful_loader
    assert "advance" not in vars(trainer.fit_loop.epoch_loop)  # undone: the class's method again


def test_on_a_backend_that_waits_for_the_dead_the_observer_aborts_the_collectives_before_the_save(monkeypatch):
    """NCCL's collectives wait for a dead peer until the timeout: once the launcher's observer sees a child rank die,
    this process's communicators are aborted (once, from the observer's thread) so that the main thread's wait
    raises and it saves. The observer and the child are real; the backend's name is faked (no NCCL here)."""
    import sys
    import threading

    import torch.distributed as dist

    from lightning_ddp_plus.processes import launcher

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(launcher, "AFTER_DEATH", launcher.AfterDeathWindow(min_notice_seconds=5.0))
    window = launcher.AFTER_DEATH
    window.reset(enabled=True)
    launcher.abort_collectives_on_a_death()
    assert window.leave_collectives is launcher.abort_default_group
    aborted: list[str] = []

    def abort_and_save() -> None:  # what the main thread then does: its wait raised, it saves
        aborted.append(threading.current_thread().name)
        with window.saving():
            pass

    window.leave_collectives = abort_and_save
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    observer = launcher.ChildObserver([child], first_rank=1, poll_seconds=0.05, window=window)
    observer.start()
    observer.join(timeout=20)
    assert not observer.is_alive()  # the save was over: it returned, killing nothing
    assert aborted == ["ddp-plus-child-observer"] and window.dead_ranks == {1}
    window.peer_died({1})
    assert aborted == ["ddp-plus-child-observer"]  # once

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")  # gloo's collectives fail by themselves
    window.reset(enabled=True)
    launcher.abort_collectives_on_a_death()
    assert window.leave_collectives is None
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    window.reset(enabled=False)  # save_on_rank_death off (or no Fabric block): nothing to leave a collective for
    launcher.abort_collectives_on_a_death()
    window.leave_collectives = lambda: aborted.append("disabled")
    window.peer_died({1})
    assert aborted == ["ddp-plus-child-observer"]


def test_the_child_observer_stops_when_asked_as_lightnings_tests_ask_a_daemon_thread():
    # Lightning's test suite stops each daemon thread a test leaves through its `stop()` and fails the test when the
    # thread is still alive (`test_replace_distributed_sampler` under the swap): the observer polls its children
    import sys

    from lightning_ddp_plus.processes import launcher

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        observer = launcher.ChildObserver([child], first_rank=1, poll_seconds=30)
        observer.start()
        observer.stop()
        assert not observer.is_alive()  # as Lightning checks it: right after stop()
        assert child.poll() is None  # stopping the observer ends no child
    finally:
        child.kill()
        child.wait()
