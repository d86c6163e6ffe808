"""Conflict rules between DDP settings and model facts, as data, evaluated by one pure function.

The rules follow what torch 2.13's reducer was measured to do (``shared/reference/ddp-behaviour-torch-2.13.md``);
the test suite re-runs every failing combination with real processes so that a rule that stops being true is
noticed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

from lightning_ddp_plus.facts import ModelFacts

Level = Literal["error", "advice"]


@dataclass(frozen=True)
class DDPView:
    """The settings the rules look at (a plain copy, so rules stay pure)."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    gradient_accumulation_steps: int = 1


@dataclass(frozen=True)
class Rule:
    """One rule: when it applies, what goes wrong, how to fix it, and the settings that resolve it."""

    id: str
    level: Level
    title: str
    applies: Callable[[DDPView, ModelFacts], bool]
    problem: Callable[[DDPView, ModelFacts], str]
    fix: str
    resolve: Optional[Callable[[DDPView, ModelFacts], dict[str, object]]] = None


@dataclass(frozen=True)
class Finding:
    rule: Rule
    message: str
    changes: dict[str, object] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"[{self.rule.id}] {self.rule.title}: {self.message} Fix: {self.rule.fix}"


def _names(names: tuple[str, ...], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _r4_resolution(view: DDPView, facts: ModelFacts) -> dict[str, object]:
    # find_unused_parameters=True would trip R1 under reentrant checkpointing; static_graph handles both.
    return {"static_graph": True} if facts.reentrant else {"find_unused_parameters": True}


RULES: tuple[Rule, ...] = (
    Rule(
        id="R1",
        level="error",
        title="reentrant checkpointing with find_unused_parameters=True",
        applies=lambda v, f: f.reentrant and v.find_unused_parameters and not v.static_graph,
        problem=lambda v, f: (
            "the model uses reentrant gradient checkpointing and find_unused_parameters=True with static_graph=False; "
            "torch's reducer fails in the first backward with 'Expected to mark a variable ready only once' "
            f"(checkpointing seen: {_names(f.checkpoint_sources)})."
        ),
        fix="set static_graph=True (find_unused_parameters is then not needed), or checkpoint with use_reentrant=False.",
        resolve=lambda v, f: {"static_graph": True, "find_unused_parameters": False},
    ),
    Rule(
        id="R2",
        level="error",
        title="parameters reused inside a reentrant checkpointed region",
        applies=lambda v, f: f.reentrant and bool(f.reused_in_checkpoint) and not v.static_graph,
        problem=lambda v, f: (
            f"parameters run more than once per forward inside reentrant checkpointing ({_names(f.reused_in_checkpoint)}) "
            "with static_graph=False; torch's reducer fails in the first backward with 'marked as ready twice'."
        ),
        fix="set static_graph=True, or checkpoint with use_reentrant=False.",
        resolve=lambda v, f: {"static_graph": True},
    ),
    Rule(
        id="R3",
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
        id="R4",
        level="error",
        title="parameters that get no gradient",
        applies=lambda v, f: bool(f.unused_parameters) and not v.find_unused_parameters and not v.static_graph,
        problem=lambda v, f: (
            f"these parameters receive no gradient: {_names(f.unused_parameters or ())}; with find_unused_parameters=False "
            "and static_graph=False torch's first optimizer step would use unreduced local gradients (replicas silently "
            "diverge) and the next forward fails with 'Expected to have finished reduction in the prior iteration'."
        ),
        fix="set find_unused_parameters=True (or static_graph=True, which also suits reentrant checkpointing), or remove "
        "the unused parameters / set requires_grad=False on them.",
        resolve=_r4_resolution,
    ),
    Rule(
        id="A1",
        level="advice",
        title="find_unused_parameters=True with nothing unused",
        applies=lambda v, f: v.find_unused_parameters and not v.static_graph and f.unused_parameters == () and not f.reentrant,
        problem=lambda v, f: "every parameter gets a gradient, yet DDP searches the autograd graph after every forward.",
        fix="set find_unused_parameters=False to skip that search.",
    ),
    Rule(
        id="A2",
        level="advice",
        title="broadcast_buffers=False with running statistics",
        applies=lambda v, f: not v.broadcast_buffers and bool(f.mutable_buffers),
        problem=lambda v, f: f"buffers that training changes ({_names(f.mutable_buffers)}) will differ across ranks, silently.",
        fix="set broadcast_buffers=True, or convert BatchNorm to SyncBatchNorm (Trainer(sync_batchnorm=True)).",
    ),
    Rule(
        id="A3",
        level="advice",
        title="broadcast_buffers=True with gradient checkpointing",
        applies=lambda v, f: v.broadcast_buffers and f.checkpointed and bool(f.mutable_buffers),
        problem=lambda v, f: (
            "the HF DDP guide advises broadcast_buffers=False with checkpointing. Measured on torch 2.13 (CPU, gloo): it "
            "changed no parameter outcome; BatchNorm inside a checkpointed block updates its running statistics twice per "
            "step (the recompute), whatever this flag."
        ),
        fix="keep it unless a buffer broadcast per forward costs you time; prefer LayerNorm or SyncBatchNorm inside "
        "checkpointed blocks.",
    ),
)


def evaluate(view: DDPView, facts: ModelFacts, rules: tuple[Rule, ...] = RULES) -> list[Finding]:
    """Every rule that applies, in table order, with the settings changes that would resolve it.

    >>> from lightning_ddp_plus.facts import ModelFacts
    >>> [f.rule.id for f in evaluate(DDPView(find_unused_parameters=True), ModelFacts(checkpointing=frozenset({"reentrant"})))]
    ['R1']
    """
    return [
        Finding(rule=rule, message=rule.problem(view, facts), changes=rule.resolve(view, facts) if rule.resolve else {})
        for rule in rules
        if rule.applies(view, facts)
    ]


def resolved_view(view: DDPView, findings: list[Finding]) -> DDPView:
    """The settings after applying every error-level finding's resolution."""
    changes: dict[str, object] = {}
    for finding in findings:
        if finding.rule.level == "error":
            changes.update(finding.changes)
    return DDPView(**{**view.__dict__, **changes})


# Messages of torch 2.13's reducer and the rule each one means.
_TORCH_ERROR_PATTERNS = (
    (re.compile(r"marked as ready twice|mark a variable ready only once"), "R1"),
    (re.compile(r"expect_autograd_hooks_"), "R3"),
    (re.compile(r"Expected to have finished reduction in the prior iteration"), "R4"),
)


def rule_for_torch_error(message: str) -> Optional[Rule]:
    """The rule a torch reducer error message corresponds to (R1 stands for R1/R2: torch says the same for both).

    >>> rule_for_torch_error("Expected to have finished reduction in the prior iteration before starting a new one").id
    'R4'
    """
    for pattern, rule_id in _TORCH_ERROR_PATTERNS:
        if pattern.search(message):
            return next(rule for rule in RULES if rule.id == rule_id)
    return None


def rules_table() -> str:
    """The rules as a Markdown table (the README's table is this output)."""
    lines = ["| rule | level | when | fix |", "|---|---|---|---|"]
    lines += [f"| {r.id} | {r.level} | {r.title} | {r.fix} |" for r in RULES]
    return "\n".join(lines)
