"""``ddp-plus check``: a conflicting and a clean config, from YAML files on disk, run by the console script's function
in this process (the console script itself is run as a subprocess by ``tests/test_bad_input.py``)."""

import pytest

from tests.helpers import check_in_process

CONFIG = """
trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy:
    class_path: lightning_ddp_plus.DDPPlusStrategy
    init_args: {{find_unused_parameters: {find_unused}}}
model:
  class_path: tests.helpers.CheckpointNet
  init_args: {{checkpointing: {checkpointing}, unused: {unused}}}
"""


def write_config(tmp_path, **values):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(**values))
    return config


def test_conflicting_config_exits_1_with_the_rule_and_fix(tmp_path, monkeypatch, capsys):
    from lightning_ddp_plus.frontends.cli import main

    config = write_config(tmp_path, find_unused="true", checkpointing="reentrant", unused="false")
    monkeypatch.setattr("sys.argv", ["ddp-plus"])
    with pytest.raises(SystemExit) as exited:  # what the console script runs, in this process
        main(["check", "--config", str(config)])
    out = capsys.readouterr().out
    assert exited.value.code == 1, out[-2000:]
    assert "ERROR [R1]" in out and "Fix: set static_graph=True" in out
    assert "one probe forward of training_step" in out


def test_unused_parameters_are_named(tmp_path, capsys):
    code, out = check_in_process(
        write_config(tmp_path, find_unused="false", checkpointing="none", unused="true"), capsys
    )
    assert code == 1
    assert "ERROR [R4]" in out and "spare.weight, spare.bias" in out


def test_clean_config_exits_0(tmp_path, capsys):
    config = write_config(tmp_path, find_unused="false", checkpointing="non_reentrant", unused="false")
    code, out = check_in_process(config, capsys)
    assert code == 0, out[-2000:]
    assert "result: no findings" in out


def test_advice_alone_exits_0(tmp_path, capsys):
    code, out = check_in_process(
        write_config(tmp_path, find_unused="true", checkpointing="none", unused="false"), capsys
    )
    assert code == 0
    assert "ADVICE [A1]" in out


def test_shipped_cpu_config_is_clean(capsys):
    from lightning_ddp_plus.demo import DEMO_CONFIG

    code, out = check_in_process(DEMO_CONFIG, capsys)
    assert code == 0, out[-2000:]
    assert "result: no findings" in out


def test_invalid_config_exits_1(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_ddp_plus.DDPPlusStrategy\n    init_args: {process_group_backend: ncll}\nmodel:\n  class_path: tests.helpers.CheckpointNet\n"
    )
    code, out = check_in_process(config, capsys)
    assert code == 1
    assert "did you mean 'nccl'" in out


def test_the_memory_plan_of_the_shipped_config_fits_80gib_at_8_ranks(capsys):
    from lightning_ddp_plus.demo import DEMO_CONFIG

    code, out = check_in_process(DEMO_CONFIG, capsys, "--device-memory", "80GiB", "--world-size", "8")
    assert code == 0, out[-2000:]
    assert "memory plan for SpiralClassifier and Adam against the --device-memory figure" in out
    assert "world size 8, device 80.00 GiB (72.00 GiB usable" in out
    assert "DDP (configured)" in out and "verdict: fits with plain DDP" in out


def test_a_plan_that_does_not_fit_exits_1_and_names_the_next_step(capsys):
    from lightning_ddp_plus.demo import DEMO_CONFIG

    code, out = check_in_process(DEMO_CONFIG, capsys, "--device-memory=64KiB")
    assert code == 1
    assert "verdict: the model itself does not fit" in out and "FSDPStrategy" in out
    assert "ERROR the configured layout does not fit the device memory" in out


def test_a_bad_device_memory_fails_before_anything_is_built(capsys):
    code, out = check_in_process("no-such-file.yaml", capsys, "--device-memory", "lots")
    assert code == 1 and "`--device-memory='lots'` is not valid" in out
    code, out = check_in_process("no-such-file.yaml", capsys, "--world-size", "0")
    assert code == 1 and "`--world-size='0'` is not valid" in out
    code, out = check_in_process("no-such-file.yaml", capsys, "--device-type", "cuda:0")
    assert code == 1 and "`--device-type='cuda:0'` is not valid" in out and "Fix: e.g. `--device-type cuda`" in out
    code, out = check_in_process("no-such-file.yaml", capsys, "--device-type=gpu")
    assert code == 1 and "`--device-type='gpu'` is not valid" in out and "'gpu' is 'cuda' on NVIDIA GPUs" in out


def test_without_a_size_the_plan_asks_for_one_on_cpu(capsys):
    from lightning_ddp_plus.demo import DEMO_CONFIG

    code, out = check_in_process(DEMO_CONFIG, capsys)
    assert code == 0
    assert "verdict: no device memory known (pass `--device-memory 80GiB`" in out


def test_the_accelerators_memory_is_read_through_its_torch_module(monkeypatch):
    # CUDA faked (this machine has none): the plan reads torch.cuda's properties of the run's device
    import torch

    from lightning_ddp_plus.memory.plan import device_memory_of

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    assert device_memory_of(torch.device("cuda", 3)) == 80 * 2**30
    assert device_memory_of(torch.device("cpu")) is None


def test_help_names_the_plan_options_before_lightningclis(capsys):
    from lightning_ddp_plus.diagnostics.check_command import run_check

    capsys.readouterr()
    assert run_check(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.index("--device-memory SIZE") < out.index("--world-size N") < out.index("--trainer.accelerator")


def test_a_config_jsonargparse_refuses_exits_1_as_documented(tmp_path, capsys):
    config = tmp_path / "unknown.yaml"
    config.write_text("trainer:\n  no_such_trainer_argument: 3\nmodel:\n  class_path: tests.helpers.CheckpointNet\n")
    code, out = check_in_process(config, capsys)
    assert code == 1
    assert "no_such_trainer_argument" in out and "ERROR the configuration is invalid" in out


def test_the_plan_columns_line_up_and_lightningcli_does_not_warn_about_its_arguments(tmp_path, capsys, recwarn):
    config = tmp_path / "sharded.yaml"  # the configured layout has the longest title: "DDP + ZeRO-1 (...) (configured)"
    config.write_text(
        CONFIG.replace(
            "{{find_unused_parameters: {find_unused}}}", "{optimizer_sharding: true, gradient_as_bucket_view: true}"
        ).replace("{{checkpointing: {checkpointing}, unused: {unused}}}", "{checkpointing: none}")
    )
    code, out = check_in_process(config, capsys, "--device-memory", "80GiB", "--world-size", "8")
    assert "(configured)" in out
    assert code == 0
    table = out[out.index("memory plan per rank") :].splitlines()[1:]
    rows = [line for line in table if line.rstrip().endswith(("fits", "yes", "no", "?"))]
    assert len(rows) >= 4
    ends = {line.rstrip().rsplit(" ", 1)[0].rstrip().__len__() for line in rows}
    assert len(ends) == 1, rows  # the total column ends at the same place on every row, "(configured)" included
    assert not [w for w in recwarn if "both args and command line arguments" in str(w.message)]


def test_a_micro_batch_suggestion_is_left_for_auto_and_removed_when_the_whole_batch_fits(tmp_path, capsys):
    """Batches of 2048 rows against 2 MiB: parameters, gradients and Adam's state fit and a whole batch's activations
    do not, so the plan suggests a micro-batch and leaves it in the run's folder for ``chunk_size="auto"``; a
    later plan whose whole batch fits removes it."""
    import json

    from lightning_ddp_plus.demo import DEMO_CONFIG
    from lightning_ddp_plus.memory.suggestion import SUGGESTION_FILE

    run = ["--trainer.default_root_dir", str(tmp_path), "--data.init_args.batch_size", "2048"]
    code, out = check_in_process(DEMO_CONFIG, capsys, "--device-memory", "2MiB", *run)
    assert code == 1 and "verdict: fits with chunk_size=" in out, out[-2000:]  # the configured run does not fit
    suggestion = json.loads((tmp_path / SUGGESTION_FILE).read_text())
    assert f"verdict: fits with chunk_size={suggestion['chunk_size']}:" in out
    assert suggestion["world_size"] == 2 and suggestion["device_memory"] == 2 * 2**20
    assert f"wrote {tmp_path / SUGGESTION_FILE}: a run of this model on 2 rank(s) with chunk_size='auto'" in out
    code, out = check_in_process(DEMO_CONFIG, capsys, "--device-memory", "64MiB", *run)
    assert code == 0 and f"removed {tmp_path / SUGGESTION_FILE}" in out
    assert not (tmp_path / SUGGESTION_FILE).exists()


def plan_table(out: str) -> str:
    return out[out.index("memory plan per rank") : out.index("verdict:")]


def test_the_plan_is_for_the_jobs_device_from_lightnings_accelerator_or_the_device_type_option(
    tmp_path, capsys, monkeypatch
):
    """A CUDA job's plan (CUDA faked through Lightning's accelerator: this machine has none) reproduces CUDA's
    optimizer implementation and allocator rounding; ``--device-type cuda`` plans the same from a CPU config, as on
    a login node; the CPU's plan differs."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import torch

    config = write_config(tmp_path, find_unused="false", checkpointing="none", unused="false")
    code, cpu = check_in_process(config, capsys, "--device-memory", "80GiB")
    assert code == 0 and "measured here as" not in cpu
    code, option = check_in_process(config, capsys, "--device-memory", "80GiB", "--device-type", "cuda")
    assert code == 0
    assert (
        "note: measured here as a cuda step: torch's foreach optimizer implementation, each allocation rounded"
        in option
    )

    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    on_cuda = tmp_path / "cuda.yaml"
    on_cuda.write_text(config.read_text().replace("accelerator: cpu", "accelerator: cuda"))
    code, faked = check_in_process(on_cuda, capsys)
    assert code == 0, faked[-2000:]
    assert "against the cuda device's memory" in faked
    assert plan_table(faked) == plan_table(option) != plan_table(cpu)
