"""Every ``DDPPlusStrategy`` argument other than the Lightning plumbing, validated in one place.

The Trainer strategy and the Fabric strategy take the same arguments and build the same ``DDPPlusOptions``, so a bad
value gets the same message from both, before any process is started.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, get_args

from lightning_ddp_plus.config.backend import normalize_backend
from lightning_ddp_plus.config.messages import describe_bad_value
from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.config.timeout import TimeoutLike, parse_timeout
from lightning_ddp_plus.processes.restart import RESUME_MODES, ResumeMode
from lightning_ddp_plus.sharding.optimizer import OptimizerSharding, check_optimizer_sharding, refusals
from lightning_ddp_plus.sync.accumulation import SHORT_WINDOW_MODES, ShortWindow, check_accumulation_steps
from lightning_ddp_plus.sync.comm_hooks import CommHook, HookFunction, parse_comm_hook
from lightning_ddp_plus.sync.uneven import UNEVEN_MODES, UnevenInputs

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
ConflictMode = Literal["error", "warn", "resolve", "off"]
CONFLICT_MODES: tuple[str, ...] = get_args(ConflictMode)
START_METHODS: tuple[str, ...] = get_args(StartMethod)


def _positive_int_or_none(argument: str, value: Any, example: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            describe_bad_value(
                argument, value, "expected a positive integer or None.", f"set e.g. `{argument}={example}`."
            )
        )
    return value


def _one_of(argument: str, value: Any, allowed: tuple[str, ...], fix: str) -> Any:
    if value not in allowed:
        raise ValueError(describe_bad_value(argument, value, f"allowed: {', '.join(allowed)}.", fix))
    return value


@dataclass(frozen=True)
class DDPPlusOptions:
    """The validated strategy arguments (see ``DDPPlusStrategy`` for their meaning).

    >>> DDPPlusOptions.create(timeout="1h", ddp_comm_hook="fp16").comm_hook
    <CommHook.FP16: 'fp16'>
    """

    settings: DDPSettings
    backend: str | None
    timeout: timedelta
    comm_hook: CommHook | HookFunction | None
    comm_state: object | None
    comm_wrapper: Callable[..., Any] | None
    model_averaging_period: int | None
    gradient_accumulation_steps: int | None
    short_window: ShortWindow
    checkpointing_conflict: ConflictMode
    verify_replicas_every_n_steps: int | None
    telemetry: bool
    start_method: StartMethod
    resume_from_last: ResumeMode = "on_restart"
    sync_guard: bool = True
    uneven_inputs: UnevenInputs = "error"
    atomic_checkpoints: bool = True
    optimizer_sharding: OptimizerSharding = False

    @classmethod
    def from_arguments(cls, arguments: dict[str, Any], ddp_kwargs: dict[str, Any]) -> DDPPlusOptions:
        """``create`` from a front end's constructor arguments (its ``locals()``): the names ``create`` takes are
        read, the Lightning plumbing (``accelerator``, ``parallel_devices`` ...) is left to the front end."""
        names = [name for name in inspect.signature(cls.create).parameters if name != "ddp_kwargs"]
        return cls.create(**{name: arguments[name] for name in names if name in arguments}, **ddp_kwargs)

    @classmethod
    def create(
        cls,
        process_group_backend: str | None = None,
        timeout: TimeoutLike | None = None,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float | Literal["auto"] | None = None,
        broadcast_buffers: bool | Literal["auto"] = True,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        ddp_comm_hook: str | Callable[..., Any] | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        model_averaging_period: int | None = None,
        gradient_accumulation_steps: int | None = None,
        short_window: ShortWindow = "mean",
        checkpointing_conflict: ConflictMode = "error",
        verify_replicas_every_n_steps: int | None = None,
        telemetry: bool = False,
        start_method: StartMethod = "popen",
        resume_from_last: ResumeMode = "on_restart",
        sync_guard: bool = True,
        uneven_inputs: UnevenInputs = "error",
        atomic_checkpoints: bool = True,
        optimizer_sharding: OptimizerSharding = False,
        **ddp_kwargs: Any,
    ) -> DDPPlusOptions:
        """Validate every argument; each bad value raises with the argument, the value, what is allowed and the fix."""
        settings = DDPSettings(
            find_unused_parameters=find_unused_parameters,
            bucket_cap_mb=bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            extra=dict(ddp_kwargs),
        )
        comm_hook = parse_comm_hook(ddp_comm_hook)
        if bucket_cap_mb == "auto" and comm_hook in (CommHook.POWERSGD, CommHook.BATCHED_POWERSGD):
            raise ValueError(
                describe_bad_value(
                    "bucket_cap_mb",
                    bucket_cap_mb,
                    f"'auto' rebuilds the buckets while it times them, and the {comm_hook.value} hook keeps its error "
                    "feedback per bucket.",
                    "set a size (e.g. `bucket_cap_mb=25`, or None for torch's default) with PowerSGD.",
                )
            )
        if ddp_comm_wrapper is not None and comm_hook is None:
            raise ValueError(
                describe_bad_value(
                    "ddp_comm_wrapper",
                    ddp_comm_wrapper,
                    "a wrapper needs a hook to wrap, and `ddp_comm_hook` is None.",
                    "set `ddp_comm_hook` too, or remove the wrapper.",
                )
            )
        if ddp_comm_wrapper is not None and not callable(ddp_comm_wrapper):
            raise TypeError(
                describe_bad_value(
                    "ddp_comm_wrapper",
                    ddp_comm_wrapper,
                    "expected a callable that wraps a hook.",
                    "pass e.g. torch's `fp16_compress_wrapper`.",
                )
            )
        if not isinstance(telemetry, bool):
            raise TypeError(
                describe_bad_value("telemetry", telemetry, "expected True or False.", "write `telemetry=True`.")
            )
        if not isinstance(sync_guard, bool):
            raise TypeError(
                describe_bad_value("sync_guard", sync_guard, "expected True or False.", "write `sync_guard=True`.")
            )
        if not isinstance(atomic_checkpoints, bool):
            raise TypeError(
                describe_bad_value(
                    "atomic_checkpoints",
                    atomic_checkpoints,
                    "expected True or False.",
                    "write `atomic_checkpoints=True`.",
                )
            )
        sharding = check_optimizer_sharding(optimizer_sharding)
        conflicts = refusals(sharding, comm_hook, gradient_accumulation_steps, bucket_cap_mb, sync_guard, uneven_inputs)
        if conflicts:
            raise ValueError(
                f"`optimizer_sharding={sharding!r}` cannot run with these settings: " + " ".join(conflicts)
            )
        return cls(
            settings=settings,
            optimizer_sharding=sharding,
            backend=normalize_backend(process_group_backend),
            timeout=parse_timeout(timeout),
            comm_hook=comm_hook,
            comm_state=ddp_comm_state,
            comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=_positive_int_or_none("model_averaging_period", model_averaging_period, "4"),
            gradient_accumulation_steps=check_accumulation_steps(gradient_accumulation_steps),
            short_window=_one_of(
                "short_window",
                short_window,
                SHORT_WINDOW_MODES,
                "use 'mean' (average over the micro-batches the window had) or 'lightning' (divide by k).",
            ),
            checkpointing_conflict=_one_of(
                "checkpointing_conflict",
                checkpointing_conflict,
                CONFLICT_MODES,
                "use 'error' (default), 'warn', 'resolve' or 'off'.",
            ),
            verify_replicas_every_n_steps=_positive_int_or_none(
                "verify_replicas_every_n_steps", verify_replicas_every_n_steps, "100"
            ),
            telemetry=telemetry,
            resume_from_last=_one_of(
                "resume_from_last",
                resume_from_last,
                RESUME_MODES,
                "use 'on_restart' (a restarted torchrun attempt resumes), 'always' or 'never'.",
            ),
            sync_guard=sync_guard,
            atomic_checkpoints=atomic_checkpoints,
            uneven_inputs=_one_of(
                "uneven_inputs",
                uneven_inputs,
                UNEVEN_MODES,
                "use 'error' (default: every rank raises at the first batch one rank lacks), 'stop' (every rank "
                "ends the epoch when the first runs out) or 'join' (the longer ranks train on).",
            ),
            start_method=_one_of(
                "start_method",
                start_method,
                START_METHODS,
                "use 'popen' for scripts and CLIs, 'spawn' inside notebooks or tests.",
            ),
        )
