"""The collective ledger, the user's call site and the stall decision, without processes: records built the way a
rank builds them, and the decision over every rank's state."""

import dataclasses
import json
import sys

import pytest
import torch

from lightning_ddp_plus.diagnostics.call_sites import (
    CallSite,
    CollectiveCall,
    collective_in_progress,
    is_library_file,
    stack_text,
    user_call_site,
)
from lightning_ddp_plus.diagnostics.collective_ledger import CollectiveLedger, CollectiveRecord
from lightning_ddp_plus.diagnostics.stalls import RankState, explain_stall, state_of


def issue(ledger: CollectiveLedger, op: str, size: int = 4) -> CollectiveRecord:
    with ledger.collective(op, size) as record:  # the user's line below is this one's caller
        pass
    return record


def test_the_call_site_is_the_users_line_with_its_source():
    ledger = CollectiveLedger()
    record = issue(ledger, "barrier")
    assert record.call_site is not None and record.call_site.function == "issue"
    assert (
        record.call_site.source
        == "with ledger.collective(op, size) as record:  # the user's line below is this one's caller"
    )
    assert str(record.call_site).startswith("test_stalls.py:")
    assert record.sequence == 1 and record.ended is not None and ledger.current is None


def test_a_collective_the_device_completes_later_stays_the_current_one_until_it_does():
    """As on CUDA: each host call's end leaves a probe of the work queued so far; the oldest record whose probe says
    "not yet" is the rank's current collective, whatever the host does meanwhile."""
    queued: list[dict] = []

    def probe_of_the_queue():
        works = list(queued)
        return lambda: all(work["done"] for work in works)

    ledger = CollectiveLedger(device_completion=probe_of_the_queue)
    queued.append({"done": False})
    first = issue(ledger, "gradient all_reduce")
    queued.append({"done": False})
    second = issue(ledger, "all_reduce")
    assert first.ended is None and ledger.current is first  # the host went on; the device did not
    state = state_of(0, ledger, None, "", now=first.started + 30)
    assert state.current is first and state.seconds == pytest.approx(30) and state.sequence == 2
    queued[0]["done"] = True
    assert ledger.current is second and first.ended is not None
    queued[1]["done"] = True
    assert ledger.current is None and second.ended is not None
    issue(ledger, "barrier")  # completed records are dropped from the pending ones
    assert ledger._pending == ()


def test_a_cuda_device_makes_records_wait_for_its_stream_and_a_cpu_one_does_not():
    from lightning_ddp_plus.diagnostics.collective_ledger import stream_completion

    ledger = CollectiveLedger()
    ledger.follow_device(torch.device("cpu"))
    assert ledger.device_completion is None
    ledger.follow_device(torch.device("cuda", 0))  # a device object needs no GPU
    assert ledger.device_completion is stream_completion


def test_torch_lightning_this_package_and_pythons_library_are_not_the_users():
    import contextlib

    import lightning.pytorch.core.module as lightning_module
    import torch.distributed.distributed_c10d as c10d

    from lightning_ddp_plus.frontends import strategy

    for module in (c10d, lightning_module, strategy, contextlib):
        assert is_library_file(module.__file__), module.__name__
    assert not is_library_file(__file__) and not is_library_file("/home/me/project/train.py")
    frame = sys._getframe()
    assert user_call_site(frame).function == "test_torch_lightning_this_package_and_pythons_library_are_not_the_users"
    assert "test_torch_lightning_this_package" in stack_text(frame)


def state(rank, ledger, current=None, seconds=9.0, site=None):
    return RankState(
        rank,
        ledger.step,
        ledger.phase,
        ledger.sequence,
        current,
        seconds,
        site,
        f"stack of rank {rank}\n",
        ledger.last(),
    )


def in_step_ledgers(count: int = 2) -> list[CollectiveLedger]:
    ledgers = []
    for _ in range(count):
        ledger = CollectiveLedger()
        ledger.enter_phase("backward", step=1)
        issue(ledger, "gradient all_reduce", 4096)
        ledger.enter_phase("optimizer step")
        issue(ledger, "sync guard agreement", 32)
        ledgers.append(ledger)
    return ledgers


def test_an_extra_collective_on_one_rank_is_out_of_step_and_names_both_lines():
    rank0, rank1 = in_step_ledgers()
    rank0.enter_phase("forward", step=2)
    site = CallSite("model.py", 57, "training_step", 'self.log("extra", loss, sync_dist=True)')
    extra = CollectiveRecord(rank0.sequence + 1, "all_reduce", 4, "forward", 2, site, 0.0)
    rank1.enter_phase("backward", step=2)
    gradients = CollectiveRecord(rank1.sequence + 1, "gradient all_reduce", 4096, "backward", 2, None, 0.0)
    report = explain_stall([state(0, rank0, extra, site=site), state(1, rank1, gradients)])
    assert report.kind == "out_of_step"
    assert 'model.py:57 in training_step: self.log("extra", loss, sync_dist=True)' in report.text
    assert "rank 1 issued gradient all_reduce of 4.0 KiB" in report.text
    assert "sync_dist=True` on some ranks only" in report.text and "Fix:" in report.text


def test_a_rank_that_has_not_reached_the_collective_is_named_with_its_line_and_stack():
    rank0, rank1 = in_step_ledgers()
    rank0.enter_phase("backward", step=2)
    waiting = CollectiveRecord(rank0.sequence + 1, "gradient all_reduce", 4096, "backward", 2, None, 0.0)
    rank1.enter_phase("forward", step=2)
    reader = CallSite("data.py", 12, "slow_read", "return handle.read()")
    report = explain_stall([state(0, rank0, waiting, seconds=7), state(1, rank1, seconds=7.4, site=reader)])
    assert report.kind == "not_reached" and report.culprits == (1,)
    assert "rank 1 has not reached it: for 7 s it has been at data.py:12 in slow_read" in report.text
    assert "stack of rank 1" in report.text


def test_rank_0_stuck_is_named_by_the_others():
    rank0, rank1, rank2 = in_step_ledgers(3)
    waiting = [
        CollectiveRecord(ledger.sequence + 1, "barrier", 0, "validation", 1, None, 0.0) for ledger in (rank1, rank2)
    ]
    report = explain_stall([state(0, rank0), state(1, rank1, waiting[0]), state(2, rank2, waiting[1])])
    assert report.kind == "not_reached" and report.culprits == (0,)
    assert report.text.startswith("Rank(s) 1, 2 have waited")


def test_every_rank_in_the_same_collective_is_not_blamed_on_a_rank():
    ledgers = in_step_ledgers()
    waiting = [CollectiveRecord(ledger.sequence + 1, "barrier", 0, "validation", 1, None, 0.0) for ledger in ledgers]
    report = explain_stall([state(rank, ledger, record) for rank, (ledger, record) in enumerate(zip(ledgers, waiting))])
    assert report.kind == "every_rank_waits" and report.culprits == ()


def test_a_rank_still_inside_the_previous_collective_is_behind_not_out_of_step():
    rank0, rank1 = in_step_ledgers()
    # rank 1 finished the agreement and waits in the next gradient all-reduce; rank 0 is still in its agreement
    ahead = CollectiveRecord(rank1.sequence + 1, "gradient all_reduce", 4096, "backward", 2, None, 0.0)
    still = rank0.last()[-1]
    report = explain_stall([state(0, rank0, still), state(1, rank1, ahead)])
    assert report.kind == "not_reached" and report.culprits == (0,)


def test_the_state_crosses_the_store_as_json():
    (ledger,) = in_step_ledgers(1)
    site = CallSite("model.py", 3, "training_step", "x = 1")
    mine = state_of(0, ledger, site, "stack\n")
    again = RankState.from_data(json.loads(json.dumps(mine.as_data())))
    assert again == mine


def test_there_is_nothing_to_explain_without_a_waiting_rank():
    (ledger,) = in_step_ledgers(1)
    with pytest.raises(ValueError, match="no rank waits"):
        explain_stall([state(0, ledger)])


def test_a_rank_waiting_in_a_collective_outside_the_ledger_is_out_of_step_when_every_rank_answered():
    """Lightning issues some collectives itself (its loop's SIGTERM broadcast before every training batch): a rank
    waiting there while the other waits in the ledger's collective is out of step, when the answers of every rank
    crossed the network; a rank that did not answer may sit behind a cut link, and then nothing is concluded."""
    rank0, rank1 = in_step_ledgers()
    rank0.enter_phase("validation", step=2)
    site = CallSite("model.py", 61, "validation_step", 'self.log("val_loss", loss, sync_dist=True)')
    extra = CollectiveRecord(rank0.sequence + 1, "all_reduce", 4, "validation", 2, site, 0.0)
    rank1.enter_phase("data fetch", step=2)
    loop = CallSite("training_epoch_loop.py", 265, "_broadcast_sigterm_tensor", "torch.distributed.broadcast(t, 0)")
    outside = CollectiveCall("broadcast", loop)
    states = [state(0, rank0, extra, site=site), dataclasses.replace(state(1, rank1), outside_ledger=outside)]
    report = explain_stall(states, world_size=2)
    assert report.kind == "out_of_step" and report.culprits == (0, 1)
    assert "rank 1 waits in broadcast issued at training_epoch_loop.py:265 in _broadcast_sigterm_tensor" in report.text
    assert 'rank 0 waits in all_reduce of 4 B at model.py:61 in validation_step: self.log("val_loss"' in report.text
    assert explain_stall([states[0]], world_size=2).kind != "out_of_step"  # rank 1 did not answer
    again = RankState.from_data(json.loads(json.dumps(states[1].as_data())))
    assert again == states[1]


def test_the_collective_a_thread_waits_in_is_read_from_its_stack():
    import torch.distributed as dist

    seen = {}

    def wait_in_barrier():
        def spy(*args, **kwargs):
            seen["call"] = collective_in_progress(sys._getframe(1))  # from inside torch.distributed's barrier
            raise RuntimeError("not initialized")  # stop here: no process group is needed

        original = dist.distributed_c10d._get_default_group
        dist.distributed_c10d._get_default_group = spy
        try:
            dist.barrier()  # the caller line that is named
        finally:
            dist.distributed_c10d._get_default_group = original

    with pytest.raises(RuntimeError):
        wait_in_barrier()
    call = seen["call"]
    assert call is not None and call.op == "barrier"
    assert (
        call.issued_at.function == "wait_in_barrier"
        and call.issued_at.source == "dist.barrier()  # the caller line that is named"
    )
    assert collective_in_progress(sys._getframe()) is None  # a thread in its own code waits in no collective
