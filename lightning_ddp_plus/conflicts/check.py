"""The conflict check of one fit: observe the first training forward, agree on the facts across ranks, evaluate the
rules, and raise, warn or resolve before the first gradient all-reduce and the first optimizer step.

The wrapper exists from setup on (as with stock Lightning); the check watches it through a forward pre-hook and a
forward hook on the wrapper and acts at the first backward, when the loss tells which parameters get gradients.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_ddp_plus.conflicts.errors import DDPConflictError
from lightning_ddp_plus.conflicts.facts import PARAMETER_FACTS, ForwardProbe, InputGradRepair, ModelFacts
from lightning_ddp_plus.conflicts.rules import (
    CheckedSettings,
    Finding,
    RuleId,
    evaluate,
    resolved_view,
    rule_by_id,
    rule_for_torch_error,
)

log = logging.getLogger(__name__)

#: ``checkpointing_conflict``: what the check does with an error-level finding (see ``ConflictCheck``).
ConflictMode = Literal["error", "warn", "resolve", "off"]

_KINDS = ("non_reentrant", "reentrant")
from lightning_ddp_plus.pipeline.component import FitStart, StepComponent


def pack_facts(facts: ModelFacts, parameters: list[str], buffers: list[str]) -> list[int]:
    """The facts as 0/1 flags in a fixed order, so that ranks can OR them with one all-reduce (MAX).

    >>> facts = ModelFacts(observed=True, checkpointing=frozenset({"reentrant"}), unused_parameters=("b",))
    >>> unpack_facts(pack_facts(facts, ["a", "b"], []), ["a", "b"], [], facts).unused_parameters
    ('b',)
    """
    flags = [int(kind in facts.checkpointing) for kind in _KINDS]
    for name in PARAMETER_FACTS:
        present = set(getattr(facts, name) or ())
        flags += [int(parameter in present) for parameter in parameters]
    mutable = set(facts.mutable_buffers)
    return flags + [int(buffer in mutable) for buffer in buffers]


def unpack_facts(flags: list[int], parameters: list[str], buffers: list[str], local: ModelFacts) -> ModelFacts:
    kinds = frozenset(kind for kind, on in zip(_KINDS, flags) if on)
    values: dict[str, Any] = {}
    offset = len(_KINDS)
    for name in PARAMETER_FACTS:
        values[name] = tuple(p for p, on in zip(parameters, flags[offset : offset + len(parameters)]) if on)
        offset += len(parameters)
    return ModelFacts(
        observed=local.observed,
        checkpointing=kinds,
        checkpoint_sources=local.checkpoint_sources,
        mutable_buffers=tuple(b for b, on in zip(buffers, flags[offset:]) if on),
        dynamic_modules=local.dynamic_modules,
        **values,
    )


def agree_across_ranks(facts: ModelFacts, module: Module, device: torch.device) -> ModelFacts:
    """Every rank must take the same decision (raise, or train with the same settings), so facts are OR-ed.

    An agreement of its own, not the step's: it runs once per fit, at the first training forward, and its decision
    changes how that step's backward runs, so it cannot wait for the step's agreement after the synced backward."""
    if not dist.is_available() or not dist.is_initialized():
        return facts
    parameters = [name for name, _ in module.named_parameters()]
    buffers = [name for name, _ in module.named_buffers()]
    vector = torch.tensor(pack_facts(facts, parameters, buffers), dtype=torch.int32, device=device)
    dist.all_reduce(vector, op=dist.ReduceOp.MAX)
    return unpack_facts(vector.tolist(), parameters, buffers, facts)


def _make_output_require_grad(module: Module, args: Any, output: Any) -> None:
    if (
        isinstance(output, Tensor)
        and output.is_floating_point()
        and not output.requires_grad
        and torch.is_grad_enabled()
    ):
        output.requires_grad_(True)


class ConflictCheck(StepComponent):
    """Owns the probe, the findings and the fixes of one fit.

    Args:
        mode: ``"error"``, ``"warn"``, ``"resolve"`` or ``"off"`` (see ``DDPPlusStrategy(checkpointing_conflict=...)``).
        warn: how warnings reach the user (rank 0 only in a Trainer).
        info: how the resolution is logged.
    """

    def __init__(self, mode: ConflictMode, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
        self.mode = mode
        self._warn, self._info = warn, info
        #: What the check found at the first training forward (empty before, or with ``"off"``).
        self.findings: list[Finding] = []
        #: What ``"resolve"`` did to the model itself (fixes for rule R5), in words.
        self.model_fixes: list[str] = []
        self._probe: ForwardProbe | None = None
        self._verifying = False
        self._hooks: list[Any] = []
        self._fix_handles: list[Any] = []
        self._module: Module | None = None
        self._last_facts: ModelFacts | None = None

    @property
    def pending(self) -> bool:
        """A forward is being observed and the decision is due at the next backward."""
        return self._probe is not None

    def fit_starts(self, fit: FitStart) -> None:
        self.attach(fit.ddp, fit.module)

    def fit_ends(self, failed: bool) -> None:
        self.detach()

    def attach(self, ddp: Module, module: Module) -> None:
        """Start a fit: observe ``ddp``'s first training forward (``module`` is the bare model inside)."""
        self.detach()
        self.findings, self.model_fixes = [], []
        if self.mode == "off":
            return
        self._module = module
        self._observe(repair=self.mode == "resolve")
        self._hooks = [
            ddp.register_forward_pre_hook(self._forward_starts),
            ddp.register_forward_hook(self._forward_ends, always_call=True),
        ]

    def detach(self) -> None:
        """End of a fit: remove the hooks, and the fixes made to the model (a later fit checks afresh)."""
        for handle in self._hooks + self._fix_handles:
            handle.remove()
        self._hooks, self._fix_handles = [], []
        self._probe = None
        self._verifying = False

    def _observe(self, repair: bool) -> None:
        assert self._module is not None
        self._probe = ForwardProbe(self._module, repair_input_grads=repair)

    def _forward_starts(self, ddp: Module, args: Any) -> None:
        if self._probe is not None and torch.is_grad_enabled():  # a training forward, as DDP tells it
            self._probe.start()

    def _forward_ends(self, ddp: Module, args: Any, output: Any) -> None:
        if self._probe is not None:
            self._probe.stop()

    def decide(
        self, loss: Tensor | None, view: CheckedSettings, agree: Callable[[ModelFacts], ModelFacts]
    ) -> CheckedSettings:
        """At the first backward: the settings to train with (``view``, or its resolution). Raises
        ``DDPConflictError`` in ``"error"`` mode, and in ``"resolve"`` mode when no safe fix exists. ``loss`` is
        ``None`` on a rank whose first forward failed: it joins the others' agreement and takes their decision."""
        probe, self._probe = self._probe, None
        assert probe is not None
        # a rank whose first forward failed (out of memory) adds nothing: it takes the others' observation
        facts = self._last_facts = agree(probe.facts(loss) if loss is not None else ModelFacts(observed=True))
        if self._verifying:
            self._verify_fixes(facts)
            return view
        self.findings = evaluate(view, facts)
        errors = [finding for finding in self.findings if finding.rule.level == "error"]
        for finding in self.findings:
            if finding.rule.level == "advice" or self.mode == "warn":
                self._warn(f"DDPPlusStrategy: {finding}")
        if not errors or self.mode == "warn":
            self.detach_observers()
            return view
        if self.mode == "error":
            raise conflict_error(errors, view)
        resolved = resolved_view(view, errors)
        if resolved.repair_input_grads and not view.repair_input_grads:
            self._install_input_grad_fixes(probe.repairs, errors, view)
        else:
            self.detach_observers()
        changes = ", ".join(
            f"{name}: {getattr(view, name)} -> {getattr(resolved, name)}" for name in _changed(view, resolved)
        )
        reasons = "; ".join(f"[{finding.rule.id}] {finding.rule.title}" for finding in errors)
        fixes = f" and {'; '.join(self.model_fixes)}" if self.model_fixes else ""
        self._info(f"DDPPlusStrategy resolved conflicts ({reasons}) by setting {changes}{fixes}.")
        return resolved

    def detach_observers(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _install_input_grad_fixes(
        self, repairs: list[InputGradRepair], errors: list[Finding], view: CheckedSettings
    ) -> None:
        assert self._module is not None
        r5 = [f for f in errors if f.rule.id == RuleId.R5]
        repaired = {name for repair in repairs for name in repair.parameters}
        no_grad = self._last_facts.no_grad_region_parameters if self._last_facts is not None else ()
        missed = [name for name in no_grad if name not in repaired]
        if missed:
            raise conflict_error(
                r5,
                view,
                note=f"'resolve' found no safe fix: the region holding {', '.join(missed[:4])} "
                "has no floating-point tensor input to make require grad. Apply the fix above in your model.",
            )
        producers = sorted({repair.producer for repair in repairs if repair.producer is not None})
        for name in producers:
            self._fix_handles.append(self._module.get_submodule(name).register_forward_hook(_make_output_require_grad))
            self.model_fixes.append(
                f"made the output of `{name}` require grad (it feeds a reentrant checkpointed region)"
            )
        if any(repair.producer is None for repair in repairs):
            hf_model = next(
                (m for m in self._module.modules() if callable(getattr(m, "enable_input_require_grads", None))), None
            )
            if hf_model is None:
                unfixable = [repair for repair in repairs if repair.producer is None]
                raise conflict_error(
                    [f for f in errors if f.rule.id == RuleId.R5],
                    view,
                    note=(
                        "'resolve' found no safe fix: the input of the region holding "
                        f"{', '.join(unfixable[0].parameters[:4])} is not the output of a module it could hook, and the "
                        "model has no enable_input_require_grads(). Apply the fix above in your model."
                    ),
                )
            hf_model_: Any = hf_model  # a Hugging Face PreTrainedModel, found by its method
            hf_model_.enable_input_require_grads()
            self._fix_handles.append(UndoWhenRemoved(hf_model_.disable_input_require_grads))
            self.model_fixes.append(f"called {type(hf_model).__name__}.enable_input_require_grads()")
        # The fix acts from the next forward on (this one was repaired in flight); check once that it holds.
        self._verifying = True
        self._observe(repair=False)

    def _verify_fixes(self, facts: ModelFacts) -> None:
        self._verifying = False
        self.detach_observers()
        if facts.no_grad_region_parameters:
            finding = next(f for f in evaluate(CheckedSettings(), facts) if f.rule.id == RuleId.R5)
            raise conflict_error(
                [finding],
                CheckedSettings(),
                note=f"'resolve' applied a fix ({'; '.join(self.model_fixes)}) that did not hold in the second training "
                "forward. Apply the fix above in your model.",
            )


class UndoWhenRemoved:
    """A handle, like a hook's, whose ``remove`` undoes a fix by calling ``function`` (``enable_input_require_grads``
    is undone by ``disable_input_require_grads``)."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self.function = function

    def remove(self) -> None:
        self.function()


def _changed(view: CheckedSettings, resolved: CheckedSettings) -> list[str]:
    return [
        name
        for name in ("find_unused_parameters", "static_graph", "repair_input_grads")
        if getattr(view, name) != getattr(resolved, name)
    ]


def conflict_error(
    errors: list[Finding],
    view: CheckedSettings,
    note: str = "",
    when: str = "at the first training forward, before any gradient was all-reduced and before any optimizer step",
) -> DDPConflictError:
    settings = ", ".join(f"{name}={getattr(view, name)}" for name in ("find_unused_parameters", "static_graph"))
    return DDPConflictError(
        f"DDPPlusStrategy found DDP settings that torch's reducer cannot train this model with (checked {when}):\n"
        + "\n".join(f"  {finding}" for finding in errors)
        + f"\nSettings: {settings}. "
        + (note or "Or set `checkpointing_conflict='resolve'` to let the strategy change them."),
        errors,
    )


@dataclass(frozen=True)
class FindingRecord:
    """A finding as plain data (rules hold functions, which cannot cross a process boundary)."""

    rule_id: RuleId
    message: str
    changes: dict[str, Any]


def finding_records(findings: list[Finding]) -> list[FindingRecord]:
    """Findings as plain data, for the process that launched the workers."""
    return [FindingRecord(finding.rule.id, finding.message, dict(finding.changes)) for finding in findings]


def findings_from_records(records: list[FindingRecord]) -> list[Finding]:
    return [
        Finding(rule=rule_by_id(record.rule_id), message=record.message, changes=record.changes) for record in records
    ]


@dataclass(frozen=True)
class LateFaultDecision:
    """What rule R6 leads to when the per-step guard found a fault: an error to raise, or settings to train on with
    and the report that says so (``warn``: as a warning rather than an info line)."""

    finding: Finding
    error: DDPConflictError | None = None
    resolved: CheckedSettings | None = None
    report: str = ""
    warn: bool = False


def decide_late_fault(
    settings: CheckedSettings, facts: ModelFacts, mode: ConflictMode, fault_text: str, skipped: bool
) -> LateFaultDecision:
    """Rule R6 after a synced backward that some rank's reducer did not finish (the guard completed it already).

    ``fault_text`` says per rank what was left without gradient; ``skipped``: the step's gradients could not be made
    exact and were dropped on every rank. ``"resolve"`` and ``"warn"`` switch ``find_unused_parameters`` on (and
    ``static_graph`` off) and train on; ``"error"`` and ``"off"`` raise.

    >>> facts = ModelFacts(observed=True, late_step=3, late_unused_by_rank=(("head.weight",), ()))
    >>> decision = decide_late_fault(CheckedSettings(), facts, "resolve", "rank 0: head.weight", skipped=False)
    >>> decision.error is None, decision.resolved.find_unused_parameters
    (True, True)
    """
    [finding] = [found for found in evaluate(settings, facts) if found.rule.id == RuleId.R6]
    if mode not in ("resolve", "warn"):
        error = conflict_error(
            [finding],
            settings,
            when=f"at optimizer step {facts.late_step}, after its backward and before its optimizer step",
            note="Or set `checkpointing_conflict='resolve'` to switch find_unused_parameters on and train on.",
        )
        return LateFaultDecision(finding, error=error)
    resolved = dataclasses.replace(settings, find_unused_parameters=True, static_graph=False)
    if skipped:
        what = (
            "This step's gradients could not be made exact (a backward failed, or bucket views were reduced in "
            "place), so they were dropped on every rank: the optimizer step skips it (the batch is not trained)."
        )
    else:
        what = "This step's gradients were averaged on every rank as find_unused_parameters=True averages them."
    report = (
        f"DDPPlusStrategy resolved [{RuleId.R6}] parameters unused on some steps ("
        + ("the graph gained a parameter" if facts.late_graph_grew else fault_text)
        + f") at optimizer step {facts.late_step} by setting find_unused_parameters: "
        f"{settings.find_unused_parameters} -> True"
        + (", static_graph: True -> False" if settings.static_graph else "")
        + f". {what}"
    )
    return LateFaultDecision(finding, resolved=resolved, report=report, warn=mode == "warn")


def recovers_in_backward(error: BaseException) -> bool:
    """Whether a backward's error is one the per-step guard can take over (rule R6: a static graph that gained a
    parameter), rather than one to re-raise."""
    found = rule_for_torch_error(str(error))
    return found is not None and found.id == RuleId.R6
