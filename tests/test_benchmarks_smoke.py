"""The benchmark scripts run at a tiny size, so they cannot rot (their figures are not asserted)."""

import json
import sys

import pytest

from tests.helpers import REPO_ROOT, run_job

pytestmark = pytest.mark.multiprocess


def test_suite_runs_every_benchmark_at_a_tiny_size(tmp_path):
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
        "--out",
        str(tmp_path),
        "--timeout",
        "240",
    ]
    result = run_job([sys.executable, script, *args], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads((tmp_path / "suite.json").read_text())
    assert set(summary) >= {
        "overhead",
        "hooks",
        "setup",
        "scaling",
        "micro_batches",
        "manual_accumulation",
        "machine",
        "config",
    }
    assert summary["micro_batches"]["stock_accumulate_4"]["ratio_to_stock_accumulate_4"] == 1.0
    assert summary["micro_batches"]["ddp_plus_micro_batch_8"]["samples_per_s"]["median"] > 0
    assert summary["overhead"]["stock"]["ratio_to_stock"] == 1.0
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


def test_shaped_link_benchmark_runs_on_two_namespaced_nodes(tmp_path):
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.netns import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"two shaped nodes cannot be made here: {reason}")
    script = str(REPO_ROOT / "benchmarks" / "shaped_link.py")
    variants = ["stock", "ddp_plus", "bucket_auto", "powersgd_r1", "stock_manual_recipe_k4", "ddp_plus_manual_k4"]
    args = ["--rates", "1gbit", "--repeats", "1", "--batches", "16", "--width", "64", "--layers", "1"]
    result = run_job(
        [sys.executable, script, *args, "--variants", *variants, "--out", str(tmp_path), "--timeout", "240"],
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads((tmp_path / "shaped_link.json").read_text())
    rows = report["results"][0]["variants"]
    assert set(rows) == set(variants)
    # the bounds and bytes, not the times: the stock recipe sends k times the gradients per optimizer step
    assert rows["stock_manual_recipe_k4"]["bytes_per_step"] == 4 * rows["ddp_plus_manual_k4"]["bytes_per_step"]
    assert rows["powersgd_r1"]["bytes_per_step"] < rows["stock"]["bytes_per_step"]
    assert (
        rows["ddp_plus"]["baseline"] == "stock" and rows["ddp_plus_manual_k4"]["baseline"] == "stock_manual_recipe_k4"
    )
    assert all(row["bound_max_compute_link_ms"] <= row["bound_compute_plus_link_ms"] for row in rows.values())
    assert rows["bucket_auto"]["auto_choices"], "auto chose no size"
    assert 900 < report["results"][0]["measured_tcp_mbit"] < 1000  # the shaping holds the link to 1 Gbit/s
    assert (tmp_path / "shaped_link.md").read_text().count("| `") == len(variants)
    assert not any(line.startswith("ddpp") for line in _namespaces())  # removed afterwards


def _namespaces() -> list[str]:
    import subprocess

    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.splitlines()


def test_sharding_benchmark_runs_with_its_bytes_and_shares(tmp_path):
    script = str(REPO_ROOT / "benchmarks" / "sharding.py")
    args = ["--width", "64", "--layers", "1", "--batches", "6", "--repeats", "1", "--nodes", "3"]
    result = run_job([sys.executable, script, *args, "--out", str(tmp_path), "--timeout", "240"], timeout=400)
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads((tmp_path / "sharding.json").read_text())
    loopback = report["sharding"][0]["variants"]
    plain, sharded = loopback["ddp_plus"], loopback["ddp_plus_sharded"]
    assert sum(sharded["state_bytes_by_rank"]) == plain["state_bytes_by_rank"][0] == plain["state_bytes_by_rank"][1]
    assert "overlap hook refuses the gloo backend" in loopback["ddp_plus_overlap"]["refused"]
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.netns import unavailable_reason

    if unavailable_reason() is None:
        shaped = report["sharding"][1]["variants"]
        # counted on the interfaces: no all-reduce sends less than 2(n-1)/n of the gradients per node, and the
        # broadcast of the parameter shares adds (n-1)/n of the parameters per node on average
        plain, sharded = shaped["ddp_plus"], shaped["ddp_plus_sharded"]
        assert min(plain["sent_bytes_per_step_by_node"]) >= 0.95 * plain["expected_bytes_per_step"]
        assert sum(sharded["sent_bytes_per_step_by_node"]) >= 0.95 * 2 * sharded["expected_bytes_per_step"]
        assert [r["nodes"] for r in report["scaling"]] == [3]
        assert not any(line.startswith("ddps") for line in _namespaces())  # removed afterwards


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
    result = run_job([*noise, *tiny, "--out", str(tmp_path), "--timeout", "240"], timeout=400)
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads((tmp_path / "straggler_noise.json").read_text())
    assert summary["balanced_comparisons"] == 2 and summary["balanced_warnings"] == []
    assert "rank 1 is the straggler: data fetch" in summary["slow_data"][0]["warnings"][0]
    cost = run_job([sys.executable, str(REPO_ROOT / "benchmarks" / "ledger_cost.py"), "--steps", "500"], timeout=120)
    assert cost.returncode == 0 and "ledger off (ledger_length=0" in cost.stdout, cost.stdout[-2000:]
