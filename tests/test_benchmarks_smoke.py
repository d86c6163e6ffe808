"""The benchmark scripts run at a tiny size, so they cannot rot (their figures are not asserted)."""

import json
import sys

import pytest

from tests.helpers import REPO_ROOT, run_job

pytestmark = pytest.mark.multiprocess


def test_manual_accumulation_benchmark_runs(tmp_path):
    out = tmp_path / "bench.json"
    script = str(REPO_ROOT / "benchmarks" / "bench_manual_accumulation.py")
    result = run_job(
        [
            sys.executable,
            script,
            "--repeats",
            "1",
            "--width",
            "32",
            "--layers",
            "1",
            "--batches",
            "8",
            "--out",
            str(out),
            "--timeout",
            "240",
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads(out.read_text())
    # counts, not times: the stock recipe all-reduces on each of the k backwards, ddp_plus once per step
    assert summary["stock"]["allreduces_per_step"] == pytest.approx(4)
    assert summary["ddp_plus"]["allreduces_per_step"] == pytest.approx(1)
    assert summary["ratio_ddp_plus_over_stock"] > 0


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
    assert set(summary) >= {"overhead", "hooks", "setup", "scaling", "manual_accumulation", "machine", "config"}
    assert summary["overhead"]["stock"]["ratio_to_stock"] == 1.0
    assert set(summary["hooks"]) == {"none", "fp16", "bf16", "powersgd"}
    # bytes are counted, not timed: fp16 and bf16 send half of what plain all-reduce sends
    plain = summary["hooks"]["none"]["bytes_per_step"]["median"]
    assert summary["hooks"]["fp16"]["bytes_per_step"]["median"] * 2 == plain
