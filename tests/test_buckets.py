"""Bucket sizes: the default is torch's (as stock gets it), and ``bucket_cap_mb="auto"`` times candidate sizes on a
real 2-rank run, keeps one, agrees across ranks and leaves the training itself untouched."""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.sync.buckets import AUTO_BUCKET_CANDIDATES_MB, TIMED_ITERATIONS
from tests.helpers import run_case_job

TUNING_STEPS = len(AUTO_BUCKET_CANDIDATES_MB) * (1 + TIMED_ITERATIONS)
CASES = [
    {"stock": True},  # 0
    {},  # 1: ddp_plus defaults
    {"strategy": {"bucket_cap_mb": 25}},  # 2
    {"strategy": {"bucket_cap_mb": "auto"}},  # 3
    {"strategy": {"bucket_cap_mb": "auto", "static_graph": True}},  # 4
    {"stock": True, "strategy": {"accumulate_grad_batches": 2, "find_unused_parameters": True}, "samples": 320},  # 5
    {  # 6
        "strategy": {
            "bucket_cap_mb": "auto",
            "gradient_accumulation_steps": 2,
            "find_unused_parameters": True,
            "telemetry": True,
        },
        "samples": 320,
    },
    {"strategy": {"bucket_cap_mb": "auto"}, "samples": 40},  # 7: 5 steps, fewer than the tuning takes
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_case_job("buckets_job.py", CASES, tmp_path_factory.mktemp("buckets") / "results.json")


@pytest.mark.multiprocess
def test_default_buckets_are_stocks(results):
    stock, plus, explicit_25 = results[0], results[1], results[2]
    assert plus["layout"] == stock["layout"]
    assert len(stock["layout"].split(",")) > 1  # torch's 1 MiB first bucket, then the rest
    # what the old explicit default gave: torch drops the small first bucket when a size is given
    assert len(explicit_25["layout"].split(",")) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize(("case", "reference"), [(3, 0), (4, 0), (6, 5)])
def test_auto_chooses_one_size_on_every_rank_and_trains_as_stock(results, case, reference):
    result, stock = results[case], results[reference]
    chosen = result["choices"][0]
    assert chosen is not None and result["choices"][1] == chosen  # the same size and figures on both ranks
    chosen_mb, medians = chosen
    assert chosen_mb in AUTO_BUCKET_CANDIDATES_MB
    assert len(medians) == len(AUTO_BUCKET_CANDIDATES_MB) and all(0 < m < float("inf") for m in medians)
    assert medians[AUTO_BUCKET_CANDIDATES_MB.index(chosen_mb)] == min(medians)
    expected_cap = int((25 if chosen_mb is None else chosen_mb) * 2**20)
    assert result["bucket_bytes_cap"] == expected_cap  # the reducer kept for the rest of the fit
    assert result["global_step"] == stock["global_step"] > TUNING_STEPS
    torch.testing.assert_close(torch.tensor(result["parameters"]), torch.tensor(stock["parameters"]), rtol=0, atol=1e-6)
    assert any("bucket_cap_mb='auto' chose" in line for line in result["lines"]), result["lines"]


@pytest.mark.multiprocess
def test_auto_says_when_the_fit_is_too_short(results):
    result = results[7]
    assert result["choices"] == [None, None]
    assert any("before the 12 that timing 4 sizes takes" in line for line in result["lines"]), result["lines"]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"bucket_cap_mb": "Auto"}, TypeError, r"bucket_cap_mb='Auto'.*did you mean 'auto'"),
        ({"bucket_cap_mb": "auto", "ddp_comm_hook": "powersgd"}, ValueError, r"bucket_cap_mb='auto'.*PowerSGD"),
        # torch's own function counts as the named hook
        ({"bucket_cap_mb": "auto", "ddp_comm_hook": powerSGD_hook.batched_powerSGD_hook}, ValueError, "PowerSGD"),
    ],
)
def test_bad_bucket_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        DDPPlusStrategy(**kwargs)
