"""Accumulation-aware sync: the window rules (pure), the settings check, and real 2-rank runs on gloo."""

import lightning as L
import pytest
import torch

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.sync.accumulation import (
    WindowPosition,
    gradient_rescale,
    loss_scale,
    merge_accumulation_settings,
    window_position,
)
from tests.helpers import TinyRegression, reference_parameters, regression_data, run_case_job


def test_windows_of_an_epoch_of_ten_with_k4():
    positions = [window_position(b, 4, 10) for b in range(1, 11)]
    assert [p.closes_window for p in positions] == [False, False, False, True, False, False, False, True, False, True]
    assert [p.length for p in positions][-2:] == [2, 2]


def test_unknown_epoch_length_keeps_full_windows():
    assert window_position(9, 4, float("inf")) == WindowPosition(index=0, length=4, length_known=False)
    # Lightning knows the last batch one ahead: it closes the window early, and the gradients get k/length
    last = window_position(10, 4, float("inf"), is_last=True)
    assert last.closes_window and last.length == 2
    assert gradient_rescale(last, 4, "mean") == 2.0 and gradient_rescale(last, 4, "lightning") == 1.0


@pytest.mark.parametrize(
    ("length", "mode", "automatic", "expected"),
    [
        (4, "mean", True, 1.0),
        (2, "mean", True, 2.0),
        (2, "lightning", True, 1.0),
        (4, "mean", False, 0.25),
        (2, "mean", False, 0.5),
        (2, "lightning", False, 0.25),
    ],
)
def test_loss_scale(length, mode, automatic, expected):
    assert loss_scale(WindowPosition(0, length), 4, mode, automatic) == expected


def test_merge_settings():
    assert merge_accumulation_settings(None, 1) == 1
    assert merge_accumulation_settings(3, 1) == 3
    assert merge_accumulation_settings(None, 5) == 5
    assert merge_accumulation_settings(2, 2) == 2
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4.*accumulate_grad_batches=2.*set only one"):
        merge_accumulation_settings(4, 2)
    with pytest.raises(ValueError, match="schedules are not supported"):
        merge_accumulation_settings(None, {0: 2})


def test_mismatch_fails_when_fit_starts_before_anything_is_launched(tmp_path):
    strategy = DDPPlusStrategy(gradient_accumulation_steps=4, start_method="spawn")
    trainer = L.Trainer(
        strategy=strategy,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=2,
        default_root_dir=tmp_path,
        logger=False,
    )
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4.*accumulate_grad_batches=2"):
        trainer.fit(TinyRegression())
    assert trainer.strategy.launcher.procs == []


def test_matching_settings_are_settled_with_the_trainer():
    trainer = L.Trainer(
        strategy=DDPPlusStrategy(gradient_accumulation_steps=4),
        accumulate_grad_batches=4,
        accelerator="cpu",
        devices=2,
        logger=False,
    )
    trainer.strategy._before_launch(trainer, trainer._fit_impl, (None,) * 6)
    assert trainer.strategy.gradient_accumulation_steps == 4 and trainer.accumulate_grad_batches == 4


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4"])
def test_bad_accumulation_steps(value):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        DDPPlusStrategy(gradient_accumulation_steps=value)


def test_bad_short_window():
    with pytest.raises(ValueError, match="short_window='avg'.*allowed: mean, lightning"):
        DDPPlusStrategy(short_window="avg")


def reference(k: int, short_window: str) -> torch.Tensor:
    return reference_parameters(TinyRegression(num_samples=80, batch_size=4, lr=0.05), k, short_window)


CASES = [
    {"manual": manual, "static_graph": static, "strategy_k": k}
    for manual in (False, True)
    for static in (False, True)
    for k in (1, 3, 4)
] + [
    {"manual": False, "static_graph": False, "trainer_k": 4},  # Lightning's own knob, same effect
    {"manual": False, "static_graph": False, "strategy_k": 4, "short_window": "lightning"},
    {"manual": True, "static_graph": True, "strategy_k": 4, "short_window": "lightning"},
]
# An iterable loader: the epoch's length is unknown, Lightning knows the last batch one ahead
ITERABLE_CASES = [
    {"manual": manual, "static_graph": False, "strategy_k": 4, "iterable": True} for manual in (False, True)
]


@pytest.fixture(scope="module")
def accumulation_results(tmp_path_factory):
    return run_case_job(
        "accumulation_job.py", CASES + ITERABLE_CASES, tmp_path_factory.mktemp("accumulation") / "results.json"
    )


def case_id(case):
    return ",".join(f"{key}={value}" for key, value in case.items())


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_one_allreduce_per_optimizer_step_and_exact_result(accumulation_results, index):
    result = accumulation_results[index]
    k = result.get("strategy_k") or result.get("trainer_k")
    expected_steps = -(-10 // k)  # windows of k over 10 micro-batches, the last one short
    assert result["optimizer_steps"] == expected_steps
    # static_graph: torch needs the very first backward synced (R3), one extra all-reduce per run
    extra = 1 if result["static_graph"] and k > 1 else 0
    assert result["hook_calls"] == expected_steps + extra  # counted by a real hook, one bucket per all-reduce
    assert result["synced_backwards"] == expected_steps + extra
    assert result["synced_backwards"] + result["skipped_backwards"] == 10
    params = [torch.tensor(p) for p in result["params"]]
    assert torch.equal(params[0], params[1]), "replicas differ"
    expected = reference(k, result.get("short_window", "mean"))
    assert torch.allclose(params[0], expected, atol=1e-5, rtol=0), (params[0] - expected).abs().max()


@pytest.mark.multiprocess
def test_short_window_modes_really_differ(accumulation_results):
    # The check above could not tell the two modes apart if the short window were never scaled.
    assert not torch.allclose(reference(4, "mean"), reference(4, "lightning"), atol=1e-5)


def test_sync_stats_reach_the_trainer_logger(tmp_path, monkeypatch):
    # One real process group of one rank, so the run stays in this process; the counts are logged under ddp/.
    import csv
    import dataclasses

    import torch.distributed as dist
    from lightning.pytorch.loggers import CSVLogger

    from tests.helpers import TinyRegressionManual, free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = DDPPlusStrategy(gradient_accumulation_steps=3, telemetry=True)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    model = TinyRegressionManual(num_samples=40, batch_size=4)
    try:
        trainer.fit(model)
        first = dataclasses.replace(strategy.sync_stats)
        trainer.fit_loop.max_epochs = 2  # a second fit call trains one more epoch: counters start again at 0
        trainer.fit(model)
    finally:
        dist.destroy_process_group()
    assert first.optimizer_steps == strategy.sync_stats.optimizer_steps == 4
    with open(next(tmp_path.rglob("metrics.csv"))) as file:
        rows = list(csv.DictReader(file))
    last = [row for row in rows if row.get("ddp/optimizer_steps")][-1]
    assert float(last["ddp/optimizer_steps"]) == 4  # windows 3, 3, 3, 1
    assert float(last["ddp/synced_backwards"]) == 4
    assert float(last["ddp/skipped_backwards"]) == 6
    # telemetry of each optimizer step, torch's own timings included, goes to the same loggers
    telemetry_rows = [row for row in rows if row.get("ddp/bytes_sent")]
    assert len(telemetry_rows) == 4 + 4  # one row per step, in each of the two fits
    assert all(float(row["ddp/backward_comm_ms"]) >= 0 for row in telemetry_rows if row.get("ddp/backward_comm_ms"))
    assert any(row.get("ddp/forward_ms") for row in telemetry_rows)
    assert strategy.sync_stats.optimizer_steps == 4


def iterable_reference(k: int) -> torch.Tensor:
    """One process: rank r trains on rows r::2 in order; each step's gradient is the mean over its window."""
    from torch import nn

    model = TinyRegression(num_samples=80, batch_size=4, lr=0.05)
    x, y = regression_data(80).tensors
    shards = [(x[r::2], y[r::2]) for r in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for start in range(0, 10, k):
        window = range(start, min(start + k, 10))
        optimizer.zero_grad()
        sum(
            nn.functional.mse_loss(model(xs[4 * b : 4 * b + 4]), ys[4 * b : 4 * b + 4]) / len(window) / 2
            for xs, ys in shards
            for b in window
        ).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(ITERABLE_CASES)), ids=[case_id(c) for c in ITERABLE_CASES])
def test_epoch_of_unknown_length_closes_its_short_last_window(accumulation_results, index):
    result = accumulation_results[len(CASES) + index]
    assert result["optimizer_steps"] == 3 and result["hook_calls"] == 3  # windows 4, 4, 2; the last closed on time
    assert result["synced_backwards"] == 3 and result["skipped_backwards"] == 7
    params = [torch.tensor(p) for p in result["params"]]
    assert torch.equal(params[0], params[1]), "replicas differ"
    expected = iterable_reference(4)
    assert torch.allclose(params[0], expected, atol=1e-5, rtol=0), (params[0] - expected).abs().max()
