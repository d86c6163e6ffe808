"""The conflict validator: model facts, the rules as data, and real 2-rank runs of every rule on gloo.

For each failing rule a run with the validator off shows that torch 2.13 really fails (so a rule that stops being
true is noticed); with ``"error"`` the project's error comes first, before any optimizer step; with ``"resolve"``
the run trains to the end and matches a single-process reference; the working combinations raise nothing.
"""

import functools
import re

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.conflicts.check import pack_facts, unpack_facts
from lightning_ddp_plus.conflicts.facts import ForwardProbe, InputGradRepair, ModelFacts, static_facts
from lightning_ddp_plus.conflicts.rules import RULES, CheckedSettings, evaluate, resolved_view, rule_for_torch_error
from tests.helpers import CheckpointNet, flat_parameters, reference_parameters, run_case_job

REENTRANT = frozenset({"reentrant"})


def observed(**values) -> ModelFacts:
    return ModelFacts(observed=True, **{"unused_parameters": (), **values})


# ---------------------------------------------------------------- rules over data (no processes)


def ids(view: CheckedSettings, facts: ModelFacts) -> list[str]:
    return [finding.rule.id for finding in evaluate(view, facts)]


def test_rule_table_is_data():
    assert [rule.id for rule in RULES] == ["R1", "R2", "R3", "R4", "R5", "R6", "R7", "A1", "A2", "A3", "A4"]
    assert all(rule.fix and rule.title for rule in RULES)


@pytest.mark.parametrize(
    ("view", "facts", "expected"),
    [
        # R1 needs trainable parameters inside a reentrant region the loss reaches, not just "reentrant somewhere"
        (
            CheckedSettings(find_unused_parameters=True),
            observed(checkpointing=REENTRANT, reentrant_parameters=("mid.0.weight",)),
            ["R1"],
        ),
        (
            CheckedSettings(find_unused_parameters=True),
            observed(checkpointing=REENTRANT),
            ["A1"],
        ),  # frozen region: torch trains it
        (
            CheckedSettings(find_unused_parameters=True, static_graph=True),
            observed(checkpointing=REENTRANT, reentrant_parameters=("w",)),
            [],
        ),
        (
            CheckedSettings(find_unused_parameters=True),
            observed(checkpointing=frozenset({"non_reentrant"}), unused_parameters=("x",)),
            [],
        ),
        (
            CheckedSettings(),
            observed(checkpointing=REENTRANT, reentrant_parameters=("w",), reused_in_checkpoint=("w",)),
            ["R2"],
        ),
        (
            CheckedSettings(find_unused_parameters=True),
            observed(checkpointing=REENTRANT, reentrant_parameters=("w",), reused_in_checkpoint=("w",)),
            ["R1", "R2"],
        ),
        (CheckedSettings(static_graph=True, gradient_accumulation_steps=4), observed(), ["R3"]),
        (CheckedSettings(), observed(unused_parameters=("spare.weight",)), ["R4"]),
        (CheckedSettings(static_graph=True), observed(unused_parameters=("spare.weight",)), []),
        # R5 whatever the settings: find_unused_parameters or static_graph hide it, they do not fix it
        (CheckedSettings(), observed(checkpointing=REENTRANT, no_grad_region_parameters=("lora.weight",)), ["R5"]),
        (
            CheckedSettings(find_unused_parameters=True),
            observed(checkpointing=REENTRANT, no_grad_region_parameters=("lora.weight",)),
            ["R5"],
        ),
        (
            CheckedSettings(static_graph=True),
            observed(checkpointing=REENTRANT, no_grad_region_parameters=("lora.weight",)),
            ["R5"],
        ),
        (
            CheckedSettings(repair_input_grads=True),
            observed(checkpointing=REENTRANT, no_grad_region_parameters=("lora.weight",)),
            [],
        ),
        (CheckedSettings(find_unused_parameters=True), observed(), ["A1"]),
        (CheckedSettings(find_unused_parameters=True), ModelFacts(unused_parameters=None), []),
        (CheckedSettings(broadcast_buffers=False), ModelFacts(mutable_buffers=("bn.running_mean",)), ["A2"]),
        (CheckedSettings(), observed(checkpointing=REENTRANT, mutable_buffers=("bn.running_mean",)), ["A3"]),
        (CheckedSettings(), observed(checkpointing=REENTRANT, reentrant_parameters=("w",)), []),
        # attributes alone (no forward observed) never raise: they only advise
        (CheckedSettings(find_unused_parameters=True), ModelFacts(checkpointing=REENTRANT), ["A4"]),
    ],
)
def test_rules(view, facts, expected):
    assert ids(view, facts) == expected


def test_r4_resolution_depends_on_checkpointing():
    plain = observed(unused_parameters=("spare.weight",))
    assert resolved_view(CheckedSettings(), evaluate(CheckedSettings(), plain)).find_unused_parameters is True
    reentrant = observed(
        checkpointing=REENTRANT, reentrant_parameters=("mid.0.weight",), unused_parameters=("spare.weight",)
    )
    resolved = resolved_view(CheckedSettings(), evaluate(CheckedSettings(), reentrant))
    assert resolved.static_graph is True and resolved.find_unused_parameters is False
    assert ids(resolved, reentrant) == []  # the resolution itself trips no rule


def test_r5_resolution_repairs_input_grads():
    facts = observed(checkpointing=REENTRANT, no_grad_region_parameters=("lora.weight",))
    assert resolved_view(CheckedSettings(), evaluate(CheckedSettings(), facts)).repair_input_grads is True


def test_messages_name_parameters_and_fix():
    finding = evaluate(CheckedSettings(), observed(unused_parameters=("spare.weight", "spare.bias")))[0]
    assert "spare.weight, spare.bias" in str(finding) and "find_unused_parameters=True" in str(finding)
    r5 = evaluate(CheckedSettings(), observed(no_grad_region_parameters=("lora_A.weight",)))[0]
    assert "lora_A.weight" in str(r5) and "enable_input_require_grads()" in str(r5) and "use_reentrant=False" in str(r5)


def test_torch_messages_map_to_rules():
    assert rule_for_torch_error("Parameter at index 3 has been marked as ready twice").id == "R1"
    assert rule_for_torch_error("expect_autograd_hooks_ INTERNAL ASSERT FAILED").id == "R3"
    assert rule_for_torch_error("something else") is None


def test_bad_mode():
    with pytest.raises(ValueError, match="checkpointing_conflict='strict'.*error, warn, resolve, off"):
        DDPPlusStrategy(checkpointing_conflict="strict")


def test_facts_survive_agreement_packing():
    facts = observed(
        checkpointing=frozenset({"reentrant", "non_reentrant"}),
        reentrant_parameters=("a",),
        reused_in_checkpoint=("a",),
        unused_parameters=("c",),
        no_grad_region_parameters=("b",),
        mutable_buffers=("bn.running_mean",),
    )
    parameters, buffers = ["a", "b", "c"], ["bn.running_mean", "bn.running_var"]
    assert unpack_facts(pack_facts(facts, parameters, buffers), parameters, buffers, facts) == facts
    # OR across ranks: rank 1 saw another unused parameter
    other = pack_facts(observed(unused_parameters=("a",)), parameters, buffers)
    merged = unpack_facts(
        [max(x, y) for x, y in zip(pack_facts(facts, parameters, buffers), other)], parameters, buffers, facts
    )
    assert merged.unused_parameters == ("a", "c")


# ---------------------------------------------------------------- model facts (no processes)


class HFStyleModel(nn.Module):
    """Carries the flags Hugging Face's PreTrainedModel sets, without importing transformers."""

    def __init__(self, use_reentrant=None):
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.gradient_checkpointing = True
        keywords = {} if use_reentrant is None else {"use_reentrant": use_reentrant}
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, **keywords)


@pytest.mark.parametrize(("use_reentrant", "kinds"), [(None, set()), (True, {"reentrant"}), (False, {"non_reentrant"})])
def test_hf_style_flags_are_read_only_when_explicit(use_reentrant, kinds):
    facts = static_facts(HFStyleModel(use_reentrant))
    assert facts.checkpointing == kinds and not facts.observed


@pytest.mark.parametrize(
    ("impl", "kind"), [(CheckpointImpl.REENTRANT, "reentrant"), (CheckpointImpl.NO_REENTRANT, "non_reentrant")]
)
def test_checkpoint_wrapper_modules(impl, kind):
    model = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl=impl))
    assert static_facts(model).checkpointing == {kind}


def test_what_a_forward_does_wins_over_attributes():
    model = HFStyleModel(use_reentrant=True)  # the flag says reentrant, the forward checkpoints non-reentrantly
    with ForwardProbe(model) as probe:
        loss = torch.utils.checkpoint.checkpoint(model.layer, torch.randn(2, 2), use_reentrant=False).sum()
    assert probe.facts(loss).checkpointing == {"non_reentrant"}


def test_a_torch_whose_checkpointing_the_probe_cannot_see_gets_a_warning_not_silence(monkeypatch):
    """A torch whose non-reentrant hook is not the class the probe knows (here its work moved to a base class, as
    torch 2.14 did with ``_checkpoint_internal_hook``): the probe must say that it is blind to non-reentrant
    checkpointing rather than report none."""

    class MovedHook(torch.utils.checkpoint._checkpoint_hook):
        pass  # no __init__ of its own

    monkeypatch.setattr(torch.utils.checkpoint, "_checkpoint_hook", MovedHook)
    model = HFStyleModel(use_reentrant=False)
    warning = "cannot observe non-reentrant gradient checkpointing on this torch"
    with pytest.warns(UserWarning, match=warning), ForwardProbe(model) as probe:
        probe.facts(torch.utils.checkpoint.checkpoint(model.layer, torch.randn(2, 2), use_reentrant=False).sum())


def test_a_torch_without_the_reentrant_function_gets_a_warning_not_a_crash(monkeypatch):
    monkeypatch.delattr(torch.utils.checkpoint, "CheckpointFunction")  # used only by reentrant calls, none here
    model = HFStyleModel(use_reentrant=False)
    with (
        pytest.warns(UserWarning, match="cannot observe reentrant gradient checkpointing"),
        ForwardProbe(model) as probe,
    ):
        loss = torch.utils.checkpoint.checkpoint(model.layer, torch.randn(2, 2), use_reentrant=False).sum()
    assert probe.facts(loss).checkpointing == {"non_reentrant"}  # what it can see, it still sees


def test_plain_model_has_no_checkpointing_and_batchnorm_buffers_are_found():
    facts = static_facts(CheckpointNet(norm="batch"))
    assert not facts.checkpointed
    assert "norm.running_mean" in facts.mutable_buffers and "mid.1.running_var" in facts.mutable_buffers


MID = ("mid.0.weight", "mid.0.bias", "mid.1.weight", "mid.1.bias", "mid.2.weight", "mid.2.bias")


@pytest.mark.parametrize(
    ("model_kwargs", "kinds", "reentrant", "reused", "unused"),
    [
        ({}, set(), (), (), ()),
        ({"checkpointing": "reentrant"}, {"reentrant"}, MID, (), ()),
        ({"checkpointing": "non_reentrant", "unused": True}, {"non_reentrant"}, (), (), ("spare.weight", "spare.bias")),
        ({"checkpointing": "reentrant", "reuse": True}, {"reentrant"}, MID, MID, ()),
    ],
)
def test_probe_observes_a_real_forward(model_kwargs, kinds, reentrant, reused, unused):
    model = CheckpointNet(**model_kwargs)
    with ForwardProbe(model) as probe:
        loss = model(torch.randn(4, 8)).pow(2).mean()
    facts = probe.facts(loss)
    assert facts.checkpointing == kinds
    assert facts.reentrant_parameters == reentrant
    assert facts.reused_in_checkpoint == reused
    assert facts.unused_parameters == unused
    loss.backward()  # the probe is gone: the reentrant recompute is not observed, and backward works
    assert "apply" not in vars(torch.utils.checkpoint.CheckpointFunction)


class Patterns(nn.Module):
    """Every way a forward can use a parameter inside reentrant checkpointing (torch's verdicts: see docs/guides/conflicts.md)."""

    def __init__(self, pattern: str, frozen_input: bool = False):
        super().__init__()
        self.pattern = pattern
        self.inp, self.a, self.b, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.scale = nn.Parameter(torch.ones(8))
        self.weight = nn.Parameter(torch.eye(8))
        self.inp.requires_grad_(not frozen_input)

    def forward(self, x):
        h, ck = self.inp(x), functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
        if self.pattern == "lambda_with_parameter":
            h = ck(lambda t: self.a(t) * self.scale, h)
        elif self.pattern == "functional":
            h = ck(lambda t: nn.functional.linear(t, self.weight), h)
        elif self.pattern == "twice_in_one_region":
            h = ck(lambda t: self.a(self.a(t)), h)
        elif self.pattern == "two_regions":
            h = ck(self.a, ck(self.a, h))
        elif self.pattern == "inside_and_outside":
            h = self.a(ck(self.a, h))
        elif self.pattern == "nested":
            h = ck(lambda t: self.b(ck(self.a, t)), h)
        elif self.pattern == "nested_shared":
            h = ck(lambda t: self.a(ck(self.a, t)), h)
        return self.head(h)


A = ("a.weight", "a.bias")


@pytest.mark.parametrize(
    ("pattern", "used", "reentrant", "reused"),
    [
        ("lambda_with_parameter", ("scale",) + A, ("scale",) + A, ()),
        ("functional", ("weight",), ("weight",), ()),
        ("twice_in_one_region", A, A, ()),  # one backward pass accumulates it once: torch trains this
        ("two_regions", A, A, A),
        ("inside_and_outside", A, A, A),
        ("nested", A + ("b.weight", "b.bias"), A + ("b.weight", "b.bias"), ()),
        ("nested_shared", A, A, A),
    ],
)
def test_probe_sees_every_use_of_a_parameter(pattern, used, reentrant, reused):
    model = Patterns(pattern)
    with ForwardProbe(model) as probe:
        loss = model(torch.randn(2, 4)).sum()
    facts = probe.facts(loss)
    every = {name for name, _ in model.named_parameters()}
    expected_unused = every - set(used) - {"inp.weight", "inp.bias", "head.weight", "head.bias"}
    assert set(facts.unused_parameters) == expected_unused, pattern
    assert set(facts.reentrant_parameters) == set(reentrant)
    assert set(facts.reused_in_checkpoint) == set(reused)


def test_attribute_reads_are_not_uses():
    model = Patterns("lambda_with_parameter")
    with ForwardProbe(model) as probe:
        h = model.inp(torch.randn(2, 4))
        loss = torch.utils.checkpoint.checkpoint(
            lambda t: t.to(model.weight.dtype) * model.weight.shape[0], h, use_reentrant=True
        ).sum()
    assert "weight" in probe.facts(loss).unused_parameters


@pytest.mark.parametrize("repair", [False, True])
def test_region_without_input_grads(repair):
    model = Patterns("lambda_with_parameter", frozen_input=True)
    with ForwardProbe(model, repair_input_grads=repair) as probe:
        loss = model(torch.randn(2, 4)).sum()
    facts = probe.facts(loss)
    assert facts.no_grad_region_parameters == ("scale", "a.weight", "a.bias")
    assert "scale" not in facts.unused_parameters  # R5 explains them; R4 would hide the cause
    loss.backward()
    got_grad = model.a.weight.grad is not None
    assert got_grad is repair
    if repair:
        assert probe.repairs == [InputGradRepair(producer="inp", parameters=("scale", "a.weight", "a.bias"))]
        assert facts.reentrant_parameters == ("scale", "a.weight", "a.bias")


def test_probe_sees_changing_buffers():
    model = CheckpointNet(norm="batch")
    with ForwardProbe(model) as probe:
        loss = model(torch.randn(4, 8)).sum()
    assert "norm.running_mean" in probe.facts(loss).mutable_buffers


def test_probe_restores_torch_even_when_the_forward_raises():
    generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator
    with pytest.raises(ZeroDivisionError), ForwardProbe(CheckpointNet()):
        torch.utils.checkpoint.checkpoint(lambda t: 1 / 0, torch.randn(2), use_reentrant=True)
    assert "apply" not in vars(torch.utils.checkpoint.CheckpointFunction)
    assert torch.utils.checkpoint._checkpoint_without_reentrant_generator is generator


# ---------------------------------------------------------------- real 2-rank runs


def run_cases(tmp_path, cases, name):
    return run_case_job("conflict_job.py", cases, tmp_path / f"{name}.json")


TORCH_FAILURES = {
    "R1": (
        {
            "strategy": {"checkpointing_conflict": "off", "find_unused_parameters": True},
            "model": {"checkpointing": "reentrant"},
            "gather": False,
        },
        r"ready only once|ready twice",
    ),
    "R2": (
        {
            "strategy": {"checkpointing_conflict": "off"},
            "model": {"checkpointing": "reentrant", "reuse": True},
            "gather": False,
        },
        r"ready only once|ready twice",
    ),
    "R3": (
        {"stock": True, "strategy": {"static_graph": True, "accumulate_grad_batches": 2}, "model": {}, "gather": False},
        r"expect_autograd_hooks_",
    ),
    "R4": (
        {"strategy": {"checkpointing_conflict": "off", "sync_guard": False}, "model": {"unused": True}},
        r"Expected to have finished reduction",
    ),
}


@pytest.fixture(scope="module")
def conflict_runs(tmp_path_factory):
    """Every case of this file on one pair of processes (a rank's start costs more than a case): every rule's failing
    combination, then the error mode's and the resolve mode's cases. Each failure happens on both ranks at the same
    point, so the process group stays in step for the next case."""
    rules = sorted(TORCH_FAILURES)
    failures = [TORCH_FAILURES[rule][0] for rule in rules]
    errors = [{"strategy": strategy, "model": model} for strategy, model, _, _ in ERROR_CASES]
    resolved = [{"strategy": strategy, "model": model} for strategy, model, _, _ in RESOLVE_CASES]
    results = run_cases(tmp_path_factory.mktemp("conflicts"), failures + errors + resolved, "all")
    return {
        "torch_failures": dict(zip(rules, results[: len(failures)])),
        "error": results[len(failures) : len(failures) + len(errors)],
        "resolve": results[len(failures) + len(errors) :],
    }


@pytest.fixture(scope="module")
def torch_failures(conflict_runs):
    return conflict_runs["torch_failures"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("rule", sorted(TORCH_FAILURES))
def test_torch_really_fails_without_the_validator(torch_failures, rule):
    case, pattern = TORCH_FAILURES[rule]
    result = torch_failures[rule]
    assert result["error"] == "RuntimeError"
    assert re.search(pattern, result["message"]), result["message"][:500]
    if rule == "R4":
        # the silent part: one optimizer step ran on unreduced gradients and the replicas already differ
        assert result["optimizer_steps"] == 1
        assert result["params"][0] != result["params"][1]
    if not case.get("stock"):
        assert f"this is rule {'R1' if rule == 'R2' else rule}" in result["message"]


ERROR_CASES = [
    (
        {"find_unused_parameters": True},
        {"checkpointing": "reentrant"},
        "R1",
        ["find_unused_parameters=True", "static_graph=False"],
    ),
    ({}, {"checkpointing": "reentrant", "reuse": True}, "R2", ["mid.0.weight", "static_graph=True"]),
    ({}, {"unused": True}, "R4", ["spare.weight", "spare.bias", "find_unused_parameters=True"]),
]


@pytest.mark.multiprocess
def test_error_mode_reports_before_any_optimizer_step(conflict_runs):
    for (strategy, model, rule, mentions), result in zip(ERROR_CASES, conflict_runs["error"], strict=True):
        assert result["error"] == "DDPConflictError", result["message"]
        assert f"[{rule}]" in result["message"] and "Fix:" in result["message"]
        for text in mentions:
            assert text in result["message"], (rule, text)
        assert result["optimizer_steps"] == 0
        initial = flat_parameters(CheckpointNet(**model)).tolist()
        assert result["params"][0] == result["params"][1] == initial


RESOLVE_CASES = [
    # (strategy, model, expected findings, expected settings after resolution)
    (
        {"checkpointing_conflict": "resolve", "find_unused_parameters": True},
        {"checkpointing": "reentrant"},
        ["R1"],
        {"static_graph": True, "find_unused_parameters": False},
    ),
    (
        {"checkpointing_conflict": "resolve"},
        {"checkpointing": "reentrant", "reuse": True},
        ["R2"],
        {"static_graph": True, "find_unused_parameters": False},
    ),
    (
        {"checkpointing_conflict": "resolve"},
        {"unused": True},
        ["R4"],
        {"static_graph": False, "find_unused_parameters": True},
    ),
    (
        {"checkpointing_conflict": "resolve"},
        {"unused": True, "checkpointing": "reentrant"},
        ["R4"],
        {"static_graph": True, "find_unused_parameters": False},
    ),
    (
        {"checkpointing_conflict": "resolve"},
        {"unused": True, "checkpointing": "non_reentrant", "reuse": True},
        ["R4"],
        {"static_graph": False, "find_unused_parameters": True},
    ),
    # working combinations: nothing to report, nothing changed
    ({}, {}, [], {"static_graph": False, "find_unused_parameters": False}),
    (
        {"find_unused_parameters": True},
        {"checkpointing": "non_reentrant", "reuse": True, "unused": True},
        [],
        {"static_graph": False, "find_unused_parameters": True},
    ),
    (
        {"static_graph": True},
        {"checkpointing": "non_reentrant", "reuse": True},
        [],
        {"static_graph": True, "find_unused_parameters": False},
    ),
    (
        {"static_graph": True},
        {"checkpointing": "reentrant", "reuse": True, "unused": True},
        [],
        {"static_graph": True, "find_unused_parameters": False},
    ),
    ({}, {"checkpointing": "reentrant"}, [], {"static_graph": False, "find_unused_parameters": False}),
    (
        {},
        {"checkpointing": "non_reentrant", "reuse": True},
        [],
        {"static_graph": False, "find_unused_parameters": False},
    ),
    (
        {"static_graph": True, "gradient_accumulation_steps": 2},
        {"checkpointing": "reentrant", "reuse": True},
        ["R3"],
        {"static_graph": True, "find_unused_parameters": False},
    ),
]


@pytest.mark.multiprocess
def test_resolve_trains_to_the_reference_and_working_combinations_raise_nothing(conflict_runs):
    for (strategy, model, findings, settings), result in zip(RESOLVE_CASES, conflict_runs["resolve"], strict=True):
        label = f"{strategy} {model}"
        assert result["error"] is None, (label, result["message"])
        assert result["findings"] == findings, label
        assert result["settings"] == settings, label
        params = [torch.tensor(p) for p in result["params"]]
        assert torch.equal(params[0], params[1]), label
        k = strategy.get("gradient_accumulation_steps", 1)
        expected = reference_parameters(CheckpointNet(**model), k=k)
        assert torch.allclose(params[0], expected, atol=1e-5, rtol=0), (label, (params[0] - expected).abs().max())
        assert result["optimizer_steps"] == (3 if k == 1 else 2)
