"""The setup line rank 0 logs when the wrapper is built: every declared argument with the value in effect.

It is generated from the declaration (``arguments.front_end_arguments``), so a new argument appears in it without
an edit here; only values that differ from what was given (``"auto"`` decided, a name parsed, the guard's agreement
path) are spelled out below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.config.timeout import format_timeout
from lightning_ddp_plus.engine.arguments import DDPPlusArguments, FrontEnd

if TYPE_CHECKING:
    from lightning_ddp_plus.engine.engine import DDPPlusEngine

#: Shown first, as what the job runs on: the resolved backend, the timeout and the world size.
_LEADING = ("process_group_backend", "timeout")


def shown(value: Any) -> str:
    """A value as the line shows it: plain values as they are, functions by name, other objects by class.

    >>> shown(None), shown("mean"), shown(shown), shown(object()), shown(("SIGTERM", "SIGUSR1"))
    ('None', 'mean', 'shown', 'object', '[SIGTERM, SIGUSR1]')
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(item, (bool, int, float, str)) for item in value):
        return f"[{', '.join(map(str, value))}]"
    if callable(value):
        return str(getattr(value, "__qualname__", type(value).__name__))
    return type(value).__name__


@dataclass(frozen=True)
class InEffect:
    """What the engine made of the arguments: the DDP settings, the hook's name, k, and the sync guard's state."""

    settings: DDPSettings
    comm_hook: str
    accumulation_steps: int
    short_window: str
    sync_guard: str
    buckets: int | None = None


def _bucket_cap(settings: DDPSettings, buckets: int | None) -> str:
    cap = settings.bucket_cap_mb
    if cap is None:
        text = "25 (torch default, 1 MiB first bucket)"
    else:
        text = "auto" if cap == "auto" else f"{cap:g}"
    return text + (f" ({buckets} buckets)" if buckets else "")


def resolved_values(arguments: DDPPlusArguments, effect: InEffect) -> dict[str, str]:
    """The values that differ from what was given: decided, parsed or resolved."""
    settings = effect.settings
    auto = "auto->" if arguments.broadcast_buffers == "auto" else ""
    report_after = arguments.stall_report_after_in_effect
    stall = "None" if report_after is None else format_timeout(report_after)
    return {
        "setup_timeout": "None" if arguments.setup_timeout is None else format_timeout(arguments.process_group_timeout),
        "stall_report_after": ("auto->" if arguments.stall_report_after == "auto" else "") + stall,
        "bucket_cap_mb": _bucket_cap(settings, effect.buckets),
        "broadcast_buffers": f"{auto}{settings.broadcast_buffers}",
        "find_unused_parameters": str(settings.find_unused_parameters),
        "static_graph": str(settings.static_graph),
        "ddp_comm_hook": effect.comm_hook,
        "gradient_accumulation_steps": str(effect.accumulation_steps),
        "sync_guard": effect.sync_guard,
    }


def setup_line(
    front_end: FrontEnd, arguments: DDPPlusArguments, effect: InEffect, backend: str, world_size: int
) -> str:
    """``<front end>: backend=..., timeout=..., world_size=..., <every other argument>=<value in effect>``.

    >>> from lightning_ddp_plus.config.settings import DDPSettings
    >>> effect = InEffect(DDPSettings(), "none", 1, "mean", "on (flags in the last bucket)")
    >>> setup_line("DDPPlusStrategy", DDPPlusArguments(timeout=300), effect, "gloo", 2).split(", ")[:4]
    ['DDPPlusStrategy: backend=gloo', 'timeout=5m', 'world_size=2', 'setup_timeout=None']
    """
    resolved = resolved_values(arguments, effect)
    rest = ", ".join(
        f"{name}={resolved[name] if name in resolved else shown(value)}"
        for name, value in arguments.given(front_end).items()
        if name not in _LEADING
    )
    extra = f", extra={effect.settings.extra}" if effect.settings.extra else ""
    timeout = format_timeout(arguments.timeout_in_effect)
    return f"{front_end}: backend={backend}, timeout={timeout}, world_size={world_size}, {rest}{extra}"


def describe_run(engine: DDPPlusEngine, front_end: FrontEnd, backend: str, world_size: int, buckets: int | None) -> str:
    """The setup line of ``engine``'s run: every argument with the value in effect, logged by rank 0 at setup."""
    window = engine.window
    guard = engine.sync_guard.describe()
    effect = InEffect(engine.settings, engine.hooks.name, window.steps, window.short_window, guard, buckets)
    return setup_line(front_end, engine.arguments, effect, backend, world_size)
