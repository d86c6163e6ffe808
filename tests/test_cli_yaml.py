"""Real LightningCLI runs from YAML files on disk: the strategy the YAML names is the one the process group gets.

Each run is one process (devices=1), so the process group is real but nothing is launched; the process group is
destroyed after each run so the next one creates its own.
"""

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.engine.arguments import front_end_arguments
from tests.helpers import ProcessGroupProbe, free_port

BASE = """
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: tests.helpers.ProcessGroupProbe
  strategy: {strategy}
model:
  class_path: tests.helpers.TinyRegression
  init_args: {{num_samples: 16, batch_size: 4}}
"""


@pytest.fixture(autouse=True)
def fresh_process_group(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr("sys.argv", ["ddp-plus"])
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def run_cli(tmp_path: Path, strategy_yaml: str) -> LightningCLI:
    config = tmp_path / "config.yaml"
    config.write_text(BASE.format(strategy=strategy_yaml))
    return LightningCLI(args=["fit", "--config", str(config)], save_config_callback=None)


def probe_of(cli: LightningCLI) -> ProcessGroupProbe:
    return next(c for c in cli.trainer.callbacks if isinstance(c, ProcessGroupProbe))


# YAML text as written in the file -> the timedelta the process group must get.
TIMEOUT_FORMS = [
    ("45", 45),
    ("12.5", 12.5),
    ("90s", 90),
    ("30m", 1800),
    ("2h", 7200),
    ("1h30m", 5400),
    ("1d", 86400),
    ("'0:30:00'", 1800),
    ("1:00:00", 3600),  # unquoted: YAML 1.1 reads base-60, the int 3600
    ("'1 day, 0:00:00'", 86400),
]


@pytest.mark.parametrize(("timeout_yaml", "seconds"), TIMEOUT_FORMS, ids=[form for form, _ in TIMEOUT_FORMS])
def test_timeout_forms_reach_the_process_group(tmp_path, timeout_yaml, seconds):
    strategy = (
        "\n    class_path: lightning_ddp_plus.DDPPlusStrategy"
        f"\n    init_args: {{process_group_backend: gloo, timeout: {timeout_yaml}, find_unused_parameters: false, bucket_cap_mb: 25}}"
    )
    cli = run_cli(tmp_path, strategy)
    assert isinstance(cli.trainer.strategy, DDPPlusStrategy)
    assert cli.trainer.strategy.timeout == timedelta(seconds=seconds)
    probe = probe_of(cli)
    assert probe.backend == "gloo"
    assert probe.timeout_seconds == pytest.approx(seconds)
    assert cli.trainer.global_step == 2


def test_strategy_name_ddp_plus(tmp_path):
    cli = run_cli(tmp_path, "ddp_plus")
    assert type(cli.trainer.strategy) is DDPPlusStrategy
    probe = probe_of(cli)
    assert probe.backend == "gloo"  # auto from the CPU accelerator
    assert probe.timeout_seconds == 1800
    assert cli.trainer.global_step == 2


@pytest.mark.parametrize(("written", "value"), [("auto", "auto"), ("null", None), ("50", 50), ("2.5", 2.5)])
def test_bucket_cap_forms_from_yaml(tmp_path, written, value):
    strategy = f"\n    class_path: lightning_ddp_plus.DDPPlusStrategy\n    init_args: {{bucket_cap_mb: {written}}}"
    cli = run_cli(tmp_path, strategy)
    assert cli.trainer.strategy.settings.bucket_cap_mb == value
    assert cli.trainer.global_step == 2


def test_bad_yaml_value_fails_before_training(tmp_path):
    strategy = "\n    class_path: lightning_ddp_plus.DDPPlusStrategy\n    init_args: {process_group_backend: ncll}"
    with pytest.raises(ValueError, match="did you mean 'nccl'"):
        run_cli(tmp_path, strategy)
    assert not dist.is_initialized()


@pytest.mark.parametrize(("written", "kind"), [("true", "BucketShardedOptimizer"), ("all_reduce", "ShardedOptimizer")])
def test_optimizer_sharding_from_yaml(tmp_path, written, kind):
    strategy = f"\n    class_path: lightning_ddp_plus.DDPPlusStrategy\n    init_args: {{optimizer_sharding: {written}}}"
    cli = run_cli(tmp_path, strategy)
    assert type(cli.trainer.strategy.optimizers[0]).__name__ == kind
    assert cli.trainer.global_step == 2


def test_overlap_from_yaml_on_cpu_fails_before_training(tmp_path):
    strategy = "\n    class_path: lightning_ddp_plus.DDPPlusStrategy\n    init_args: {optimizer_sharding: overlap, sync_guard: false}"
    with pytest.raises(ValueError, match="overlap hook refuses the gloo backend"):
        run_cli(tmp_path, strategy)
    assert not dist.is_initialized()


#: Every argument the Trainer strategy takes, from the one declaration.
STRATEGY_ARGUMENTS = tuple(front_end_arguments("DDPPlusStrategy"))


@pytest.mark.parametrize("config", ["cpu.yaml", "gpu.yaml", "multinode.yaml"])
def test_every_config_prints_every_strategy_argument(config, monkeypatch, capsys):
    import yaml

    from lightning_ddp_plus.frontends.cli import main

    monkeypatch.setattr("sys.argv", ["ddp-plus"])
    with pytest.raises(SystemExit) as exited:  # in this process: what the console script runs, without its start-up
        main(["fit", "--config", str(Path(__file__).parents[1] / "configs" / config), "--print_config"])
    out = capsys.readouterr().out
    assert exited.value.code in (0, None), out[-3000:]
    printed = yaml.safe_load(out[out.index("# lightning.pytorch") if "# lightning.pytorch" in out else 0 :])
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_ddp_plus.DDPPlusStrategy"
    for name in STRATEGY_ARGUMENTS:
        assert name in strategy["init_args"], name


def test_help_shows_types_and_defaults(monkeypatch, capsys):
    from lightning_ddp_plus.frontends.cli import main

    monkeypatch.setattr("sys.argv", ["ddp-plus"])
    with pytest.raises(SystemExit) as exited:  # what the console script runs, in this process
        main(["fit", "--trainer.strategy.help", "lightning_ddp_plus.DDPPlusStrategy"])
    out = capsys.readouterr().out
    assert exited.value.code in (0, None), out[-3000:]
    text = " ".join(out.split())
    for name in STRATEGY_ARGUMENTS:
        assert f"--trainer.strategy.{name}" in text
    assert "type: str | null, default: null" in text  # process_group_backend
    assert "type: Union[float, Literal['auto'], null], default: null" in text  # bucket_cap_mb
    assert "Default on." in text  # the declared docstrings reach the help (sync_guard, atomic_checkpoints)


def test_demo_writes_the_shipped_config_and_never_overwrites(tmp_path):
    from lightning_ddp_plus.demo import DEMO_CONFIG
    from lightning_ddp_plus.frontends.cli import main

    # the repository's configs/cpu.yaml is the shipped file itself, so the two cannot drift
    assert (Path(__file__).parents[1] / "configs" / "cpu.yaml").resolve() == DEMO_CONFIG.resolve()
    target = tmp_path / "cpu.yaml"
    main(["demo", "--write-config", str(target)])
    assert target.read_text() == DEMO_CONFIG.read_text()
    target.write_text("edited")
    with pytest.raises(SystemExit, match="exists; name a new file"):
        main(["demo", "--write-config", str(target)])
    assert target.read_text() == "edited"


def test_the_former_name_micro_batch_size_still_reads_from_yaml(tmp_path):
    strategy = "\n    class_path: lightning_ddp_plus.DDPPlusStrategy\n    init_args: {micro_batch_size: 2}"
    with pytest.warns(DeprecationWarning, match=r"`micro_batch_size` is renamed `chunk_size`"):
        cli = run_cli(tmp_path, strategy)
    assert cli.trainer.strategy.arguments.chunk_size == 2
    assert cli.trainer.global_step == 2
