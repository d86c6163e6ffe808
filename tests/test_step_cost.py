"""What a steady step costs: counted, not timed, on real gloo jobs of 2 and 4 ranks (``tests/scripts/step_cost_job.py``):
with the features that need a per-step agreement off, and with them on while no rank has news. And what opening the
side channel connects (``tests/scripts/side_channel_job.py``)."""

import json

import pytest

from tests.helpers import python_script, run_case_job, start_ranks

#: Every feature that agrees across ranks per step off: no guard, no notices, no ``num_items``.
OFF = {"sync_guard": False, "preemption_signals": []}
CASES = [
    {"name": "off", "strategy": OFF},
    {"name": "off, k=2", "strategy": OFF, "k": 2},
    {"name": "replicas, validation", "strategy": {"verify_replicas_every_n_steps": 1}, "validate_every": 4},
    # the defaults: the guard on every synced backward, SIGTERM taken as a notice
    {"name": "defaults", "strategy": {}},
    {"name": "notices without the guard", "strategy": {"sync_guard": False}},
    {"name": "defaults, k=2", "strategy": {}, "k": 2},
    {"name": "a hook on the wrapper", "strategy": {}, "hook_on_the_wrapper": True},
    {"name": "num_items", "strategy": {}, "num_items": True},
    {"name": "num_items, k=2", "strategy": {}, "num_items": True, "k": 2},
    # the flags ride in the last bucket's reduce-scatter
    {"name": "optimizer_sharding", "strategy": {"optimizer_sharding": True}, "num_items": True},
    {"name": "optimizer_sharding, guard off", "strategy": {"optimizer_sharding": True, "sync_guard": False}},
    # the compressing hooks' last bucket carries the flags, compressed as torch's hook compresses it
    {"name": "ddp_comm_hook fp16", "strategy": {"ddp_comm_hook": "fp16"}},
    {"name": "ddp_comm_hook bf16", "strategy": {"ddp_comm_hook": "bf16"}},
    # 16-bit buckets hold counts above 256 inexactly (bf16): the counts take their own all-reduce
    {"name": "num_items, bf16", "strategy": {}, "num_items": True, "precision": "bf16-true"},
    # 14 steady steps of 80 ms: about 2 looks of the stall watchdog's thread (every 0.5 s)
    {"name": "defaults, 80 ms steps", "strategy": {}, "sleep": 0.08},
]
STEADY = ["off", "off, k=2"]
SHARDED = ["optimizer_sharding", "optimizer_sharding, guard off"]
COMPRESSED = ["ddp_comm_hook fp16", "ddp_comm_hook bf16"]
QUIET = ["defaults", "notices without the guard", "defaults, k=2", "num_items", "num_items, k=2", *SHARDED, *COMPRESSED]
ON_FOUR_RANKS = [case for case in CASES if case["name"] in ("defaults", "notices without the guard", *SHARDED)]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_cost") / "out.json"
    return {case["name"]: case for case in run_case_job("step_cost_job.py", CASES, out, timeout=300)}


@pytest.fixture(scope="module")
def counted_on_four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_cost_4") / "out.json"
    results = run_case_job("step_cost_job.py", ON_FOUR_RANKS, out, timeout=300, world_size=4)
    return {case["name"]: case for case in results}


def own_calls(case: dict, kind: str) -> dict:
    """The Python-level calls of ``kind`` (``collective`` or ``store``) a steady step made, per step, but the
    gradient buckets' own all-reduces."""
    return {name: n for name, n in case["calls"].items() if name.startswith(kind)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", QUIET)
def test_with_no_rank_having_news_a_step_makes_no_store_call(counted, name):
    """Issue 59: the guard agreed through one store look-up per rank per step on gloo, so the store's host took N
    calls per step. Its flags now ride in the last gradient bucket on every backend: there is no other branch (on
    any backend but gloo, the agreement was a blocking all-reduce per synced backward)."""
    assert counted[name]["steps"] == 14
    assert own_calls(counted[name], "store") == {}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", QUIET)
def test_with_no_rank_having_news_a_step_issues_no_collective_of_its_own(counted, name):
    """Issue 59: on every backend but gloo the guard's flags took a blocking all-reduce per synced backward, and
    without the guard a notice's flag did; with ``optimizer_sharding`` the flags kept that all-reduce (they ride in
    the last bucket's reduce-scatter now), and so did they with ``ddp_comm_hook="fp16"`` or ``"bf16"`` (they ride in the
    last compressed bucket now); ``num_items``' counts took one more (they ride with the flags now)."""
    assert own_calls(counted[name], "collective") == {}
    assert {op: n for op, n in counted[name]["per_step"].items() if op != "gradient all_reduce"} == {}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [case["name"] for case in ON_FOUR_RANKS])
def test_on_four_ranks_a_quiet_step_makes_no_store_call_and_no_collective_of_its_own(counted_on_four_ranks, name):
    case = counted_on_four_ranks[name]
    assert case["steps"] == 14
    assert own_calls(case, "store") == {}
    assert own_calls(case, "collective") == {}


@pytest.mark.multiprocess
def test_with_no_rank_having_news_the_stall_watchdogs_thread_makes_no_store_call(counted):
    """Issue 59: the stall watchdog's thread asked the store for a new episode every 0.5 s on every rank, 0.08-0.21
    calls per rank per step; a store's host took N of them per poll. A rank whose main thread makes progress has
    nothing to explain and nobody it must answer: a rank that waits on it stops making progress too."""
    case = counted["defaults, 80 ms steps"]
    assert case["steps"] == 14
    assert case["thread_calls"] == {}
    assert own_calls(case, "store") == {}


@pytest.mark.multiprocess
def test_item_counts_in_a_16_bit_bucket_take_their_own_all_reduce(counted):
    """The counts ride only where the last bucket holds them exactly (32 or 64 bits); in a bf16 bucket they would
    round above 256, so every rank all-reduces them itself, once per optimizer step."""
    case = counted["num_items, bf16"]
    assert case["steps"] == 14
    assert case["per_step"].get("item count all_reduce (num_items)") == 1.0
    assert own_calls(case, "collective") == {"collective all_reduce": 1.0}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", STEADY)
def test_with_the_per_step_features_off_a_step_issues_only_its_gradient_all_reduce(counted, name):
    """Issue 57, item 12: with the guard and notices off and no ``num_items``, a flag all-reduce still ran on every
    synced backward (per-item averaging declares its two flags whether or not a step gives counts)."""
    per_step = counted[name]["per_step"]
    assert counted[name]["steps"] == 14
    assert per_step.get("gradient all_reduce") == 1.0  # the counting sees the step's own collective
    assert {op: n for op, n in per_step.items() if op != "gradient all_reduce"} == {}


@pytest.mark.multiprocess
def test_after_a_validation_the_per_step_features_still_see_training_forwards(counted):
    """Lightning puts the DDP wrapper in eval mode for validation and gives the train mode back to the
    LightningModule only, so the wrapper's ``training`` stayed False for the rest of the fit, and the engine took
    no forward for a training one again: the replica check every step ran 4 times in 16 steps (validation every
    4 batches). DDP itself tells a training forward by grad mode."""
    assert counted["replicas, validation"]["replica_checks"] == 16


@pytest.mark.multiprocess
def test_a_hook_the_user_registers_on_the_wrapper_takes_the_flag_carriers_place(counted):
    """torch takes one communication hook per wrapper, and the flag carrier is one: a user's own, registered on
    ``trainer.strategy.model`` once training starts, raised "can only be called once". It now takes the carrier's
    place, and the flags take their own all-reduce."""
    case = counted["a hook on the wrapper"]
    assert case["users_hook_calls"] >= 16  # every step's buckets went through the user's hook
    assert case["guard"] == "on (all-reduce per step)"
    assert own_calls(case, "collective") == {"collective all_reduce": 1.0}


@pytest.mark.multiprocess
def test_opening_the_side_channel_connects_to_no_peer_before_it_is_used():
    """Issue 59: the side channel is a gloo group of every rank, opened at each fit's start. gloo connected every pair
    of ranks there, N - 1 connections per rank (on an NCCL job, a full mesh that only its rare exchanges use: a fault,
    an out-of-memory retry, uneven inputs, the straggler comparison). It now connects a pair at its first exchange."""
    world = 6
    results = start_ranks(python_script("side_channel_job.py"), world_size=world, timeout=120)
    for result in results:
        assert result.returncode == 0, result.stdout[-3000:]
    ranks = [json.loads(line) for result in results for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(rank["rank"] for rank in ranks) == list(range(world))
    assert all(rank["maximum"] == [world - 1] for rank in ranks)
    added = {rank["rank"]: rank["opened"] - rank["joined"] for rank in ranks}
    assert max(added.values()) <= 2, added  # its listening socket (and the store's), no peer: eagerly, N - 1 more
