"""What is generated from the one declaration of the arguments (``DDPPlusArguments``) is current and complete: both
front ends' signatures, the docs' arguments table, the example config, and the setup line."""

import dataclasses
import importlib.util
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from lightning_ddp_plus import DDPPlusArguments, DDPPlusFabricStrategy, DDPPlusStrategy
from lightning_ddp_plus.engine.arguments import ARGUMENT_FIELDS, argument_docs, trainer_only_arguments
from lightning_ddp_plus.frontends.hf import HFStyleDDPPlusStrategy

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("docs_generated", ROOT / "docs" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_tables_and_the_config_are_current():
    generator = load_generator()
    assert [str(path.relative_to(ROOT)) for path in generator.stale_files()] == []


def test_the_generated_keywords_are_written_in_the_package_style_without_a_formatter(monkeypatch):
    """The generator writes ``ruff format``'s text itself: with nothing on PATH (a venv's python called without
    activating it, a docs-only install) the committed file is still current, and ruff leaves it as it is."""
    monkeypatch.setenv("PATH", "")
    generator = load_generator()
    text = generator.keywords_text()
    assert text == generator.KEYWORDS.read_text()
    assert 'Literal["auto"]' in text and "Literal['auto']" not in text  # the test can fail: ruff's quotes are kept
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(generator.KEYWORDS), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert done.stdout == text


def test_the_arguments_table_has_a_row_per_argument_with_its_docstring():
    table = (ROOT / "docs" / "arguments.md").read_text()
    docs = argument_docs()
    for name in ARGUMENT_FIELDS:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert docs[name].split(".")[0].replace("``", "`")[:40] in row
    for name, lacks in trainer_only_arguments().items():
        assert f"no: {lacks.reason}" in next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))


def test_a_new_argument_reaches_the_config_and_an_unknown_one_is_refused():
    generator = load_generator()
    text = generator.CONFIG.read_text()
    without = "\n".join(line for line in text.splitlines() if "uneven_inputs:" not in line) + "\n"
    assert "      uneven_inputs: error\n" in generator.config_text(without)
    with pytest.raises(ValueError, match="uneven_input.*does not declare"):
        generator.config_text(text.replace("uneven_inputs:", "uneven_input:"))
    config = yaml.safe_load(text)["trainer"]["strategy"]["init_args"]
    assert list(config) == [name for name in ARGUMENT_FIELDS if name in inspect.signature(DDPPlusStrategy).parameters]


def declared(front_end) -> dict:
    return {
        name: (parameter.annotation, parameter.default)
        for name, parameter in inspect.signature(front_end).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


def test_both_front_ends_take_the_declared_arguments_with_their_types_and_defaults():
    hints = typing.get_type_hints(DDPPlusArguments)
    expected = {name: (hints[name], spec.default) for name, spec in ARGUMENT_FIELDS.items()}
    # then each former name, typed as its new one, defaulting to None (a YAML written with it still reads)
    expected["micro_batch_size"] = (hints["chunk_size"], None)
    assert declared(DDPPlusStrategy) == expected
    # The intended differences: Fabric lacks the Trainer-only arguments (each with its reason), and its plumbing uses
    # Lightning's Fabric name for the precision plugin.
    fabric_lacks = set(trainer_only_arguments())
    assert fabric_lacks == {"resume_from_last", "model_averaging_period", "on_world_size_change", "save_on_rank_death"}
    assert declared(DDPPlusFabricStrategy) == {k: v for k, v in expected.items() if k not in fabric_lacks}
    plumbing = {
        name
        for name, parameter in inspect.signature(DDPPlusFabricStrategy).parameters.items()
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    }
    assert plumbing == {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision"}
    # The Hugging Face front end takes the names it ports instead of the arguments they set, and every other one.
    hf = declared(HFStyleDDPPlusStrategy)
    assert "process_group_backend" not in hf and "timeout" not in hf and "telemetry" in hf
    assert {field.name for field in dataclasses.fields(DDPPlusArguments)} == {*ARGUMENT_FIELDS, "ddp_kwargs"}


def test_fabric_refuses_what_it_lacks_with_the_reason():
    with pytest.raises(TypeError, match=r"`resume_from_last='always'` is not valid: DDPPlusFabricStrategy does not "):
        DDPPlusFabricStrategy(resume_from_last="always")
    with pytest.raises(TypeError, match=r"model_averaging_period=4.*post-local SGD.*Fix: use `DDPPlusStrategy`"):
        DDPPlusFabricStrategy(model_averaging_period=4)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("uneven_input", "uneven_inputs"), ("optimiser_sharding", "optimizer_sharding"), ("sync_gaurd", "sync_guard")],
)
def test_misspelt_new_arguments_get_the_name_they_meant(typo, meant):
    for front_end in (DDPPlusStrategy, DDPPlusFabricStrategy):
        with pytest.raises(TypeError, match=f"unexpected keyword argument `{typo}`.*did you mean `{meant}`"):
            front_end(**{typo: True})


def test_the_setup_line_names_every_argument():
    line = DDPPlusStrategy(process_group_backend="gloo").describe()
    for name in ARGUMENT_FIELDS:
        if name not in ("process_group_backend", "timeout"):  # shown first, as the backend and timeout in effect
            assert f" {name}=" in line, name
    assert "atomic_checkpoints=True" in line
    fabric_line = DDPPlusFabricStrategy().describe()
    assert "resume_from_last" not in fabric_line and "uneven_inputs=error" in fabric_line
