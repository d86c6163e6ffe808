"""The conflict check of one fit: observe the first training forward, agree on the facts across ranks, evaluate the
rules, and raise, warn or resolve before the first gradient all-reduce and the first optimizer step.

The wrapper exists from setup on (as with stock Lightning); the check watches it through a forward pre-hook and a
forward hook on the wrapper and acts at the first backward, when the loss tells which parameters get gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_ddp_plus.conflicts.errors import DDPConflictError
from lightning_ddp_plus.conflicts.facts import PARAMETER_FACTS, ForwardProbe, InputGradRepair, ModelFacts
from lightning_ddp_plus.conflicts.rules import RULES, DDPView, Finding, evaluate, resolved_view, rule_for_torch_error

log = logging.getLogger(__name__)

_KINDS = ("non_reentrant", "reentrant")


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
    """Every rank must take the same decision (raise, or train with the same settings), so facts are OR-ed."""
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


class ConflictCheck:
    """Owns the probe, the findings and the fixes of one fit.

    Args:
        mode: ``"error"``, ``"warn"``, ``"resolve"`` or ``"off"`` (see ``DDPPlusStrategy(checkpointing_conflict=...)``).
        warn: how warnings reach the user (rank 0 only in a Trainer).
        info: how the resolution is logged.
    """

    def __init__(self, mode: str, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
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
        if self._probe is not None and ddp.training and torch.is_grad_enabled():
            self._probe.start()

    def _forward_ends(self, ddp: Module, args: Any, output: Any) -> None:
        if self._probe is not None:
            self._probe.stop()

    def decide(self, loss: Tensor, view: DDPView, agree: Callable[[ModelFacts], ModelFacts]) -> DDPView:
        """At the first backward: the settings to train with (``view``, or its resolution). Raises
        ``DDPConflictError`` in ``"error"`` mode, and in ``"resolve"`` mode when no safe fix exists."""
        probe, self._probe = self._probe, None
        assert probe is not None
        facts = self._last_facts = agree(probe.facts(loss))
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

    def _install_input_grad_fixes(self, repairs: list[InputGradRepair], errors: list[Finding], view: DDPView) -> None:
        assert self._module is not None
        r5 = [f for f in errors if f.rule.id == "R5"]
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
                    [f for f in errors if f.rule.id == "R5"],
                    view,
                    note=(
                        "'resolve' found no safe fix: the input of the region holding "
                        f"{', '.join(unfixable[0].parameters[:4])} is not the output of a module it could hook, and the "
                        "model has no enable_input_require_grads(). Apply the fix above in your model."
                    ),
                )
            hf_model_: Any = hf_model  # a Hugging Face PreTrainedModel, found by its method
            hf_model_.enable_input_require_grads()
            self._fix_handles.append(_Call(hf_model_.disable_input_require_grads))
            self.model_fixes.append(f"called {type(hf_model).__name__}.enable_input_require_grads()")
        # The fix acts from the next forward on (this one was repaired in flight); check once that it holds.
        self._verifying = True
        self._observe(repair=False)

    def _verify_fixes(self, facts: ModelFacts) -> None:
        self._verifying = False
        self.detach_observers()
        if facts.no_grad_region_parameters:
            finding = next(f for f in evaluate(DDPView(), facts) if f.rule.id == "R5")
            raise conflict_error(
                [finding],
                DDPView(),
                note=f"'resolve' applied a fix ({'; '.join(self.model_fixes)}) that did not hold in the second training "
                "forward. Apply the fix above in your model.",
            )


class _Call:
    """A removable handle that calls a function (to undo ``enable_input_require_grads``)."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self.function = function

    def remove(self) -> None:
        self.function()


def _changed(view: DDPView, resolved: DDPView) -> list[str]:
    return [
        name
        for name in ("find_unused_parameters", "static_graph", "repair_input_grads")
        if getattr(view, name) != getattr(resolved, name)
    ]


def conflict_error(
    errors: list[Finding],
    view: DDPView,
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


def explain_torch_error(message: str) -> str | None:
    """Text to append to a torch reducer error: which rule it is and the fix (``None`` for other errors)."""
    rule = rule_for_torch_error(message)
    if rule is None:
        return None
    return (
        f"lightning-ddp-plus: this is rule {rule.id} ({rule.title}). Fix: {rule.fix} With "
        "`checkpointing_conflict='error'` (the default) DDPPlusStrategy reports it before the first optimizer step; "
        "'resolve' changes the settings for you."
    )


def finding_records(findings: list[Finding]) -> list[tuple[str, str, dict[str, Any]]]:
    """Findings as plain data (rules hold functions, which cannot cross a process boundary)."""
    return [(finding.rule.id, finding.message, dict(finding.changes)) for finding in findings]


def findings_from_records(records: list[tuple[str, str, dict[str, Any]]]) -> list[Finding]:
    rules = {rule.id: rule for rule in RULES}
    return [Finding(rule=rules[rule_id], message=message, changes=changes) for rule_id, message, changes in records]
