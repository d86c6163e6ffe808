"""Model facts that decide whether a DDP configuration works, observed during a real training forward.

What torch's reducer cares about is where each trainable parameter's gradient is accumulated (the rule table in the
docs' conflict checks guide gives the measurements):

- the autograd graph of the loss (ordinary use, non-reentrant checkpointing included);
- a reentrant checkpointed region, whose parameters are hidden from that graph and get their gradient in a separate
  backward pass run when the region is recomputed; a region whose tensor inputs do not require grad is never
  recomputed, so its parameters get no gradient at all.

A parameter accumulated in more than one of these places is "marked ready twice"; one used several times inside
one region is not. So the probe attributes every use of a parameter to the innermost reentrant region it happens
in, whatever the call form (module call, ``F.linear(h, self.weight)``, ``h * self.scale`` in a lambda, nested
regions), through a ``TorchFunctionMode`` that is active only inside reentrant regions, and reads the rest from the
loss's autograd graph. What a forward really does wins over what attributes suggest; attributes (Hugging Face flags,
torch's ``CheckpointWrapper``) are only read when no forward can be observed (``static_facts``).

The probe patches ``torch.utils.checkpoint`` (reentrant: ``CheckpointFunction.apply``; non-reentrant: the
saved-tensors hook class each region enters) only between ``start()`` and ``stop()`` (one forward), restores it even
if the forward raises, and registers its module hooks on the probed model only.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from typing_extensions import Self

from lightning_ddp_plus.private_apis.torch_distributed import tree_leaves

REENTRANT = "reentrant"
NON_REENTRANT = "non_reentrant"


def non_reentrant_hook_class() -> type | None:
    """The saved-tensors hook that non-reentrant ``torch.utils.checkpoint`` enters for each region, where this torch
    has one we can see (a class of its own with an ``__init__`` taking the region's frame), else ``None``."""
    hook_class = getattr(torch_checkpoint, "_checkpoint_hook", None)
    hooks = getattr(torch.autograd.graph, "saved_tensors_hooks", None)
    if not isinstance(hook_class, type) or hooks is None or not issubclass(hook_class, hooks):
        return None
    return hook_class if "__init__" in hook_class.__dict__ else None


def warn_probe_blind(kind: str, missing: str) -> None:
    """The probe cannot see ``kind`` checkpointing on this torch (``missing`` is what it looked for): say so once per
    probe, rather than report no checkpointing."""
    warnings.warn(
        f"lightning-ddp-plus: torch {torch.__version__} has no {missing} for the conflict check's probe to see, so "
        f"it cannot observe {kind} gradient checkpointing on this torch: the conflict rules that depend on it are "
        "incomplete. Please report your torch version to lightning-ddp-plus; meanwhile set find_unused_parameters "
        "and static_graph as the docs' rule table says for how your model checkpoints.",
        stacklevel=4,
    )


@dataclass(frozen=True)
class ModelFacts:
    """What the conflict rules look at; parameter names as ``named_parameters()`` gives them.

    Attributes:
        observed: facts come from a real forward (``False``: read from attributes only, see ``static_facts``).
        checkpointing: kinds of gradient checkpointing seen (``"reentrant"``, ``"non_reentrant"``).
        checkpoint_sources: where the checkpointing was seen, for messages.
        reentrant_parameters: trainable parameters whose gradient a reentrant region that the loss reaches computes.
        reused_in_checkpoint: trainable parameters whose gradient is accumulated in more than one backward pass: in
            two reentrant regions, or in one and outside it.
        unused_parameters: trainable parameters that get no gradient (``None`` when no forward was observed).
        no_grad_region_parameters: trainable parameters inside a reentrant region entered with grad enabled but no
            input that requires grad: torch never recomputes such a region, so they never learn.
        mutable_buffers: buffers that a training forward changes (BatchNorm-style running statistics).
        dynamic_modules: modules whose graph changes from step to step by design (LayerDrop active in training, or a
            module that sets ``ddp_dynamic_graph = True``), with the reason, for messages.
        late_step: the optimizer step at which the per-step guard found parameters without gradient (``None``: the
            facts are from the first forward).
        late_unused_by_rank: per rank, the parameters that got no gradient at ``late_step``.
        late_graph_grew: at ``late_step`` a backward failed because it used a parameter that ``static_graph``'s first
            step did not (torch: "Your training graph has changed in this iteration").
    """

    observed: bool = False
    checkpointing: frozenset[str] = frozenset()
    checkpoint_sources: tuple[str, ...] = ()
    reentrant_parameters: tuple[str, ...] = ()
    reused_in_checkpoint: tuple[str, ...] = ()
    unused_parameters: tuple[str, ...] | None = None
    no_grad_region_parameters: tuple[str, ...] = ()
    mutable_buffers: tuple[str, ...] = ()
    dynamic_modules: tuple[str, ...] = ()
    late_step: int | None = None
    late_unused_by_rank: tuple[tuple[str, ...], ...] = ()
    late_graph_grew: bool = False

    @property
    def reentrant(self) -> bool:
        return REENTRANT in self.checkpointing

    @property
    def checkpointed(self) -> bool:
        return bool(self.checkpointing)


#: The per-parameter facts, in the order ``agreement`` packs them.
PARAMETER_FACTS = ("reentrant_parameters", "reused_in_checkpoint", "unused_parameters", "no_grad_region_parameters")


def static_facts(module: nn.Module) -> ModelFacts:
    """Facts readable from the module itself, without running it: checkpointing flags and changing buffers.

    >>> from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, CheckpointImpl
    >>> model = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl=CheckpointImpl.REENTRANT))
    >>> sorted(static_facts(model).checkpointing), static_facts(model).observed
    (['reentrant'], False)
    """
    kinds: set[str] = set()
    sources: list[str] = []
    for name, sub in module.named_modules():
        kind = _flagged_checkpointing_kind(sub)
        if kind is not None:
            kinds.add(kind)
            sources.append(f"{name or type(sub).__name__}: gradient_checkpointing flag ({kind}, from attributes)")
    return ModelFacts(
        checkpointing=frozenset(kinds),
        checkpoint_sources=tuple(sources),
        mutable_buffers=running_stat_buffers(module),
        dynamic_modules=find_dynamic_modules(module),
    )


#: Hugging Face config attributes that switch LayerDrop on (wav2vec2, HuBERT, WavLM, BART, Whisper, M2M100 ...).
LAYERDROP_ATTRIBUTES = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def find_dynamic_modules(module: nn.Module) -> tuple[str, ...]:
    """Modules whose training graph changes between steps by design, with the reason.

    LayerDrop (a Hugging Face config's ``layerdrop``, ``encoder_layerdrop`` or ``decoder_layerdrop`` above 0, read
    once per config object, while the module trains), or a module that declares itself dynamic with the attribute
    ``ddp_dynamic_graph = True`` (multi-task heads chosen per batch, towers skipped for some batches).

    >>> class Heads(nn.Module):
    ...     ddp_dynamic_graph = True
    >>> find_dynamic_modules(nn.Sequential(nn.Linear(2, 2), Heads()))
    ('1: declares ddp_dynamic_graph = True',)
    """
    found: list[str] = []
    configs_seen: set[int] = set()
    for name, sub in module.named_modules():
        label = name or type(sub).__name__
        if getattr(sub, "ddp_dynamic_graph", False) is True:
            found.append(f"{label}: declares ddp_dynamic_graph = True")
        config = getattr(sub, "config", None)
        if config is None or id(config) in configs_seen or not sub.training:
            continue
        configs_seen.add(id(config))
        for attribute in LAYERDROP_ATTRIBUTES:
            value = getattr(config, attribute, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                found.append(f"{label}: LayerDrop ({type(config).__name__}.{attribute}={value:g})")
    return tuple(found)


def _flagged_checkpointing_kind(module: nn.Module) -> str | None:
    impl = getattr(module, "checkpoint_impl", None)
    if type(module).__name__ == "CheckpointWrapper" and impl is not None:
        return NON_REENTRANT if "NO_REENTRANT" in getattr(impl, "name", str(impl)).upper() else REENTRANT
    if getattr(module, "gradient_checkpointing", None) is not True:
        return None
    keywords = getattr(getattr(module, "_gradient_checkpointing_func", None), "keywords", None) or {}
    if "use_reentrant" not in keywords:
        return None  # unknown: only a forward tells
    return REENTRANT if keywords["use_reentrant"] else NON_REENTRANT


def running_stat_buffers(module: nn.Module) -> tuple[str, ...]:
    """Buffers that a training forward updates: BatchNorm-style running statistics."""
    names = []
    for name, sub in module.named_modules():
        if getattr(sub, "track_running_stats", False) and getattr(sub, "running_mean", None) is not None:
            prefix = f"{name}." if name else ""
            names += [prefix + buffer_name for buffer_name, _ in sub.named_buffers(recurse=False)]
    return tuple(names)


@dataclass
class _Region:
    """One call of reentrant ``torch.utils.checkpoint``."""

    parent: int | None
    grad_enabled: bool
    inputs_require_grad: bool
    parameters: set[int] = field(default_factory=set)
    node: Any = None  # the region's backward node (its output's grad_fn), when the output requires grad
    repaired_input: str | None = None  # module whose output fed the repaired input ("" when none is known)


@dataclass(frozen=True)
class InputGradRepair:
    """A reentrant region whose inputs did not require grad, repaired for the probed forward.

    ``producer`` is the module (a name from ``named_modules()``) whose output was the region's input, or ``None``
    when the input was not a module's output.
    """

    producer: str | None
    parameters: tuple[str, ...]


class _ParameterUses(TorchFunctionMode):
    """Attributes every tensor operation that takes a trainable parameter to the innermost open reentrant region."""

    def __init__(self, probe: ForwardProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # Reading an attribute (`.dtype`, `.shape`, `.data`) or detaching is not a use that carries a gradient.
        if getattr(func, "__name__", "") not in ("__get__", "detach", "detach_") and self.probe._stack:
            region = self.probe._regions[self.probe._stack[-1]]
            trainable = self.probe._trainable
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, Tensor) and id(leaf) in trainable:
                    region.parameters.add(id(leaf))
        return func(*args, **kwargs)


class ForwardProbe:
    """Observes training forwards (``start()`` ... ``stop()``, repeatable) and tells the facts for a loss.

    Args:
        module: the model whose parameters and buffers are reported (the bare module, not the DDP wrapper).
        repair_input_grads: when a reentrant region is entered with grad enabled and no input requiring grad, feed it
            a copy of its first floating-point input that requires grad, so that its parameters do get gradients in
            this forward (the resolution of rule R5); ``repairs`` says which regions were repaired.

    >>> import torch.utils.checkpoint as cp
    >>> block, scale = nn.Linear(4, 4), nn.Parameter(torch.ones(4))
    >>> model = nn.ModuleDict({"block": block}); model.scale = scale
    >>> with ForwardProbe(model) as probe:
    ...     h = torch.randn(2, 4, requires_grad=True)
    ...     loss = cp.checkpoint(lambda t: block(t) * scale, h, use_reentrant=True).sum()
    >>> facts = probe.facts(loss)
    >>> facts.unused_parameters, sorted(facts.reentrant_parameters)
    ((), ['block.bias', 'block.weight', 'scale'])
    """

    def __init__(self, module: nn.Module, repair_input_grads: bool = False) -> None:
        self.module = module
        self.repair_input_grads = repair_input_grads
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._trainable = {id(p) for p in module.parameters() if p.requires_grad}
        self._regions: list[_Region] = []
        self._stack: list[int] = []
        self._kinds: set[str] = set()
        self._buffers_before: dict[str, Tensor] | None = None
        self._outputs: dict[int, tuple[weakref.ref[Any], str]] = {}
        self._handles: list[Any] = []
        self._restore: list[Any] = []
        self._mode = _ParameterUses(self)
        self.active = False

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start observing (idempotent)."""
        if self.active:
            return
        if self._buffers_before is None:
            self._buffers_before = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        self._patch_checkpoint()
        if self.repair_input_grads:
            for name, sub in self.module.named_modules():
                self._handles.append(sub.register_forward_hook(self._remember_output(name)))
        self.active = True

    def stop(self) -> None:
        """Stop observing and restore everything patched (idempotent); call it before backward, where reentrant
        checkpointing re-runs the forward."""
        if not self.active:
            return
        self.active = False
        while self._restore:
            self._restore.pop()()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _patch_checkpoint(self) -> None:
        self._patch_non_reentrant()
        probe = self
        function_class = getattr(torch_checkpoint, "CheckpointFunction", None)
        if not isinstance(function_class, type) or not hasattr(function_class, "apply"):
            warn_probe_blind("reentrant", "`torch.utils.checkpoint.CheckpointFunction`")
            return
        original_apply: Callable[..., Any] = function_class.apply

        def apply(run_function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            args, region = probe._open_region(args)
            try:
                if len(probe._stack) == 1:
                    with probe._mode:
                        output = original_apply(run_function, preserve_rng_state, *args)
                else:
                    output = original_apply(run_function, preserve_rng_state, *args)
            finally:
                probe._stack.pop()
            region.node = next((t.grad_fn for t in _tensors(output) if t.grad_fn is not None), None)
            return output

        own_apply = function_class.__dict__.get("apply")
        setattr(function_class, "apply", apply)  # noqa: B010  (a method mypy would not let us assign)
        self._restore.append(
            lambda: setattr(function_class, "apply", own_apply) if own_apply else delattr(function_class, "apply")
        )

    def _patch_non_reentrant(self) -> None:
        """See non-reentrant checkpointing by the saved-tensors hook every non-reentrant region enters
        (``_checkpoint_hook``: in torch since 2.0, tested on 2.13, 2.14 and 2.15), patched on the class so that
        whichever function of ``torch.utils.checkpoint`` enters it is seen; where this torch has no such hook, warn
        that the check is blind to it instead of reporting nothing."""
        hook_class = non_reentrant_hook_class()
        if hook_class is None:
            warn_probe_blind("non-reentrant", "`torch.utils.checkpoint._checkpoint_hook` saved-tensors hook class")
            return
        probe = self
        original_init = hook_class.__dict__["__init__"]

        def init(hook: Any, *args: Any, **kwargs: Any) -> None:
            probe._kinds.add(NON_REENTRANT)
            original_init(hook, *args, **kwargs)

        hook_class.__init__ = init  # type: ignore[misc]  # undone by _restore when the probe ends
        self._restore.append(lambda: setattr(hook_class, "__init__", original_init))

    def _open_region(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], _Region]:
        self._kinds.add(REENTRANT)
        tensors = [a for a in args if isinstance(a, Tensor)]
        region = _Region(
            parent=self._stack[-1] if self._stack else None,
            grad_enabled=torch.is_grad_enabled(),
            inputs_require_grad=any(t.requires_grad for t in tensors),
        )
        if self.repair_input_grads and region.parent is None and region.grad_enabled and not region.inputs_require_grad:
            index = next((i for i, a in enumerate(args) if isinstance(a, Tensor) and a.is_floating_point()), None)
            if index is not None:
                region.repaired_input = self._producer_of(args[index]) or ""
                args = (*args[:index], args[index].detach().requires_grad_(True), *args[index + 1 :])
        self._regions.append(region)
        self._stack.append(len(self._regions) - 1)
        return args, region

    def _remember_output(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, Tensor):
                self._outputs[id(output)] = (weakref.ref(output), name)

        return hook

    def _producer_of(self, tensor: Tensor) -> str | None:
        entry = self._outputs.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    @property
    def repairs(self) -> list[InputGradRepair]:
        """The regions repaired by ``repair_input_grads`` that hold trainable parameters."""
        return [
            InputGradRepair(region.repaired_input or None, self._sorted_names(region.parameters))
            for region in self._regions
            if region.repaired_input is not None and region.parameters
        ]

    def _sorted_names(self, ids: Iterable[int]) -> tuple[str, ...]:
        wanted = set(ids)
        return tuple(name for name, p in self.module.named_parameters() if id(p) in wanted)

    def facts(self, loss: Any) -> ModelFacts:
        """The observed facts; ``loss`` (what backward will run on) tells which parameters get a gradient."""
        self.stop()
        nodes, graph_parameters = autograd_reach(loss)
        contexts: dict[int, set[Any]] = defaultdict(set[Any])
        for pid in graph_parameters & self._trainable:
            contexts[pid].add("graph")
        reached: list[bool] = []
        for index, region in enumerate(self._regions):
            is_reached = reached[region.parent] if region.parent is not None else region.node in nodes
            reached.append(is_reached)
            if is_reached:
                for pid in region.parameters:
                    contexts[pid].add(index)
        in_reached_regions = {
            pid for index, region in enumerate(self._regions) if reached[index] for pid in region.parameters
        }
        # Reported whether or not the probe repaired them: the repair lasts one forward, the rule says what must last.
        no_grad_regions = {
            pid
            for region in self._regions
            if region.parent is None and region.grad_enabled and not region.inputs_require_grad
            for pid in region.parameters
        }
        unused = self._trainable - set(contexts) - no_grad_regions
        return ModelFacts(
            observed=True,
            checkpointing=frozenset(self._kinds),
            checkpoint_sources=tuple(f"torch.utils.checkpoint call ({kind})" for kind in sorted(self._kinds)),
            reentrant_parameters=self._sorted_names(in_reached_regions),
            reused_in_checkpoint=self._sorted_names(pid for pid, where in contexts.items() if len(where) > 1),
            unused_parameters=self._sorted_names(unused),
            no_grad_region_parameters=self._sorted_names(no_grad_regions),
            mutable_buffers=self._changed_buffers(),
            dynamic_modules=find_dynamic_modules(self.module),
        )

    def _changed_buffers(self) -> tuple[str, ...]:
        before = self._buffers_before or {}
        changed = {
            name for name, b in self.module.named_buffers() if name in before and not torch.equal(b, before[name])
        }
        return tuple(sorted(changed | set(running_stat_buffers(self.module))))


def autograd_reach(output: Any) -> tuple[set[Any], set[int]]:
    """The backward nodes reachable from ``output``'s tensors, and the ids of the leaf tensors they accumulate into.

    A reentrant checkpointed region appears as one node; the parameters it uses are not behind it.
    """
    pending = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    nodes: set[Any] = set()
    leaves: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        pending.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return nodes, leaves


def _tensors(output: Any) -> Iterator[Tensor]:
    """Tensors in a step output: a tensor, or nested mappings (Hugging Face ``ModelOutput`` too) and sequences."""
    if isinstance(output, Tensor):
        yield output
    elif isinstance(output, Mapping):
        for value in output.values():
            yield from _tensors(value)
    elif isinstance(output, (list, tuple)):
        for value in output:
            yield from _tensors(value)
