"""Every argument of ``DDPPlusStrategy`` and ``DDPPlusFabricStrategy`` beyond Lightning's plumbing, declared once.

``DDPPlusArguments`` is a keyword-only dataclass: each field is one argument, with its type, its default, its
docstring (the string under it) and its check, which is the function of the module that owns the behaviour. What is
built from it:

- both front ends' signatures (``takes_declared_arguments``), which LightningCLI reads, so YAML keeps the flat
  ``init_args`` shape and ``--help`` shows every argument with its type and docstring;
- the validation of a front end's keywords (``DDPPlusArguments.for_front_end``): every argument's own check first,
  in declaration order, then the checks across arguments, so a cross check never sees an unvalidated value;
- the spelling suggestions for a misspelt name, over every declared name and torch's ``DistributedDataParallel``
  arguments;
- the docs' argument table, the example config and the setup line (``argument_docs``, ``front_end_arguments``).

Adding an argument: one field here (type, default, docstring, check), then the code that uses it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache, cached_property
from typing import Any, Literal

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.config.backend import normalize_backend
from lightning_ddp_plus.config.checks import (
    require_bool,
    require_count,
    require_one_of,
    require_positive_int_or_none,
)
from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, closest_name, describe_bad_value
from lightning_ddp_plus.config.settings import DDPSettings, require_bool_or_auto, require_bucket_cap
from lightning_ddp_plus.config.timeout import (
    DEFAULT_TIMEOUT,
    TimeoutLike,
    check_setup_timeout,
    format_timeout,
    parse_timeout,
)
from lightning_ddp_plus.conflicts.check import ConflictMode
from lightning_ddp_plus.diagnostics.replicas import check_every_n_steps
from lightning_ddp_plus.persistence.resume import ResumeMode
from lightning_ddp_plus.persistence.world_size import WorldSizeChange
from lightning_ddp_plus.private_apis.torch_distributed import CAN_SET_GROUP_TIMEOUT, GROUP_TIMEOUT_BACKENDS
from lightning_ddp_plus.processes.launcher import StartMethod
from lightning_ddp_plus.sharding.optimizer import OptimizerSharding, check_optimizer_sharding, refusals
from lightning_ddp_plus.sync.accumulation import ShortWindow, check_accumulation_steps
from lightning_ddp_plus.sync.buckets import check_auto_with_hook
from lightning_ddp_plus.sync.comm_hooks import CommHook, HookFunction, check_comm_wrapper, parse_comm_hook
from lightning_ddp_plus.sync.micro_batches import check_micro_batch_size, micro_batch_refusals
from lightning_ddp_plus.sync.uneven import UnevenInputs

#: The front ends, by the class name their messages use.
FrontEnd = Literal["DDPPlusStrategy", "DDPPlusFabricStrategy"]

#: ``check(argument, value) -> the accepted value``: raises ``ArgumentValueError``/``ArgumentTypeError``.
Check = Callable[[str, Any], Any]


def _value_only(check: Callable[[Any], Any]) -> Check:
    """An owner's check that names its argument itself."""
    return lambda _argument, value: check(value)


def _flag(argument: str, value: Any) -> bool:
    return require_bool(argument, value)


def _choice(fix: str) -> Check:
    """One of the names the field's ``Literal`` type allows; ``fix`` says what each means."""
    return lambda argument, value: require_one_of(argument, value, typing.get_args(argument_types()[argument]), fix)


def _stall_threshold(argument: str, value: Any) -> Any:
    """``"auto"``, ``None``, or a duration in ``timeout``'s forms (parsed; compared with ``timeout`` afterwards)."""
    return value if value in ("auto", None) else parse_timeout(value, argument)


def _setup_timeout(argument: str, value: Any) -> timedelta | None:
    return None if value is None else parse_timeout(value, argument)


def _count(example: str) -> Check:
    return lambda argument, value: require_positive_int_or_none(argument, value, example)


@dataclass(frozen=True)
class TrainerOnly:
    """Why ``DDPPlusFabricStrategy`` does not take an argument, and what to do there instead."""

    reason: str
    fix: str


def argument(default: Any, check: Check | None = None, trainer_only: TrainerOnly | None = None) -> Any:
    """One declared argument: its default, its check, and why Fabric does not take it (``trainer_only``)."""
    return field(default=default, metadata={"check": check, "trainer_only": trainer_only})


@dataclass(frozen=True, kw_only=True)
class DDPPlusArguments:
    """The validated arguments of one strategy. Each value is as given, normalized by its check (a backend name in
    lower case, a timeout as a ``timedelta``, a hook name as a ``CommHook``).

    >>> DDPPlusArguments(timeout="1h", ddp_comm_hook="fp16").comm_hook
    <CommHook.FP16: 'fp16'>
    """

    process_group_backend: str | None = argument(None, _value_only(normalize_backend))
    """``"nccl"``, ``"gloo"``, ``"mpi"``, ``"ucc"``, ``"xccl"``, ``"hccl"``, ``"cncl"``, or ``None``/``"auto"`` to follow
    the accelerator (cuda->nccl, cpu->gloo, xpu->xccl, hpu->hccl, mlu->cncl)."""

    timeout: TimeoutLike | None = argument(DEFAULT_TIMEOUT, lambda argument, value: parse_timeout(value, argument))
    """How long a collective may wait before the job fails: seconds, a ``timedelta``, ``"90s"``, ``"30m"``, ``"2h"``,
    ``"1h30m"``, ``"1d"``, ``"0:30:00"`` or ``"1 day, 0:00:00"``. Default 30 minutes."""

    setup_timeout: TimeoutLike | None = argument(None, _setup_timeout)
    """How long a collective may wait from the process group's creation to the first training step: the ranks
    waiting while rank 0 prepares data or loads a large model. The first training forward sets the group's timeout
    to ``timeout`` (and the end of the fit back), so a stuck step is not waited for as long. The same forms as
    ``timeout``; ``None`` (default): ``timeout`` throughout. Needs a gloo or NCCL process group."""

    find_unused_parameters: bool = argument(False, _flag)
    """Let DDP find parameters that get no gradient in an iteration."""

    bucket_cap_mb: float | Literal["auto"] | None = argument(None, _value_only(require_bucket_cap))
    """Size of the gradient buckets in MiB. ``None`` (default): torch's default, 25 MiB with a 1 MiB first bucket, as
    stock ``DDPStrategy``. A number: every bucket that size. ``"auto"``: time 25 (the default), 1, 5 and 100 MiB for 3
    optimizer steps each, keep the fastest for the rest of the fit and log the choice (``bucket_choice``); not with
    PowerSGD hooks, whose state is per bucket."""

    broadcast_buffers: bool | Literal["auto"] = argument(True, require_bool_or_auto)
    """Keep buffers (e.g. BatchNorm statistics) equal to rank 0's at every forward. ``"auto"``: on when the model has
    buffers that training changes (BatchNorm-style running statistics), off otherwise."""

    static_graph: bool = argument(False, _flag)
    """Promise DDP that the graph and the set of used parameters never change."""

    gradient_as_bucket_view: bool = argument(False, _flag)
    """Make gradients views into the communication buckets (saves memory)."""

    ddp_comm_hook: str | Callable[..., Any] | None = argument(None, _value_only(parse_comm_hook))
    """``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"batched_powersgd"``, a dotted import path to a hook function, or a
    callable ``hook(state, bucket)``. Registered on every backend, gloo included."""

    ddp_comm_state: object | None = argument(None)
    """State passed to the hook; PowerSGD gets a default state when this is ``None``."""

    ddp_comm_wrapper: Callable[..., Any] | None = argument(None)
    """Wrapper applied to the hook, e.g. torch's ``fp16_compress_wrapper``."""

    model_averaging_period: int | None = argument(
        None,
        _count("4"),
        trainer_only=TrainerOnly(
            "Fabric's DDP strategy has no post-local SGD model averaging (Lightning runs it in the Trainer strategy's "
            "optimizer step).",
            "use `DDPPlusStrategy` with a Trainer, or average with torch's `PostLocalSGDOptimizer` in your loop.",
        ),
    )
    """Period of model averaging for post-local SGD, as in Lightning's ``DDPStrategy`` (Trainer only)."""

    gradient_accumulation_steps: int | None = argument(None, _value_only(check_accumulation_steps))
    """Micro-batches per optimizer step; the gradient all-reduce runs only on the last one of each window, in
    automatic and manual optimization. The same as ``Trainer(accumulate_grad_batches=...)``: set either (they must
    agree if both are set; checked when ``fit`` starts, before any process is launched)."""

    micro_batch_size: int | Literal["auto"] | None = argument(None, check_micro_batch_size)
    """Rows per chunk: each training batch is split along its first dimension into chunks of this many rows, each
    runs forward and backward with its loss weighted by its share of the rows, only the last one all-reduces, and one
    optimizer step follows the batch: the global batch, the schedule and ``global_step`` stay as they are. It
    multiplies with accumulation. ``"auto"``: start with the whole batch; when any rank runs out of memory in a
    forward or backward, every rank drops the batch's gradients, halves the size and runs the batch again, and keeps
    the size that held (logged once, saved in checkpoints). ``None`` (default): the whole batch; an out-of-memory error
    on one rank then ends every rank with an error that names it. Automatic optimization only."""

    short_window: ShortWindow = argument(
        "mean", _choice("use 'mean' (average over the micro-batches the window had) or 'lightning' (divide by k).")
    )
    """How the short last window of an epoch is averaged. ``"mean"`` (default): the mean over the micro-batches it
    really had. ``"lightning"``: Lightning's rule, the sum divided by k."""

    checkpointing_conflict: ConflictMode = argument(
        "error", _choice("use 'error' (default), 'warn', 'resolve' or 'off'.")
    )
    """What to do when the DDP settings conflict with the model (gradient checkpointing, reused or unused parameters;
    see the rule table in the docs' conflict checks guide). The first training forward is observed and the decision
    taken at the first backward: ``"error"`` (default) raises ``DDPConflictError`` before any gradient is all-reduced
    or any optimizer step runs; ``"warn"`` warns once per rule and trains as stock DDP would; ``"resolve"`` changes the
    settings (and, for rule R5, the model's input grads) to a working combination and logs what changed; ``"off"``
    checks nothing at the first forward. For what the per-step guard finds later (rule R6), ``"resolve"`` and
    ``"warn"`` switch ``find_unused_parameters`` on and train on with that step's gradients averaged; ``"error"`` and
    ``"off"`` raise."""

    verify_replicas_every_n_steps: int | None = argument(None, _value_only(check_every_n_steps))
    """Every N optimizer steps, check that all ranks hold identical parameters (and buffers, when
    ``broadcast_buffers`` is on); a mismatch stops training with ``ReplicaDriftError`` naming the tensor, the ranks and
    the step. ``None`` (default): off."""

    telemetry: bool = argument(False, _flag)
    """Record, per optimizer step, buckets all-reduced, bytes sent, synced and skipped backward passes and torch's
    timings of forward, backward compute, communication and overlap, logged under ``ddp/`` (with the Trainer, adds
    the ``DDPTelemetry`` callback)."""

    start_method: StartMethod = argument(
        "popen", _choice("use 'popen' for scripts and CLIs, 'spawn' inside notebooks or tests.")
    )
    """How processes are started: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"``, ``"forkserver"``."""

    resume_from_last: ResumeMode = argument(
        "on_restart",
        _choice("use 'on_restart' (a restarted torchrun attempt resumes), 'always' or 'never'."),
        trainer_only=TrainerOnly(
            "Fabric has no fit loop or checkpoint connector that could resume.",
            "load your checkpoint with `fabric.load(path, state)` before your loop (the Fabric guide shows it).",
        ),
    )
    """Resume ``fit`` from the last checkpoint (``ModelCheckpoint(save_last=True)``) when one exists:
    ``"on_restart"`` (default) in an attempt that torchrun restarted after a failure, ``"always"``, or ``"never"``.
    A ``ckpt_path`` you set yourself wins. Under torchrun the process group of each attempt is created on a store of
    its own, and a mid-epoch checkpoint resumes at the batch where it was taken (Trainer only)."""

    on_world_size_change: WorldSizeChange = argument(
        "keep_global_batch",
        _choice(
            "use 'keep_global_batch' (accumulation recomputed), 'keep_per_rank_batch' (the global batch changes) or "
            "'error'."
        ),
        trainer_only=TrainerOnly(
            "Fabric has no fit loop that resumes from a checkpoint.",
            "when you load a checkpoint taken on another number of ranks, set your loop's accumulation and sampler "
            "yourself.",
        ),
    )
    """A resume (``ckpt_path``, ``resume_from_last``, a torchrun restart) on a different number of ranks than the
    checkpoint's: ``"keep_global_batch"`` (default) recomputes accumulation so that each optimizer step trains as many
    rows as before (refused, naming the sizes that fit, when no accumulation can), ``"keep_per_rank_batch"`` keeps
    accumulation and says how the global batch changes, ``"error"`` refuses. Either way the epoch resumes at the same
    sample of its permutation (Lightning's ``DistributedSampler``), and one line says what changed (Trainer only)."""

    sync_guard: bool = argument(True, _flag)
    """After every backward that should synchronize, check on every rank that torch's reducer all-reduced every
    bucket, and act before the optimizer step (rule R6): no optimizer step is ever applied with gradients that were not
    all-reduced, and a parameter unused on some ranks only ends the step with an error instead of a hang. The ranks
    agree through the job's store on gloo (one look-up per step), and with one all-reduce of a few integers per step
    on a small gloo group of their own on other backends. Default on."""

    uneven_inputs: UnevenInputs = argument(
        "error",
        _choice(
            "use 'error' (default: every rank raises at the first batch one rank lacks), 'stop' (every rank ends the "
            "epoch when the first runs out) or 'join' (the longer ranks train on)."
        ),
    )
    """Ranks whose shards hold different numbers of batches (an ``IterableDataset`` split by rank,
    ``use_distributed_sampler=False``): ``"error"`` (default) raises ``UnevenInputsError`` on every rank at the first
    batch that is one rank's last and not another's, naming the counts; ``"stop"`` ends the epoch on every rank there
    and reports, once per epoch, the batches left untrained; ``"join"`` lets the longer ranks train on while the others
    repeat their last batch with weight 0, the gradient being the mean over the batches really trained. Nothing is
    compared when every training loader has a ``DistributedSampler`` (even by construction). With Fabric it needs
    ``strategy.micro_batches(loader)``."""

    atomic_checkpoints: bool = argument(True, _flag)
    """Write every checkpoint to a temporary file beside its target, fsync it, rename it over the target and fsync the
    directory, so a kill, a full disk or a node crash during a save leaves the previous file whole. A checkpoint IO
    you pass stays yours, as passed: Lightning's own ``TorchCheckpointIO`` is saved atomically, another class is left
    to save as it saves (said once; wrap it in ``AtomicCheckpointIO`` yourself to make its saves atomic). Default
    on."""

    optimizer_sharding: OptimizerSharding = argument(False, _value_only(check_optimizer_sharding))
    """ZeRO stage 1: ``True`` wraps every optimizer in torch's ``ZeroRedundancyOptimizer`` with its class,
    hyperparameters and parameter groups, so each rank keeps the optimizer state of about 1/N of the parameters
    (whole parameters, so unevenly on small models) and the updated parameters are broadcast after each step; exact,
    on every backend. ``"overlap"`` runs the step inside the backward with torch's ``hook_with_zero_step`` (NCCL/HCCL
    only: refused on gloo before launch; torch applies no update in the first 2 steps, 3 with ``static_graph``;
    refused with a comm hook, accumulation, ``bucket_cap_mb="auto"``, ``sync_guard``, ``uneven_inputs="join"`` and
    gradient clipping). Checkpoints hold the consolidated, plain optimizer state (gathered on rank 0 at each save).
    Default ``False``."""

    stall_report_after: TimeoutLike | Literal["auto"] | None = argument("auto", _stall_threshold)
    """How long a collective may be waited in before the ranks compare what they are doing, through the job's store,
    and say why: ranks out of step (a collective issued on some ranks only, e.g. ``self.log(..., sync_dist=True)`` on
    one rank) end the job at once with each rank's collective and line; a rank that has not reached the collective is
    named with its line and stack, and the collective timeout's error carries the same report. ``"auto"`` (default):
    a quarter of ``timeout``, at most 5 minutes. ``None``: off. The same forms as ``timeout``, and shorter than it."""

    ledger_length: int = argument(64, lambda argument, value: require_count(argument, value, "64"))
    """The collectives each rank remembers (its collective ledger), for the stall report. ``0``: none (the ledger
    is off), which needs ``stall_report_after=None``."""

    find_stragglers_every_n_steps: int | None = argument(50, _count("50"))
    """Every N optimizer steps, the ranks compare their median time per step in data fetch, compute (less the time
    waited in collectives), collective wait and optimizer step (one gather of four integers per rank), and a rank
    the others wait for gets one warning (repeated at most every 5 minutes) naming it, the phase and the figures.
    ``None``: off."""

    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict, metadata={"declared": False})
    """Further ``DistributedDataParallel`` arguments (a front end's ``**kwargs``), checked against its signature."""

    def __post_init__(self) -> None:
        for name in front_end_arguments():
            check = ARGUMENT_FIELDS[name].metadata["check"]
            if check is not None:
                object.__setattr__(self, name, check(name, getattr(self, name)))
        self._check_across_arguments()

    def _check_across_arguments(self) -> None:
        self._check_timeouts()
        check_comm_wrapper(self.ddp_comm_wrapper, self.comm_hook)
        check_auto_with_hook(self.bucket_cap_mb, self.comm_hook)
        micro_batch_conflicts = micro_batch_refusals(
            self.micro_batch_size,
            self.sync_guard,
            self.static_graph,
            self.gradient_accumulation_steps,
            self.optimizer_sharding == "overlap",
        )
        if micro_batch_conflicts:
            raise ArgumentValueError(
                describe_bad_value(
                    "micro_batch_size",
                    self.micro_batch_size,
                    "it cannot run with these settings: " + " ".join(micro_batch_conflicts),
                    micro_batch_conflicts.fix,
                )
            )
        conflicts = refusals(
            self.optimizer_sharding,
            self.comm_hook,
            self.gradient_accumulation_steps,
            self.bucket_cap_mb,
            self.sync_guard,
            self.uneven_inputs,
        )
        if conflicts:
            raise ArgumentValueError(
                f"`optimizer_sharding={self.optimizer_sharding!r}` cannot run with these settings: "
                + " ".join(conflicts)
                + " Fix: use `optimizer_sharding=True` (the same memory saving, the step after the backward), or "
                "change the settings named."
            )

    def _check_timeouts(self) -> None:
        """``stall_report_after`` against ``timeout``, a ledger to compare while the report is on, and
        ``setup_timeout`` against a backend named here (``"auto"`` is judged once the device is known)."""
        if self.setup_timeout is not None:
            check_setup_timeout(self.process_group_timeout, self.backend, CAN_SET_GROUP_TIMEOUT, GROUP_TIMEOUT_BACKENDS)
        threshold = self.stall_threshold
        if threshold is not None and threshold >= self.collective_timeout:
            raise ArgumentValueError(
                describe_bad_value(
                    "stall_report_after",
                    format_timeout(threshold),
                    f"it must be shorter than `timeout` ({format_timeout(self.collective_timeout)}), which ends the job.",
                    "set it well below the timeout (e.g. a quarter of it: `'auto'`), or raise `timeout`.",
                )
            )
        if threshold is not None and self.ledger_length == 0:
            raise ArgumentValueError(
                describe_bad_value(
                    "ledger_length",
                    0,
                    "the stall report needs the ranks' ledgers, and `stall_report_after` is on "
                    f"({format_timeout(threshold)}).",
                    "keep a ledger (e.g. `ledger_length=64`, the default), or turn the report off with "
                    "`stall_report_after=None`.",
                )
            )

    @classmethod
    def for_front_end(cls, front_end: FrontEnd, keywords: Mapping[str, Any]) -> DDPPlusArguments:
        """A front end's keywords (its ``**arguments``): the declared ones it takes, and the rest as further
        ``DistributedDataParallel`` arguments. A name neither declared nor torch's gets the closest name as its fix;
        an argument the front end does not take gets the reason and what to do instead."""
        taken = set(front_end_arguments(front_end))
        declared, extra = {}, {}
        for name, value in keywords.items():
            if name in taken:
                declared[name] = value
            elif name in ARGUMENT_FIELDS:
                lacks: TrainerOnly = ARGUMENT_FIELDS[name].metadata["trainer_only"]
                raise ArgumentTypeError(
                    describe_bad_value(name, value, f"{front_end} does not take it: {lacks.reason}", lacks.fix)
                )
            elif name in _DDP_PARAMETERS:
                extra[name] = value
            else:
                raise ArgumentTypeError(unknown_argument_message(front_end, name, value))
        return cls(**declared, ddp_kwargs=extra)

    @property
    def backend(self) -> str | None:
        """The backend named (lower case), or ``None`` to follow the accelerator."""
        return self.process_group_backend

    @property
    def collective_timeout(self) -> timedelta:
        """``timeout`` as its check parsed it."""
        assert isinstance(self.timeout, timedelta)
        return self.timeout

    @property
    def process_group_timeout(self) -> timedelta:
        """The timeout the process group is created with: ``setup_timeout``, else ``timeout``."""
        assert self.setup_timeout is None or isinstance(self.setup_timeout, timedelta)
        return self.setup_timeout or self.collective_timeout

    @property
    def setup_collective_timeout(self) -> timedelta | None:
        """``setup_timeout`` as its check parsed it (``None``: ``timeout`` throughout)."""
        assert self.setup_timeout is None or isinstance(self.setup_timeout, timedelta)
        return self.setup_timeout

    @property
    def stall_threshold(self) -> timedelta | None:
        """``stall_report_after`` in effect: ``"auto"`` decided (a quarter of the timeout, at most 5 minutes)."""
        if self.stall_report_after is None:
            return None
        if self.stall_report_after == "auto":
            return min(self.collective_timeout / 4, timedelta(minutes=5))
        assert isinstance(self.stall_report_after, timedelta)
        return self.stall_report_after

    @property
    def comm_hook(self) -> CommHook | HookFunction | None:
        """``ddp_comm_hook`` as its check parsed it: a named hook, a hook function, or ``None``."""
        hook: CommHook | HookFunction | None = self.ddp_comm_hook  # type: ignore[assignment]
        return hook

    @cached_property
    def settings(self) -> DDPSettings:
        """The ``DistributedDataParallel`` knobs, as given (``broadcast_buffers="auto"`` still undecided)."""
        return DDPSettings(
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=self.bucket_cap_mb,
            broadcast_buffers=self.broadcast_buffers,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            extra=dict(self.ddp_kwargs),
        )

    def given(self, front_end: FrontEnd) -> dict[str, Any]:
        """Every argument the front end takes, with its value (declaration order)."""
        return {name: getattr(self, name) for name in front_end_arguments(front_end)}


#: The declared arguments' fields, by name (``ddp_kwargs`` is not an argument of its own).
ARGUMENT_FIELDS: dict[str, dataclasses.Field[Any]] = {
    f.name: f for f in dataclasses.fields(DDPPlusArguments) if f.metadata.get("declared", True)
}
_DDP_PARAMETERS = tuple(inspect.signature(DistributedDataParallel.__init__).parameters)[1:]


def front_end_arguments(front_end: FrontEnd | None = None) -> list[str]:
    """The declared arguments a front end takes (every one when ``None``), in declaration order."""
    return [
        name
        for name, spec in ARGUMENT_FIELDS.items()
        if front_end in (None, "DDPPlusStrategy") or spec.metadata["trainer_only"] is None
    ]


def trainer_only_arguments() -> dict[str, TrainerOnly]:
    """The arguments only ``DDPPlusStrategy`` takes, and why ``DDPPlusFabricStrategy`` does not."""
    return {
        name: spec.metadata["trainer_only"] for name, spec in ARGUMENT_FIELDS.items() if spec.metadata["trainer_only"]
    }


def unknown_argument_message(front_end: str, name: str, value: Any) -> str:
    """The error for a name that is neither declared nor one of ``DistributedDataParallel``'s arguments."""
    suggestion = closest_name(name, (*ARGUMENT_FIELDS, *_DDP_PARAMETERS))
    fix = (
        f"did you mean `{suggestion}`?"
        if suggestion
        else "check the spelling against the documented arguments (docs/arguments.md)."
    )
    return (
        f"{front_end} got an unexpected keyword argument `{name}` (given {value!r}): it is neither a strategy "
        f"argument nor an argument of torch's DistributedDataParallel. Fix: {fix}"
    )


@cache
def argument_types() -> dict[str, Any]:
    """Each declared argument's type, evaluated (the module uses postponed annotations)."""
    hints = typing.get_type_hints(DDPPlusArguments)
    return {name: hints[name] for name in ARGUMENT_FIELDS}


@cache
def argument_docs() -> dict[str, str]:
    """Each declared argument's docstring (the string literal under its field), whitespace folded."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(DDPPlusArguments)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return {name: docs[name] for name in ARGUMENT_FIELDS}


def declared_parameters(front_end: FrontEnd, without: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """The front end's declared arguments (but ``without``) as keyword-only parameters, typed, with defaults."""
    types = argument_types()
    return [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=ARGUMENT_FIELDS[name].default, annotation=types[name]
        )
        for name in front_end_arguments(front_end)
        if name not in without
    ]


def takes_declared_arguments(
    front_end: FrontEnd, without: tuple[str, ...] = (), ddp_kwargs: bool = True
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """For a front end's ``__init__(self, <its own parameters>, **arguments)``: its signature becomes its own
    parameters, then every declared argument the front end takes (keyword-only, typed, with its default) but those
    ``without`` (which its own parameters set), then (``ddp_kwargs``) ``**kwargs`` for further
    ``DistributedDataParallel`` arguments; its docstring's ``Args:`` gains each argument's docstring. That is what
    ``inspect.signature``, LightningCLI and ``help()`` show."""

    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        further = [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any)] if ddp_kwargs else []
        declared = declared_parameters(front_end, without)
        init.__signature__ = inspect.Signature([*own, *declared, *further])  # type: ignore[attr-defined]
        docs = argument_docs()
        entries = [f"    {parameter.name}: {docs[parameter.name]}" for parameter in declared]
        if ddp_kwargs:
            entries.append(
                "    **kwargs: further ``DistributedDataParallel`` arguments, checked against its signature."
            )
        init.__doc__ = (inspect.cleandoc(init.__doc__ or "Args:") + "\n" + "\n".join(entries)).strip()
        return init

    return decorate
