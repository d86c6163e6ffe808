"""Communication hooks by name, mapped to torch's hook functions, with sensible default states.

Stock Lightning registers hooks only on CUDA; torch runs them on every backend, gloo included, and so do we.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, closest_name, describe_bad_value
from lightning_ddp_plus.pipeline.component import FitStart, StepComponent
from lightning_ddp_plus.sync.flag_carrier import FlagCarrier, flags_ride_buckets

HookFunction = Callable[[Any, "torch.distributed.GradBucket"], "torch.futures.Future[torch.Tensor]"]


class CommHook(str, Enum):
    """Named communication hooks accepted by ``DDPPlusStrategy(ddp_comm_hook=...)``.

    >>> CommHook("fp16").function.__name__
    'fp16_compress_hook'
    """

    FP16 = "fp16"
    BF16 = "bf16"
    POWERSGD = "powersgd"
    BATCHED_POWERSGD = "batched_powersgd"

    @property
    def function(self) -> HookFunction:
        return _HOOK_FUNCTIONS[self]

    def default_state(self) -> object | None:
        """The state the hook gets when the user gives none.

        PowerSGD: rank-1 approximation with error feedback and warm start (torch's recommended starting point), and
        plain all-reduce for the first 2 iterations, the shortest warm-up torch allows with error feedback.
        """
        if self in (CommHook.POWERSGD, CommHook.BATCHED_POWERSGD):
            return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return None


_HOOK_FUNCTIONS: dict[CommHook, HookFunction] = {
    CommHook.FP16: default_hooks.fp16_compress_hook,
    CommHook.BF16: default_hooks.bf16_compress_hook,
    CommHook.POWERSGD: powerSGD_hook.powerSGD_hook,
    CommHook.BATCHED_POWERSGD: powerSGD_hook.batched_powerSGD_hook,
}

#: The compressing hooks, by the dtype they send: their last bucket can carry the step's flags (``FlagCarrier``).
COMPRESSED: dict[CommHook, torch.dtype] = {CommHook.FP16: torch.float16, CommHook.BF16: torch.bfloat16}

_NAMES = tuple(hook.value for hook in CommHook)


def parse_comm_hook(value: str | CommHook | HookFunction | None) -> CommHook | HookFunction | None:
    """Accept a hook name, a dotted import path to a hook function, a callable, or ``None``. torch's own functions for
    the named hooks become their names, so that they get the same treatment (PowerSGD's bucket order).

    >>> parse_comm_hook("FP16")
    <CommHook.FP16: 'fp16'>
    >>> parse_comm_hook("torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook").__name__
    'allreduce_hook'
    >>> parse_comm_hook(powerSGD_hook.powerSGD_hook)
    <CommHook.POWERSGD: 'powersgd'>
    """
    if value is None or isinstance(value, CommHook):
        return value
    named = next((hook for hook, function in _HOOK_FUNCTIONS.items() if function is value), None)
    if named is not None:
        return named
    if isinstance(value, str):
        name = value.strip().lower()
        if name in ("", "none", "no"):
            return None
        if name in _NAMES:
            return CommHook(name)
        if "." in value:
            return _import_hook(value.strip())
        suggestion = closest_name(name, _NAMES)
        raise ArgumentValueError(
            describe_bad_value(
                "ddp_comm_hook",
                value,
                f"unknown hook name; allowed: {', '.join(_NAMES)}, a dotted import path to a hook function, a callable, or None.",
                f"did you mean {suggestion!r}?" if suggestion else "use one of the names listed.",
            )
        )
    if callable(value):
        return value
    raise ArgumentTypeError(
        describe_bad_value(
            "ddp_comm_hook",
            value,
            f"expected a hook name ({', '.join(_NAMES)}), a callable `hook(state, bucket)`, or None.",
            "pass e.g. 'fp16'.",
        )
    )


def check_comm_wrapper(wrapper: Any, hook: CommHook | HookFunction | None) -> Callable[..., Any] | None:
    """Validate ``ddp_comm_wrapper`` against the parsed ``ddp_comm_hook``: a callable, and only with a hook."""
    if wrapper is None:
        return None
    if hook is None:
        raise ArgumentValueError(
            describe_bad_value(
                "ddp_comm_wrapper",
                wrapper,
                "a wrapper needs a hook to wrap, and `ddp_comm_hook` is None.",
                "set `ddp_comm_hook` too, or remove the wrapper.",
            )
        )
    if not callable(wrapper):
        raise ArgumentTypeError(
            describe_bad_value(
                "ddp_comm_wrapper",
                wrapper,
                "expected a callable that wraps a hook.",
                "pass e.g. torch's `fp16_compress_wrapper`.",
            )
        )
    checked: Callable[..., Any] = wrapper
    return checked


def _import_hook(path: str) -> HookFunction:
    module_name, _, attribute = path.rpartition(".")
    try:
        hook = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ArgumentValueError(
            describe_bad_value(
                "ddp_comm_hook",
                path,
                f"expected a dotted path to a hook function that can be imported, and this one could not be loaded "
                f"({error}).",
                f"check the module and function name, or use one of {', '.join(_NAMES)}.",
            )
        ) from error
    if not callable(hook):
        raise ArgumentTypeError(
            describe_bad_value(
                "ddp_comm_hook",
                path,
                "the import path names something that is not callable.",
                "point it at a function `hook(state, bucket)`.",
            )
        )
    function: HookFunction = hook
    return function


@dataclass
class HookCallCounter:
    """How often the registered hook ran (each call all-reduces one gradient bucket) and how many gradient bytes
    it was handed (before any compression the hook applies)."""

    calls: int = 0
    bucket_bytes: int = 0
    element_size: int = 4


def counted_hook(hook: HookFunction, counter: HookCallCounter) -> HookFunction:
    """Wrap ``hook`` so that each call is counted.

    The wrapper has a name of its own, which also lets torch's bf16 hook run on gloo: torch refuses it by function
    name unless CUDA+NCCL or XPU+XCCL are present, although gloo reduces bfloat16 tensors correctly.
    """

    # Real (not string) annotations: torch's register_comm_hook compares them with dist.GradBucket and Future.
    def ddp_plus_counted_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        counter.calls += 1
        counter.bucket_bytes += buffer.numel() * buffer.element_size()
        counter.element_size = buffer.element_size()
        return hook(state, bucket)

    ddp_plus_counted_hook.__qualname__ = f"counted({getattr(hook, '__qualname__', repr(hook))})"
    return ddp_plus_counted_hook


def bucket_ordered_hook(hook: HookFunction) -> HookFunction:
    """Wrap a hook that issues further collectives from its futures' callbacks (PowerSGD: the uncompressed tensors,
    then P, then Q) so that a bucket's first collective is issued only after the previous bucket's last one finished.

    A process group matches collectives by the order in which each rank issues them. A callback issues its collective
    whenever the previous one completes, while the autograd thread issues the next bucket's first collective whenever
    that bucket's gradients are ready; with two or more buckets the two orders interleave differently on different
    ranks (gloo then fails with "Received data size doesn't match expected size" between nodes). Waiting for the previous bucket fixes the order; the wait falls at the end of the backward for all but the
    smallest buckets, so little overlap is lost.
    """
    previous: list[torch.futures.Future[torch.Tensor]] = []

    def ddp_plus_bucket_ordered_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() > 0 and previous:
            previous[0].wait()
        future = hook(state, bucket)
        previous[:] = [future]
        return future

    ddp_plus_bucket_ordered_hook.__qualname__ = f"bucket_ordered({getattr(hook, '__qualname__', repr(hook))})"
    return ddp_plus_bucket_ordered_hook


class HookAssembly(StepComponent):
    """The communication hook a wrapper gets: the named hook or callable, its state (PowerSGD gets a default one),
    the optional wrapper, and a counter of its calls. Registered on every backend, gloo included. Without one, the
    ``carrier``'s (the step's flags in the last bucket) where it can ride (``flags_ride_buckets``; ``own_hook_later``:
    the ZeRO overlap registers its hook after the wrap). A hook whose state holds the ``carrier`` carries the flags
    itself (``optimizer_sharding=True``'s reduce-scatter).

    >>> assembly = HookAssembly(CommHook.FP16, state=None, wrapper=None)
    >>> assembly.name
    'fp16'
    """

    def __init__(
        self,
        hook: CommHook | HookFunction | None,
        state: object | None,
        wrapper: Callable[..., Any] | None,
        carrier: FlagCarrier | None = None,
        own_hook_later: bool = False,
    ) -> None:
        self.hook = hook
        self.user_state = state
        self.wrapper = wrapper
        self.carrier, self.own_hook_later = carrier, own_hook_later
        #: Calls of the registered hook (one per gradient bucket all-reduced) on this rank.
        self.counter = HookCallCounter()
        #: The state the hook was last registered with (PowerSGD's holds its iteration and error feedback).
        self.state: object | None = None

    @property
    def name(self) -> str:
        if isinstance(self.hook, CommHook):
            return self.hook.value
        if self.hook is not None:
            return getattr(self.hook, "__qualname__", repr(self.hook))
        return "none"

    def fit_starts(self, fit: FitStart) -> None:
        self.register(fit.ddp)

    def register(self, ddp: "torch.nn.parallel.DistributedDataParallel") -> None:
        """Register the hook on a new wrapper (a fresh default state each time, like a fresh reducer)."""
        if self.carrier is not None:
            self.carrier.installed = False
        if self.hook is None:
            if self.carrier is not None and flags_ride_buckets(ddp, None, self.own_hook_later):
                self.carrier.register(ddp)  # not counted: the counter is the user's hook's
            return
        if isinstance(self.hook, CommHook):
            function = self.hook.function
            self.state = self.user_state if self.user_state is not None else self.hook.default_state()
        else:
            function, self.state = self.hook, self.user_state
        rides = self.carrier is not None and flags_ride_buckets(ddp, None, self.own_hook_later)
        carrier = self.carrier if rides else None
        plain = self.wrapper is None and self.state is None
        compression = COMPRESSED.get(self.hook) if plain and isinstance(self.hook, CommHook) else None
        if carrier is not None and compression is not None:
            function = carrier.compressing(function, compression)  # its last bucket carries the flags
        if self.wrapper is not None:
            function = self.wrapper(function)
        if self.hook in (CommHook.POWERSGD, CommHook.BATCHED_POWERSGD):
            function = bucket_ordered_hook(function)
        ddp.register_comm_hook(state=self.state, hook=counted_hook(function, self.counter))
        # the flags ride where the hook carries them: the compressing one above, or the sharding's reduce-scatter
        if carrier is not None and (compression is not None or getattr(self.state, "carrier", None) is carrier):
            carrier.riding()
