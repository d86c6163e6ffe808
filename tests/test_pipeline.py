"""The step pipeline on its own, in one process: the components in one ordered list, called in order, and the
per-step agreement's flags declared by the components that own them and read back by name."""

import re
from pathlib import Path

import pytest

from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy
from lightning_ddp_plus.pipeline.agreement import AgreementFlags
from lightning_ddp_plus.pipeline.component import EpochEnd, StepComponent, StepPipeline
from lightning_ddp_plus.preemption.stop import STOP
from lightning_ddp_plus.sync.chunks import OUT_OF_MEMORY
from lightning_ddp_plus.sync.item_averaging import ITEMS_OFF, ITEMS_ON
from lightning_ddp_plus.sync.uneven import SOME_RANK_ENDS, SOME_RANK_GOES_ON
from tests.helpers import process_group_ended_after

ROOT = Path(__file__).resolve().parents[1]


class Recording(StepComponent):
    def __init__(self, name: str, said: list[str], flags: tuple[str, ...] = ()) -> None:
        self.name, self.said, self.agreement_flags = name, said, flags

    def step_done(self, step: int) -> None:
        self.said.append(f"{self.name} step {step}")

    def epoch_ends(self, end: EpochEnd) -> None:
        self.said.append(f"{self.name} epoch")

    def fit_ends(self, failed: bool) -> None:
        self.said.append(f"{self.name} ends")

    def agreement_values(self) -> dict[str, int]:
        return dict.fromkeys(self.agreement_flags, 1)


def test_every_point_calls_the_components_in_order_and_the_end_of_a_fit_in_the_reverse_one():
    said: list[str] = []
    first, second = Recording("first", said), Recording("second", said)
    pipeline = StepPipeline([first, None, second])  # None: a feature its arguments turned off
    pipeline.step_done(1)
    pipeline.epoch_ends(EpochEnd(step=1))
    pipeline.fit_ends(failed=False)
    assert said == ["first step 1", "second step 1", "first epoch", "second epoch", "second ends", "first ends"]
    pipeline.add(Recording("added", said), before=second)
    assert [c.name for c in pipeline] == ["first", "added", "second"]
    with pytest.raises(TypeError, match="must subclass StepComponent: \\['object'\\]"):
        StepPipeline([object()])


def test_the_flags_are_laid_out_once_in_the_pipelines_order_and_read_by_name():
    said: list[str] = []
    pipeline = StepPipeline([Recording("a", said, ("a's news",)), Recording("b", said, ("b's news", "b's other"))])
    flags = pipeline.flags
    assert flags.names == ("a's news", "b's news", "b's other")
    packed = flags.pack(pipeline.agreement_values())
    assert packed == [1, 1, 1]
    agreed = flags.read([0, 1, 0])
    assert (agreed["a's news"], agreed["b's news"], agreed["b's other"]) == (0, 1, 0)
    with pytest.raises(KeyError, match="no agreement flag .c.*news. was declared"):
        agreed["c's news"]
    assert agreed.get("c's news") == 0  # a feature turned off reads as no news
    with pytest.raises(KeyError, match="were not declared"):
        flags.pack({"c's news": 1})
    with pytest.raises(ValueError, match="declared twice"):
        AgreementFlags(["stop", "stop"])
    with pytest.raises(ValueError, match="2 flag values for the 3 declared"):
        flags.read([0, 1])


#: per-item averaging compares the ranks' decision in the first window, whatever the arguments
ITEMS = (ITEMS_ON, ITEMS_OFF)


@pytest.mark.parametrize(
    ("arguments", "flags"),
    [
        ({}, (*ITEMS, SOME_RANK_ENDS, SOME_RANK_GOES_ON, STOP)),  # notices are on by default
        ({"preemption_signals": []}, (*ITEMS, SOME_RANK_ENDS, SOME_RANK_GOES_ON)),
        ({"chunk_size": "auto"}, (*ITEMS, SOME_RANK_ENDS, SOME_RANK_GOES_ON, OUT_OF_MEMORY, STOP)),
        ({"chunk_size": 4, "preemption_signals": []}, (*ITEMS, SOME_RANK_ENDS, SOME_RANK_GOES_ON)),
    ],
)
def test_each_feature_declares_its_own_flags_as_its_arguments_turn_it_on(arguments, flags):
    for front_end in (DDPPlusStrategy, DDPPlusFabricStrategy):
        assert front_end(**arguments).engine.pipeline.flags.names == flags


def test_the_development_guide_lists_the_pipeline_in_the_engines_order():
    """``docs/development.md`` shows the component list as the engine holds it (a reordering fails here)."""
    engine = DDPPlusStrategy(
        setup_timeout=600,
        find_stragglers_every_n_steps=10,
        telemetry=True,
        bucket_cap_mb="auto",
        stall_report_after=60,
        verify_replicas_every_n_steps=10,
    ).engine
    guide = (ROOT / "docs" / "development.md").read_text()
    listed = re.findall(r"^\d+\. `(\w+)` \(`engine\.(\w+)`\)", guide, flags=re.MULTILINE)
    assert [(type(c).__name__, _attribute(engine, c)) for c in engine.pipeline] == listed


def _attribute(engine, component) -> str:
    return next(name for name, value in vars(engine).items() if value is component)


@pytest.mark.parametrize("counts_items", [False, True])
def test_a_step_walks_the_parameters_only_for_a_feature_that_needs_it(tmp_path, monkeypatch, counts_items):
    """Issue 50: without ``num_items`` no step after the first walks the model's parameters from this package's
    code (a walk costs a Python loop over every tensor, per step); with ``num_items`` the closing backward does (it
    scales every gradient), which shows the count sees a walk. A real one-rank fit on gloo; ``Module.parameters`` and
    ``named_parameters`` are wrapped to count the calls whose caller is this package's code."""
    import sys

    import lightning as L
    from torch import nn

    from tests.helpers import TinyRegression, process_group_ended_after

    walks: list[tuple[int, str]] = []
    step = {"now": -1}

    def counted(original):
        def walk(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if "lightning_ddp_plus" in caller.co_filename and step["now"] >= 1:
                walks.append((step["now"], caller.co_name))
            return original(self, *args, **kwargs)

        return walk

    monkeypatch.setattr(nn.Module, "parameters", counted(nn.Module.parameters))
    monkeypatch.setattr(nn.Module, "named_parameters", counted(nn.Module.named_parameters))

    class Steps(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step["now"] = trainer.global_step

    class Items(TinyRegression):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y, reduction="sum")
            return {"loss": loss, "num_items": x.shape[0]} if counts_items else loss / x.shape[0]

    trainer = L.Trainer(
        strategy=DDPPlusStrategy(process_group_backend="gloo"),
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Steps()],
    )
    with process_group_ended_after():
        trainer.fit(Items(num_samples=32, batch_size=4))
    assert trainer.global_step == 8
    steps_walked = {walked for walked, _ in walks}
    if counts_items:
        assert steps_walked == set(range(1, 8)), walks
    else:
        assert walks == []


def test_a_component_is_called_only_at_the_points_it_acts_at():
    calls = []

    class NoFlags(StepComponent):  # says nothing in the agreement: its agreement_values is never asked
        def agreement_values(self):
            calls.append("agreement_values")
            return {}

        def step_done(self, step):
            calls.append(f"step_done {step}")

    pipeline = StepPipeline([NoFlags()])
    pipeline.agreement_values()
    pipeline.agreement_needed()
    pipeline.step_done(1)
    assert calls == ["step_done 1"]


def test_a_feature_that_is_off_is_left_out_of_the_pipeline():
    off = [type(c).__name__ for c in DDPPlusStrategy(verify_replicas_every_n_steps=None).engine.pipeline]
    on = [type(c).__name__ for c in DDPPlusStrategy(verify_replicas_every_n_steps=5).engine.pipeline]
    assert "ReplicaGuard" not in off
    assert "ReplicaGuard" in on
    assert "GroupTimeouts" not in off  # no setup_timeout: the group's timeout never changes
    assert "GroupTimeouts" in [type(c).__name__ for c in DDPPlusStrategy(setup_timeout=600).engine.pipeline]


def test_a_trainer_step_enters_no_file_of_a_feature_that_is_off(tmp_path):
    """One step of a 1-rank fit with the defaults, traced (``benchmarks/step_path.py``)."""
    from benchmarks.step_path import trace_one_step

    with process_group_ended_after():
        trace = trace_one_step(str(tmp_path))
    files = trace.files
    assert "frontends/strategy.py" in files  # the trace saw the step
    assert "diagnostics/replicas.py" not in files  # verify_replicas_every_n_steps is off by default
    assert "config/timeout.py" not in files  # so is setup_timeout
    assert "frontends/trainer_chunks.py" not in files  # and chunk_size
    assert "sync/chunks.py" not in files
    assert "persistence/resume.py" not in files  # no resume: no generators to give back
    # no call climbs back into a file already on the stack (the launcher's, or the loop wrapper's in private_apis)
    assert sorted(trace.climbs) == []
