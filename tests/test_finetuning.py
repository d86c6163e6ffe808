"""Layers unfrozen during a fit (Lightning's ``BaseFinetuning``) are all-reduced like every other layer."""

import pytest

from tests.helpers import run_case_job

CASES = [
    {"reference": True},
    {"reference": False, "stock": True},
    {"reference": False},
    {"reference": False, "strategy": {"gradient_accumulation_steps": 2}},
    {"reference": False, "strategy": {"optimizer_sharding": "all_reduce"}},
    # a guard fault after the unfreeze: rank 1 leaves a head out at one step, settled from rank 0's finished reducer
    # (rule R6 "resolve"); the reference finds unused parameters from the start
    {"reference": True, "aux": True, "strategy": {"find_unused_parameters": True}},
    {"reference": False, "aux": True, "strategy": {"checkpointing_conflict": "resolve"}},
]


@pytest.mark.multiprocess
def test_layers_unfrozen_after_the_wrap_are_averaged_as_ddp_would(tmp_path):
    results = run_case_job("finetuning_job.py", CASES, tmp_path / "out.json")
    reference, stock, plus, accumulated, sharded, aux_reference, aux_fault = results
    assert reference["replica_spread"] == 0.0 and reference["groups"] == 2
    # stock DDP left the layer frozen at the wrap out of its all-reduce: each rank stepped its own gradient
    assert stock["replica_spread"] > 1e-3
    for case in (plus, sharded):
        assert case["replica_spread"] == 0.0 and case["groups"] == 2, case
        assert max(abs(a - b) for a, b in zip(case["params"], reference["params"], strict=True)) <= 1e-6, case
    assert accumulated["replica_spread"] == 0.0
    # issue 57: the fault's settle broadcast rank 0's gradients for the unfrozen layer too, which DDP never reduced
    # (rank 0's own gradient, not the mean)
    assert aux_reference["replica_spread"] == 0.0
    assert aux_fault["replica_spread"] == 0.0
    distance = max(abs(a - b) for a, b in zip(aux_fault["params"], aux_reference["params"], strict=True))
    assert distance <= 1e-6
