"""Coming from the Hugging Face Trainer: ``TrainingArguments`` ported to ``DDPPlusStrategy``, with and without
``transformers`` installed, from Python and from YAML."""

import ast
from datetime import timedelta
from types import SimpleNamespace

import pytest
from lightning.pytorch.cli import LightningCLI
from torch import nn

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.frontends.hf import HF_DEFAULTS, HFStyleDDPPlusStrategy, port_training_arguments
from tests.helpers import _LAUNCH_VARIABLES, REPO_ROOT


class HFLike(nn.Linear):
    """Has what the Hugging Face Trainer looks at on a PreTrainedModel."""

    def __init__(self, checkpointing: bool) -> None:
        super().__init__(2, 2)
        self.is_activation_checkpointing = checkpointing


@pytest.mark.parametrize(
    ("args", "model", "expected"),
    [
        # every None default, resolved as the HF Trainer resolves it
        (
            {},
            None,
            {
                "find_unused_parameters": True,
                "timeout": 1800,
                "gradient_accumulation_steps": 1,
                "process_group_backend": None,
            },
        ),
        ({"gradient_checkpointing": True}, None, {"find_unused_parameters": False}),
        ({"activation_checkpointing": True}, None, {"find_unused_parameters": False}),
        ({}, HFLike(checkpointing=True), {"find_unused_parameters": False}),  # the model's own checkpointing counts
        ({"gradient_checkpointing": True}, nn.Linear(2, 2), {"find_unused_parameters": True}),  # not an HF model: True
        ({"ddp_find_unused_parameters": True, "gradient_checkpointing": True}, None, {"find_unused_parameters": True}),
        # explicit values pass through
        (
            {"ddp_backend": "gloo", "ddp_timeout": 600, "gradient_accumulation_steps": 4},
            None,
            {"process_group_backend": "gloo", "timeout": 600, "gradient_accumulation_steps": 4},
        ),
        (
            {"ddp_bucket_cap_mb": 50, "ddp_broadcast_buffers": False, "ddp_static_graph": True},
            None,
            {"bucket_cap_mb": 50, "broadcast_buffers": False, "static_graph": True},
        ),
        # the Trainer's token averaging: over every device's tokens by default, or each device's own
        ({}, None, {"average_items_across_ranks": True}),
        ({"average_tokens_across_devices": False}, None, {"average_items_across_ranks": False}),
    ],
)
def test_every_name_and_default(args, model, expected):
    port = port_training_arguments(args, model)
    for name, value in expected.items():
        assert port.strategy_kwargs[name] == value, name
    # None leaves torch's defaults alone
    for hf_name, name in (
        ("ddp_bucket_cap_mb", "bucket_cap_mb"),
        ("ddp_broadcast_buffers", "broadcast_buffers"),
        ("ddp_static_graph", "static_graph"),
    ):
        if args.get(hf_name) is None:
            assert name not in port.strategy_kwargs
    assert port.trainer_kwargs == {"accumulate_grad_batches": args.get("gradient_accumulation_steps", 1)}


def test_an_object_with_the_attributes_and_the_classmethod():
    args = SimpleNamespace(
        gradient_accumulation_steps=2, ddp_timeout=120, ddp_bucket_cap_mb=10, gradient_checkpointing=True
    )
    strategy, trainer_kwargs = DDPPlusStrategy.from_training_arguments(args, static_graph=True)
    assert strategy.timeout == timedelta(seconds=120) and strategy.gradient_accumulation_steps == 2
    assert strategy.settings.bucket_cap_mb == 10 and strategy.settings.find_unused_parameters is False
    assert strategy.settings.static_graph is True  # an override of a DDPPlusStrategy argument
    assert trainer_kwargs == {"accumulate_grad_batches": 2}


def test_mistakes_are_named():
    with pytest.raises(ValueError, match=r"ddp_find_unused_parameter.*did you mean `ddp_find_unused_parameters`"):
        port_training_arguments({"ddp_find_unused_parameter": True})
    with pytest.raises(TypeError, match="TrainingArguments"):
        port_training_arguments("output")
    with pytest.raises(ValueError, match="process_group_backend='mccl'.*allowed: nccl, gloo"):
        DDPPlusStrategy.from_training_arguments({"ddp_backend": "mccl"})


def test_real_training_arguments(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    if not transformers.utils.is_torch_available():
        pytest.skip("this transformers release does not support the installed torch")
    for name in _LAUNCH_VARIABLES:  # left by earlier in-process runs; TrainingArguments would start a process group
        monkeypatch.delenv(name, raising=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        gradient_accumulation_steps=4,
        ddp_timeout=600,
        ddp_bucket_cap_mb=10,
        ddp_broadcast_buffers=False,
        gradient_checkpointing=True,
        report_to=[],
    )
    strategy, trainer_kwargs = DDPPlusStrategy.from_training_arguments(args)
    assert strategy.settings.find_unused_parameters is False  # follows gradient checkpointing
    assert strategy.timeout == timedelta(seconds=600) and strategy.settings.bucket_cap_mb == 10
    assert strategy.settings.broadcast_buffers is False and trainer_kwargs == {"accumulate_grad_batches": 4}
    from tests.zoo import build

    model = build("gpt2_non_reentrant")  # a real PreTrainedModel that checkpoints: HF's rule reads the model too
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[])
    assert port_training_arguments(plain, model).strategy_kwargs["find_unused_parameters"] is False


def test_the_package_never_imports_transformers():
    # The port reads plain attributes or keys (the tests above use a dict and a SimpleNamespace), so it works without
    # transformers installed. (Importing Lightning may import transformers through torchmetrics when it is installed,
    # so sys.modules cannot tell; the package's own imports can.)
    for path in (REPO_ROOT / "lightning_ddp_plus").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(name.split(".")[0] in ("transformers", "peft") for name in names), path


def test_hf_names_in_yaml(tmp_path, monkeypatch):
    config = tmp_path / "hf.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n"
        "    class_path: lightning_ddp_plus.HFStyleDDPPlusStrategy\n"
        "    init_args: {gradient_accumulation_steps: 4, ddp_find_unused_parameters: null, ddp_timeout: 3600,\n"
        "                gradient_checkpointing: true, ddp_bucket_cap_mb: 50}\n"
        "model:\n  class_path: tests.helpers.TinyRegression\n"
    )
    monkeypatch.setattr("sys.argv", ["ddp-plus"])
    cli = LightningCLI(args=["--config", str(config)], run=False, save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HFStyleDDPPlusStrategy)
    assert strategy.timeout == timedelta(hours=1) and strategy.gradient_accumulation_steps == 4
    assert strategy.settings.find_unused_parameters is False and strategy.settings.bucket_cap_mb == 50


def test_the_port_reads_exactly_the_documented_names():
    assert set(HF_DEFAULTS) == {
        "gradient_accumulation_steps", "ddp_backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers", "ddp_static_graph", "ddp_timeout", "gradient_checkpointing", "activation_checkpointing",
        "average_tokens_across_devices",
    }  # fmt: skip
