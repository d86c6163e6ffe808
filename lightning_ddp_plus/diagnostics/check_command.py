"""``ddp-plus check --config FILE [--device-memory 80GiB] [--world-size N] [--device-type cuda]``: the conflict
checks and the memory plan, without a process group and without training.

Builds the Trainer, model and data from a LightningCLI config (so every argument is validated as for ``fit``),
reads the model's static facts, runs one probe forward of ``training_step`` on a training batch in this process
where it can, evaluates the rules and prints each finding with its fix. Then the memory plan
(``lightning_ddp_plus.memory.plan``) for that model, the first optimizer of ``configure_optimizers`` and that batch:
per-rank bytes of each DDP layout at the job's world size (``--world-size`` overrides it), against the device's
memory (the accelerator's when one is present, else ``--device-memory``), with a verdict and the next step. The
step is measured here as it runs on the job's device (the Trainer's accelerator, or ``--device-type`` where this
machine has another: a login node without the GPU).
Exit status 1 when an error-level finding exists, when the configured layout does not fit the device memory, or
when the config itself is invalid; else 0.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from lightning_ddp_plus.conflicts.facts import ForwardProbe, ModelFacts, static_facts
from lightning_ddp_plus.conflicts.rules import CheckedSettings, Finding, evaluate
from lightning_ddp_plus.memory.devices import is_known_device_type
from lightning_ddp_plus.memory.plan import MemoryPlan, device_memory_of, measure_model, plan_layouts
from lightning_ddp_plus.memory.sizes import parse_size
from lightning_ddp_plus.memory.suggestion import (
    SUGGESTION_FILE,
    ChunkSuggestion,
    parameter_count,
    write_suggestion,
)
from lightning_ddp_plus.sync.accumulation import merge_accumulation_settings
from lightning_ddp_plus.sync.chunks import batch_rows

CHECK_HELP = """usage: ddp-plus check --config FILE [--device-memory SIZE] [--world-size N] [--device-type TYPE]
                      [LightningCLI arguments]

The conflict checks and the memory plan of a LightningCLI config, without a process group and without training.
Exit status 1 on an error-level finding, a configured layout that does not fit, or an invalid config; else 0.

options of ddp-plus check:
  --device-memory SIZE  the memory of one device, e.g. 80GiB or 24GB (default: the accelerator's, when present)
  --world-size N        the number of ranks to plan for (default: the config's devices x num_nodes)
  --device-type TYPE    the device the job trains on, e.g. cuda, when this machine has another (default: the
                        Trainer's accelerator): its optimizer implementation and allocator rounding are planned

LightningCLI's arguments (the config's):"""


def settings_view(trainer: pl.Trainer) -> CheckedSettings:
    strategy = trainer.strategy
    engine = getattr(strategy, "engine", None)
    if engine is not None:
        steps = merge_accumulation_settings(engine.window.requested, trainer.accumulate_grad_batches)
        return CheckedSettings(
            engine.settings.find_unused_parameters,
            engine.settings.static_graph,
            bool(engine.settings.broadcast_buffers),
            steps,
        )
    kwargs = getattr(strategy, "_ddp_kwargs", {}) or {}
    return CheckedSettings(
        find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
        static_graph=bool(kwargs.get("static_graph", False)),
        broadcast_buffers=bool(kwargs.get("broadcast_buffers", True)),
        gradient_accumulation_steps=int(trainer.accumulate_grad_batches),
    )


def training_batch(model: pl.LightningModule, datamodule: pl.LightningDataModule | None) -> Any:
    """The first batch of the training loader, as ``fit`` would build it."""
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    else:
        model.setup("fit")
        loader = model.train_dataloader()
    return next(iter(loader))


def training_loss(model: pl.LightningModule, batch: Any) -> Tensor:
    """One ``training_step`` forward, returning its loss."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log() outside a fit warns; only the loss matters here
        output = model.training_step(batch, 0)
    loss = output if isinstance(output, Tensor) else output["loss"] if isinstance(output, dict) else None
    if loss is None:
        raise ValueError("training_step returned no loss tensor")
    return loss


def probe_facts(model: pl.LightningModule, batch: Any) -> tuple[ModelFacts, str]:
    """Facts from one ``training_step`` on a training batch; static facts, and why, when that cannot run here."""
    try:
        if isinstance(batch, Exception):
            raise batch
        model.train()
        with ForwardProbe(model) as probe:
            loss = training_loss(model, batch)
        return probe.facts(loss), "one probe forward of training_step on a training batch"
    except Exception as error:  # noqa: BLE001 - any failure means: fall back to what can be read statically
        return static_facts(
            model
        ), f"static facts only (the probe forward could not run here: {type(error).__name__}: {error})"


def first_optimizer(configured: Any) -> Optimizer | None:
    """The first optimizer of what ``configure_optimizers`` returned, in any of the forms Lightning accepts."""
    if isinstance(configured, Optimizer):
        return configured
    if isinstance(configured, dict):
        return first_optimizer(configured.get("optimizer"))
    if isinstance(configured, list | tuple) and configured:
        return first_optimizer(configured[0])
    return None


@dataclass(frozen=True, kw_only=True)
class PlanArguments:
    """The options ``ddp-plus check`` takes for the memory plan, besides LightningCLI's."""

    device_memory: int | None = None
    """Bytes of one device (``None``: the accelerator's, where one is present)."""
    world_size: int | None = None
    """Ranks to plan for (``None``: the config's devices x num_nodes)."""
    device_type: str | None = None
    """The device type the job trains on (``None``: the Trainer's accelerator's)."""


def plan_arguments(args: list[str]) -> tuple[list[str], PlanArguments]:
    """Take ``--device-memory SIZE``, ``--world-size N`` and ``--device-type TYPE`` out of ``args`` (the rest goes
    to LightningCLI)."""
    rest: list[str] = []
    found: dict[str, Any] = {}
    iterator = iter(args)
    for argument in iterator:
        name, _, inline = argument.partition("=")
        if name not in ("--device-memory", "--world-size", "--device-type"):
            rest.append(argument)
            continue
        value = inline or next(iterator, "")
        if name == "--device-memory":
            found["device_memory"] = parse_size(value)
        elif name == "--world-size":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(
                    f"`--world-size={value!r}` is not valid: expected a positive integer. Fix: e.g. `--world-size 8`."
                )
            found["world_size"] = int(value)
        elif not is_known_device_type(value):
            raise ValueError(
                f"`--device-type={value!r}` is not valid: expected a torch device type without an index, such as "
                "'cuda', 'xpu' or 'cpu' (Lightning's accelerator 'gpu' is 'cuda' on NVIDIA GPUs). "
                "Fix: e.g. `--device-type cuda`."
            )
        else:
            found["device_type"] = value
    return rest, PlanArguments(**found)


def memory_plan(
    trainer: pl.Trainer, model: pl.LightningModule, batch: Any, requested: PlanArguments
) -> tuple[MemoryPlan | None, str]:
    """The plan for the configured run; ``None`` and why when the model's forward cannot run here."""
    strategy = trainer.strategy
    engine = getattr(strategy, "engine", None)
    if engine is not None:
        configured = (bool(engine.settings.gradient_as_bucket_view), bool(engine.arguments.optimizer_sharding))
    else:
        configured = (bool((getattr(strategy, "_ddp_kwargs", {}) or {}).get("gradient_as_bucket_view")), False)
    source = "the --device-memory figure"
    device_memory = requested.device_memory
    if device_memory is None:
        device_memory = device_memory_of(strategy.root_device)
        source = f"the {strategy.root_device.type} device's memory"
    # the job's device, through Lightning's accelerator (the model itself stays where it was built, on the CPU)
    device_type = requested.device_type or strategy.root_device.type
    try:
        if isinstance(batch, Exception):
            raise batch
        optimizer = first_optimizer(model.configure_optimizers())
        rows = batch_rows(batch)
        figures = measure_model(
            model, optimizer, lambda: training_loss(model, batch), inputs=batch, rows=rows, device_type=device_type
        )
    except Exception as error:  # noqa: BLE001 - the plan needs one real forward; say why it could not run
        return None, f"memory plan: not made (one training forward could not run here: {type(error).__name__}: {error})"
    size = requested.world_size or trainer.num_devices * trainer.num_nodes
    whole = engine is not None and engine.arguments.optimizer_sharding == "all_reduce"
    plan = plan_layouts(figures, size, device_memory, configured=configured, whole_parameters=whole)
    memory = "" if device_memory is None else f" against {source}"
    return (
        plan,
        f"memory plan for {type(model).__name__} and {type(optimizer).__name__ if optimizer else 'no optimizer'}{memory}:\n{plan.render()}",
    )


def leave_suggestion(plan: MemoryPlan, folder: str, model: pl.LightningModule) -> str | None:
    """Where the plan suggests a chunk size: write it for ``chunk_size="auto"`` (``memory.suggestion``); where
    it decided on another layout, remove a suggestion an earlier check left. What was done, as a line (``None``: the
    plan made no decision, having no device memory to decide against)."""
    if plan.decision is None or plan.device_memory is None:
        return None
    path = Path(folder) / SUGGESTION_FILE
    micro = next((layout for layout in plan.layouts if layout.name == "chunks"), None)
    if plan.decision.layout != "chunks" or micro is None or micro.chunk_size is None:
        if path.is_file():
            path.unlink()
            return f"removed {path}: this plan suggests no chunk size for chunk_size='auto' to start from."
        return None
    suggestion = ChunkSuggestion(
        chunk_size=micro.chunk_size,
        world_size=plan.world_size,
        device_memory=plan.device_memory,
        parameters=parameter_count(model),
    )
    written = write_suggestion(folder, suggestion)
    return (
        f"wrote {written}: a run of this model on {plan.world_size} rank(s) with chunk_size='auto' starts from "
        f"{suggestion.chunk_size} rows per chunk."
    )


def describe_facts(facts: ModelFacts) -> str:
    def names(values: Any, limit: int = 6) -> str:
        values = list(values or ())
        return (
            ", ".join(values[:limit]) + (f" and {len(values) - limit} more" if len(values) > limit else "")
            if values
            else "none"
        )

    unused = "not observed" if facts.unused_parameters is None else names(facts.unused_parameters)
    return (
        f"checkpointing: {names(sorted(facts.checkpointing))}; trained inside reentrant regions: "
        f"{names(facts.reentrant_parameters)}; accumulated more than once: {names(facts.reused_in_checkpoint)}; "
        f"in regions without input grads: {names(facts.no_grad_region_parameters)}; parameters without gradient: "
        f"{unused}; buffers training changes: {names(facts.mutable_buffers)}"
    )


def report(view: CheckedSettings, facts: ModelFacts, source: str, findings: list[Finding]) -> str:
    lines = [
        (
            f"settings: find_unused_parameters={view.find_unused_parameters}, static_graph={view.static_graph}, "
            f"broadcast_buffers={view.broadcast_buffers}, accumulation={view.gradient_accumulation_steps}"
        ),
        f"model facts ({source}): {describe_facts(facts)}",
    ]
    lines += [f"{finding.rule.level.upper()} {finding}" for finding in findings]
    errors = sum(finding.rule.level == "error" for finding in findings)
    lines.append(f"result: {errors} error(s), {len(findings) - errors} advice" if findings else "result: no findings")
    return "\n".join(lines)


def run_check(args: list[str]) -> int:
    from lightning.pytorch.cli import LightningCLI

    try:
        args, requested = plan_arguments(args)
    except ValueError as error:
        print(f"ERROR {error}", file=sys.stderr)
        return 1
    if any(argument in ("-h", "--help") for argument in args):
        print(CHECK_HELP)  # then LightningCLI's own help, for the config's arguments
    command_line, sys.argv = sys.argv, [sys.argv[0], *args]  # read from there: LightningCLI warns when given both
    try:
        cli = LightningCLI(run=False, save_config_callback=None)
    except SystemExit as exit_:  # jsonargparse's own errors exit 2 after printing; --help exits 0
        if exit_.code in (0, None):
            return 0
        print("ERROR the configuration is invalid: see the message above.", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as error:
        print(f"ERROR the configuration is invalid: {error}", file=sys.stderr)
        return 1
    finally:
        sys.argv = command_line
    view = settings_view(cli.trainer)
    try:
        batch: Any = training_batch(cli.model, cli.datamodule)
    except Exception as error:  # noqa: BLE001 - reported by the probe and the plan
        batch = error
    facts, source = probe_facts(cli.model, batch)
    findings = evaluate(view, facts)
    print(report(view, facts, source, findings))
    plan, text = memory_plan(cli.trainer, cli.model, batch, requested)
    print(text)
    left = None if plan is None else leave_suggestion(plan, cli.trainer.default_root_dir, cli.model)
    if left is not None:
        print(left)
    does_not_fit = plan is not None and plan.configured is not None and plan.fits(plan.configured) is False
    if does_not_fit:
        print("ERROR the configured layout does not fit the device memory: see the verdict above.")
    return 1 if does_not_fit or any(finding.rule.level == "error" for finding in findings) else 0
