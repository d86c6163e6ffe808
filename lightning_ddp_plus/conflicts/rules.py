"""Conflict rules between DDP settings and model facts, as data, evaluated by one pure function.

The rules follow what torch 2.13's reducer was measured to do: the docs' reference page "What torch's reducer does"
(``docs/torch-reducer.md``) holds the measured matrix of checkpointing patterns and settings. The test suite re-runs
every failing combination with real processes, on hand-made and on Hugging Face / PEFT models, so that a rule that
stops being true is noticed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

from lightning_ddp_plus.conflicts.facts import ModelFacts

Level = Literal["error", "advice"]


class RuleId(str, Enum):
    """The rules' names: ``R*`` are errors torch's reducer would raise or hide, ``A*`` advice. A ``RuleId`` equals
    its name as a plain string (``RuleId.R6 == "R6"``), so findings compare and serialize as before."""

    R1 = "R1"
    R2 = "R2"
    R3 = "R3"
    R4 = "R4"
    R5 = "R5"
    R6 = "R6"
    R7 = "R7"
    A1 = "A1"
    A2 = "A2"
    A3 = "A3"
    A4 = "A4"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class CheckedSettings:
    """The settings the rules look at (a plain copy, so rules stay pure).

    ``repair_input_grads`` is not a DDP argument: it stands for the resolution of R5, making the inputs of reentrant
    regions require grad (what Hugging Face's ``enable_input_require_grads()`` does).
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    gradient_accumulation_steps: int = 1
    repair_input_grads: bool = False


@dataclass(frozen=True)
class Rule:
    """One rule: when it applies, what goes wrong, how to fix it, and the settings that resolve it."""

    id: RuleId
    level: Level
    title: str
    applies: Callable[[CheckedSettings, ModelFacts], bool]
    problem: Callable[[CheckedSettings, ModelFacts], str]
    fix: str
    resolve: Callable[[CheckedSettings, ModelFacts], dict[str, object]] | None = None


@dataclass(frozen=True)
class Finding:
    rule: Rule
    message: str
    changes: dict[str, object] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"[{self.rule.id}] {self.rule.title}: {self.message} Fix: {self.rule.fix}"


def _names(names: tuple[str, ...] | None, limit: int = 8) -> str:
    names = names or ()
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _r4_resolution(view: CheckedSettings, facts: ModelFacts) -> dict[str, object]:
    # find_unused_parameters=True would trip R1 when reentrant regions compute gradients; static_graph handles both,
    # unless the graph changes between steps, which static_graph cannot describe.
    if facts.reentrant_parameters and not facts.dynamic_modules:
        return {"static_graph": True}
    return _find_unused_resolution(view, facts)


def _find_unused_resolution(view: CheckedSettings, facts: ModelFacts) -> dict[str, object]:
    return {"find_unused_parameters": True, "static_graph": False}


def _by_rank(names_by_rank: tuple[tuple[str, ...], ...]) -> str:
    return "; ".join(f"rank {rank}: {_names(names) or 'none'}" for rank, names in enumerate(names_by_rank))


def _r6_problem(view: CheckedSettings, facts: ModelFacts) -> str:
    if facts.late_graph_grew:
        return (
            f"at optimizer step {facts.late_step} the backward used a parameter that the first step did not use, "
            "which static_graph=True cannot take (torch raised 'Your training graph has changed in this iteration' "
            "inside the backward on some rank). DDPPlusStrategy completed the reduction on every rank, so no rank "
            "waits for the others, and stopped before the optimizer step: replicas are still identical."
        )
    return (
        f"at optimizer step {facts.late_step} these parameters got no gradient "
        f"({_by_rank(facts.late_unused_by_rank)}) although find_unused_parameters={view.find_unused_parameters} and "
        f"static_graph={view.static_graph} promise every step uses the parameters of the first: torch's reducer "
        "all-reduces buckets strictly in order, so it never launched that bucket or any after it. Stock DDP would "
        "apply each rank's own un-averaged gradients at this step (replicas diverge) and fail at the next forward (or "
        "hang, when only some ranks skip the parameters); DDPPlusStrategy completed the reduction on every rank and "
        "stopped before the optimizer step, so replicas are still identical."
    )


_DYNAMIC_FIX = (
    "set find_unused_parameters=True (static_graph cannot describe a graph that changes), or keep the graph constant "
    "(e.g. LayerDrop that multiplies a dropped layer's output by zero instead of skipping the layer; a head that "
    "adds 0 * its loss on the steps it is not trained). checkpointing_conflict='resolve' switches "
    "find_unused_parameters on by itself."
)


RULES: tuple[Rule, ...] = (
    Rule(
        id=RuleId.R1,
        level="error",
        title="reentrant checkpointing with find_unused_parameters=True",
        applies=lambda v, f: (
            f.observed and bool(f.reentrant_parameters) and v.find_unused_parameters and not v.static_graph
        ),
        problem=lambda v, f: (
            f"trainable parameters get their gradient inside reentrant checkpointing ({_names(f.reentrant_parameters)}) "
            "and find_unused_parameters=True with static_graph=False: DDP's search after the forward cannot see them, "
            "marks them unused, and torch's reducer fails in the first backward with 'Expected to mark a variable "
            "ready only once'."
        ),
        fix="set static_graph=True (find_unused_parameters is then not needed), or checkpoint with use_reentrant=False.",
        resolve=lambda v, f: {"static_graph": True, "find_unused_parameters": False},
    ),
    Rule(
        id=RuleId.R2,
        level="error",
        title="parameters whose gradient reentrant checkpointing accumulates more than once",
        applies=lambda v, f: f.observed and bool(f.reused_in_checkpoint) and not v.static_graph,
        problem=lambda v, f: (
            f"these parameters are used in more than one reentrant checkpointed region, or in one and outside it "
            f"({_names(f.reused_in_checkpoint)}), so each backward accumulates their gradient in separate passes; with "
            "static_graph=False torch's reducer fails in the first backward with 'marked as ready twice'."
        ),
        fix="set static_graph=True, or checkpoint with use_reentrant=False.",
        resolve=lambda v, f: {"static_graph": True},
    ),
    Rule(
        id=RuleId.R3,
        level="advice",
        title="static_graph with gradient accumulation",
        applies=lambda v, f: v.static_graph and v.gradient_accumulation_steps > 1,
        problem=lambda v, f: (
            "torch asserts (expect_autograd_hooks_) when the first backward of a static graph skips the all-reduce; "
            "DDPPlusStrategy syncs the run's first micro-batch, which keeps the result exact and costs one all-reduce."
        ),
        fix="nothing to do; this is handled.",
    ),
    Rule(
        id=RuleId.R4,
        level="error",
        title="parameters that get no gradient",
        applies=lambda v, f: (
            f.observed and bool(f.unused_parameters) and not v.find_unused_parameters and not v.static_graph
        ),
        problem=lambda v, f: (
            f"these parameters receive no gradient: {_names(f.unused_parameters)}; with find_unused_parameters=False "
            "and static_graph=False torch's first optimizer step would use unreduced local gradients (replicas silently "
            "diverge) and the next forward fails with 'Expected to have finished reduction in the prior iteration'."
        ),
        fix="set find_unused_parameters=True (or static_graph=True, which also suits reentrant checkpointing), or remove "
        "the unused parameters / set requires_grad=False on them.",
        resolve=_r4_resolution,
    ),
    Rule(
        id=RuleId.R5,
        level="error",
        title="trainable parameters in a reentrant region that gets no gradient",
        applies=lambda v, f: f.observed and bool(f.no_grad_region_parameters) and not v.repair_input_grads,
        problem=lambda v, f: (
            f"a reentrant checkpointed region holds trainable parameters ({_names(f.no_grad_region_parameters)}) but none "
            "of its inputs requires grad, so torch never recomputes it in backward and these parameters get no gradient "
            "at all: they never learn, on every rank alike (torch only warns 'None of the inputs have "
            "requires_grad=True'). find_unused_parameters or static_graph would hide this, not fix it."
        ),
        fix="checkpoint with use_reentrant=False, or make an input of the checkpointed region require grad (Hugging Face "
        "models: call model.enable_input_require_grads() after enabling gradient checkpointing).",
        resolve=lambda v, f: {"repair_input_grads": True},
    ),
    Rule(
        id=RuleId.R6,
        level="error",
        title="parameters unused on some steps",
        applies=lambda v, f: f.late_step is not None,
        problem=_r6_problem,
        fix=_DYNAMIC_FIX,
        resolve=_find_unused_resolution,
    ),
    Rule(
        id=RuleId.R7,
        level="error",
        title="a model whose graph changes between steps",
        applies=lambda v, f: bool(f.dynamic_modules) and (not v.find_unused_parameters or v.static_graph),
        problem=lambda v, f: (
            f"{_names(f.dynamic_modules, limit=4)}: some steps will leave parameters without gradient whether or "
            f"not this first step did, and find_unused_parameters={v.find_unused_parameters}, "
            f"static_graph={v.static_graph} cannot handle that (the reducer waits for a gradient that never comes)."
        ),
        fix=_DYNAMIC_FIX,
        resolve=_find_unused_resolution,
    ),
    Rule(
        id=RuleId.A1,
        level="advice",
        title="find_unused_parameters=True with nothing unused",
        applies=lambda v, f: (
            f.observed
            and v.find_unused_parameters
            and not v.static_graph
            and f.unused_parameters == ()
            and not f.dynamic_modules
            and not f.reentrant_parameters
            and not f.no_grad_region_parameters
        ),
        problem=lambda v, f: (
            "every parameter gets a gradient, yet DDP searches the autograd graph after every forward."
        ),
        fix="set find_unused_parameters=False to skip that search.",
    ),
    Rule(
        id=RuleId.A2,
        level="advice",
        title="broadcast_buffers=False with running statistics",
        applies=lambda v, f: not v.broadcast_buffers and bool(f.mutable_buffers),
        problem=lambda v, f: (
            f"buffers that training changes ({_names(f.mutable_buffers)}) will differ across ranks, silently."
        ),
        fix="set broadcast_buffers=True, or convert BatchNorm to SyncBatchNorm (Trainer(sync_batchnorm=True)).",
    ),
    Rule(
        id=RuleId.A3,
        level="advice",
        title="broadcast_buffers=True with gradient checkpointing",
        applies=lambda v, f: v.broadcast_buffers and f.checkpointed and bool(f.mutable_buffers),
        problem=lambda v, f: (
            "the HF DDP guide advises broadcast_buffers=False with checkpointing. It "
            "changed no parameter outcome; BatchNorm inside a checkpointed block updates its running statistics twice per "
            "step (the recompute), whatever this flag."
        ),
        fix="keep it unless a buffer broadcast per forward costs you time; prefer LayerNorm or SyncBatchNorm inside "
        "checkpointed blocks.",
    ),
    Rule(
        id=RuleId.A4,
        level="advice",
        title="reentrant checkpointing flagged, not observed",
        applies=lambda v, f: not f.observed and f.reentrant and v.find_unused_parameters and not v.static_graph,
        problem=lambda v, f: (
            f"no forward could be observed, but attributes say reentrant checkpointing ({_names(f.checkpoint_sources)}); "
            "if trainable parameters are inside the checkpointed regions, the first backward fails as in R1."
        ),
        fix="run the check where training_step can run, or set static_graph=True / checkpoint with use_reentrant=False.",
    ),
)


def evaluate(view: CheckedSettings, facts: ModelFacts, rules: tuple[Rule, ...] = RULES) -> list[Finding]:
    """Every rule that applies, in table order, with the settings changes that would resolve it.

    >>> facts = ModelFacts(observed=True, checkpointing=frozenset({"reentrant"}), reentrant_parameters=("w",), unused_parameters=())
    >>> [str(f.rule.id) for f in evaluate(CheckedSettings(find_unused_parameters=True), facts)]
    ['R1']
    """
    return [
        Finding(rule=rule, message=rule.problem(view, facts), changes=rule.resolve(view, facts) if rule.resolve else {})
        for rule in rules
        if rule.applies(view, facts)
    ]


def resolved_view(view: CheckedSettings, findings: list[Finding]) -> CheckedSettings:
    """The settings after applying every error-level finding's resolution."""
    changes: dict[str, object] = {}
    for finding in findings:
        if finding.rule.level == "error":
            changes.update(finding.changes)
    return replace(view, **changes)  # type: ignore[arg-type]  # a rule's changes name CheckedSettings fields


# Messages of torch 2.13's reducer and the rule each one means.
_TORCH_ERROR_PATTERNS = (
    (re.compile(r"marked as ready twice|mark a variable ready only once"), RuleId.R1),
    (re.compile(r"expect_autograd_hooks_"), RuleId.R3),
    (re.compile(r"Expected to have finished reduction in the prior iteration"), RuleId.R4),
    (re.compile(r"Your training graph has changed in this iteration"), RuleId.R6),
)


def rule_by_id(rule_id: RuleId) -> Rule:
    """The rule of that id."""
    return next(candidate for candidate in RULES if candidate.id == rule_id)


def rule_for_torch_error(message: str) -> Rule | None:
    """The rule a torch reducer error message corresponds to (R1 stands for R1/R2: torch says the same for both).

    >>> str(rule_for_torch_error("Expected to have finished reduction in the prior iteration before starting a new one").id)
    'R4'
    """
    for pattern, rule_id in _TORCH_ERROR_PATTERNS:
        if pattern.search(message):
            return rule_by_id(rule_id)
    return None


def rules_table() -> str:
    """The rules as a Markdown table (the docs' conflict-checks guide shows this output, written by ``docs/generated.py``)."""
    lines = ["| rule | level | when | fix |", "|---|---|---|---|"]
    lines += [f"| {r.id} | {r.level} | {r.title} | {r.fix} |" for r in RULES]
    return "\n".join(lines)
