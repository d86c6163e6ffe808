"""``StepComponent``: one per-step feature, with one small protocol; ``StepPipeline``: an ordered list of them,
called in order.

A component overrides the points it acts at; the others do nothing. Over a fit the pipeline calls:

1. ``fit_starts(FitStart)``: a new wrapper; counters and cadences restart.
2. per training forward, ``forward_starts(ForwardStart)`` (every forward of the wrapper, ``training`` says which);
3. per backward, ``before_backward(BackwardStart)``, the backward, ``after_backward(BackwardEnd)``; after a synced
   one, the ranks agree in one exchange that carries every component's ``agreement_flags`` (their values from
   ``agreement_values``, asked as the backward's last gradient bucket leaves), and each component reads the outcome
   by name in ``agreed(AgreedStep)``;
4. per optimizer step, ``step_done(step)``, which issues no collective; then, once the front end's loop has counted
   the step (before the next training forward, or at the epoch's end), ``step_counted(step)``, where the collectives
   a step makes due run (the straggler comparison): a death learnt in one of them then saves a whole step, where in
   ``step_done`` it would pair step k+1's weights with the loop's counters of step k;
5. ``epoch_ends(EpochEnd)``, and at the end of training the same with ``training_ends``;
6. ``fit_ends(failed)``, in the reverse order, what was attached first is detached last.

Every component that acts at a point is called there on every rank, in the same order, so a component may issue a
collective at a point where its decision is the same on every rank (the replica guard's check, the straggler
comparison). A component is not called at a point it does not override, nor at the agreement's points when it
declares no flag: a step costs only what acts in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.pipeline.agreement import AgreedFlags, AgreementFlags


@dataclass(frozen=True, kw_only=True)
class FitStart:
    """A fit starts on a new wrapper."""

    ddp: DistributedDataParallel
    """The wrapper the fit trains."""
    module: Module
    """The bare model inside it."""
    broadcast_buffers: bool
    """DDP broadcasts rank 0's buffers at every forward (``broadcast_buffers`` in effect)."""


@dataclass(frozen=True, kw_only=True)
class ForwardStart:
    """A forward of the wrapper starts (DDP's own pre-hooks have not run yet)."""

    ddp: DistributedDataParallel
    training: bool
    """A training forward (the wrapper trains and autograd records)."""
    step: int
    """Optimizer steps applied so far in this fit (as ``trainer.global_step``)."""


@dataclass(frozen=True, kw_only=True)
class BackwardStart:
    """A backward is about to run."""

    ddp: DistributedDataParallel
    loss: Tensor | None
    """The loss as the front end gave it (before any scaling)."""
    synced: bool
    """This backward all-reduces the gradients."""
    forward_synced: bool
    """The training forward before it ran with gradient sync on."""
    closes_window: bool
    """It is the last backward of its accumulation window (a synced one, on the last chunk)."""


@dataclass(frozen=True, kw_only=True)
class BackwardEnd:
    """A backward ran (or raised what the per-step guard takes over), before the ranks' agreement."""

    ddp: DistributedDataParallel | None
    synced: bool
    failed: bool = False
    """It raised what the guard completes on this rank."""


@dataclass(frozen=True, kw_only=True)
class AgreedStep:
    """What the ranks agreed after a synced backward, read by name."""

    flags: AgreedFlags
    """Every declared flag's maximum over the ranks."""
    step: int
    """The optimizer step the backward belongs to (steps applied so far + 1)."""
    out_of_memory: bool
    """Some rank ran out of memory in this attempt: the batch runs again, no step follows it yet."""
    skipped: bool = False
    """The guard dropped this step's gradients on every rank (they could not be made exact): nothing to average."""


@dataclass(frozen=True, kw_only=True)
class EpochEnd:
    """A training epoch ended on every rank (also at the end of training, where ``training_ends``)."""

    step: int
    """Optimizer steps applied so far in this fit."""
    training_ends: bool = False
    """Training ends too: no forward follows."""


class StepComponent:
    """One per-step feature: override the points it acts at (see the module's docstring). A small published base
    class, as torch's ``JoinHook``: the engine calls it, a component never calls another's points."""

    #: The names of the flags this component adds to the per-step agreement (read back by name in ``agreed``); an
    #: instance may declare its own, from its settings, which are the same on every rank.
    agreement_flags: tuple[str, ...] = ()

    def fit_starts(self, fit: FitStart) -> None:
        """A fit starts on ``fit.ddp``: attach, and restart what a fit counts."""

    def forward_starts(self, forward: ForwardStart) -> None:
        """A forward of the wrapper starts."""

    def before_backward(self, backward: BackwardStart) -> None:
        """A backward is about to run."""

    def after_backward(self, backward: BackwardEnd) -> None:
        """A backward ran; for a synced one the agreement follows."""

    def agreement_needed(self) -> bool:
        """Where no guard check carries the flags: whether this component's must be exchanged after this synced
        backward (their own all-reduce; the same answer on every rank). By default whenever it declares any."""
        return bool(self.agreement_flags)

    def agreement_values(self) -> Mapping[str, int]:
        """This rank's values of ``agreement_flags`` for the agreement about to run (the maximum over the ranks is
        agreed; a name left out counts 0)."""
        return {}

    def agreed(self, agreed: AgreedStep) -> None:
        """The ranks agreed after a synced backward."""

    def step_done(self, step: int) -> None:
        """Optimizer step ``step`` (counted from 1 in each fit) was applied on every rank; no collective here (see
        ``step_counted``)."""

    def step_counted(self, step: int) -> None:
        """The front end's loop has counted optimizer step ``step`` (before the next training forward, or at the
        epoch's end): the collectives the step made due run here, on every rank."""

    def epoch_ends(self, end: EpochEnd) -> None:
        """A training epoch ended (and training, where ``end.training_ends``)."""

    def fit_ends(self, failed: bool) -> None:
        """The fit ends (``failed``: with an error): detach."""


class StepPipeline:
    """The components of a run in their order: each point of a fit calls every component in that order
    (``fit_ends`` in the reverse one).

    >>> class Counter(StepComponent):
    ...     agreement_flags = ("news",)
    ...     def __init__(self):
    ...         self.steps = []
    ...     def step_done(self, step):
    ...         self.steps.append(step)
    >>> counter = Counter()
    >>> pipeline = StepPipeline([counter])
    >>> pipeline.step_done(1); pipeline.step_done(2)
    >>> counter.steps, pipeline.flags.names
    ([1, 2], ('news',))
    """

    def __init__(self, components: Iterable[StepComponent | None]) -> None:
        #: ``None`` entries are features turned off by their arguments.
        self.components: list[StepComponent] = [c for c in components if c is not None]
        #: The step applied last whose ``step_counted`` has not run yet.
        self.uncounted_step: int | None = None
        wrong = [type(c).__name__ for c in self.components if not isinstance(c, StepComponent)]
        if wrong:
            raise TypeError(f"pipeline components must subclass StepComponent: {wrong}")
        self._lay_out()

    def _lay_out(self) -> None:
        """Which components act at each point, and the agreement's flags."""
        self.flags = AgreementFlags(name for c in self.components for name in c.agreement_flags)
        self._at = {
            point: [c for c in self.components if _acts_at(c, point)]
            for point in vars(StepComponent)
            if callable(getattr(StepComponent, point)) and not point.startswith("_")
        }

    def __iter__(self) -> Iterator[StepComponent]:
        return iter(self.components)

    def add(self, component: StepComponent, before: StepComponent | None = None) -> None:
        """A further component, last or just before ``before`` (its flags join the agreement)."""
        index = self.components.index(before) if before is not None else len(self.components)
        self.components.insert(index, component)
        self._lay_out()

    def fit_starts(self, fit: FitStart) -> None:
        self.uncounted_step = None
        for component in self._at["fit_starts"]:
            component.fit_starts(fit)

    def forward_starts(self, forward: ForwardStart) -> None:
        for component in self._at["forward_starts"]:
            component.forward_starts(forward)

    def before_backward(self, backward: BackwardStart) -> None:
        for component in self._at["before_backward"]:
            component.before_backward(backward)

    def after_backward(self, backward: BackwardEnd) -> None:
        for component in self._at["after_backward"]:
            component.after_backward(backward)

    def agreement_needed(self) -> bool:
        return any(component.agreement_needed() for component in self._at["agreement_needed"])

    def agreement_values(self) -> dict[str, int]:
        values: dict[str, int] = {}
        for component in self._at["agreement_values"]:
            values.update(component.agreement_values())
        return values

    def agreed(self, agreed: AgreedStep) -> None:
        for component in self._at["agreed"]:
            component.agreed(agreed)

    def step_done(self, step: int) -> None:
        self.uncounted_step = step
        for component in self._at["step_done"]:
            component.step_done(step)

    def count_step(self) -> None:
        """The front end's loop has counted the last step applied (a training forward starts, or an epoch ends):
        its ``step_counted`` runs, once."""
        step, self.uncounted_step = self.uncounted_step, None
        if step is not None:
            for component in self._at["step_counted"]:
                component.step_counted(step)

    def epoch_ends(self, end: EpochEnd) -> None:
        self.count_step()
        for component in self._at["epoch_ends"]:
            component.epoch_ends(end)

    def fit_ends(self, failed: bool) -> None:
        for component in reversed(self._at["fit_ends"]):
            component.fit_ends(failed)


#: The points where a component without flags has nothing to say.
_AGREEMENT_POINTS = ("agreement_needed", "agreement_values")


def _acts_at(component: StepComponent, point: str) -> bool:
    """``component`` declares flags, at the agreement's points (the default ``agreement_needed`` reads them), or
    overrides ``point``."""
    if point in _AGREEMENT_POINTS:
        return bool(component.agreement_flags)
    return getattr(getattr(component, point), "__func__", None) is not getattr(StepComponent, point)
