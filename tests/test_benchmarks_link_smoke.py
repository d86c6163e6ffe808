"""The benchmarks that shape a link between namespaced nodes run at a tiny size (their bytes are asserted, not their
times); a file of their own, so that they run beside the other benchmarks' smoke tests."""

import json
import sys

import pytest

from tests import warm
from tests.helpers import REPO_ROOT, run_job

pytestmark = pytest.mark.multiprocess


def test_shaped_link_benchmark_runs_on_two_namespaced_nodes(tmp_path):
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.netns import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"two shaped nodes cannot be made here: {reason}")
    script = str(REPO_ROOT / "benchmarks" / "shaped_link.py")
    variants = [
        "stock",
        "ddp_plus",
        "ddp_plus_side_channel",
        "bucket_auto",
        "powersgd_r1",
        "stock_manual_recipe_k4",
        "ddp_plus_manual_k4",
    ]
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
    # the shaping holds the link to 1 Gbit/s (the floor is loose: another test may share the cores)
    assert 500 < report["results"][0]["measured_tcp_mbit"] < 1000
    assert (tmp_path / "shaped_link.md").read_text().count("| `") == len(variants)
    assert not any(line.startswith("ddpp") for line in _namespaces())  # removed afterwards


def _namespaces() -> list[str]:
    import subprocess

    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.splitlines()


def test_sharding_benchmark_runs_with_its_bytes_and_shares(tmp_path):
    script = str(REPO_ROOT / "benchmarks" / "sharding.py")
    args = ["--width", "64", "--layers", "1", "--batches", "6", "--repeats", "1", "--nodes", "2"]
    variants = ["ddp_plus", "ddp_plus_sharded", "ddp_plus_sharded_all_reduce", "ddp_plus_overlap", "step_in_hook"]
    command = [sys.executable, script, *args, "--variants", *variants, "--out", str(tmp_path), "--timeout", "240"]
    result = run_job(command, timeout=400, env=warm.environment())
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads((tmp_path / "sharding.json").read_text())
    loopback = report["sharding"][0]["variants"]
    plain, sharded, old = (loopback[v] for v in ("ddp_plus", "ddp_plus_sharded", "ddp_plus_sharded_all_reduce"))
    full = plain["state_bytes_by_rank"][0]
    assert sum(old["state_bytes_by_rank"]) == full == plain["state_bytes_by_rank"][1]
    # Adam's moments split to the element (a 4-byte step per piece on each rank)
    assert full <= sum(sharded["state_bytes_by_rank"]) <= full + 2 * 4 * 16
    assert max(sharded["state_bytes_by_rank"]) <= full / 2 + 4 * 16 + 8 * 8
    # counted by the hook: the ring all-reduce's bytes, but the padding
    ring = plain["expected_bytes_per_step"]
    assert all(ring <= counted <= ring + 64 for counted in sharded["hook_bytes_per_step_by_rank"])
    assert "overlap hook refuses the gloo backend" in loopback["ddp_plus_overlap"]["refused"]
    # the same fit, each variant's parameters against ddp_plus's: sharded and the step in the hook are exact
    assert sharded["max_abs_difference_to_ddp_plus"] < 1e-6
    assert loopback["step_in_hook"]["max_abs_difference_to_ddp_plus"] < 1e-6
    assert len(loopback["step_in_hook"]["bucket_bytes"]) >= 1
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.netns import unavailable_reason

    if unavailable_reason() is None:
        shaped = report["sharding"][1]["variants"]
        # counted on the interfaces: no all-reduce sends less than 2(n-1)/n of the gradients per node; the
        # reduce-scatter and all-gather send as much, and torch's ZeroRedundancyOptimizer adds the broadcast of the
        # parameter shares, (n-1)/n of the parameters per node on average (at this tiny size a fit's one-off traffic,
        # such as the state moving to DDP's rebuilt buckets after the first step, weighs too much to compare them)
        plain, sharded, old = (shaped[v] for v in ("ddp_plus", "ddp_plus_sharded", "ddp_plus_sharded_all_reduce"))
        assert min(plain["sent_bytes_per_step_by_node"]) >= 0.95 * plain["expected_bytes_per_step"]
        assert min(sharded["sent_bytes_per_step_by_node"]) >= 0.95 * plain["expected_bytes_per_step"]
        assert sum(old["sent_bytes_per_step_by_node"]) >= 0.95 * 2 * old["expected_bytes_per_step"]
        # 2 nodes of the scaling table: the shaped setting's own ddp_plus runs, not run again
        assert [r["nodes"] for r in report["scaling"]] == [2]
        assert report["scaling"][0]["variants"]["ddp_plus"] == plain
        assert not any(line.startswith("ddps") for line in _namespaces())  # removed afterwards


def test_the_sharding_summary_gives_each_variant_its_ratios_and_the_bound():
    # the arithmetic of the table, on made-up runs: vs stock, vs ddp_plus, vs max(compute, link), bytes a ring needs
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.sharding import summarize

    def runs(ms: float) -> list[dict]:
        row = {"step_ms": ms, "state_bytes_by_rank": [8, 8], "consolidation_s_by_rank": [0.0, 0.0]}
        return [{**row, "sent_bytes_per_step_by_node": [1.0, 1.0], "hook_bytes_per_step_by_rank": [None, None]}]

    raw = {name: runs(ms) for name, ms in [("compute_only", 10.0), ("stock", 40.0), ("ddp_plus", 50.0)]}
    raw["ddp_plus_sharded_all_reduce"] = runs(100.0)
    gradient = 125_000_000 // 8  # 1 Gbit: the ring's 2(n-1)/n x G = G on 2 nodes takes 125 ms
    last = gradient // 5  # the last bucket DDP sends: its all-reduce (25 ms) starts when the backward ends
    raw["ddp_plus"][0]["bucket_bytes"] = [gradient - last, last]
    raw["ddp_plus_sharded_all_reduce"][0]["bucket_bytes"] = [gradient]  # not a plain all-reduce: no such bound
    report = summarize(raw, nodes=2, rate="1gbit", gradient_bytes=gradient)["variants"]
    assert report["compute_only"]["expected_bytes_per_step"] == 0
    assert report["ddp_plus"]["ratio_to_stock"] == 1.25 and report["ddp_plus"]["ratio_to_ddp_plus"] == 1.0
    assert report["ddp_plus"]["link_bound_ms"] == pytest.approx(125.0)
    assert report["ddp_plus"]["overlap_bound_ms"] == pytest.approx(125.0)  # max(10, 125)
    assert report["ddp_plus"]["overlap_bound_with_last_bucket_ms"] == pytest.approx(150.0)
    assert report["ddp_plus"]["ratio_to_bound_with_last_bucket"] == pytest.approx(50.0 / 150.0)
    assert "last_bucket_ms" not in report["stock"]  # its layout unknown
    assert "last_bucket_ms" not in report["ddp_plus_sharded_all_reduce"]
    assert report["ddp_plus_sharded_all_reduce"]["expected_bytes_per_step"] == 1.5 * gradient  # the broadcast too
    # overlap_bound's table: DDP's schedule floor from the compute-only run's phases, and the ratios
    from benchmarks.overlap_bound import add_schedule_floor, markdown

    raw["compute_only"][0]["phase_ms"] = {"data fetch": 1.0, "compute": 4.0, "optimizer step": 5.0}
    result = add_schedule_floor({"model": "m", **summarize(raw, nodes=2, rate="1gbit", gradient_bytes=gradient)})
    assert result["variants"]["ddp_plus"]["schedule_floor_ms"] == pytest.approx(131.0)  # max(10, 125 + 1 + 5)
    row = next(line for line in markdown([result]).splitlines() if "`ddp_plus`" in line)
    assert "| 150.0 | 0.40 | 0.33 | 131.0 | 0.38 |" in row


def test_the_link_allreduce_benchmark_runs_at_a_tiny_size(tmp_path):
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.netns import unavailable_reason

    if reason := unavailable_reason():
        pytest.skip(f"two shaped nodes cannot be made here: {reason}")
    out = tmp_path / "link_allreduce.json"
    script = str(REPO_ROOT / "benchmarks" / "link_allreduce.py")
    args = ["--rate", "10gbit", "--megabytes", "2", "--repeats", "1", "--idle-ms", "5", "--out", str(out)]
    result = run_job([sys.executable, script, *args], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads(out.read_text())
    for setting in ("tcp_slow_start_after_idle=1", "tcp_slow_start_after_idle=0"):
        cases = report[setting]
        assert {"one call", "buckets of 25 MiB", "compute alone", "compute while the buckets travel"} <= set(cases)
        assert all(case["ms"] > 0 for name, case in cases.items() if name != "tcp Mbit/s")
        assert cases["compute while the buckets travel"]["x compute alone"] > 0
