"""The benchmark scripts run at a tiny size, so they cannot rot (their figures are not asserted)."""

import json
import sys

import pytest

from tests import warm
from tests.helpers import REPO_ROOT, run_job

pytestmark = pytest.mark.multiprocess


def test_suite_runs_its_benchmarks_at_a_tiny_size(tmp_path):
    script = str(REPO_ROOT / "benchmarks" / "suite.py")
    args = [
        "--repeats",
        "1",
        "--width",
        "32",
        "--layers",
        "1",
        "--batches",
        "6",
        # the benchmarks whose code is their own, the 2-rank ones in one launch (scaling times the same fit on 1 and 2
        # processes, two launches more: CI's time)
        "--only",
        "overhead",
        "hooks",
        "setup",
        "micro_batches",
        "manual_accumulation",
        "--out",
        str(tmp_path),
        "--timeout",
        "240",
    ]
    result = run_job([sys.executable, script, *args], timeout=600, env=warm.environment())
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads((tmp_path / "suite.json").read_text())
    assert set(summary) >= {
        "overhead",
        "hooks",
        "setup",
        "micro_batches",
        "manual_accumulation",
        "machine",
        "config",
    }
    assert summary["micro_batches"]["stock_accumulate_4"]["ratio_to_stock_accumulate_4"] == 1.0
    assert summary["micro_batches"]["ddp_plus_micro_batch_8"]["samples_per_s"]["median"] > 0
    assert summary["overhead"]["stock"]["ratio_to_stock"] == 1.0
    assert summary["setup"]["ddp_plus_validator_on"]["first_step_s"]["median"] > 0
    assert summary["overhead"]["ddp_plus"]["ratio_to_ddp_plus_ledger_off"] > 0
    assert set(summary["hooks"]) == {"none", "fp16", "bf16", "powersgd"}
    # bytes are counted, not timed: fp16 and bf16 send half of what plain all-reduce sends
    plain = summary["hooks"]["none"]["bytes_per_step"]["median"]
    assert summary["hooks"]["fp16"]["bytes_per_step"]["median"] * 2 == plain
    # counts, not times: the stock manual recipe all-reduces on each of the k=4 backwards, ddp_plus once per step
    manual = summary["manual_accumulation"]
    assert manual["stock"]["allreduces_per_step"] == pytest.approx(4)
    assert manual["ddp_plus"]["allreduces_per_step"] == pytest.approx(1)
    assert manual["ratio_ddp_plus_over_stock"] > 0


def test_the_ddp_or_zero_example_plans_a_model_from_the_meta_device():
    result = run_job(
        [sys.executable, str(REPO_ROOT / "examples" / "ddp_or_zero.py"), "--tiny", "--sequence", "64"], timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "memory plan per rank, world size 8, device 24.00 GiB" in result.stdout
    assert result.stdout.count("verdict: ") == 2


def test_the_straggler_noise_and_ledger_cost_benchmarks_run_at_a_tiny_size(tmp_path):
    noise = [sys.executable, str(REPO_ROOT / "benchmarks" / "straggler_noise.py")]
    tiny = ["--repeats", "1", "--steps", "10", "--every", "5", "--width", "32", "--layers", "1", "--delay-ms", "60"]
    result = run_job([*noise, *tiny, "--out", str(tmp_path), "--timeout", "240"], timeout=400, env=warm.environment())
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads((tmp_path / "straggler_noise.json").read_text())
    assert summary["balanced_comparisons"] == 2 and summary["balanced_warnings"] == []
    assert "rank 1 is the straggler: data fetch" in summary["slow_data"][0]["warnings"][0]
    cost = run_job([sys.executable, str(REPO_ROOT / "benchmarks" / "ledger_cost.py"), "--steps", "500"], timeout=120)
    assert cost.returncode == 0 and "ledger off (ledger_length=0" in cost.stdout, cost.stdout[-2000:]


def test_the_item_averaging_cost_benchmark_runs_at_a_tiny_size(tmp_path):
    """Its table's workload is what ``test_item_averaging.py`` checks; here its cost part runs end to end."""
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "item_averaging.py"), "--only", "cost"]
    tiny = ["--steps", "6", "--repeats", "1", "--width", "16"]
    result = run_job([*command, *tiny, "--out", str(tmp_path / "items.json")], timeout=300, env=warm.environment())
    assert result.returncode == 0, result.stdout[-3000:]
    cost = json.loads((tmp_path / "items.json").read_text())["cost"]
    assert set(cost) == {"stock", "ddp_plus", "ddp_plus + num_items"}
    assert cost["stock"]["ratio to stock"] == 1.0 and cost["ddp_plus + num_items"]["median step (ms)"] > 0


def test_the_rank_death_cost_benchmark_runs_at_a_tiny_size(tmp_path):
    script = str(REPO_ROOT / "benchmarks" / "rank_death.py")
    args = ["--only", "work", "cost", "--steps", "10", "--repeats", "1", "--out", str(tmp_path / "out.json")]
    result = run_job([sys.executable, script, *args], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["cost"]["stock"]["ratio to stock"] == 1.0
    assert summary["work"]["work per optimizer step (us)"] > 0


def test_the_scale_benchmark_counts_what_each_variant_issues_per_step(tmp_path):
    """Counts, not times: stock broadcasts its SIGTERM flag every step, bare DDP issues nothing of its own."""
    script = [sys.executable, str(REPO_ROOT / "benchmarks" / "scale.py")]
    tiny = ["--ranks", "2", "--steps", "8", "--warm-up", "2", "--sleep", "0.01", "--variants", "bare", "stock"]
    result = run_job([*script, *tiny, "--out", str(tmp_path), "--timeout", "240"], timeout=400, env=warm.environment())
    assert result.returncode == 0, result.stdout[-3000:]
    by_variant = {r["variant"]: r for r in json.loads((tmp_path / "scale.json").read_text())}
    assert by_variant["stock"]["per step"] == {"collective broadcast": 1.0}
    assert by_variant["bare"]["per step"] == {}
    assert by_variant["bare"]["first step from start (s)"] > 0
    # the start after every rank called fit, apart from the ranks' import times (their fit calls' spread)
    bare = by_variant["bare"]
    assert bare["first step from the last fit call (s)"] > 0
    assert bare["first step from the last fit call (s)"] < bare["first step from start (s)"]
    assert bare["fit calls spread (s)"] >= 0


def test_the_flag_transport_benchmark_keeps_the_gradients(tmp_path):
    """The flags appended to the last bucket leave the all-reduced gradients as they were."""
    script = [sys.executable, str(REPO_ROOT / "benchmarks" / "flag_transport.py")]
    tiny = ["--width", "64", "--layers", "2", "--steps", "5", "--repeats", "1", "--out", str(tmp_path / "flags.json")]
    result = run_job([*script, *tiny], timeout=300, env=warm.environment())
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads((tmp_path / "flags.json").read_text())
    assert summary["flags in last bucket"]["largest weight difference to python hook"] == 0.0
    assert summary["builtin"]["ratio to builtin"] == 1.0
