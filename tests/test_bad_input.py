"""Bad configurations, given through Python, a YAML file and the ``ddp-plus`` command line: each fails with a clear
error (the setting, and what to do) before any process is spawned or process group created."""

import pytest
import torch
import torch.distributed as dist
import yaml
from lightning import Trainer
from lightning.pytorch.cli import LightningCLI

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import TinyRegression, console_script, run_job

# (id, strategy arguments, Trainer arguments, pattern the Python error must match)
BAD = [
    ("backend-typo", {"process_group_backend": "ncll"}, {}, r"process_group_backend='ncll'.*did you mean 'nccl'"),
    ("nccl-on-cpu", {"process_group_backend": "nccl"}, {}, r"'nccl' cannot run collectives on 'cpu' devices.*Fix"),
    ("xccl-without-xpu", {"process_group_backend": "xccl"}, {}, r"'xccl' cannot run collectives on 'cpu'"),
    ("mpi-not-built", {"process_group_backend": "mpi"}, {}, r"has no 'mpi' backend.*Fix"),
    ("timeout-zero", {"timeout": 0}, {}, r"`timeout=0`.*greater than zero"),
    ("timeout-negative", {"timeout": -30}, {}, r"`timeout=-30`.*greater than zero"),
    ("timeout-unreadable", {"timeout": "soon"}, {}, r"`timeout='soon'`.*could not be read"),
    ("bucket-zero", {"bucket_cap_mb": 0}, {}, r"`bucket_cap_mb=0`.*greater than zero"),
    ("bucket-negative", {"bucket_cap_mb": -25}, {}, r"bucket_cap_mb=-25"),
    ("bucket-string", {"bucket_cap_mb": "big"}, {}, r"bucket_cap_mb='big'.*positive number"),
    ("flag-string", {"find_unused_parameters": "false"}, {}, r"find_unused_parameters='false'.*True or False"),
    ("flag-int", {"static_graph": 1}, {}, r"static_graph=1.*True or False"),
    ("buffers-unknown", {"broadcast_buffers": "sometimes"}, {}, r"broadcast_buffers='sometimes'"),
    ("hook-typo", {"ddp_comm_hook": "fp61"}, {}, r"ddp_comm_hook='fp61'.*did you mean 'fp16'"),
    ("hook-bad-path", {"ddp_comm_hook": "no_such_module.hook"}, {}, r"could not be loaded"),
    ("accumulation-zero", {"gradient_accumulation_steps": 0}, {}, r"gradient_accumulation_steps=0.*positive integer"),
    (
        "accumulation-mismatch",
        {"gradient_accumulation_steps": 4},
        {"accumulate_grad_batches": 2},
        r"gradient_accumulation_steps=4.*accumulate_grad_batches=2.*set only one",
    ),
    ("short-window", {"short_window": "avg"}, {}, r"short_window='avg'"),
    ("start-method", {"start_method": "thread"}, {}, r"start_method='thread'"),
    ("conflict-mode", {"checkpointing_conflict": "strict"}, {}, r"checkpointing_conflict='strict'"),
    ("guard-negative", {"verify_replicas_every_n_steps": -1}, {}, r"verify_replicas_every_n_steps=-1"),
    ("telemetry-string", {"telemetry": "yes"}, {}, r"telemetry='yes'"),
    ("uneven-typo", {"uneven_inputs": "drop"}, {}, r"uneven_inputs='drop'.*allowed: error, stop, join"),
    ("sync-guard-string", {"sync_guard": "on"}, {}, r"sync_guard='on'.*True or False"),
    ("averaging-zero", {"model_averaging_period": 0}, {}, r"model_averaging_period=0"),
    (
        "unknown-argument",
        {"find_unused_parameter": True},
        {},
        r"unexpected keyword argument `find_unused_parameter`.*did you mean `find_unused_parameters`",
    ),
    ("managed-argument", {"device_ids": [0]}, {}, r"device_ids.*cannot be passed"),
]
IDS = [case[0] for case in BAD]


def skip_where_the_case_cannot_fail(name: str) -> None:
    if name == "mpi-not-built" and torch.distributed.is_mpi_available():
        pytest.skip("this torch build has MPI; the case needs it absent")


def test_the_table_is_big_enough():
    assert len(BAD) >= 20


# Settled when `fit` starts (the launcher is the first point that has the Trainer's settings), before any launch.
AT_FIT = {"accumulation-mismatch"}


@pytest.mark.parametrize(("name", "strategy", "trainer", "pattern"), BAD, ids=IDS)
def test_python(tmp_path, name, strategy, trainer, pattern):
    skip_where_the_case_cannot_fail(name)
    with pytest.raises((ValueError, TypeError), match=pattern):
        # spawn: should a fit-time case wrongly pass, workers of an importable model start, not copies of pytest
        built = Trainer(
            strategy=DDPPlusStrategy(**{"start_method": "spawn", **strategy}),
            accelerator="cpu",
            devices=2,
            default_root_dir=tmp_path,
            logger=False,
            **trainer,
        )
        if name in AT_FIT:
            built.fit(TinyRegression())
    assert not dist.is_initialized()
    if name in AT_FIT:
        assert built.strategy.launcher.procs == []  # nothing was started


def yaml_config(strategy: dict, trainer: dict, root: str) -> str:
    return yaml.safe_dump(
        {
            # devices=1: should a case unexpectedly pass validation, nothing is launched from inside pytest
            "trainer": {
                "accelerator": "cpu",
                "devices": 1,
                "logger": False,
                "enable_checkpointing": False,
                "default_root_dir": root,
                "max_epochs": 1,
                **trainer,
                "strategy": {"class_path": "lightning_ddp_plus.DDPPlusStrategy", "init_args": strategy},
            },
            "model": {"class_path": "tests.helpers.TinyRegression"},
        }
    )


# Arguments a YAML file can express; jsonargparse's own type check may answer first, naming the key. A quoted
# 'false' or 'yes' is read by jsonargparse as the boolean it spells, which is what a YAML author means.
YAML_CASES = [
    case
    for case in BAD
    if case[0] not in ("managed-argument", "unknown-argument", "flag-string", "telemetry-string", "sync-guard-string")
]


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    if dist.is_initialized():  # a case that wrongly passed validation trained; keep the next case independent
        dist.destroy_process_group()


@pytest.mark.parametrize(("name", "strategy", "trainer", "pattern"), YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_yaml_file(tmp_path, monkeypatch, capsys, name, strategy, trainer, pattern):
    skip_where_the_case_cannot_fail(name)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_config(strategy, trainer, str(tmp_path)))
    monkeypatch.setattr("sys.argv", ["ddp-plus"])
    with pytest.raises((ValueError, TypeError, SystemExit)) as raised:
        LightningCLI(args=["fit", "--config", str(config)], save_config_callback=None)
    text = str(raised.value) + capsys.readouterr().err
    key = next(iter(strategy)) if name != "accumulation-mismatch" else "accumulate_grad_batches"
    assert key in text, text[-2000:]
    assert not dist.is_initialized()


CLI_CASES = [
    ("--trainer.strategy.init_args.process_group_backend=ncll", "did you mean 'nccl'"),
    ("--trainer.strategy.init_args.timeout=0", "greater than zero"),
    ("--trainer.strategy.init_args.bucket_cap_mb=-1", "bucket_cap_mb"),
    ("--trainer.strategy.init_args.ddp_comm_hook=fp61", "did you mean 'fp16'"),
    ("--trainer.strategy.init_args.process_group_backend=nccl", "cannot run collectives on 'cpu'"),
    ("--trainer.accumulate_grad_batches=3 --trainer.strategy.init_args.gradient_accumulation_steps=2", "set only one"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("flags", "pattern"), CLI_CASES)
def test_command_line(flags, pattern):
    result = run_job([console_script("ddp-plus"), "fit", "--config", "configs/cpu.yaml", *flags.split()], timeout=120)
    assert result.returncode != 0
    assert pattern in result.stdout, result.stdout[-2000:]
    assert "Initializing distributed" not in result.stdout  # nothing was launched
