"""``ddp-plus report``: the telemetry of a real 2-rank run, logged by CSVLogger, drawn into a PNG."""

import csv
import re

import pytest

from lightning_ddp_plus.diagnostics.report import ReportError, find_metrics, read_telemetry
from lightning_ddp_plus.diagnostics.report import main as run_report
from tests.helpers import console_script, run_job


@pytest.mark.multiprocess
def test_report_of_a_real_run(tmp_path, capsys):
    from lightning_ddp_plus.demo.spirals import SpiralClassifier

    logs = tmp_path / "logs"
    flags = [
        f"--trainer.logger.init_args.save_dir={logs}",
        "--trainer.max_epochs=1",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_checkpointing=false",
        "--trainer.strategy.init_args.telemetry=true",
        "--trainer.strategy.init_args.gradient_accumulation_steps=2",
        "--trainer.strategy.init_args.find_stragglers_every_n_steps=1",
        "--data.init_args.num_train=512",
        "--data.init_args.num_val=64",
    ]
    fit = run_job([console_script("ddp-plus"), "fit", "--config", "configs/cpu.yaml", *flags], timeout=180)
    assert fit.returncode == 0, fit.stdout[-3000:]
    assert run_report([str(logs)]) == 0  # in this process: the drawing needs no rank
    output = capsys.readouterr().out

    metrics = next(logs.rglob("metrics.csv"))
    png = metrics.parent / "ddp_report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(metrics) as file:
        rows = [row for row in csv.DictReader(file) if row.get("ddp/bytes_sent")]
    # 512 samples / 2 ranks / batch 64 = 4 batches per rank, k=2: 2 optimizer steps, each one all-reduce of every
    # parameter's fp32 gradient, one synced and one skipped backward
    assert len(rows) == 2
    parameter_bytes = 4 * sum(p.numel() for p in SpiralClassifier(num_classes=3, hidden=128, depth=3).parameters())
    assert {float(row["ddp/bytes_sent"]) for row in rows} == {parameter_bytes}
    summary = dict(re.findall(r"(\w+)=([\d.e+-]+|nan)", output))
    assert float(summary["steps"]) == 2
    assert float(summary["synced_backwards"]) == 2 and float(summary["skipped_backwards"]) == 2
    printed = float(summary["median_MB_per_step"])  # 3 significant digits
    assert printed == pytest.approx(parameter_bytes / 2**20, rel=5e-3)
    # every rank's phase times side by side: logged at each comparison (every step here), printed as bars
    with open(metrics) as file:
        phase_rows = [row for row in csv.DictReader(file) if row.get("ddp/rank1/data_fetch_ms")]
    assert len(phase_rows) == 2
    assert all(float(row["ddp/rank0/compute_ms"]) > 0 and float(row["ddp/rank1/compute_ms"]) > 0 for row in phase_rows)
    assert "phase times per rank (median ms per optimizer step over 2 comparison(s)):" in output
    for phase in ("data fetch", "compute", "collective wait", "optimizer step"):
        assert re.search(rf"  {phase} +rank 0 #* +[\d.]+\n +rank 1 #* +[\d.]+", output), output


def test_report_says_what_is_missing(tmp_path):
    with pytest.raises(ReportError, match="No metrics.csv under .*CSVLogger"):
        find_metrics(tmp_path)
    metrics = tmp_path / "version_0" / "metrics.csv"
    metrics.parent.mkdir()
    metrics.write_text("epoch,step,train_loss\n0,0,1.5\n")
    assert find_metrics(tmp_path) == metrics
    with pytest.raises(ReportError, match=r"no ddp/ telemetry rows: train with DDPPlusStrategy\(telemetry=True\)"):
        read_telemetry(metrics)


def test_report_command_fails_cleanly_without_logs(tmp_path, capsys):
    from lightning_ddp_plus.frontends.cli import main

    with pytest.raises(SystemExit) as exited:  # what the console script runs, in this process
        main(["report", str(tmp_path)])
    assert exited.value.code == 1
    assert "ERROR No metrics.csv" in capsys.readouterr().err
