"""The DDP wrapper exists exactly when stock Lightning's does, whatever ``checkpointing_conflict`` is, and a resolution
rebuilds its reducer in place: callbacks keep a valid wrapper and their communication hooks (real 2-rank runs)."""

import pytest
import torch

from tests.helpers import CheckpointNet, reference_parameters, run_case_job

CASES = [
    {"stock": True},
    {"stock": False},
    {"stock": False, "strategy": {"checkpointing_conflict": "off"}},
    # R1 resolved: static_graph switched on at the first backward, after the callback registered its hook
    {
        "stock": False,
        "strategy": {"checkpointing_conflict": "resolve", "find_unused_parameters": True},
        "model": {"checkpointing": "reentrant"},
    },
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_case_job("wrapper_job.py", CASES, tmp_path_factory.mktemp("wrapper") / "results.json")


@pytest.mark.multiprocess
def test_callbacks_see_the_wrapper_when_stock_callbacks_do(results):
    stock = results[0]["seen"]
    assert stock == {"setup": False, "on_fit_start": True, "on_train_start": True}
    for result in results[1:]:
        assert result["seen"] == stock, result


@pytest.mark.multiprocess
def test_a_resolution_keeps_the_wrapper_and_the_hooks_registered_on_it(results):
    for result in results:
        assert result["same_wrapper"], result
        # 24 samples, batch 4, 2 ranks: 3 steps, one bucket each; the callback's own hook saw every all-reduce
        assert result["optimizer_steps"] == 3 and result["hook_calls"] == 3, result
        params = [torch.tensor(p) for p in result["params"]]
        assert torch.equal(params[0], params[1])
        expected = reference_parameters(CheckpointNet(**result.get("model", {})))
        assert torch.allclose(params[0], expected, atol=1e-5, rtol=0)
    assert results[3]["settings"] == {"static_graph": True}
