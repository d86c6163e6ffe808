"""Resuming on another number of ranks: the same global batch, the same place in the data, the same parameters.

Pure decisions first, then real jobs: checkpoints taken on 1 and 2 ranks (Lightning's shuffled DistributedSampler,
256 samples, 8 rows per rank; mid-epoch and at an epoch's end; Lightning's accumulation, the strategy's in manual
optimization, and ZeRO-1 sharding), resumed on 2, 1 and 3 ranks (2 -> 3: 4 rows x accumulation 3 on 240 samples, a
3-process job), compared with the uninterrupted runs."""

import json

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_ddp_plus import ArgumentValueError
from lightning_ddp_plus.persistence.generators import (
    GENERATORS_KEY,
    generator_states,
    give_generators_back,
    set_generator_states,
)
from lightning_ddp_plus.persistence.world_size import (
    DataLayout,
    ResumeAtSample,
    plan_world_size_change,
    reachable_world_sizes,
)
from tests.helpers import python_script, start_ranks

TWO_RANKS = DataLayout(
    world_size=2, rows_per_rank=8, accumulation=1, epoch=0, batches_consumed=4, dataset_length=256, shuffle=True, seed=0
)


def test_keeping_the_global_batch_recomputes_accumulation():
    to_one = plan_world_size_change(TWO_RANKS, 1, "keep_global_batch")
    assert (to_one.accumulation, to_one.batches_consumed, to_one.samples_consumed) == (2, 8, 64)
    assert to_one.message == (
        "world size changed 2 -> 1: keeping the global batch of 16 (accumulation 1 -> 2), resuming epoch 0 at "
        "sample 64 of 256"
    )
    assert plan_world_size_change(TWO_RANKS, 2, "keep_global_batch") is None  # nothing changed
    one_rank = DataLayout(1, 8, 2, 0, 8, 256, True, 0)
    assert plan_world_size_change(one_rank, 2, "keep_global_batch").accumulation == 1


def test_a_size_that_cannot_reach_the_global_batch_is_refused_with_the_sizes_that_can():
    with pytest.raises(ArgumentValueError) as raised:
        plan_world_size_change(TWO_RANKS, 3, "keep_global_batch")
    message = str(raised.value)
    assert "global batch of 16 (8 rows per rank x 2 ranks x accumulation 1) cannot be reached on 3 ranks" in message
    assert "Fix: run on one of 1, 2 ranks" in message
    assert reachable_world_sizes(DataLayout(2, 4, 3, 0, 0, 256, True, 0)) == [1, 2, 3, 6]


def test_error_and_keep_per_rank_batch_say_what_changed():
    with pytest.raises(ArgumentValueError, match=r"taken on 2 ranks and this run has 1\. Fix: run on 2 ranks"):
        plan_world_size_change(TWO_RANKS, 1, "error")
    kept = plan_world_size_change(TWO_RANKS, 1, "keep_per_rank_batch")
    assert kept.accumulation == 1
    assert "the global batch changes from 16 to 8" in kept.message and "learning rate" in kept.message


@pytest.mark.parametrize(("consumed", "world"), [(64, 1), (64, 3), (0, 2), (250, 4)])
def test_the_rest_of_the_epoch_is_the_permutation_after_what_was_consumed(consumed, world):
    whole = DistributedSampler(range(256), num_replicas=1, rank=0, shuffle=True, seed=7)
    whole.set_epoch(3)
    order = list(whole)
    dealt = []
    for rank in range(world):
        sampler = DistributedSampler(range(256), num_replicas=world, rank=rank, shuffle=True, seed=7)
        resumed = ResumeAtSample(sampler, start=consumed, epoch=3)
        dealt.append(list(resumed))
        assert len(dealt[-1]) == len(dealt[0])  # every rank the same number (padded as the sampler pads)
        assert list(resumed) == list(sampler)  # the next pass is the sampler's own
    interleaved = [index for row in zip(*dealt) for index in row]
    assert interleaved[: 256 - consumed] == order[consumed:]


def test_generator_states_survive_a_weights_only_checkpoint_and_a_new_rank_is_seeded(tmp_path, monkeypatch):
    import random

    import numpy

    before = generator_states()
    try:
        saved = generator_states()
        expected = (torch.rand(3), random.random(), numpy.random.rand())
        torch.save({GENERATORS_KEY: [saved]}, tmp_path / "states.ckpt")
        loaded = torch.load(tmp_path / "states.ckpt", weights_only=True)[GENERATORS_KEY]
        assert give_generators_back(loaded, 0, sampler_seed=None).how == "restored"
        again = (torch.rand(3), random.random(), numpy.random.rand())
        assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]
        monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
        given = give_generators_back(loaded, 2, sampler_seed=7)  # rank 2 of a checkpoint taken on 1 rank
        assert (given.how, given.seed) == ("seeded", 9)
        drawn = torch.rand(1)
        torch.manual_seed(9)
        assert torch.equal(drawn, torch.rand(1))
        monkeypatch.setenv("PL_GLOBAL_SEED", "100")  # seed_everything's seed comes first
        assert give_generators_back(loaded, 1, sampler_seed=7).seed == 101
    finally:
        set_generator_states(before)


# ------------------------------------------------------------------ real jobs


def run(world: int, cases: list, out) -> dict:
    for result in start_ranks(python_script("world_size_job.py") + [str(out), json.dumps(cases)], world_size=world):
        assert result.returncode == 0, result.stdout[-4000:]
    return {result["name"]: result for result in json.loads(out.read_text())}


#: The other knobs a change of world size must keep working: chunks of 4 rows, telemetry, joined uneven inputs and
#: the replica check at every step (the every-step guard is on in every case).
KNOBS = {"chunk_size": 4, "telemetry": True, "uneven_inputs": "join", "verify_replicas_every_n_steps": 1}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("world_size")
    one, two = (str(folder / name) for name in ("one.ckpt", "two.ckpt"))
    manual, boundary, sharded = (str(folder / name) for name in ("manual.ckpt", "boundary.ckpt", "sharded.ckpt"))
    wide, knobs, stateful = (str(folder / name) for name in ("two_b4.ckpt", "knobs.ckpt", "stateful.ckpt"))
    items, one_sharded = str(folder / "items.ckpt"), str(folder / "one_sharded.ckpt")
    iterable, one_cycle = str(folder / "iterable.ckpt"), str(folder / "one_cycle.ckpt")
    # 240 samples: 10 steps of 24 on 2 ranks (4 rows x accumulation 3), and the 192 after 2 steps deal evenly to 3
    four_by_three = {"batch_size": 4, "accumulate": 3, "samples": 240}
    manual_case = {"manual": True, "strategy_accumulate": 2}  # the strategy's window, k = 2 on one rank
    results = run(
        1,
        [
            {"name": "one, stop", "stop_after": 4, "accumulate": 2, "checkpoint": one},
            {"name": "one, manual, stop", "stop_after": 4, "checkpoint": manual, **manual_case},
            {
                "name": "one, sharded, stop",
                "stop_after": 4,
                "accumulate": 2,
                "checkpoint": one_sharded,
                "sharding": True,
            },
        ],
        folder / "1.json",
    )
    results |= run(
        2,
        [
            {"name": "reference"},
            {"name": "reference, 2 epochs", "epochs": 2},
            {"name": "reference, 4 rows x 3", **four_by_three},
            {"name": "two (4 rows x 3), stop", "stop_after": 2, "checkpoint": wide, **four_by_three},
            {"name": "two, stop", "stop_after": 4, "checkpoint": two},
            {"name": "two, stop at the epoch's end", "stop_after": 16, "checkpoint": boundary},
            {"name": "two, sharded, stop", "stop_after": 4, "checkpoint": sharded, "sharding": True},
            {"name": "two, knobs, stop", "stop_after": 4, "checkpoint": knobs, "strategy": KNOBS},
            {"name": "two, stateful loader, stop", "stop_after": 4, "checkpoint": stateful, "stateful": True},
            {"name": "reference, items", "items": True},
            {"name": "two, items, stop", "stop_after": 4, "checkpoint": items, "items": True},
            {"name": "reference, one cycle", "one_cycle": True},
            {"name": "two, one cycle, stop", "stop_at": 4, "checkpoint": one_cycle, "one_cycle": True},
            {"name": "1 -> 2", "resume": one},
            {"name": "1 -> 2, manual", "resume": manual, **manual_case},
            {"name": "1 -> 2, sharded", "resume": one_sharded, "sharding": True},
            # the same world size: the loader restores its own place (before: skipped again, 64 samples lost)
            {"name": "2 -> 2, stateful loader", "resume": stateful, "stateful": True},
            # an iterable data set has no sampler to skip with (before: the 4 batches trained again)
            {"name": "reference, iterable", "iterable": True},
            {"name": "two, iterable, stop", "stop_after": 4, "checkpoint": iterable, "iterable": True},
            {"name": "2 -> 2, iterable", "resume": iterable, "iterable": True},
        ],
        folder / "2.json",
    )
    results |= run(
        1,
        [
            {"name": "2 -> 1", "resume": two},
            {"name": "2 -> 1, at the epoch boundary", "resume": boundary, "epochs": 2},
            {"name": "2 -> 1, sharded", "resume": sharded, "sharding": True},
            {"name": "2 -> 1, knobs", "resume": knobs, "strategy": KNOBS},
            {"name": "2 -> 1, a sampler of its own", "resume": two, "trainer": {"use_distributed_sampler": False}},
            {"name": "2 -> 1, stateful loader", "resume": stateful, "stateful": True},
            {"name": "2 -> 1, num_items", "resume": items, "items": True},
            {"name": "2 -> 1, one cycle", "resume": one_cycle, "one_cycle": True},
            {  # not a resume: "join" on a single rank whose loader Lightning does not shard (it used to pad forever)
                "name": "one rank, join, its own sampler",
                "strategy": {"uneven_inputs": "join"},
                "trainer": {"use_distributed_sampler": False},
            },
            {"name": "2 -> 1, error", "resume": two, "mode": "error"},
            {"name": "2 -> 1, keep per-rank batch", "resume": two, "mode": "keep_per_rank_batch"},
        ],
        folder / "3.json",
    )
    results |= run(3, [{"name": "2 -> 3", "resume": wide, "batch_size": 4, "samples": 240}], folder / "4.json")
    return results


def samples(*results) -> list[int]:
    return sorted(index for result in results for rank in result["seen"] for index in rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("before", "after", "reference", "steps", "accumulation"),
    [
        ("two, stop", "2 -> 1", "reference", 16, 2),
        ("one, stop", "1 -> 2", "reference", 16, 1),
        ("one, manual, stop", "1 -> 2, manual", "reference", 16, 1),  # the strategy's window, manual optimization
        ("two, sharded, stop", "2 -> 1, sharded", "reference", 16, 2),  # ZeRO-1 state consolidated, re-sharded
        ("one, sharded, stop", "1 -> 2, sharded", "reference", 16, 1),  # a chunk per rank from one rank's state
        ("two, stop at the epoch's end", "2 -> 1, at the epoch boundary", "reference, 2 epochs", 32, 2),
        ("two (4 rows x 3), stop", "2 -> 3", "reference, 4 rows x 3", 10, 2),  # 3 processes
        ("two, knobs, stop", "2 -> 1, knobs", "reference", 16, 2),  # chunks, telemetry, join, replica checks
        ("two, items, stop", "2 -> 1, num_items", "reference, items", 16, 2),  # the window's items, k 1 -> 2
        # issue 57, item 2: OneCycleLR from `estimated_stepping_batches` built the loader before the restore, and
        # the change was planned for batch 0
        ("two, one cycle, stop", "2 -> 1, one cycle", "reference, one cycle", 16, 2),
    ],
)
def test_a_resume_on_another_world_size_trains_each_sample_once_and_equals_the_uninterrupted_run(
    resumed, before, after, reference, steps, accumulation
):
    result = resumed[after]
    assert result["error"] is None, result["error"]
    epochs = resumed[reference].get("epochs", 1)
    # each sample once per epoch: the epochs before the checkpoint, and the rest after it
    assert samples(resumed[before], result) == sorted(list(range(resumed[reference].get("samples", 256))) * epochs)
    if before.endswith("epoch's end"):
        assert samples(result) == list(range(256))  # the whole second epoch on the new size
    assert result["global_step"] == resumed[reference]["global_step"] == steps
    assert result["accumulation"] == accumulation
    params = [torch.tensor(p) for p in result["params"]]
    assert all(torch.equal(params[0], p) for p in params)
    expected = torch.tensor(resumed[reference]["params"][0])
    difference = float((params[0] - expected).abs().max())
    assert torch.allclose(params[0], expected, atol=1e-5, rtol=0), difference
    line = next(line for line in result["log"].splitlines() if "DDPPlusStrategy: world size changed" in line)
    print(
        f"| {after} | {result['global_step']} | {len(samples(resumed[before], result))} | {difference:.1e} | {line} |"
    )


@pytest.mark.multiprocess
def test_the_line_that_says_what_changed(resumed):
    assert (
        "world size changed 2 -> 1: keeping the global batch of 16 (accumulation 1 -> 2), resuming epoch 0 at sample "
        "64 of 256." in resumed["2 -> 1"]["log"]
    )
    assert "world size changed 1 -> 2: keeping the global batch of 16 (accumulation 2 -> 1)" in resumed["1 -> 2"]["log"]
    boundary = resumed["2 -> 1, at the epoch boundary"]["log"]
    assert "(accumulation 1 -> 2), resuming at the start of epoch 1." in boundary  # not epoch 0's permutation again


@pytest.mark.multiprocess
def test_error_refuses_and_keep_per_rank_batch_changes_the_global_batch(resumed):
    refused = resumed["2 -> 1, error"]
    assert refused["error"].startswith("ArgumentValueError: `on_world_size_change='error'`")
    assert samples(refused) == []  # nothing trained
    kept = resumed["2 -> 1, keep per-rank batch"]
    assert kept["error"] is None
    changed = next(line for line in kept["log"].splitlines() if "world size changed" in line)
    print(f"| 2 -> 1, error | {refused['error'][:300]} |\n| 2 -> 1, keep per-rank batch | {changed} |")
    assert "the global batch changes from 16 to 8" in kept["log"]
    assert samples(resumed["two, stop"], kept) == list(range(256))  # still resumed at the same sample
    assert kept["global_step"] == 4 + 192 // 8


@pytest.mark.multiprocess
def test_each_rank_gets_its_generators_back_and_a_new_rank_starts_from_the_seed_and_its_rank(resumed):
    # 2 -> 1: rank 0 draws first what the uninterrupted run's rank 0 drew at the same batch (the 5th)
    assert resumed["2 -> 1"]["draws"][0][0] == resumed["reference"]["draws"][0][4]
    assert resumed["2 -> 1"]["draws"][0][0] == resumed["two, stop"]["next_draw"][0]
    # 1 -> 2: rank 0 continues the one-rank run's stream; rank 1 did not exist: seed 0 (the sampler's) + rank 1
    assert resumed["1 -> 2"]["draws"][0][0] == resumed["one, stop"]["next_draw"][0]
    torch.manual_seed(0 + 1)
    assert resumed["1 -> 2"]["draws"][1][0] == torch.rand(1).item()
    said = "rank 1 did not exist when the checkpoint was taken (on 1 ranks): random generators of a new rank start "
    assert said + "from seed 0 plus its rank." in resumed["1 -> 2"]["log"]


@pytest.mark.multiprocess
def test_join_on_a_single_rank_ends_the_epoch_when_its_loader_ends(resumed):
    alone = resumed["one rank, join, its own sampler"]
    assert alone["error"] is None and alone["global_step"] == 256 // 8
    assert samples(alone) == list(range(256))


@pytest.mark.multiprocess
def test_a_loader_the_strategy_cannot_place_is_refused_unless_it_restores_its_own_place(resumed):
    refused = resumed["2 -> 1, a sampler of its own"]
    assert refused["error"].startswith("CheckpointResumeError: world size changed 2 -> 1, and the training loader is ")
    assert "Fix: resume on 2 ranks, or let Lightning add the sampler" in refused["error"]
    assert samples(refused) == []  # nothing trained
    stateful = resumed["2 -> 1, stateful loader"]
    assert stateful["error"] is None and stateful["accumulation"] == 2  # the global batch kept: only k changed
    assert "keeping the global batch of 16 (accumulation 1 -> 2); the loader restores its place." in stateful["log"]
    # its own place: 4 batches given of this rank's 32 on one rank, so 28 trained here (in 14 steps of 2)
    assert len(samples(stateful)) == 28 * 8 and stateful["global_step"] == 4 + 14


@pytest.mark.multiprocess
def test_a_resume_on_the_same_ranks_continues_a_stateful_loader_and_an_iterable_data_set_once(resumed):
    for stop, resume in (
        ("two, stateful loader, stop", "2 -> 2, stateful loader"),
        ("two, iterable, stop", "2 -> 2, iterable"),
    ):
        before, after = resumed[stop], resumed[resume]
        assert after["error"] is None and after["global_step"] == 16, after["error"]
        assert samples(before, after) == list(range(256)), resume  # every sample once: none twice, none lost
    iterable = resumed["2 -> 2, iterable"]
    assert "those batches are fetched again and dropped, not trained" in iterable["log"]
    reference = resumed["reference, iterable"]
    assert max(abs(a - b) for a, b in zip(iterable["params"][0], reference["params"][0], strict=True)) <= 1e-6
    assert "the loader restores its place" in resumed["2 -> 2, stateful loader"]["log"]


def test_a_skipped_sized_iterable_stays_sized_for_lightning():
    """Issue 57: ``SkipFirstBatches`` had no ``__len__``, so a resumed epoch of a sized ``IterableDataset`` became
    unsized to Lightning, and a fractional ``val_check_interval`` then raised. Its length is the loader's."""
    from lightning.fabric.utilities.data import has_len
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_ddp_plus.persistence.resume import SkipFirstBatches

    class Sized(IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 10

    class Unsized(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    skipped = SkipFirstBatches(DataLoader(Sized(), batch_size=2), skip=3)
    assert has_len(skipped) and len(skipped) == 5
    assert [batch.tolist() for batch in skipped] == [[6, 7], [8, 9]]
    assert not has_len(SkipFirstBatches(DataLoader(Unsized(), batch_size=2), skip=3))
