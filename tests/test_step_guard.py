"""The guard on every synced backward (rule R6), known-dynamic models (rule R7) and uneven inputs, on real 2-rank
gloo jobs: a warm-up head dropped after 3 steps, a tower skipped on one rank only, one head per batch, a real
``transformers`` wav2vec2 with LayerDrop, and shards of different lengths; each against stock ``DDPStrategy`` and
against a ``find_unused_parameters=True`` reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.conflicts.facts import ModelFacts, find_dynamic_modules
from lightning_ddp_plus.conflicts.rules import CheckedSettings, evaluate, resolved_view, rule_for_torch_error
from lightning_ddp_plus.sync.step_guard import BucketsLaunched, SyncFault
from tests.helpers import run_case_job


def _replica_gap(run: dict) -> float:
    first, second = run["params"]
    return max(abs(a - b) for a, b in zip(first, second))


def _gap(run: dict, reference: dict) -> float:
    return max(abs(a - b) for a, b in zip(run["params"][0], reference["params"][0]))


# ---------------------------------------------------------------- pure decisions


def test_rule_r6_names_the_step_and_every_rank():
    facts = ModelFacts(observed=True, late_step=4, late_unused_by_rank=(("aux.weight",), ()))
    [finding] = [f for f in evaluate(CheckedSettings(), facts) if f.rule.id == "R6"]
    assert "optimizer step 4" in finding.message and "rank 0: aux.weight; rank 1: none" in finding.message
    assert resolved_view(CheckedSettings(static_graph=True), [finding]) == CheckedSettings(find_unused_parameters=True)
    assert rule_for_torch_error("Your training graph has changed in this iteration, e.g., ...").id == "R6"


def test_layerdrop_recommends_find_unused_and_never_static_graph():
    from transformers import BartConfig, BartModel, Wav2Vec2Config, Wav2Vec2Model

    tiny = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}
    wav2vec2 = Wav2Vec2Model(Wav2Vec2Config(layerdrop=0.1, conv_dim=(8,), conv_stride=(5,), conv_kernel=(10,), **tiny))
    bart = BartModel(
        BartConfig(
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=16,
            decoder_ffn_dim=16,
            vocab_size=32,
            encoder_layerdrop=0.2,
        )
    )
    assert find_dynamic_modules(wav2vec2) == ("Wav2Vec2Model: LayerDrop (Wav2Vec2Config.layerdrop=0.1)",)
    assert find_dynamic_modules(bart) == ("BartModel: LayerDrop (BartConfig.encoder_layerdrop=0.2)",)
    dynamic = find_dynamic_modules(wav2vec2)
    assert find_dynamic_modules(wav2vec2.eval()) == ()  # LayerDrop acts in training only
    # every parameter used at step 1, reentrant checkpointing: R4 alone would pick static_graph; LayerDrop forbids it
    facts = ModelFacts(
        observed=True,
        unused_parameters=("layers.1.weight",),
        reentrant_parameters=("layers.0.weight",),
        dynamic_modules=dynamic,
    )
    findings = [f for f in evaluate(CheckedSettings(static_graph=False), facts) if f.rule.level == "error"]
    assert [f.rule.id for f in findings] == ["R4", "R7"]
    assert resolved_view(CheckedSettings(), findings).static_graph is False
    assert [
        f.rule.id for f in evaluate(CheckedSettings(find_unused_parameters=True), facts) if f.rule.id in ("R7", "A1")
    ] == []
    assert "R7" in [f.rule.id for f in evaluate(CheckedSettings(find_unused_parameters=True, static_graph=True), facts)]


def test_a_module_can_declare_itself_dynamic():
    class Heads(nn.Module):
        ddp_dynamic_graph = True

    assert find_dynamic_modules(nn.Sequential(nn.Linear(2, 2), Heads())) == ("1: declares ddp_dynamic_graph = True",)


def test_fault_in_words():
    fault = SyncFault(step=2, unused=(("a", "b"), ()), launched=(BucketsLaunched(0, 2), None))
    assert fault.describe() == "rank 0: a, b (its reducer launched 0 of 2 buckets); rank 1: none (its reducer finished)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"uneven_inputs": "Stop"}, "allowed: error, stop, join"),
        ({"sync_guard": "yes"}, "`sync_guard='yes'` is not valid"),
    ],
)
def test_bad_values_are_refused_at_construction(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        DDPPlusStrategy(**kwargs)


# ---------------------------------------------------------------- real 2-rank jobs

REFERENCE = {"stock": True, "strategy": {"find_unused_parameters": True}}
RESOLVE = {"checkpointing_conflict": "resolve"}

GUARD_CASES = [
    {"name": "warmup_reference", **REFERENCE, "model": {"variant": "warmup"}},
    {"name": "warmup_stock", "stock": True, "model": {"variant": "warmup"}},
    {"name": "warmup_defaults", "model": {"variant": "warmup"}},
    {"name": "warmup_resolve", "strategy": RESOLVE, "model": {"variant": "warmup"}},
    {"name": "warmup_static_graph", "strategy": {"static_graph": True}, "model": {"variant": "warmup"}},
    {
        "name": "warmup_static_graph_resolve",
        "strategy": {**RESOLVE, "static_graph": True},
        "model": {"variant": "warmup"},
    },
    {"name": "warmup_guard_off", "strategy": {"sync_guard": False}, "model": {"variant": "warmup"}},
    {"name": "late_static", "strategy": {"static_graph": True}, "model": {"variant": "late_start"}},
    {"name": "late_static_one_rank", "strategy": {"static_graph": True}, "model": {"variant": "late_start_one_rank"}},
    {
        "name": "late_static_one_rank_resolve",
        "strategy": {**RESOLVE, "static_graph": True},
        "model": {"variant": "late_start_one_rank"},
    },
    {
        "name": "late_static_guard_off",
        "strategy": {"static_graph": True, "sync_guard": False},
        "model": {"variant": "late_start"},
    },
    {"name": "manual_reference", **REFERENCE, "model": {"variant": "warmup", "manual": True}},
    {"name": "manual_defaults", "model": {"variant": "warmup", "manual": True}},
    {"name": "manual_resolve", "strategy": RESOLVE, "model": {"variant": "warmup", "manual": True}},
    {
        "name": "k2_reference",
        "stock": True,
        "strategy": {"find_unused_parameters": True, "accumulate_grad_batches": 2},
        "model": {"variant": "warmup", "batches": [8, 8]},
    },
    {
        "name": "k2_resolve",
        "strategy": {**RESOLVE, "accumulate_grad_batches": 2},
        "model": {"variant": "warmup", "batches": [8, 8]},
    },
    {"name": "tower_reference", **REFERENCE, "model": {"variant": "tower_one_rank"}},
    {"name": "tower_defaults", "model": {"variant": "tower_one_rank"}},
    {"name": "tower_resolve", "strategy": RESOLVE, "model": {"variant": "tower_one_rank"}},
    {"name": "tower_defaults_all_reduce", "agreement": "all_reduce", "model": {"variant": "tower_one_rank"}},
    {
        "name": "tower_resolve_all_reduce",
        "agreement": "all_reduce",
        "strategy": RESOLVE,
        "model": {"variant": "tower_one_rank"},
    },
    # ZeRO-1: a finished rank holds only its chunk, so its gradients cannot be broadcast (before: 0.48 off)
    {
        "name": "tower_resolve_sharded",
        "strategy": {**RESOLVE, "optimizer_sharding": True},
        "model": {"variant": "tower_one_rank"},
    },
    {
        "name": "warmup_resolve_sharded",
        "strategy": {**RESOLVE, "optimizer_sharding": True},
        "model": {"variant": "warmup"},
    },
    {
        "name": "warmup_resolve_all_reduce",
        "agreement": "all_reduce",
        "strategy": RESOLVE,
        "model": {"variant": "warmup"},
    },
    {"name": "multitask_reference", **REFERENCE, "model": {"variant": "multitask"}},
    {"name": "multitask_stock", "stock": True, "model": {"variant": "multitask"}},
    {"name": "multitask_defaults", "model": {"variant": "multitask"}},
    {"name": "multitask_resolve", "strategy": RESOLVE, "model": {"variant": "multitask"}},
    {"name": "wav2vec2_reference", **REFERENCE, "model": {"variant": "wav2vec2", "layerdrop": 0.1}},
    {"name": "wav2vec2_stock", "stock": True, "model": {"variant": "wav2vec2", "layerdrop": 0.1}},
    {"name": "wav2vec2_defaults", "model": {"variant": "wav2vec2", "layerdrop": 0.1}},
    {
        "name": "wav2vec2_first_forward_off",
        "strategy": {"checkpointing_conflict": "off"},
        "model": {"variant": "wav2vec2", "layerdrop": 0.1},
    },
    {"name": "wav2vec2_resolve", "strategy": RESOLVE, "model": {"variant": "wav2vec2", "layerdrop": 0.1}},
]


@pytest.fixture(scope="module")
def step_guard_runs(tmp_path_factory):
    """Every case of this file, the guard's and the uneven inputs', on one pair of processes (a rank's start, which
    imports torch and Lightning, costs more than a case)."""
    out = tmp_path_factory.mktemp("guard") / "results.json"
    return {run["name"]: run for run in run_case_job("step_guard_job.py", GUARD_CASES + UNEVEN_CASES, out)}


@pytest.fixture(scope="module")
def guard_runs(step_guard_runs):
    return step_guard_runs


@pytest.mark.multiprocess
def test_stock_applies_an_unaveraged_step_then_fails(guard_runs):
    for name in ("warmup_stock", "multitask_stock", "wav2vec2_stock"):
        run = guard_runs[name]
        assert run["error"] == "RuntimeError", name
        assert _replica_gap(run) > 1e-4, name  # the step before the error used each rank's own gradients


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name", ["warmup_defaults", "warmup_static_graph", "manual_defaults", "tower_defaults", "tower_defaults_all_reduce"]
)
def test_error_stops_every_rank_before_the_optimizer_step(guard_runs, name):
    run = guard_runs[name]
    assert run["error"] == "DDPConflictError", run["message"]
    assert "[R6] parameters unused on some steps" in run["message"]
    assert "at optimizer step 4" in run["message"] and "extra.weight" in run["message"]
    assert "find_unused_parameters=True" in run["message"]  # the fix
    assert run["optimizer_steps"] == 3 and run["global_step"] == [3, 3]
    assert _replica_gap(run) == 0.0  # identical when it stopped
    assert run["seconds_to_error_by_rank"][0] is not None and run["seconds_to_error_by_rank"][1] is not None


@pytest.mark.multiprocess
def test_a_tower_unused_on_one_rank_names_each_rank(guard_runs):
    message = guard_runs["tower_defaults"]["message"]
    assert "rank 0: extra.weight, extra.bias" in message and "rank 1: none" in message


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("warmup_resolve", "warmup_reference"),
        ("warmup_static_graph_resolve", "warmup_reference"),
        ("manual_resolve", "manual_reference"),
        ("k2_resolve", "k2_reference"),
        ("tower_resolve", "tower_reference"),
        ("tower_resolve_all_reduce", "tower_reference"),
        ("tower_resolve_sharded", "tower_reference"),
        ("warmup_resolve_sharded", "warmup_reference"),
        ("warmup_resolve_all_reduce", "warmup_reference"),
        ("multitask_resolve", "multitask_reference"),
        ("wav2vec2_resolve", "wav2vec2_reference"),
    ],
)
def test_resolve_trains_as_find_unused_parameters_from_the_start(guard_runs, name, reference):
    run, ref = guard_runs[name], guard_runs[reference]
    assert run["error"] is None and ref["error"] is None, run["message"] or ref["message"]
    assert run["settings"] == {"find_unused_parameters": True, "static_graph": False}
    assert run["global_step"] == ref["global_step"]
    assert _replica_gap(run) == 0.0
    assert _gap(run, ref) < 1e-6


@pytest.mark.multiprocess
def test_which_check_catches_which_model(guard_runs):
    assert guard_runs["warmup_resolve"]["findings"] == ["R6"]  # step 1 used everything: only the guard sees it
    assert guard_runs["multitask_defaults"]["findings"] == ["R4"]  # step 1 already leaves a head unused
    assert guard_runs["wav2vec2_defaults"]["findings"] == ["R7"]  # LayerDrop, although step 1 dropped no layer
    assert guard_runs["wav2vec2_resolve"]["findings"] == ["R7"]
    off = guard_runs["wav2vec2_first_forward_off"]
    assert off["error"] == "DDPConflictError" and "at optimizer step 2" in off["message"]
    assert _replica_gap(off) == 0.0
    # without the guard, ddp_plus meets the fault as stock does
    assert (
        guard_runs["warmup_guard_off"]["error"] == "RuntimeError"
        and _replica_gap(guard_runs["warmup_guard_off"]) > 1e-4
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["late_static", "late_static_one_rank"])
def test_a_static_graph_that_gains_a_parameter_stops_every_rank(guard_runs, name):
    run = guard_runs[name]
    assert run["error"] == "DDPConflictError", run["message"]
    assert "[R6]" in run["message"] and "at optimizer step 3 the backward used a parameter" in run["message"]
    assert run["optimizer_steps"] == 2 and _replica_gap(run) == 0.0
    # torch's own error, without the guard: raised inside the backward (on one rank only, the others would wait)
    off = guard_runs["late_static_guard_off"]
    assert off["error"] == "RuntimeError" and "Your training graph has changed" in off["message"]
    assert "this is rule R6" in off["message"]


@pytest.mark.multiprocess
def test_resolve_skips_the_failed_step_on_every_rank_and_trains_on(guard_runs):
    run = guard_runs["late_static_one_rank_resolve"]
    assert run["error"] is None, run["message"]
    assert run["settings"] == {"find_unused_parameters": True, "static_graph": False}
    assert run["findings"] == ["R6"] and run["global_step"] == [6, 6]
    assert _replica_gap(run) == 0.0


UNEVEN_CASES = [
    {"name": "error", "model": {"batches": [6, 4], "warmup_steps": 99}},
    {"name": "error_manual", "model": {"batches": [6, 4], "warmup_steps": 99, "manual": True}},
    {"name": "error_sync_dist", "model": {"batches": [6, 4], "warmup_steps": 99, "sync_dist": True}},
    {"name": "error_k2", "strategy": {"accumulate_grad_batches": 2}, "model": {"batches": [7, 5], "warmup_steps": 99}},
    {
        "name": "stop",
        "strategy": {"uneven_inputs": "stop"},
        "model": {"batches": [6, 4], "warmup_steps": 99},
        "epochs": 2,
    },
    {
        "name": "stop_longer_rank_1",
        "strategy": {"uneven_inputs": "stop"},
        "model": {"batches": [4, 6], "warmup_steps": 99},
    },
    {
        "name": "stop_manual",
        "strategy": {"uneven_inputs": "stop"},
        "model": {"batches": [6, 4], "warmup_steps": 99, "manual": True},
    },
    {
        "name": "stop_sync_dist",
        "strategy": {"uneven_inputs": "stop"},
        "model": {"batches": [6, 4], "warmup_steps": 99, "sync_dist": True},
    },
    {
        "name": "stop_k2",
        "strategy": {"uneven_inputs": "stop", "accumulate_grad_batches": 2},
        "model": {"batches": [7, 5], "warmup_steps": 99},
    },
    {
        "name": "stop_k3",
        "strategy": {"uneven_inputs": "stop", "accumulate_grad_batches": 3},
        "model": {"batches": [4, 6], "warmup_steps": 99},
    },
    {"name": "even", "model": {"batches": [5, 5], "warmup_steps": 99}},
    {
        "name": "stop_uneven_validation",
        "strategy": {"uneven_inputs": "stop"},
        "epochs": 2,
        "model": {"batches": [6, 4], "warmup_steps": 99, "val_batches": [3, 1]},
    },
    {
        "name": "join_uneven_validation",
        "strategy": {"uneven_inputs": "join"},
        "model": {"batches": [6, 4], "warmup_steps": 99, "val_batches": [1, 3]},
    },
    {
        "name": "join_distributed_sampler",
        "strategy": {"uneven_inputs": "join"},
        "model": {"batches": [5, 5], "warmup_steps": 99, "data": "sampler"},
    },
    {"name": "error_all_reduce", "agreement": "all_reduce", "model": {"batches": [6, 4], "warmup_steps": 99}},
    {
        "name": "stop_all_reduce",
        "agreement": "all_reduce",
        "strategy": {"uneven_inputs": "stop"},
        "model": {"batches": [6, 4], "warmup_steps": 99},
    },
    {"name": "join", "strategy": {"uneven_inputs": "join"}, "model": {"batches": [6, 4], "warmup_steps": 99}},
    {
        "name": "join_2_epochs",
        "strategy": {"uneven_inputs": "join"},
        "epochs": 2,
        "model": {"batches": [6, 4], "warmup_steps": 99},
    },
    {
        "name": "join_longer_rank_1",
        "strategy": {"uneven_inputs": "join", "verify_replicas_every_n_steps": 1},
        "model": {"batches": [3, 6], "warmup_steps": 99},
    },
    {
        "name": "join_k2",
        "strategy": {"uneven_inputs": "join", "accumulate_grad_batches": 2},
        "model": {"batches": [7, 5], "warmup_steps": 99},
    },
    {
        "name": "join_manual",
        "strategy": {"uneven_inputs": "join"},
        "model": {"batches": [6, 4], "warmup_steps": 99, "manual": True},
    },
    {
        "name": "join_sync_dist",
        "strategy": {"uneven_inputs": "join"},
        "model": {"batches": [6, 4], "warmup_steps": 99, "sync_dist": True},
    },
]


@pytest.fixture(scope="module")
def uneven_runs(step_guard_runs):
    return step_guard_runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["error", "error_manual", "error_sync_dist", "error_k2", "error_all_reduce"])
def test_uneven_error_names_the_counts_on_every_rank(uneven_runs, name):
    run = uneven_runs[name]
    assert run["error"] == "UnevenInputsError", run["message"]
    shorter = 5 if name == "error_k2" else 4
    assert f"rank 1 has {shorter} (batch {shorter} is its last)" in run["message"]
    assert "rank 0 has more than" in run["message"] and "uneven_inputs='stop'" in run["message"]
    assert _replica_gap(run) == 0.0
    assert run["trained"] == [shorter - 1, shorter - 1]  # the shorter rank's last batch is trained by no rank


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "trained", "steps"),
    [
        ("stop", [8, 8], 8),
        ("stop_longer_rank_1", [4, 4], 4),
        ("stop_manual", [4, 4], 4),
        ("stop_sync_dist", [4, 4], 4),
        ("stop_k2", [5, 5], 3),
        ("stop_k3", [4, 4], 2),
        ("stop_all_reduce", [4, 4], 4),
        ("join_distributed_sampler", [5, 5], 5),  # even by construction: nothing compared, nothing padded
        ("stop_uneven_validation", [8, 8], 8),  # and validation shards of 3 and 1 batches after each epoch
        ("join_uneven_validation", [6, 6], 6),
        ("even", [5, 5], 5),
    ],
)
def test_uneven_stop_ends_every_epoch_together(uneven_runs, name, trained, steps):
    run = uneven_runs[name]
    assert run["error"] is None, run["message"]
    assert run["trained"] == trained and run["optimizer_steps"] == steps
    assert _replica_gap(run) == 0.0


def join_reference(batches: list[int], k: int = 1, epochs: int = 1) -> list[float]:
    """One process: every optimizer step's gradient is the mean over the batches really trained in its window (a
    rank that ran out contributes none), SGD with momentum as in the job."""
    from torch.utils.data import DataLoader

    from tests.helpers import flat_parameters
    from tests.scripts.step_guard_job import GuardNet, Shard

    model = GuardNet(variant="warmup", batches=tuple(batches), warmup_steps=99)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shards = [list(DataLoader(Shard(rank, n * 4), 4)) for rank, n in enumerate(batches)]
    longest = max(batches)
    for _ in range(epochs):
        for start in range(0, longest, k):
            real = [(r, b) for b in range(start, min(start + k, longest)) for r in range(2) if b < batches[r]]
            optimizer.zero_grad()
            (sum(model.loss(shards[r][b], b) for r, b in real) / len(real)).backward()
            optimizer.step()
    return flat_parameters(model).tolist()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "batches", "k", "epochs"),
    [
        ("join", [6, 4], 1, 1),
        ("join_2_epochs", [6, 4], 1, 2),
        ("join_longer_rank_1", [3, 6], 1, 1),
        ("join_k2", [7, 5], 2, 1),
        ("join_manual", [6, 4], 1, 1),
        ("join_sync_dist", [6, 4], 1, 1),
    ],
)
def test_uneven_join_trains_the_longer_shards_with_the_mean_over_real_batches(uneven_runs, name, batches, k, epochs):
    run = uneven_runs[name]
    assert run["error"] is None, run["message"]
    longest = max(batches)
    assert run["trained"] == [longest * epochs] * 2  # the shorter rank repeats its last batch with weight 0
    assert run["optimizer_steps"] == -(-longest // k) * epochs
    assert _replica_gap(run) == 0.0
    reference = join_reference(batches, k, epochs)
    assert max(abs(a - b) for a, b in zip(run["params"][0], reference)) < 1e-6
