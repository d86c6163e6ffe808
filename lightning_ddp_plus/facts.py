"""Model facts that decide whether a DDP configuration works: gradient checkpointing and its kind, parameters
reused inside a checkpointed region, parameters that get no gradient, and buffers that training changes.

Detected without importing optional libraries: Hugging Face models are recognised by their flags, torch's
checkpoint wrapper by its class, and calls to ``torch.utils.checkpoint`` are observed during one forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

REENTRANT = "reentrant"
NON_REENTRANT = "non_reentrant"


@dataclass(frozen=True)
class ModelFacts:
    """What the conflict rules look at.

    ``unused_parameters`` is ``None`` when no forward has been observed (nothing is known about it).
    """

    checkpointing: frozenset[str] = frozenset()
    checkpoint_sources: tuple[str, ...] = ()
    reused_in_checkpoint: tuple[str, ...] = ()
    unused_parameters: Optional[tuple[str, ...]] = None
    mutable_buffers: tuple[str, ...] = ()

    @property
    def reentrant(self) -> bool:
        return REENTRANT in self.checkpointing

    @property
    def checkpointed(self) -> bool:
        return bool(self.checkpointing)


def static_facts(module: nn.Module) -> ModelFacts:
    """Facts readable from the module itself, without running it.

    >>> from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, CheckpointImpl
    >>> model = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl=CheckpointImpl.REENTRANT))
    >>> sorted(static_facts(model).checkpointing)
    ['reentrant']
    """
    kinds: set[str] = set()
    sources: list[str] = []
    for name, sub in module.named_modules():
        kind = _hf_checkpointing_kind(sub)
        if kind is not None:
            kinds.add(kind)
            sources.append(f"{name or type(sub).__name__}: gradient_checkpointing flag ({kind})")
        impl = getattr(sub, "checkpoint_impl", None)
        if type(sub).__name__ == "CheckpointWrapper" and impl is not None:
            kind = NON_REENTRANT if "NO_REENTRANT" in getattr(impl, "name", str(impl)).upper() else REENTRANT
            kinds.add(kind)
            sources.append(f"{name}: CheckpointWrapper ({kind})")
    return ModelFacts(checkpointing=frozenset(kinds), checkpoint_sources=tuple(sources), mutable_buffers=running_stat_buffers(module))


def _hf_checkpointing_kind(module: nn.Module) -> Optional[str]:
    enabled = getattr(module, "is_gradient_checkpointing", None)
    if enabled is not True and getattr(module, "gradient_checkpointing", None) is not True:
        return None
    function = getattr(module, "_gradient_checkpointing_func", None)
    keywords = getattr(function, "keywords", None) or {}
    # Hugging Face passes use_reentrant=True unless the user asked otherwise.
    return REENTRANT if keywords.get("use_reentrant", True) else NON_REENTRANT


def running_stat_buffers(module: nn.Module) -> tuple[str, ...]:
    """Buffers that a training forward updates: BatchNorm-style running statistics."""
    names = []
    for name, sub in module.named_modules():
        if getattr(sub, "track_running_stats", False) and getattr(sub, "running_mean", None) is not None:
            prefix = f"{name}." if name else ""
            names += [prefix + buffer_name for buffer_name, _ in sub.named_buffers(recurse=False)]
    return tuple(names)


@dataclass
class ForwardProbe:
    """Observes one forward: checkpoint calls and their kind, which parameters modules use inside checkpointed
    regions (and how often), and which buffers change. Use as a context manager around the forward only."""

    module: nn.Module
    kinds: set[str] = field(default_factory=set)
    region_uses: Counter = field(default_factory=Counter)
    _depth: int = 0
    _handles: list = field(default_factory=list)
    _originals: dict = field(default_factory=dict)
    _buffers_before: dict = field(default_factory=dict)
    active: bool = False

    def __enter__(self) -> ForwardProbe:
        self._buffers_before = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        probe = self
        original_forward = torch_checkpoint.CheckpointFunction.forward
        original_generator = torch_checkpoint._checkpoint_without_reentrant_generator

        def reentrant_forward(ctx: Any, run_function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            probe._enter(REENTRANT)
            try:
                return original_forward(ctx, run_function, preserve_rng_state, *args)
            finally:
                probe._exit()

        def non_reentrant_generator(*args: Any, **kwargs: Any) -> Any:
            inner = original_generator(*args, **kwargs)
            probe._enter(NON_REENTRANT)
            try:
                yield from inner
            finally:
                probe._exit()

        self._originals = {"forward": original_forward, "generator": original_generator}
        torch_checkpoint.CheckpointFunction.forward = staticmethod(reentrant_forward)
        torch_checkpoint._checkpoint_without_reentrant_generator = non_reentrant_generator
        self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._on_module_call))
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop observing (idempotent); call it before backward, where reentrant checkpointing re-runs the forward."""
        if not self.active:
            return
        self.active = False
        torch_checkpoint.CheckpointFunction.forward = staticmethod(self._originals["forward"])
        torch_checkpoint._checkpoint_without_reentrant_generator = self._originals["generator"]
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, kind: str) -> None:
        if self.active:
            self.kinds.add(kind)
            self._depth += 1

    def _exit(self) -> None:
        if self.active:
            self._depth -= 1

    def _on_module_call(self, module: nn.Module, args: Any) -> None:
        if self._depth > 0:
            for param in module.parameters(recurse=False):
                self.region_uses[id(param)] += 1

    def facts(self, loss: Optional[Tensor]) -> ModelFacts:
        """The observed facts; ``loss`` (the tensor backward will run on) tells which parameters get a gradient."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        static = static_facts(self.module)
        reused = tuple(names[i] for i, count in self.region_uses.items() if count > 1 and i in names)
        unused = None
        if loss is not None:
            reached = reachable_parameters(loss) | {i for i in self.region_uses}
            unused = tuple(n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in reached)
        changed = tuple(
            name for name, b in self.module.named_buffers() if name in self._buffers_before and not torch.equal(b, self._buffers_before[name])
        )
        return ModelFacts(
            checkpointing=static.checkpointing | frozenset(self.kinds),
            checkpoint_sources=static.checkpoint_sources + tuple(f"torch.utils.checkpoint call ({kind})" for kind in sorted(self.kinds)),
            reused_in_checkpoint=reused,
            unused_parameters=unused,
            mutable_buffers=tuple(sorted(set(changed) | set(static.mutable_buffers))),
        )


def reachable_parameters(output: Any) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``output`` accumulates gradients into.

    Reentrant checkpointing hides its region's parameters from this graph; the probe adds those it saw used.
    """
    roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen: set = set()
    found: set[int] = set()
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        roots.extend(next_node for next_node, _ in node.next_functions)
    return found


def _tensors(output: Any) -> Iterable[Tensor]:
    if isinstance(output, Tensor):
        yield output
    elif isinstance(output, dict):
        for value in output.values():
            yield from _tensors(value)
    elif isinstance(output, (list, tuple)):
        for value in output:
            yield from _tensors(value)
