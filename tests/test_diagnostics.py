"""Diagnostics: replica-drift guard, sync telemetry, broadcast_buffers="auto" and straggler attribution, with real
2-rank gloo runs."""

import pytest
import torch

from lightning_ddp_plus import DDPPlusStrategy, DDPSettings
from lightning_ddp_plus.diagnostics.phase_timings import PhaseTimes, find_straggler
from lightning_ddp_plus.diagnostics.replicas import fingerprints, first_mismatch
from tests.helpers import TinyRegression, run_case_job


def test_fingerprints_tell_tensors_apart():
    a = [torch.arange(6.0).reshape(2, 3), torch.ones(4)]
    b = [a[0].clone(), a[1].clone()]
    b[1][2] += 1e-6
    gathered = torch.stack([fingerprints(a), fingerprints(b)])
    assert first_mismatch(gathered, ["w", "v"]) == ("v", [1])
    assert first_mismatch(torch.stack([fingerprints(a), fingerprints(a)]), ["w", "v"]) is None


def test_auto_buffers_setting():
    assert DDPSettings(broadcast_buffers="auto").resolve_auto(True).broadcast_buffers is True
    assert DDPSettings(broadcast_buffers="auto").resolve_auto(False).broadcast_buffers is False
    with pytest.raises(RuntimeError, match="must be resolved"):
        DDPSettings(broadcast_buffers="auto").to_ddp_kwargs()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"verify_replicas_every_n_steps": 0}, "verify_replicas_every_n_steps"),
        ({"telemetry": "yes"}, "telemetry"),
        ({"broadcast_buffers": "sometimes"}, "broadcast_buffers"),
    ],
)
def test_bad_diagnostics_arguments(kwargs, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        DDPPlusStrategy(**kwargs)


CASES = [
    # 0: a replica corrupted on rank 1 after step 3 is caught at the check after step 4
    {
        "strategy": {"verify_replicas_every_n_steps": 2},
        "corrupt": {"step": 3, "parameter": "net.0.weight"},
        "epochs": 2,
    },
    # 1: a clean run with the guard on
    {"strategy": {"verify_replicas_every_n_steps": 2}, "epochs": 2},
    # 2: telemetry with accumulation, against an independent counting hook
    {"strategy": {"telemetry": True, "gradient_accumulation_steps": 3, "independent_hook": True}},
    # 3, 4: bytes without a hook and with fp16
    {"strategy": {"telemetry": True}},
    {"strategy": {"telemetry": True, "ddp_comm_hook": "fp16"}},
    # 5, 6, 7: broadcast_buffers auto for LayerNorm / BatchNorm, and BatchNorm with the broadcast off
    {"strategy": {"broadcast_buffers": "auto"}, "model": {"checkpoint_net": True}},
    {"strategy": {"broadcast_buffers": "auto"}, "model": {"checkpoint_net": True, "norm": "batch"}},
    {"strategy": {"broadcast_buffers": False}, "model": {"checkpoint_net": True, "norm": "batch"}},
]


# Straggler attribution: a rank sleeping DELAY_S per batch while its batch loads or in its training step
DELAY_S = 0.12
STRAGGLER_CASES = [
    {"name": "balanced", "slow": None, "rank": 0, "delay_s": 0, "steps": 30, "every": 10},
    {"name": "slow data on rank 1", "slow": "data", "rank": 1, "delay_s": DELAY_S, "steps": 20, "every": 10},
    {"name": "slow compute on rank 1", "slow": "compute", "rank": 1, "delay_s": DELAY_S, "steps": 20, "every": 10},
    # a BatchNorm: DDP broadcasts buffers at every forward, so rank 1 waits there, not in the gradient all-reduce
    {
        "name": "slow data on rank 0, buffers",
        "slow": "data",
        "rank": 0,
        "delay_s": DELAY_S,
        "steps": 20,
        "every": 10,
        "buffers": True,
    },
]
# a run shorter than the cadence: no comparison during the fit, one at its end
STRAGGLER_CASES.append(
    {"name": "slow data on rank 1, 32 steps", "slow": "data", "rank": 1, "delay_s": DELAY_S, "steps": 32, "every": 50}
)
# epochs shorter than the cadence: each epoch's end compares its steps
STRAGGLER_CASES.append(
    {
        "name": "slow compute on rank 1, 2 epochs of 12 steps",
        "slow": "compute",
        "rank": 1,
        "delay_s": DELAY_S,
        "steps": 24,
        "epoch_steps": 12,
        "every": 50,
    }
)
CASES += [{"straggler": case, "name": case["name"]} for case in STRAGGLER_CASES]
# a feature added to the step pipeline from outside the package (tests/scripts/pipeline_job.py)
CASES.append({"name": "a component added", "pipeline": {"steps": 4, "news_at_step": 3}})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_case_job("diagnostics_job.py", CASES, tmp_path_factory.mktemp("diagnostics") / "results.json")


@pytest.fixture(scope="module")
def stragglers(results):
    return {case["name"]: case for case in results if "straggler" in case}


@pytest.mark.parametrize(
    ("name", "rank", "phase"),
    [
        ("slow data on rank 1", 1, "data fetch"),
        ("slow compute on rank 1", 1, "compute"),
        ("slow data on rank 0, buffers", 0, "data fetch"),
    ],
)
@pytest.mark.multiprocess
def test_the_slow_rank_is_named_once_with_its_phase_and_figures(stragglers, name, rank, phase):
    outcome = stragglers[name]
    assert len(outcome["warnings"]) == 1, outcome["warnings"]  # two comparisons, one warning: repeats are held back
    warning = outcome["warnings"][0]
    assert f"rank {rank} is the straggler: {phase} " in warning
    assert "median of the last 10 steps" in warning and "every rank waits for it" in warning
    last = {times["rank"]: times for times in outcome["comparisons"][-1]}
    slow, other = last[rank], last[1 - rank]
    key = phase.replace(" ", "_") + "_ms"
    assert slow[key] - other[key] > 0.8 * DELAY_S * 1000  # the delay lands in the phase it was put in
    assert other["collective_wait_ms"] - slow["collective_wait_ms"] > 0.8 * DELAY_S * 1000  # and the other waits


@pytest.mark.multiprocess
def test_a_run_shorter_than_the_cadence_names_its_straggler_at_the_end_of_the_fit(stragglers):
    outcome = stragglers["slow data on rank 1, 32 steps"]
    assert outcome["comparisons"] == []  # 32 steps, a comparison every 50: none during the fit
    [warning] = outcome["warnings"]
    assert "rank 1 is the straggler: data fetch " in warning
    assert "median of the last 32 steps" in warning and "every rank waits for it" in warning


@pytest.mark.multiprocess
def test_an_epoch_shorter_than_the_cadence_names_its_straggler_at_its_end(stragglers):
    outcome = stragglers["slow compute on rank 1, 2 epochs of 12 steps"]
    [at_second_epoch] = outcome["at_epoch_start"]  # the first epoch's end compared its 12 steps
    assert outcome["comparisons"] == [at_second_epoch]  # and nothing else compared during the epochs (cadence 50)
    medians = {times["rank"]: times for times in at_second_epoch}
    assert medians[1]["compute_ms"] - medians[0]["compute_ms"] > 0.8 * DELAY_S * 1000
    [warning] = outcome["warnings"]  # the second epoch's end finds the same: held back
    assert "rank 1 is the straggler: compute " in warning and "median of the last 12 steps" in warning


@pytest.mark.multiprocess
def test_a_balanced_run_names_no_one(stragglers):
    outcome = stragglers["balanced"]
    assert outcome["warnings"] == []
    assert len(outcome["comparisons"]) == 3  # every 10 steps, 30 steps
    for comparison in outcome["comparisons"]:
        times = [PhaseTimes(**rank_times) for rank_times in comparison]
        assert find_straggler(times, 10) is None


@pytest.mark.multiprocess
def test_corrupted_replica_is_caught_with_name_rank_and_step(results):
    result = results[0]
    assert result["error"] == "ReplicaDriftError"
    assert "optimizer step 4" in result["message"]
    assert "`net.0.weight` on rank(s) 1 differs from rank 0" in result["message"]
    assert result["optimizer_steps"] == 4  # stopped at the check, before step 5


@pytest.mark.multiprocess
def test_clean_run_with_guard_finishes(results):
    result = results[1]
    assert result["error"] is None
    assert result["optimizer_steps"] == 16
    assert result["replica_checks"] == 8


@pytest.mark.multiprocess
def test_telemetry_equals_independent_counts_with_accumulation(results):
    result = results[2]
    totals = result["telemetry_totals"]
    assert result["error"] is None
    assert totals["buckets"] == result["independent"]["calls"] == 3  # 8 micro-batches, k=3: windows 3, 3, 2
    assert totals["bytes_sent"] == result["independent"]["bytes"]
    assert totals["synced_backwards"] == result["synced_backwards"] == 3
    assert totals["skipped_backwards"] == result["skipped_backwards"] == 5
    # torch's own runtime statistics, read back (no Python hook per bucket, nothing patched)
    timed = result["telemetry_last"]
    assert timed["timed_iteration"] >= 1 and timed["backward_comm_ms"] > 0 and timed["forward_ms"] > 0


@pytest.mark.multiprocess
def test_fp16_sends_half_the_bytes(results):
    plain, fp16 = results[3]["telemetry_totals"], results[4]["telemetry_totals"]
    assert plain["buckets"] == fp16["buckets"] == 8
    # without a hook the bytes come from the reducer's bucket layout: every fp32 gradient once per step
    assert plain["bytes_sent"] == 8 * 4 * sum(p.numel() for p in TinyRegression().parameters())
    assert fp16["bytes_sent"] * 2 == plain["bytes_sent"]


@pytest.mark.multiprocess
def test_auto_buffers(results):
    layer_norm, batch_norm, batch_norm_off = results[5], results[6], results[7]
    assert layer_norm["broadcast_buffers"] is False
    assert batch_norm["broadcast_buffers"] is True
    assert batch_norm["buffers_equal_after_forward"] is True
    # the contrast: without the broadcast, running statistics differ across ranks
    assert batch_norm_off["buffers_equal_after_forward"] is False
    assert all(r["error"] is None for r in (layer_norm, batch_norm, batch_norm_off))


@pytest.mark.multiprocess
def test_a_component_added_to_the_pipeline_is_called_in_order_and_its_flag_is_agreed_by_name(results):
    """A new feature is a ``StepComponent`` and one line: the pipeline calls it at every point of the fit in order,
    and the flag it declares travels in the step's one agreement. Rank 1 has news at step 3 only: rank 0 reads it
    by name there. The flags ride in the last gradient bucket, so no step exchanges them on its own, news or not."""
    outcome = next(case for case in results if case.get("name") == "a component added")
    step = ["forward_starts {}", "before_backward", "after_backward", "agreed", "step_done {}"]
    expected = ["fit_starts"]
    for number in range(4):
        expected += [call.format(number) if "forward" in call else call.format(number + 1) for call in step]
    # the epoch's end (stragglers compared) and training's
    expected += ["epoch_ends 4", "epoch_ends 4 training_ends", "fit_ends failed=False"]
    assert outcome["calls"] == expected
    assert outcome["agreed_news"] == {"1": 0, "2": 0, "3": 1, "4": 0}
    # the notice check before the first step (preemption) only: step 3's news rode in its last bucket
    assert outcome["flag_exchanges_at_steps"] == [0]
