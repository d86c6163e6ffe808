"""Bad configurations, given through Python, a YAML file and the ``ddp-plus`` command line: each fails with a clear
error before any process is spawned or process group created, and the error meets four marks, shown first: it names
the argument, the value, what is allowed, and the fix."""

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import yaml
from lightning import Trainer

from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy
from lightning_ddp_plus.engine.arguments import trainer_only_arguments
from lightning_ddp_plus.frontends.cli import main
from tests.helpers import TinyRegression, console_script, run_job


@dataclass(frozen=True)
class Bad:
    """One kind of bad input: the strategy's arguments, the Trainer's, what the error must match, and whether a YAML
    author can write it (YAML reads ``yes``/``on``/``"false"`` as booleans, as every LightningCLI config does)."""

    id: str
    strategy: dict
    pattern: str
    trainer: dict = field(default_factory=dict)
    in_yaml: bool = True

    @property
    def argument(self) -> str:
        return next(iter(self.strategy)) if self.id != "accumulation-mismatch" else "gradient_accumulation_steps"


BAD = [
    Bad("backend-typo", {"process_group_backend": "ncll"}, r"process_group_backend='ncll'.*did you mean 'nccl'"),
    Bad("backend-type", {"process_group_backend": 5}, r"process_group_backend=5.*pass the name as a string"),
    Bad("nccl-on-cpu", {"process_group_backend": "nccl"}, r"'nccl' cannot run collectives on 'cpu' devices.*Fix"),
    Bad("xccl-without-xpu", {"process_group_backend": "xccl"}, r"'xccl' cannot run collectives on 'cpu'"),
    Bad("mpi-not-built", {"process_group_backend": "mpi"}, r"has no 'mpi' backend.*Fix"),
    Bad("timeout-zero", {"timeout": 0}, r"`timeout=0`.*greater than zero"),
    Bad("timeout-negative", {"timeout": -30}, r"`timeout=-30`.*greater than zero"),
    Bad("timeout-unreadable", {"timeout": "soon"}, r"`timeout='soon'`.*could not be read"),
    Bad("timeout-negative-string", {"timeout": "-1h"}, r"`timeout='-1h'`.*could not be read"),
    Bad("timeout-bool", {"timeout": True}, r"`timeout=True`.*a boolean is not a duration", in_yaml=False),
    Bad("bucket-zero", {"bucket_cap_mb": 0}, r"`bucket_cap_mb=0`.*greater than zero"),
    Bad("bucket-negative", {"bucket_cap_mb": -25}, r"bucket_cap_mb=-25"),
    Bad("bucket-string", {"bucket_cap_mb": "big"}, r"bucket_cap_mb='big'.*positive number"),
    Bad("bucket-auto-case", {"bucket_cap_mb": "Auto"}, r"bucket_cap_mb='Auto'.*did you mean 'auto'"),
    Bad(
        "bucket-auto-powersgd",
        {"bucket_cap_mb": "auto", "ddp_comm_hook": "powersgd"},
        r"bucket_cap_mb='auto'.*error feedback per bucket.*not 'auto'",
    ),
    Bad(
        "flag-string",
        {"find_unused_parameters": "false"},
        r"find_unused_parameters='false'.*True or False",
        in_yaml=False,
    ),
    Bad("flag-int", {"static_graph": 1}, r"static_graph=1.*True or False"),
    Bad("flag-yes", {"gradient_as_bucket_view": "yes"}, r"gradient_as_bucket_view='yes'.*True or False", in_yaml=False),
    Bad("buffers-unknown", {"broadcast_buffers": "sometimes"}, r"broadcast_buffers='sometimes'"),
    Bad("buffers-none", {"broadcast_buffers": None}, r"broadcast_buffers=None.*True or False"),
    Bad("hook-typo", {"ddp_comm_hook": "fp61"}, r"ddp_comm_hook='fp61'.*did you mean 'fp16'"),
    Bad("hook-bad-path", {"ddp_comm_hook": "no_such_module.hook"}, r"could not be loaded"),
    Bad("hook-type", {"ddp_comm_hook": 5}, r"ddp_comm_hook=5.*expected a hook name", in_yaml=False),
    Bad("wrapper-without-hook", {"ddp_comm_wrapper": print}, r"ddp_comm_wrapper=.*needs a hook to wrap", in_yaml=False),
    Bad("averaging-zero", {"model_averaging_period": 0}, r"model_averaging_period=0"),
    Bad("accumulation-zero", {"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0.*positive integer"),
    Bad("accumulation-string", {"gradient_accumulation_steps": "four"}, r"gradient_accumulation_steps='four'"),
    Bad(
        "accumulation-mismatch",
        {"gradient_accumulation_steps": 4},
        r"gradient_accumulation_steps=4.*accumulate_grad_batches=2.*set only one",
        trainer={"accumulate_grad_batches": 2},
    ),
    Bad("short-window", {"short_window": "avg"}, r"short_window='avg'.*allowed: mean, lightning"),
    Bad("items-across", {"average_items_across_ranks": 0}, r"average_items_across_ranks=0.*True or False"),
    Bad("start-method", {"start_method": "thread"}, r"start_method='thread'"),
    Bad("conflict-mode", {"checkpointing_conflict": "strict"}, r"checkpointing_conflict='strict'"),
    Bad("replicas-negative", {"verify_replicas_every_n_steps": -1}, r"verify_replicas_every_n_steps=-1"),
    Bad("replicas-zero", {"verify_replicas_every_n_steps": 0}, r"verify_replicas_every_n_steps=0"),
    Bad("telemetry-string", {"telemetry": "yes"}, r"telemetry='yes'", in_yaml=False),
    Bad("telemetry-int", {"telemetry": 2}, r"telemetry=2.*True or False"),
    Bad("resume-literal", {"resume_from_last": "last"}, r"resume_from_last='last'.*allowed: on_restart, always, never"),
    Bad("sync-guard-string", {"sync_guard": "on"}, r"sync_guard='on'.*True or False", in_yaml=False),
    Bad("preemption-string", {"preemption_signals": "SIGTERM"}, r"preemption_signals='SIGTERM'.*list", in_yaml=False),
    Bad("preemption-kill", {"preemption_signals": ["SIGKILL"]}, r"preemption_signals=\['SIGKILL'\].*cannot be caught"),
    Bad("preemption-typo", {"preemption_signals": ["SIGTREM"]}, r"preemption_signals=\['SIGTREM'\].*did you mean"),
    Bad("uneven-typo", {"uneven_inputs": "drop"}, r"uneven_inputs='drop'.*allowed: error, stop, join"),
    Bad("uneven-literal", {"uneven_inputs": "skip"}, r"uneven_inputs='skip'.*did you mean 'stop'"),
    Bad("atomic-string", {"atomic_checkpoints": "no"}, r"atomic_checkpoints='no'.*True or False", in_yaml=False),
    Bad("rank-death-number", {"save_on_rank_death": 2}, r"save_on_rank_death=2.*True or False"),
    Bad("sharding-literal", {"optimizer_sharding": "maybe"}, r"optimizer_sharding='maybe'.*allowed: False, True"),
    Bad(
        "overlap-with-hook",
        {"optimizer_sharding": "overlap", "ddp_comm_hook": "fp16"},
        r"optimizer_sharding='overlap'.*`ddp_comm_hook` is set",
    ),
    Bad(
        "unknown-argument",
        {"find_unused_parameter": True},
        r"unexpected keyword argument `find_unused_parameter`.*did you mean `find_unused_parameters`",
    ),
    Bad("typo-uneven", {"uneven_input": "stop"}, r"`uneven_input`.*did you mean `uneven_inputs`"),
    Bad("typo-sharding", {"optimiser_sharding": True}, r"`optimiser_sharding`.*did you mean `optimizer_sharding`"),
    Bad("typo-guard", {"sync_gaurd": True}, r"`sync_gaurd`.*did you mean `sync_guard`"),
    Bad("managed-argument", {"device_ids": [0]}, r"device_ids.*cannot be passed"),
    Bad("stall-not-below-timeout", {"stall_report_after": "1h"}, r"stall_report_after='1h'.*shorter than `timeout`"),
    Bad("stall-negative", {"stall_report_after": -3}, r"stall_report_after=-3.*greater than zero"),
    Bad("ledger-zero", {"ledger_length": 0}, r"ledger_length=0.*needs the ranks' ledgers.*stall_report_after=None"),
    Bad("ledger-negative", {"ledger_length": -1}, r"ledger_length=-1.*expected an integer of 0 or more"),
    Bad("setup-timeout-zero", {"setup_timeout": 0}, r"`setup_timeout=0`.*greater than zero"),
    Bad(
        "setup-timeout-backend",
        {"setup_timeout": "2h", "process_group_backend": "mpi"},
        r"setup_timeout='2h'.*cannot change the timeout of an 'mpi' group.*raise `timeout` itself",
    ),
    Bad("micro-batch-zero", {"chunk_size": 0}, r"chunk_size=0.*must be at least 1 row"),
    Bad("micro-batch-negative", {"chunk_size": -8}, r"chunk_size=-8.*must be at least 1 row"),
    Bad("micro-batch-string", {"chunk_size": "half"}, r"chunk_size='half'.*expected an integer, 'auto'"),
    Bad(
        "micro-batch-auto-without-guard",
        {"chunk_size": "auto", "sync_guard": False},
        r"chunk_size='auto'.*cannot run.*sync_guard=False",
    ),
    Bad(
        "micro-batch-auto-static-graph",
        {"chunk_size": "auto", "static_graph": True},
        r"chunk_size='auto'.*cannot run.*static graph",
    ),
    Bad(
        "micro-batch-auto-accumulation",
        {"chunk_size": "auto", "gradient_accumulation_steps": 2},
        r"chunk_size='auto'.*cannot run.*gradient_accumulation_steps=2.*Fix: use a fixed",
    ),
    Bad(
        "micro-batch-auto-trainer-accumulation",
        {"chunk_size": "auto"},
        r"chunk_size='auto'.*cannot run with `accumulate_grad_batches=2`.*Fix",
        trainer={"accumulate_grad_batches": 2},
    ),
    Bad(
        "micro-batch-overlap",
        {"chunk_size": 8, "optimizer_sharding": "overlap"},
        r"chunk_size=8.*optimizer_sharding='overlap'.*Fix: use `optimizer_sharding=True`",
    ),
    Bad(
        "world-size-change-literal",
        {"on_world_size_change": "shrink"},
        r"on_world_size_change='shrink'.*allowed: keep_global_batch, keep_per_rank_batch, error",
    ),
    Bad("stragglers-zero", {"find_stragglers_every_n_steps": 0}, r"find_stragglers_every_n_steps=0.*positive integer"),
]
IDS = [case.id for case in BAD]

#: Fabric's own refusals: what only the Trainer strategy takes.
FABRIC_BAD = [
    Bad("fabric-resume", {"resume_from_last": "always"}, r"resume_from_last='always'.*does not take it.*fabric.load"),
    Bad("fabric-averaging", {"model_averaging_period": 4}, r"model_averaging_period=4.*does not take it.*Fix"),
    Bad("fabric-world-size", {"on_world_size_change": "error"}, r"on_world_size_change='error'.*does not take it.*Fix"),
    Bad("fabric-rank-death", {"save_on_rank_death": False}, r"save_on_rank_death=False.*does not take it.*Fix"),
]

#: Words that say what is allowed, in the package's messages.
ALLOWED_WORDS = ("allowed", "expected", "must", "neither", "does not take", "cannot", "needs", "has no", "disagree")


def shown_forms(value) -> list[str]:
    """How a value may appear in a message: its repr, and as YAML/jsonargparse hands a number over (-5 as -5.0)."""
    forms = [repr(value), str(value)]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        forms.append(repr(float(value)))
    return forms


def assert_four_marks(message: str, case: Bad) -> None:
    first = message.strip().splitlines()[0]
    assert f"`{case.argument}" in first, first  # the argument
    value = case.strategy[case.argument]
    assert any(form in first for form in shown_forms(value)) or callable(value), first  # the value
    assert any(word in first for word in ALLOWED_WORDS), first  # what is allowed
    assert "Fix:" in first, first  # the fix


def skip_where_the_case_cannot_fail(name: str) -> None:
    if name == "mpi-not-built" and torch.distributed.is_mpi_available():
        pytest.skip("this torch build has MPI; the case needs it absent")


def test_the_table_covers_every_declared_argument():
    from lightning_ddp_plus.engine.arguments import ARGUMENT_FIELDS

    tried = {name for case in BAD + FABRIC_BAD for name in case.strategy}
    assert set(ARGUMENT_FIELDS) - tried == {"ddp_comm_state"}  # any object is a valid state
    assert len(BAD) + len(FABRIC_BAD) >= 64


# Settled when `fit` starts (the launcher is the first point that has the Trainer's settings), before any launch.
AT_FIT = {"accumulation-mismatch", "micro-batch-auto-trainer-accumulation"}


@pytest.mark.parametrize("case", BAD, ids=IDS)
def test_python(tmp_path, case):
    skip_where_the_case_cannot_fail(case.id)
    with pytest.raises((ValueError, TypeError), match=case.pattern) as raised:
        # spawn: should a fit-time case wrongly pass, workers of an importable model start, not copies of pytest
        built = Trainer(
            strategy=DDPPlusStrategy(**{"start_method": "spawn", **case.strategy}),
            accelerator="cpu",
            devices=2,
            default_root_dir=tmp_path,
            logger=False,
            **case.trainer,
        )
        if case.id in AT_FIT:
            built.fit(TinyRegression())
    assert_four_marks(str(raised.value), case)
    assert not dist.is_initialized()
    if case.id in AT_FIT:
        assert built.strategy.launcher.procs == []  # nothing was started


#: Judged when the device is known (Fabric's connector), or the Trainer's only: not at Fabric's construction.
NOT_AT_FABRIC_CONSTRUCTION = {
    "nccl-on-cpu",
    "xccl-without-xpu",
    "mpi-not-built",
    "accumulation-mismatch",
    "micro-batch-auto-trainer-accumulation",
}


@pytest.mark.parametrize(
    "case",
    [c for c in BAD if c.id not in NOT_AT_FABRIC_CONSTRUCTION and c.argument not in trainer_only_arguments()],
    ids=lambda c: c.id,
)
def test_fabric_gives_the_same_messages(case):
    with pytest.raises((ValueError, TypeError), match=case.pattern.replace("DDPPlusStrategy", "DDPPlusFabricStrategy")):
        DDPPlusFabricStrategy(**case.strategy)


@pytest.mark.parametrize("case", FABRIC_BAD, ids=lambda c: c.id)
def test_fabric_refuses_the_trainer_only_arguments(case):
    with pytest.raises(TypeError, match=case.pattern) as raised:
        DDPPlusFabricStrategy(**case.strategy)
    assert_four_marks(str(raised.value), case)


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


YAML_CASES = [case for case in BAD if case.in_yaml]


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    if dist.is_initialized():  # a case that wrongly passed validation trained; keep the next case independent
        dist.destroy_process_group()


def refused_by_ddp_plus(argv: list[str], capsys) -> str:
    """Run ``ddp-plus`` in this process; it must end with exit status 2 and the project's message alone."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    error = capsys.readouterr().err
    assert exited.value.code == 2, error[-2000:]
    assert "Traceback" not in error and "usage:" not in error, error[-2000:]
    lines = [line for line in error.splitlines() if line.strip()]
    first = next(index for index, line in enumerate(lines) if line.startswith("ddp-plus: error: "))
    assert all("Error" not in line for line in lines[:first]), lines[:first]  # nothing of another error before it
    assert not dist.is_initialized()
    return lines[first].removeprefix("ddp-plus: error: ")


@pytest.mark.parametrize("case", YAML_CASES, ids=[c.id for c in YAML_CASES])
def test_yaml_file(tmp_path, monkeypatch, capsys, case):
    skip_where_the_case_cannot_fail(case.id)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_config(case.strategy, case.trainer, str(tmp_path)))
    monkeypatch.setattr("sys.argv", ["ddp-plus"])
    message = refused_by_ddp_plus(["fit", "--config", str(config)], capsys)
    assert_four_marks(message, case)


# One case per way a flag can be refused: jsonargparse's literal and key checks, a value the strategy's check
# refuses while the classes are built, the device, a type, and the settings settled when fit starts.
CLI_CASES = [
    ("uneven-literal", "--trainer.strategy.init_args.uneven_inputs=skip"),
    ("typo-sharding", "--trainer.strategy.init_args.optimiser_sharding=true"),
    ("timeout-zero", "--trainer.strategy.init_args.timeout=0"),
    ("nccl-on-cpu", "--trainer.strategy.init_args.process_group_backend=nccl"),
    ("telemetry-int", "--trainer.strategy.init_args.telemetry=2"),
    (
        "accumulation-mismatch",
        "--trainer.accumulate_grad_batches=2 --trainer.strategy.init_args.gradient_accumulation_steps=4",
    ),
]


@pytest.mark.parametrize(("name", "flags"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_command_line_flags(tmp_path, monkeypatch, capsys, name, flags):
    case = next(c for c in BAD if c.id == name)
    config = tmp_path / "good.yaml"
    config.write_text(yaml_config({"start_method": "spawn"}, {"devices": 2}, str(tmp_path)))
    monkeypatch.setattr("sys.argv", ["ddp-plus"])
    message = refused_by_ddp_plus(["fit", "--config", str(config), *flags.split()], capsys)
    assert_four_marks(message, case)


@pytest.mark.multiprocess
def test_the_console_script_ends_before_any_rank_starts():
    flag = "--trainer.strategy.init_args.uneven_inputs=skip"
    result = run_job([console_script("ddp-plus"), "fit", "--config", "configs/cpu.yaml", flag], timeout=120)
    assert result.returncode == 2
    assert result.stdout.lstrip().splitlines()[0].startswith("ddp-plus: error: `uneven_inputs='skip'` is not valid")
    assert "Traceback" not in result.stdout and "Initializing distributed" not in result.stdout
