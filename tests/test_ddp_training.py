"""Real 2-process DDP training on gloo with ``ddp_plus`` (popen launcher) and ``ddp_plus_spawn``."""

import json

import lightning as L
import pytest
import torch

import lightning_ddp_plus  # noqa: F401
from tests.helpers import QUIET_TRAINER, ReplicaReport, TinyRegression, python_script, run_case_job, run_job

pytestmark = pytest.mark.multiprocess


def run_popen_job(tmp_path, strategy_kwargs, trainer_kwargs=None):
    out = tmp_path / "report.json"
    args = python_script("ddp_job.py") + [str(out), json.dumps(strategy_kwargs), json.dumps(trainer_kwargs or {})]
    result = run_job(args)
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads(out.read_text()), result.stdout


def assert_identical_replicas(report):
    params = [torch.tensor(p) for p in report["params"]]
    assert len(params) == 2
    assert torch.equal(params[0], params[1]), f"replicas differ by {(params[0] - params[1]).abs().max()}"


def test_ddp_plus_popen_trains_with_identical_replicas(tmp_path):
    report, output = run_popen_job(tmp_path, {"name": "ddp_plus"})
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert report["global_step"] == [16, 16]  # 64 samples / 2 ranks / batch 4, 2 epochs
    assert_identical_replicas(report)
    assert "DDPPlusStrategy: backend=gloo, timeout=30m, world_size=2" in output
    # The model really trained: the final parameters differ from the initial ones.
    initial = torch.cat([p.detach().flatten() for p in TinyRegression().parameters()])
    assert not torch.allclose(initial, torch.tensor(report["params"][0]))


def test_ddp_plus_spawn_trains_with_identical_replicas(tmp_path):
    out = tmp_path / "report.json"
    trainer = L.Trainer(
        strategy="ddp_plus_spawn",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        **QUIET_TRAINER,
        callbacks=[ReplicaReport(str(out))],
    )
    model = TinyRegression()
    trainer.fit(model)
    report = json.loads(out.read_text())
    assert report["global_step"] == [8, 8]
    assert_identical_replicas(report)
    # what the workers counted reaches the strategy object in this (launching) process
    strategy = trainer.strategy
    assert strategy.sync_stats.optimizer_steps == strategy.sync_stats.synced_backwards == 8
    assert strategy.findings == []  # the check ran in the workers and found nothing
    assert strategy.settings.broadcast_buffers is True
    # spawn returns rank 0's weights to the main process
    assert torch.allclose(
        torch.cat([p.detach().flatten() for p in model.parameters()]), torch.tensor(report["params"][0])
    )


#: One pair of processes runs every case (``hooks_job.py``): the imports and the process group once. The typed knobs
#: come first: the process group is created with the first case's timeout.
TYPED_KNOBS = {"timeout": "90s", "bucket_cap_mb": 1, "gradient_as_bucket_view": True, "static_graph": True}
HOOK_CASES = {
    "typed_knobs": TYPED_KNOBS,
    "none": {},
    "fp16": {"ddp_comm_hook": "fp16"},
    "bf16": {"ddp_comm_hook": "bf16"},
    "powersgd": {"ddp_comm_hook": "powersgd"},
}


@pytest.fixture(scope="module")
def hook_runs(tmp_path_factory):
    cases = [{"name": name, "strategy": strategy} for name, strategy in HOOK_CASES.items()]
    results = run_case_job("hooks_job.py", cases, tmp_path_factory.mktemp("hooks") / "runs.json")
    return {run["name"]: run for run in results}


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_named_compression_hook_really_runs_on_gloo(hook_runs, hook):
    report = hook_runs[hook]
    # one bucket per backward, 8 backwards per rank
    assert report["hook_calls"] == [8, 8]
    assert_identical_replicas(report)
    assert f"comm_hook={hook}" in report["setup_line"]
    if hook == "fp16":
        # every all-reduced gradient went through float16
        assert report["grads_fp16_exact"] == [True, True]


def test_typed_knobs_reach_the_process_group_and_the_wrapper(hook_runs):
    report = hook_runs["typed_knobs"]
    assert report["timeout_seconds"] == 90
    assert_identical_replicas(report)
    assert "timeout=1m30s" in report["setup_line"] and "static_graph=True" in report["setup_line"]
    assert "bucket_cap_mb=1" in report["setup_line"] and "gradient_as_bucket_view=True" in report["setup_line"]


def test_without_hook_gradients_are_not_fp16_rounded(hook_runs):
    # The control for the test above: plain all-reduce keeps float32 precision, so the fp16 check can fail.
    report = hook_runs["none"]
    assert report["hook_calls"] == [0, 0]
    assert report["grads_fp16_exact"] == [False, False]


def test_powersgd_with_default_state_trains(hook_runs):
    report = hook_runs["powersgd"]
    assert report["hook_calls"] == [8, 8]
    assert_identical_replicas(report)
