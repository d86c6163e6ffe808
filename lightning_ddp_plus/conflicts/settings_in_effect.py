"""The DDP settings a run trains with, and the reducer rebuilt in place when a conflict rule changes them.

They start as given, ``broadcast_buffers="auto"`` is decided when the model is wrapped (on when it has running
statistics), and the rules may change ``find_unused_parameters`` and ``static_graph``: at the first backward
(``"resolve"``), or after a step some rank's reducer did not finish (rule R6, ``"resolve"`` and ``"warn"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.conflicts.check import ConflictCheck, agree_across_ranks, decide_late_fault
from lightning_ddp_plus.conflicts.facts import ModelFacts, running_stat_buffers
from lightning_ddp_plus.conflicts.rules import CheckedSettings
from lightning_ddp_plus.private_apis.torch_ddp import rebuild_reducer, replay_forward


class LateFault(Protocol):
    """What the per-step guard found after a synced backward (``sync.step_guard.SyncFault``), as rule R6 reads it."""

    @property
    def step(self) -> int: ...
    @property
    def unused(self) -> tuple[tuple[str, ...], ...]: ...
    @property
    def aborted(self) -> bool: ...
    @property
    def skipped(self) -> bool: ...
    def describe(self) -> str: ...


class SettingsInEffect:
    """The settings in effect (``current``) and their changes.

    Args:
        given: the settings as the arguments gave them.
        on_rebuilt: told of every reducer a rule's change rebuilt after the first backward (telemetry reads its
            buckets again).
    """

    def __init__(self, given: DDPSettings, on_rebuilt: Callable[[DistributedDataParallel], None]) -> None:
        self.given = given
        self.current = given.resolve_auto(True) if given.broadcast_buffers == "auto" else given
        self.on_rebuilt = on_rebuilt

    def for_module(self, module: Module) -> DDPSettings:
        """At wrapping: ``broadcast_buffers="auto"`` decided for ``module``."""
        self.current = self.given.resolve_auto(bool(running_stat_buffers(module)))
        return self.current

    def checked(self, accumulation_steps: int) -> CheckedSettings:
        """The settings in effect, as the conflict rules look at them."""
        return CheckedSettings(
            find_unused_parameters=self.current.find_unused_parameters,
            static_graph=self.current.static_graph,
            broadcast_buffers=bool(self.current.broadcast_buffers),
            gradient_accumulation_steps=accumulation_steps,
        )

    def change(self, ddp: DistributedDataParallel, resolved: CheckedSettings, always: bool = False) -> bool:
        """Apply what a rule resolved: a new reducer when it differs (``always``: even when it does not); False when
        nothing changed."""
        unchanged = (resolved.find_unused_parameters, resolved.static_graph) == (
            self.current.find_unused_parameters,
            self.current.static_graph,
        )
        if unchanged and not always:
            return False
        self.current = dataclasses.replace(
            self.current, find_unused_parameters=resolved.find_unused_parameters, static_graph=resolved.static_graph
        )
        rebuild_reducer(ddp, resolved.find_unused_parameters, resolved.static_graph)
        return True

    def at_first_backward(
        self,
        check: ConflictCheck,
        ddp: DistributedDataParallel,
        loss: Tensor | None,
        accumulation_steps: int,
        forward_synced: bool,
        post_forward: bool,
    ) -> Tensor | None:
        """The conflict check decides, with every rank's facts; a change rebuilds the reducer and redoes for it what
        the forward did (``post_forward``: DDP's forward had finished). Returns the loss to run backward on."""
        device = next(ddp.module.parameters()).device
        resolved = check.decide(
            loss, self.checked(accumulation_steps), lambda f: agree_across_ranks(f, ddp.module, device)
        )
        if not self.change(ddp, resolved) or loss is None:
            return loss
        return replay_forward(ddp, loss, forward_synced, post_forward)

    def rebuild(self, ddp: DistributedDataParallel) -> None:
        """A new reducer with the settings in effect (after a backward that failed half way)."""
        rebuild_reducer(ddp, self.current.find_unused_parameters, self.current.static_graph)
        self.on_rebuilt(ddp)

    def after_late_fault(
        self,
        check: ConflictCheck,
        ddp: DistributedDataParallel,
        fault: LateFault,
        accumulation_steps: int,
        warn: Callable[[str], None],
        info: Callable[[str], None],
    ) -> None:
        """Rule R6 decides: raises its error, or changes the settings, keeps the finding in ``check`` and reports
        it (as a warning, or a line)."""
        facts = ModelFacts(
            observed=True, late_step=fault.step, late_unused_by_rank=fault.unused, late_graph_grew=fault.aborted
        )
        checked = self.checked(accumulation_steps)
        decision = decide_late_fault(checked, facts, check.mode, fault.describe(), fault.skipped)
        if decision.error is not None:
            raise decision.error
        assert decision.resolved is not None
        self.change(ddp, decision.resolved, always=True)
        self.on_rebuilt(ddp)
        check.findings.append(decision.finding)
        (warn if decision.warn else info)(decision.report)
