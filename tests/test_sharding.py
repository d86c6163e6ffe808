"""Optimizer-state sharding (``optimizer_sharding``): the settings it refuses and why, before any process starts,
and real 2-rank gloo runs that must match unsharded training to 1e-6 and keep their checkpoints portable."""

import json

import lightning as L
import pytest
import torch
from lightning.fabric.accelerators import CPUAccelerator as FabricCPUAccelerator

from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy
from lightning_ddp_plus.sharding.bucket_shards import BucketLayout, pieces_of, shard_size
from lightning_ddp_plus.sharding.optimizer import check_optimizer_sharding
from lightning_ddp_plus.sharding.partition import assign_ranks, bytes_per_rank
from tests.helpers import python_script, run_case_job, start_ranks
from tests.test_strategy_args import FakeCUDAAccelerator, trainer


@pytest.mark.parametrize("value", ["zero1", 1, None, "True"])
def test_a_bad_value_names_what_is_allowed(value):
    allowed = r"allowed: False, True, 'all_reduce', 'overlap'.*Fix: use True"
    with pytest.raises(ValueError, match=r"`optimizer_sharding=.*" + allowed):
        DDPPlusStrategy(optimizer_sharding=value)
    assert check_optimizer_sharding(True) is True


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"ddp_comm_hook": "fp16"}, r"`ddp_comm_hook` is set"),
        ({"gradient_accumulation_steps": 4}, r"`gradient_accumulation_steps=4`"),
        ({"bucket_cap_mb": "auto", "sync_guard": False}, r"`bucket_cap_mb='auto'`"),
        ({}, r"`sync_guard=True` acts after the backward"),
        ({"uneven_inputs": "join", "sync_guard": False}, r"`uneven_inputs='join'`"),
    ],
)
def test_overlap_refuses_what_would_act_after_its_step(settings, reason):
    for strategy in (DDPPlusStrategy, DDPPlusFabricStrategy):
        with pytest.raises(
            ValueError, match=r"`optimizer_sharding='overlap'` cannot run with these settings: .*" + reason
        ):
            strategy(optimizer_sharding="overlap", **settings)


def test_sharding_without_overlap_takes_every_other_setting():
    strategy = DDPPlusStrategy(
        optimizer_sharding="all_reduce", ddp_comm_hook="fp16", gradient_accumulation_steps=4, bucket_cap_mb="auto"
    )
    assert strategy.arguments.optimizer_sharding == "all_reduce"
    strategy = DDPPlusStrategy(optimizer_sharding=True, gradient_accumulation_steps=4, bucket_cap_mb="auto")
    assert strategy.arguments.optimizer_sharding is True


def test_the_reduce_scatter_is_the_hook_so_a_comm_hook_is_refused_with_the_way_out():
    for strategy in (DDPPlusStrategy, DDPPlusFabricStrategy):
        with pytest.raises(
            ValueError,
            match=r"`optimizer_sharding=True` cannot run with these settings: `ddp_comm_hook` is set.*"
            r"use `optimizer_sharding='all_reduce'`.*Fix: as the reason says",
        ):
            strategy(optimizer_sharding=True, ddp_comm_hook="fp16")


def test_overlap_on_gloo_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"overlap hook refuses the gloo backend.*Fix: use `optimizer_sharding=True`"):
        trainer(DDPPlusStrategy(optimizer_sharding="overlap", sync_guard=False))
    with pytest.raises(ValueError, match=r"overlap hook refuses the gloo backend"):
        L.Fabric(
            strategy=DDPPlusFabricStrategy(optimizer_sharding="overlap", sync_guard=False),
            accelerator=FabricCPUAccelerator(),
            devices=2,
        )


def test_overlap_on_nccl_builds_and_says_so():
    built = trainer(DDPPlusStrategy(optimizer_sharding="overlap", sync_guard=False), accelerator=FakeCUDAAccelerator())
    assert built.strategy.process_group_backend == "nccl"
    assert "optimizer_sharding=overlap" in built.strategy.describe()
    with pytest.raises(ValueError, match="overlap hook refuses the gloo backend"):
        trainer(
            DDPPlusStrategy(optimizer_sharding="overlap", sync_guard=False, process_group_backend="gloo"),
            accelerator=FakeCUDAAccelerator(),
        )


def test_fabric_refuses_clipping_after_an_overlapped_step():
    strategy = DDPPlusFabricStrategy(optimizer_sharding="overlap", sync_guard=False)
    module = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"`fabric.clip_gradients` with `optimizer_sharding='overlap'`.*Fix"):
        strategy.clip_gradients_norm(module, torch.optim.SGD(module.parameters(), lr=0.1), max_norm=1.0)
    with pytest.raises(ValueError, match=r"can no longer be clipped"):
        strategy.clip_gradients_value(module, torch.optim.SGD(module.parameters(), lr=0.1), clip_val=1.0)


def test_the_trainer_refuses_clipping_with_overlap_when_the_optimizers_are_set_up():
    # CUDA faked, nothing launched: the strategy's own step of Lightning's setup, called as Lightning calls it
    from tests.helpers import TinyRegression

    built = L.Trainer(
        strategy=DDPPlusStrategy(optimizer_sharding="overlap", sync_guard=False),
        accelerator=FakeCUDAAccelerator(),
        devices=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
    )
    model = TinyRegression()
    model.trainer = built
    built.strategy.connect(model)
    with pytest.raises(ValueError, match=r"`Trainer\(gradient_clip_val=1.0\)`.*before Lightning clips"):
        built.strategy.setup_optimizers(built)


def test_the_partition_is_torchs_sorted_greedy_over_whole_parameters():
    # largest first, each to the rank with the fewest elements so far, counted across groups
    assert assign_ranks([[128, 16, 16, 1]], 2) == [[0, 1, 1, 1]]
    assert assign_ranks([[128, 16], [16, 1]], 2) == [[0, 1], [1, 1]]
    assert assign_ranks([[4, 4, 4, 4]], 3) == [[0, 1, 2, 0]]
    assert bytes_per_rank([[3, 1]], [[30, 10]], 4) == [30, 10, 0, 0]
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        assign_ranks([[1]], 0)


CASES = [
    {"optimizer": "adam", "resume": True},
    {"optimizer": "adamw", "scheduler": True},
    {"optimizer": "sgd_momentum"},
    {"optimizer": "adamw", "k": 4, "clip": 0.05},
    {"optimizer": "groups", "manual_k": 4, "scheduler": True},
    {"optimizer": "adam", "strategy": {"verify_replicas_every_n_steps": 1, "telemetry": True, "bucket_cap_mb": "auto"}},
    {"optimizer": "adamw", "k": 2, "clip": 0.05, "strategy": {"static_graph": True, "chunk_size": 2}},
    {"optimizer": "adamw", "k": 2, "clip": 0.05, "mode": "all_reduce"},
    # the reducer's map of used parameters and the hook's exchanges, on gloo (before: a hang at the second step)
    {"optimizer": "adam", "strategy": {"find_unused_parameters": True}},
    {"fabric": True},
    {"overlap": True},
    {"memory": True},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding")
    cases = [{**case, "root": str(root / str(index))} for index, case in enumerate(CASES)]
    return run_case_job("sharding_job.py", cases, root / "results.json")


def close(a, b, tolerance=1e-6):
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tolerance


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES) - 3))
def test_sharded_training_equals_unsharded_training(results, index):
    case = results[index]
    plain, sharded = case["plain"], case["with_sharding"]
    assert sharded["sharded"] and not plain["sharded"]
    assert sharded["steps"] == plain["steps"] > 0
    assert close(plain["params"], sharded["params"]), case
    assert sharded["lr"] == plain["lr"]
    if case.get("scheduler") or case.get("fabric"):
        assert sharded["lr"] < 0.01  # the scheduler really changed the rate the sharded step used
    assert case["scheduler_warnings"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", [0, 4])
def test_each_rank_keeps_the_state_of_its_chunks_only(results, index):
    # Adam: two float32 moments per element of a rank's pieces, and one float32 step per piece
    case = results[index]
    plain, sharded = case["plain"], case["with_sharding"]
    layout = BucketLayout(tuple(tuple(tuple(entry) for entry in bucket) for bucket in sharded["layout"]))
    pieces = [pieces_of(layout, rank, 2) for rank in range(2)]
    assert sharded["state_bytes"] == [sum(8 * piece.length + 4 for piece in own) for own in pieces]
    elements = [sum(piece.length for piece in own) for own in pieces]
    assert sum(elements) == sum(n for group in plain["numels"] for n in group)
    assert abs(elements[0] - elements[1]) <= len(layout.buckets)  # even to the element, but the padding


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", [1, 2])
def test_sharding_moves_the_bytes_of_ddps_all_reduce(results, index):
    # per rank, a ring all-reduce of B bytes sends 2(N-1)/N x B = B on 2 ranks: the bytes DDP's hook was handed
    sharded = results[index]["with_sharding"]
    handed = sharded["hook_bytes"]
    padding = 2 * 4 * len(sharded["layout"]) * sharded["steps"]  # at most one float32 per bucket and collective
    assert sharded["sent_bytes"][0] == sharded["sent_bytes"][1]
    assert handed <= sharded["sent_bytes"][0] <= handed + padding


@pytest.mark.multiprocess
def test_sgd_momentum_shards_its_buffers(results):
    case = results[2]
    assert sum(case["with_sharding"]["state_bytes"]) == case["plain"]["state_bytes"][0] == 4 * 161


@pytest.mark.multiprocess
def test_a_sharded_checkpoint_is_consolidated_and_portable(results):
    case = results[0]
    plain = case["plain"]
    # the file holds the full, plain optimizer state, and a world size of 1 takes all of it
    assert case["checkpoint_state_bytes"] == plain["state_bytes"][0] == case["world_size_1_loaded"]
    assert case["half_steps"] == plain["steps"] // 2
    for resumed in ("resumed_sharded", "resumed_plain", "resumed_stock", "resumed_from_last", "plain_into_sharded"):
        assert case[resumed]["steps"] == plain["steps"], resumed
        assert case[resumed]["started_at"] == plain["steps"] // 2, resumed  # it resumed, and did not start over
        assert close(plain["params"], case[resumed]["params"]), resumed
    assert case["resumed_sharded"]["sharded"] and not case["resumed_stock"]["sharded"]
    # each save of the sharded run's last.ckpt gathered the state on rank 0: a collective, in the ledger
    assert case["with_sharding"]["consolidations"] >= 1 and case["plain"]["consolidations"] == 0


@pytest.mark.multiprocess
def test_fabric_save_and_load_of_a_sharded_optimizer(results):
    case = results[9]
    assert close(case["plain"]["params"], case["resumed_sharded"]["params"])
    assert case["resumed_sharded"]["steps"] == case["plain"]["steps"] == 6
    assert case["resumed_sharded"]["started_at"] == 3
    assert case["resumed_sharded"]["lr"] == case["plain"]["lr"]
    assert case["with_sharding"]["consolidations"] == 1 and case["plain"]["consolidations"] == 0  # fabric.save


@pytest.mark.multiprocess
def test_torch_refuses_the_overlap_on_gloo_as_the_strategy_says_before_launch(results):
    assert results[10]["error"] == "Gloo backend using Overlapping DDP with ZeRO may meet hangs"


@pytest.mark.multiprocess
def test_the_plans_buckets_gradients_and_shares_are_what_ddp_and_zero_really_hold(results):
    # a tiny real Llama in DDP on 2 ranks: the bytes the reducer's buckets hold (seen by a comm hook), the gradient
    # bytes outside them, and each rank's real ZeRO-1 state after a step, against the memory plan's figures
    case = results[11]
    trainable = case["plan_trainable"]
    plain, view = case["bucket_view_False"], case["bucket_view_True"]
    assert plain["bucket_bytes"] == view["bucket_bytes"] == trainable
    assert plain["gradient_bytes_outside_buckets"] == trainable  # the plan's gradients row without bucket view
    assert view["gradient_bytes_outside_buckets"] == 0  # with it: the gradients are the buckets
    assert case["state_by_rank_False"] == case["state_by_rank_True"] == case["plan_state_by_rank"]
    # optimizer_sharding=True: the plan's even split of the elements, but DDP's bucket padding (one element of 8
    # bytes per bucket and rank), a 4-byte step per piece, and the plan's steps spread over elements (4 bytes per
    # parameter: fewer than 64 here)
    for real, planned in zip(case["state_by_rank_chunks"], case["plan_chunks_by_rank"]):
        assert abs(real - planned) <= 8 * case["chunk_buckets"] + 4 * case["chunk_pieces"] + 4 * 64, (real, planned)


def test_each_rank_owns_one_equal_chunk_of_every_bucket_padded_to_the_world_size():
    layout = BucketLayout((((0, 6), (1, 3)), ((2, 2),)))  # buckets of 9 and 2 elements, on 3 ranks
    owned = [pieces_of(layout, rank, 3) for rank in range(3)]
    assert [[(p.parameter, p.start, p.length) for p in own] for own in owned] == [
        [(0, 0, 3), (2, 0, 1)],
        [(0, 3, 3), (2, 1, 1)],
        [(1, 0, 3)],  # the second bucket's third chunk is padding only
    ]
    assert sorted((p.parameter, p.start) for own in owned for p in own) == [(0, 0), (0, 3), (1, 0), (2, 0), (2, 1)]
    assert shard_size(9, 3) == 3 and shard_size(10, 3) == 4


THREE_RANK_CASES = [
    {"optimizer": "adamw", "clip": 0.05, "resume": True},
    {"optimizer": "sgd_momentum", "k": 3, "early_sync": True, "replace_storage": True},
]


@pytest.mark.multiprocess
def test_three_ranks_train_exactly_and_keep_a_third_of_the_state_each(tmp_path):
    cases = [{**case, "root": str(tmp_path)} for case in THREE_RANK_CASES]
    out = tmp_path / "results.json"
    for done in start_ranks(python_script("bucket_shards_job.py") + [str(out), json.dumps(cases)], world_size=3):
        assert done.returncode == 0, done.stdout[-4000:]
    adamw, momentum = json.loads(out.read_text())
    for case in (adamw, momentum):
        assert case["world_size"] == 3
        assert case["difference"] <= 1e-5, case
        assert case["state_keys_equal"] and case["state_difference"] <= 1e-5, case
        assert case["buckets"] >= 2  # tiny buckets: parameters straddle chunks
        assert case["pieces_are_views"]  # after `param.data = ...` too (the momentum case): they follow the storage
    assert adamw["resumed_difference"] <= 1e-5  # the consolidated state, loaded sharded, goes on as the plain one
    # a ring all-reduce sends 2(N-1)/N of each bucket per rank; sharding sends the same, but the padding
    elements = sum(adamw["bucket_elements"])
    ddp_bytes = 2 * 2 * 4 * elements // 3 * 4  # 4 steps
    assert ddp_bytes <= adamw["sent_bytes"] <= ddp_bytes + 2 * 4 * 3 * adamw["buckets"] * 4
    # SGD's momentum: one float32 per element, split to the element (but the padding) over 3 ranks
    total = 4 * 440
    assert sum(momentum["state_bytes"]) == total
    assert max(momentum["state_bytes"]) - min(momentum["state_bytes"]) <= 4 * momentum["buckets"]


@pytest.mark.multiprocess
def test_a_sharded_step_holds_the_chunk_it_received_and_no_copy_of_the_model(tmp_path):
    """Above what a rank holds between steps, a ZeRO-1 step holds the averaged chunk it received (1/N of the
    gradients: what the memory plan counts among a sharded rank's gradients) and the transfers' buffers of a few
    buckets, which do not grow with the model. Gathering every bucket at once held 3.5x the parameters' bytes more."""
    cases = [{"layers": 8}, {"layers": 24}]
    env = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}  # every tensor its own mapping: the resident set follows them
    small, large = run_case_job("sharded_peak_job.py", cases, tmp_path / "out.json", env=env)
    grown = large["parameter_bytes"] - small["parameter_bytes"]  # 64 MiB more parameters
    for rank in range(2):
        growth = large["step_above_held"][rank] - small["step_above_held"][rank]
        # half of it is the received chunk (measured 0.52-0.69 with the transfers' timing; 3.5 when every bucket
        # was gathered at once)
        assert 0.4 * grown <= growth <= grown, growth / grown


def test_fp16_gradient_scaling_is_refused_with_its_way_out_and_bf16_is_taken():
    # each rank would look for inf in its own chunks only, and skip its step alone
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_ddp_plus.sharding.zero import ZeroSharding

    sharding = ZeroSharding(True, info=print)
    with pytest.raises(ValueError, match=r"gradient scaler.*Fix: use `precision='bf16-mixed'`.*'all_reduce'"):
        sharding.shard([], None, False, precision=MixedPrecision("16-mixed", "cpu"))
    assert sharding.shard([], None, False, precision=MixedPrecision("bf16-mixed", "cpu")) == []
    assert (
        ZeroSharding("all_reduce", info=print).shard([], None, False, precision=MixedPrecision("16-mixed", "cpu")) == []
    )


PIECE_CASES = [
    {"optimizer": "adafactor"},
    {"optimizer": "adamw", "channels_last": True, "resume": True},
    {"optimizer": "adamw", "add_group_at": 2},
    {"optimizer": "adamw", "add_group_at": 2, "frozen_before_wrap": True},
    {"optimizer": "sgd_momentum", "replace_storage": True, "replace_dtype": True},
]


@pytest.mark.multiprocess
def test_pieces_follow_the_parameters_layout_and_groups_and_refuse_what_they_cannot_hold(tmp_path):
    factored, channels_last, added, frozen, recast = run_case_job(
        "bucket_shards_job.py", [{**case, "root": str(tmp_path)} for case in PIECE_CASES], tmp_path / "out.json"
    )
    # Adafactor keeps a row and a column statistic per matrix: on flat pieces it trained 9e-3 away from the plain run
    assert "Adafactor is not known to update each element" in factored["refused"]
    assert "Fix: use `optimizer_sharding='all_reduce'`" in factored["refused"]
    # a channels_last weight is laid out in DDP's bucket as in memory (before: `view(-1)` raised)
    assert channels_last["difference"] <= 1e-6 and channels_last["state_difference"] <= 1e-6, channels_last
    assert channels_last["resumed_difference"] <= 1e-6
    # a group added at the third step (frozen layers unfrozen): stepped from then on (before: never, 0.04 away)
    assert added["difference"] <= 1e-6 and added["state_difference"] <= 1e-6, added
    # frozen before the wrap, DDP left them out of its buckets: said, with the way out
    assert "did not require grad when DDP wrapped it" in frozen["refused"]
    assert "`optimizer_sharding='all_reduce'`" in frozen["refused"]
    # a parameter recast after the wrap: named (before: its float64 bytes were read as float32)
    assert "parameters 0 (torch.float32 -> torch.float64)" in recast["refused"]


def test_only_element_wise_optimizers_are_stepped_on_pieces_unless_declared():
    from lightning_ddp_plus import elementwise_optimizer
    from lightning_ddp_plus.sharding.optimizer import bucket_sharded, is_elementwise
    from lightning_ddp_plus.sharding.reduce_scatter import GradientShards

    parameters = [torch.zeros(2, 2, requires_grad=True)]
    for known in (torch.optim.SGD, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam):
        assert is_elementwise(known(parameters, lr=0.1))
    for whole in (torch.optim.Adafactor, torch.optim.Muon, torch.optim.LBFGS):
        assert not is_elementwise(whole(parameters, lr=0.1))
        with pytest.raises(ValueError, match=rf"`optimizer_sharding=True`.*{whole.__name__} is not known.*Fix: "):
            bucket_sharded(whole(parameters, lr=0.1), GradientShards())

    class TrustRatio(torch.optim.SGD):  # its own step: not known element-wise until declared
        def step(self, closure=None):
            return super().step(closure)

    assert not is_elementwise(TrustRatio(parameters, lr=0.1))
    assert is_elementwise(elementwise_optimizer(TrustRatio)(parameters, lr=0.1))
