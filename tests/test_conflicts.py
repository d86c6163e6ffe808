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
from lightning_ddp_plus.facts import ForwardProbe, ModelFacts, static_facts
from lightning_ddp_plus.rules import RULES, DDPView, evaluate, resolved_view, rule_for_torch_error
from tests.helpers import CheckpointNet, flat_parameters, reference_parameters, run_case_job

REENTRANT = frozenset({"reentrant"})


# ---------------------------------------------------------------- rules over data (no processes)


def ids(view: DDPView, facts: ModelFacts) -> list[str]:
    return [finding.rule.id for finding in evaluate(view, facts)]


def test_rule_table_is_data():
    assert [rule.id for rule in RULES] == ["R1", "R2", "R3", "R4", "A1", "A2", "A3"]
    assert all(rule.fix and rule.title for rule in RULES)


@pytest.mark.parametrize(
    ("view", "facts", "expected"),
    [
        (DDPView(find_unused_parameters=True), ModelFacts(checkpointing=REENTRANT, unused_parameters=()), ["R1"]),
        (DDPView(find_unused_parameters=True, static_graph=True), ModelFacts(checkpointing=REENTRANT, unused_parameters=()), []),
        (DDPView(find_unused_parameters=True), ModelFacts(checkpointing=frozenset({"non_reentrant"}), unused_parameters=("x",)), []),
        (DDPView(), ModelFacts(checkpointing=REENTRANT, reused_in_checkpoint=("mid.0.weight",), unused_parameters=()), ["R2"]),
        (DDPView(), ModelFacts(checkpointing=frozenset({"non_reentrant"}), reused_in_checkpoint=("w",), unused_parameters=()), []),
        (DDPView(static_graph=True, gradient_accumulation_steps=4), ModelFacts(unused_parameters=()), ["R3"]),
        (DDPView(), ModelFacts(unused_parameters=("spare.weight",)), ["R4"]),
        (DDPView(static_graph=True), ModelFacts(unused_parameters=("spare.weight",)), []),
        (DDPView(find_unused_parameters=True), ModelFacts(unused_parameters=()), ["A1"]),
        (DDPView(find_unused_parameters=True), ModelFacts(unused_parameters=None), []),
        (DDPView(broadcast_buffers=False), ModelFacts(mutable_buffers=("bn.running_mean",)), ["A2"]),
        (DDPView(), ModelFacts(checkpointing=REENTRANT, mutable_buffers=("bn.running_mean",), unused_parameters=()), ["A3"]),
        (DDPView(), ModelFacts(checkpointing=REENTRANT, unused_parameters=()), []),
    ],
)
def test_rules(view, facts, expected):
    assert ids(view, facts) == expected


def test_r4_resolution_depends_on_checkpointing():
    plain = evaluate(DDPView(), ModelFacts(unused_parameters=("spare.weight",)))
    assert resolved_view(DDPView(), plain).find_unused_parameters is True
    reentrant = ModelFacts(checkpointing=REENTRANT, unused_parameters=("spare.weight",))
    resolved = resolved_view(DDPView(), evaluate(DDPView(), reentrant))
    assert resolved.static_graph is True and resolved.find_unused_parameters is False
    assert ids(resolved, reentrant) == []  # the resolution itself trips no rule


def test_messages_name_parameters_and_fix():
    finding = evaluate(DDPView(), ModelFacts(unused_parameters=("spare.weight", "spare.bias")))[0]
    assert "spare.weight, spare.bias" in str(finding) and "find_unused_parameters=True" in str(finding)


def test_torch_messages_map_to_rules():
    assert rule_for_torch_error("Parameter at index 3 has been marked as ready twice").id == "R1"
    assert rule_for_torch_error("expect_autograd_hooks_ INTERNAL ASSERT FAILED").id == "R3"
    assert rule_for_torch_error("something else") is None


def test_bad_mode():
    with pytest.raises(ValueError, match="checkpointing_conflict='strict'.*error, warn, resolve, off"):
        DDPPlusStrategy(checkpointing_conflict="strict")


# ---------------------------------------------------------------- model facts (no processes)


class HFStyleModel(nn.Module):
    """Carries the flags Hugging Face's PreTrainedModel sets, without importing transformers."""

    def __init__(self, use_reentrant=None):
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.is_gradient_checkpointing = True
        keywords = {} if use_reentrant is None else {"use_reentrant": use_reentrant}
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, **keywords)


@pytest.mark.parametrize(("use_reentrant", "kind"), [(None, "reentrant"), (True, "reentrant"), (False, "non_reentrant")])
def test_hf_style_flags(use_reentrant, kind):
    assert static_facts(HFStyleModel(use_reentrant)).checkpointing == {kind}


@pytest.mark.parametrize(("impl", "kind"), [(CheckpointImpl.REENTRANT, "reentrant"), (CheckpointImpl.NO_REENTRANT, "non_reentrant")])
def test_checkpoint_wrapper_modules(impl, kind):
    model = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl=impl))
    assert static_facts(model).checkpointing == {kind}


def test_plain_model_has_no_checkpointing_and_batchnorm_buffers_are_found():
    facts = static_facts(CheckpointNet(norm="batch"))
    assert not facts.checkpointed
    assert "norm.running_mean" in facts.mutable_buffers and "mid.1.running_var" in facts.mutable_buffers


@pytest.mark.parametrize(
    ("model_kwargs", "kinds", "reused", "unused"),
    [
        ({}, set(), (), ()),
        ({"checkpointing": "reentrant"}, {"reentrant"}, (), ()),
        ({"checkpointing": "non_reentrant", "unused": True}, {"non_reentrant"}, (), ("spare.weight", "spare.bias")),
        ({"checkpointing": "reentrant", "reuse": True}, {"reentrant"}, ("mid.0.weight", "mid.0.bias", "mid.1.weight", "mid.1.bias", "mid.2.weight", "mid.2.bias"), ()),
    ],
)
def test_probe_observes_a_real_forward(model_kwargs, kinds, reused, unused):
    model = CheckpointNet(**model_kwargs)
    with ForwardProbe(model) as probe:
        loss = model(torch.randn(4, 8)).pow(2).mean()
    facts = probe.facts(loss)
    assert facts.checkpointing == kinds
    assert facts.reused_in_checkpoint == reused
    assert facts.unused_parameters == unused
    loss.backward()  # the probe is gone: reentrant recompute is not counted, and backward works
    assert torch.utils.checkpoint.CheckpointFunction.forward is not None


def test_probe_sees_changing_buffers():
    model = CheckpointNet(norm="batch")
    with ForwardProbe(model) as probe:
        loss = model(torch.randn(4, 8)).sum()
    assert "norm.running_mean" in probe.facts(loss).mutable_buffers


# ---------------------------------------------------------------- real 2-rank runs


def run_cases(tmp_path, cases, name):
    return run_case_job("conflict_job.py", cases, tmp_path / f"{name}.json")


TORCH_FAILURES = {
    "R1": ({"strategy": {"checkpointing_conflict": "off", "find_unused_parameters": True}, "model": {"checkpointing": "reentrant"}, "gather": False}, r"ready only once|ready twice"),
    "R2": ({"strategy": {"checkpointing_conflict": "off"}, "model": {"checkpointing": "reentrant", "reuse": True}, "gather": False}, r"ready only once|ready twice"),
    "R3": ({"stock": True, "strategy": {"static_graph": True, "accumulate_grad_batches": 2}, "model": {}, "gather": False}, r"expect_autograd_hooks_"),
    "R4": ({"strategy": {"checkpointing_conflict": "off"}, "model": {"unused": True}}, r"Expected to have finished reduction"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("rule", sorted(TORCH_FAILURES))
def test_torch_really_fails_without_the_validator(tmp_path, rule):
    case, pattern = TORCH_FAILURES[rule]
    (result,) = run_cases(tmp_path, [case], rule)
    assert result["error"] == "RuntimeError"
    assert re.search(pattern, result["message"]), result["message"][:500]
    if rule == "R4":
        # the silent part: one optimizer step ran on unreduced gradients and the replicas already differ
        assert result["optimizer_steps"] == 1
        assert result["params"][0] != result["params"][1]
    if not case.get("stock"):
        assert f"this is rule {'R1' if rule == 'R2' else rule}" in result["message"]


ERROR_CASES = [
    ({"find_unused_parameters": True}, {"checkpointing": "reentrant"}, "R1", ["find_unused_parameters=True", "static_graph=False"]),
    ({}, {"checkpointing": "reentrant", "reuse": True}, "R2", ["mid.0.weight", "static_graph=True"]),
    ({}, {"unused": True}, "R4", ["spare.weight", "spare.bias", "find_unused_parameters=True"]),
]


@pytest.mark.multiprocess
def test_error_mode_reports_before_any_optimizer_step(tmp_path):
    cases = [{"strategy": strategy, "model": model} for strategy, model, _, _ in ERROR_CASES]
    results = run_cases(tmp_path, cases, "error")
    for (strategy, model, rule, mentions), result in zip(ERROR_CASES, results):
        assert result["error"] == "DDPConflictError", result["message"]
        assert f"[{rule}]" in result["message"] and "Fix:" in result["message"]
        for text in mentions:
            assert text in result["message"], (rule, text)
        assert result["optimizer_steps"] == 0
        initial = flat_parameters(CheckpointNet(**model)).tolist()
        assert result["params"][0] == result["params"][1] == initial


RESOLVE_CASES = [
    # (strategy, model, expected findings, expected settings after resolution)
    ({"checkpointing_conflict": "resolve", "find_unused_parameters": True}, {"checkpointing": "reentrant"}, ["R1"], {"static_graph": True, "find_unused_parameters": False}),
    ({"checkpointing_conflict": "resolve"}, {"checkpointing": "reentrant", "reuse": True}, ["R2"], {"static_graph": True, "find_unused_parameters": False}),
    ({"checkpointing_conflict": "resolve"}, {"unused": True}, ["R4"], {"static_graph": False, "find_unused_parameters": True}),
    ({"checkpointing_conflict": "resolve"}, {"unused": True, "checkpointing": "reentrant"}, ["R4"], {"static_graph": True, "find_unused_parameters": False}),
    ({"checkpointing_conflict": "resolve"}, {"unused": True, "checkpointing": "non_reentrant", "reuse": True}, ["R4"], {"static_graph": False, "find_unused_parameters": True}),
    # working combinations: nothing to report, nothing changed
    ({}, {}, [], {"static_graph": False, "find_unused_parameters": False}),
    ({"find_unused_parameters": True}, {"checkpointing": "non_reentrant", "reuse": True, "unused": True}, [], {"static_graph": False, "find_unused_parameters": True}),
    ({"static_graph": True}, {"checkpointing": "non_reentrant", "reuse": True}, [], {"static_graph": True, "find_unused_parameters": False}),
    ({"static_graph": True}, {"checkpointing": "reentrant", "reuse": True, "unused": True}, [], {"static_graph": True, "find_unused_parameters": False}),
    ({}, {"checkpointing": "reentrant"}, [], {"static_graph": False, "find_unused_parameters": False}),
    ({}, {"checkpointing": "non_reentrant", "reuse": True}, [], {"static_graph": False, "find_unused_parameters": False}),
    ({"static_graph": True, "gradient_accumulation_steps": 2}, {"checkpointing": "reentrant", "reuse": True}, ["R3"], {"static_graph": True, "find_unused_parameters": False}),
]


@pytest.mark.multiprocess
def test_resolve_trains_to_the_reference_and_working_combinations_raise_nothing(tmp_path):
    cases = [{"strategy": strategy, "model": model} for strategy, model, _, _ in RESOLVE_CASES]
    results = run_cases(tmp_path, cases, "resolve")
    for (strategy, model, findings, settings), result in zip(RESOLVE_CASES, results):
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
