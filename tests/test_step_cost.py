"""What a steady step costs when the features that need a per-step agreement are off: counted, not timed, on a real
2-rank gloo job (``tests/scripts/step_cost_job.py``)."""

import pytest

from tests.helpers import run_case_job

#: Every feature that agrees across ranks per step off: no guard, no notices, no ``num_items``.
OFF = {"sync_guard": False, "preemption_signals": []}
CASES = [
    {"name": "off", "strategy": OFF},
    {"name": "off, k=2", "strategy": OFF, "k": 2},
    {"name": "replicas, validation", "strategy": {"verify_replicas_every_n_steps": 1}, "validate_every": 4},
]
STEADY = ["off", "off, k=2"]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_cost") / "out.json"
    return {case["name"]: case for case in run_case_job("step_cost_job.py", CASES, out, timeout=300)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", STEADY)
def test_with_the_per_step_features_off_a_step_issues_only_its_gradient_all_reduce(counted, name):
    """Issue 57, item 12: with the guard and notices off and no ``num_items``, a flag all-reduce still ran on every
    synced backward (per-item averaging declares its two flags whether or not a step gives counts)."""
    per_step = counted[name]["per_step"]
    assert counted[name]["steps"] == 14
    assert per_step.get("gradient all_reduce") == 1.0  # the counting sees the step's own collective
    assert {op: n for op, n in per_step.items() if op != "gradient all_reduce"} == {}


@pytest.mark.multiprocess
def test_after_a_validation_the_per_step_features_still_see_training_forwards(counted):
    """Lightning puts the DDP wrapper in eval mode for validation and gives the train mode back to the
    LightningModule only, so the wrapper's ``training`` stayed False for the rest of the fit, and the engine took
    no forward for a training one again: the replica check every step ran 4 times in 16 steps (validation every
    4 batches). DDP itself tells a training forward by grad mode."""
    assert counted["replicas, validation"]["replica_checks"] == 16
