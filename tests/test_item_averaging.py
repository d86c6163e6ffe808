"""``num_items``: each optimizer step's gradient is the mean over every item of its window on every rank.

The job trains token sequences of 1-24 valid tokens on 2 gloo ranks and compares, after every step of an epoch,
with one process training the global batch (``tests/scripts/item_average_job.py``). The counts are wrong in the
ways a user might get them wrong, and the errors say so on every rank."""

import pytest
import torch

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError
from lightning_ddp_plus.sync.accumulation import AccumulationWindow
from lightning_ddp_plus.sync.item_averaging import ItemAveraging, WindowItems, check_num_items
from tests.helpers import run_case_job

# ------------------------------------------------------------------ pure


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (2.5, ArgumentTypeError),
        (True, ArgumentTypeError),
        (-1, ArgumentValueError),
        (torch.tensor([1, 2]), ArgumentTypeError),
        (torch.tensor(3.0), ArgumentTypeError),
        ("12", ArgumentTypeError),
    ],
)
def test_a_count_that_is_not_a_non_negative_integer_is_refused_with_the_four_marks(value, error):
    with pytest.raises(error) as raised:
        check_num_items(value)
    message = str(raised.value)
    assert message.startswith("`num_items=") and "is not valid" in message and "integer" in message
    assert "Fix:" in message


def test_an_integer_and_a_one_element_integer_tensor_are_counts():
    assert check_num_items(0) == 0
    assert check_num_items(torch.tensor([7])).shape == ()
    assert int(check_num_items(torch.tensor(7, dtype=torch.int32))) == 7


def test_window_problems_name_what_was_wrong():
    assert WindowItems(1.0, 10, 4, 0, 0).problem() is None
    assert "missing for 1" in WindowItems(1.0, 10, 3, 1, 0).problem()
    assert "negative on 2" in WindowItems(1.0, 10, 4, 0, 2).problem()


def test_one_process_window_divides_the_summed_gradient_by_its_items():
    """Without a process group: two micro-batches of 3 and 1 items; the result is the mean over the 4 items."""
    said: list[str] = []
    averaging = ItemAveraging(AccumulationWindow(2, "mean"), info=said.append)
    weight = torch.zeros(1, requires_grad=True)
    per_item = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]
    for values in per_item:
        averaging.pending = torch.tensor(values.numel())
        count = averaging.take()
        loss = (weight * values).mean()  # d loss / d weight = the values' mean
        averaging.recorded(count, loss)
        (loss * averaging.loss_factor(count)).backward()
    window = averaging.window_closed([weight])
    assert window.items == 4 and averaging.window.per_item
    assert weight.grad.item() == pytest.approx(16.0 / 4)  # not (2 + 10) / 2
    assert averaging.loss_per_item == pytest.approx(0.0)
    assert averaging.unit == 2.0  # the next window's summed loss is divided by the mean items per micro-batch
    assert len(said) == 1 and said[0].startswith("per-item averaging is on")


def test_a_window_with_no_item_skips_the_step_with_a_warning():
    averaging = ItemAveraging(AccumulationWindow(None, "mean"))
    weight = torch.ones(1, requires_grad=True)
    averaging.pending = 0
    count = averaging.take()
    loss = (weight * 2).sum()
    averaging.recorded(count, loss)
    (loss * averaging.loss_factor(count)).backward()
    with pytest.warns(UserWarning, match="no item in this optimizer step's window on any rank; the step is skipped"):
        averaging.window_closed([weight])
    assert weight.grad is None


def test_a_count_after_a_fit_started_without_one_is_refused():
    averaging = ItemAveraging(AccumulationWindow(None, "mean"))
    assert averaging.take() is None and averaging.on is False
    averaging.pending = 3
    with pytest.raises(ArgumentValueError, match="the fit's first step did not"):
        averaging.take()


# ------------------------------------------------------------------ 2 ranks against one process


def case(name: str, **fields) -> dict:
    return {"name": name, "k": 2, "batch_size": 4, **fields}


CASES = [
    case("stock DDPStrategy", stock=True, num_items=False),
    case("ddp_plus without num_items", num_items=False),
    case("ddp_plus, accumulation 2"),
    case("chunks", k=1, batch_size=8, strategy={"chunk_size": 2}),
    case("chunks and accumulation", strategy={"chunk_size": 3}),
    case("chunks without num_items", k=1, batch_size=8, num_items=False, strategy={"chunk_size": 2}),
    case("clipping", clip=0.05),
    case("sharding and momentum", momentum=0.9, strategy={"optimizer_sharding": True}),
    case("fp16 compression", strategy={"ddp_comm_hook": "fp16"}),
    # the items' summed loss would overflow fp16 (above 65504) in the first window: counted before the backward
    case("fp16 compression, large gradients", loss_scale=2e4, lr=1e-7, strategy={"ddp_comm_hook": "fp16"}),
    case(
        "fp16 compression, large gradients, auto",
        k=1,
        batch_size=8,
        loss_scale=2e4,
        lr=1e-7,
        strategy={"ddp_comm_hook": "fp16", "chunk_size": "auto"},
    ),
    case("auto after an out-of-memory error", k=1, batch_size=16, rows_that_fit=5, strategy={"chunk_size": "auto"}),
    case("join on uneven shards", uneven=True, strategy={"uneven_inputs": "join"}),
    case("manual optimization", manual=True, strategy={"gradient_accumulation_steps": 2}),
    case("static graph", strategy={"static_graph": True}),
    case("each rank's own items", strategy={"average_items_across_ranks": False}),
    case("a window with no item", override={"batches": [2, 3], "value": "zero"}, skipped_steps=[1]),
    case("equal counts (control)", equal=True),
    case("equal counts without num_items (control)", equal=True, num_items=False),
    case("float", override={"batches": [0], "value": "float"}),
    case("negative", override={"batches": [0], "value": "negative"}),
    case("negative tensor", override={"batches": [3], "value": "negative tensor"}),
    case("two elements", override={"batches": [0], "value": "two elements"}),
    case("missing on some steps", override={"batches": [2], "value": "missing"}),
    case("given after steps without", override={"batches": [0, 1], "value": "missing"}),
    # rank 1's training step never gives a count, rank 0's does: in the agreement, in the count's all-reduce before
    # the closing backward (a comm hook), and where no count is all-reduced (before: "the ranks are out of step" at
    # the stall report, naming no count, and a silently mixed average)
    *(
        case(
            f"given on rank 0 only{suffix}",
            override={"batches": list(range(8)), "value": "missing", "ranks": [1]},
            strategy=extra,
        )
        for suffix, extra in [
            ("", {}),
            (", fp16 compression", {"ddp_comm_hook": "fp16"}),
            (", each rank's own items", {"average_items_across_ranks": False}),
        ]
    ),
    case("a transformers causal LM", hf=True, lr=0.1),
    case("a transformers causal LM, stock", hf=True, lr=0.1, stock=True, num_items=False),
    case("Fabric", fabric=True),
    # ZeRO-1 at DDP's bytes with what splits, re-weights, stops or steps a window its own way
    case(
        "sharding, auto after an out-of-memory error",
        k=1,
        batch_size=16,
        rows_that_fit=5,
        strategy={"chunk_size": "auto", "optimizer_sharding": True},
    ),
    case(
        "sharding, join on uneven shards", uneven=True, strategy={"uneven_inputs": "join", "optimizer_sharding": True}
    ),
    case(
        "sharding, chunks, static graph, clipping",
        clip=0.05,
        strategy={"optimizer_sharding": True, "static_graph": True, "chunk_size": 3},
    ),
    case(
        "sharding, manual optimization",
        manual=True,
        strategy={"gradient_accumulation_steps": 2, "optimizer_sharding": True},
    ),
    case("sharding, Fabric", fabric=True, strategy={"optimizer_sharding": True}),
    # a static graph syncs the fit's first micro-batch before its window's count: exact as it is (the sharded case
    # above too: a review's suspicion, measured wrong), refused where something acts on that sum as if it were
    # final (before: fp16 compression of large gradients trained to NaN on diverged replicas; each rank's own items
    # 2e-4 away from one device)
    case("sharding, static graph", strategy={"optimizer_sharding": True, "static_graph": True}),
    case(
        "static graph, fp16 compression, large gradients",
        loss_scale=2e4,
        lr=1e-7,
        strategy={"ddp_comm_hook": "fp16", "static_graph": True},
    ),
    case("static graph, each rank's own items", strategy={"average_items_across_ranks": False, "static_graph": True}),
    # fp16 mixed precision with its gradient scaler (the plugin given explicitly: Lightning runs "16-mixed" as bf16
    # on the CPU)
    case("fp16 with a gradient scaler", fp16_scaler=True),
    case(
        "fp16 with a gradient scaler, a window with no item",
        fp16_scaler=True,
        override={"batches": [2, 3], "value": "zero"},
        skipped_steps=[1],
    ),
    case("fp16 with a gradient scaler, auto", fp16_scaler=True, k=1, batch_size=8, strategy={"chunk_size": "auto"}),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("items") / "results.json"
    return {result["name"]: result for result in run_case_job("item_average_job.py", CASES, out)}


EXACT = [
    "ddp_plus, accumulation 2",
    "chunks",
    "chunks and accumulation",
    "clipping",
    "sharding and momentum",
    "auto after an out-of-memory error",
    "join on uneven shards",
    "manual optimization",
    "static graph",
    "each rank's own items",
    "a window with no item",
    "equal counts (control)",
    "equal counts without num_items (control)",
    "a transformers causal LM",
    "Fabric",
    "sharding, auto after an out-of-memory error",
    "sharding, join on uneven shards",
    "sharding, chunks, static graph, clipping",
    "sharding, manual optimization",
    "sharding, Fabric",
    "sharding, static graph",
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", EXACT)
def test_every_step_equals_one_process_training_the_global_batch(results, name):
    result = results[name]
    assert result["error"] is None and result["replicas_equal"]
    assert result["max_difference"] < 1e-5, result
    if name != "equal counts without num_items (control)":
        assert result["loss_per_item"] == pytest.approx(result["reference_loss"], abs=1e-5) or name.startswith("each")


@pytest.mark.multiprocess
def test_without_num_items_micro_batches_weigh_the_same_and_differ(results):
    for name in ("stock DDPStrategy", "ddp_plus without num_items", "chunks without num_items"):
        assert results[name]["error"] is None and results[name]["max_difference"] > 1e-3, results[name]
    assert results["stock DDPStrategy"]["max_difference"] == pytest.approx(
        results["ddp_plus without num_items"]["max_difference"], rel=1e-4
    )
    assert results["a transformers causal LM, stock"]["max_difference"] > 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["fp16 compression", "fp16 compression, large gradients"])
def test_fp16_compression_stays_within_its_rounding(results, name):
    result = results[name]
    assert result["error"] is None and result["replicas_equal"]
    assert result["max_difference"] < 1e-4  # fp16 buckets: about 2 significant digits fewer than fp32


@pytest.mark.multiprocess
def test_the_auto_case_really_ran_out_of_memory_and_counted_its_items_once(results):
    assert results["auto after an out-of-memory error"]["size_changes"] >= 1


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "expected", "steps"),
    [
        ("fp16 compression, large gradients, auto", "gradients are not finite after the comm hook", 0),
        ("float", "ArgumentTypeError: `num_items=2.5` is not valid", 0),
        ("negative", "ArgumentValueError: `num_items=-3` is not valid", 0),
        ("negative tensor", "negative on 2 micro-batches", 1),
        ("two elements", "tensor of shape (2,)", 0),
        ("missing on some steps", "given for 2 and missing for 2 micro-batches of one optimizer step", 1),
        ("given after steps without", "the fit's first step did not", 1),
        *(
            (f"given on rank 0 only{suffix}", "given by the first training step on some ranks and not on others", 0)
            for suffix in ("", ", fp16 compression", ", each rank's own items")
        ),
        ("static graph, fp16 compression, large gradients", "exact only without a `ddp_comm_hook`", 0),
        ("static graph, each rank's own items", "exact only without `average_items_across_ranks=False`", 0),
    ],
)
def test_a_wrong_count_ends_the_fit_on_every_rank_at_its_step(results, name, expected, steps):
    result = results[name]
    assert result["error"] is not None and expected in result["error"], result
    assert "Fix:" in result["error"]
    assert result["steps"] == steps and result["replicas_equal"]


@pytest.mark.multiprocess
def test_a_gradient_scaler_skips_only_the_window_without_items(results):
    # the counts come before the closing backward and the first window runs at its own items' scale: before, the
    # scaler's 65536 times a summed loss overflowed fp16 and the fit's first step was skipped (scale 32768, 0.03 away)
    scaled = results["fp16 with a gradient scaler"]
    assert scaled["error"] is None and scaled["replicas_equal"] and scaled["scaler_scale"] == 65536.0
    assert scaled["max_difference"] < 1e-4  # fp16 autocast's rounding
    # a window with no item: skipped through the scaler (before: its step asserted, "No inf checks were recorded")
    empty = results["fp16 with a gradient scaler, a window with no item"]
    assert empty["error"] is None and empty["replicas_equal"] and empty["scaler_scale"] == 32768.0
    assert empty["max_difference"] < 1e-4
    # chunk_size="auto" counts after the backward (a rank may run its batch again): the first window still runs
    # at the summed loss and overflows, and the scaler skips that one step, now said with the way to count first
    auto = results["fp16 with a gradient scaler, auto"]
    assert auto["error"] is None and auto["replicas_equal"] and auto["scaler_scale"] == 32768.0
    assert len(auto["num_items_warnings"]) == 1 and "Set a fixed `chunk_size`" in auto["num_items_warnings"][0]
    assert scaled["num_items_warnings"] == []
