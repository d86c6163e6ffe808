"""``ddp-plus check --config FILE``: the conflict checks that need no process group, without training.

Builds the Trainer, model and data from a LightningCLI config (so every argument is validated as for ``fit``),
reads the model's static facts, runs one probe forward of ``training_step`` on a training batch in this process
where it can, evaluates the rules and prints each finding with its fix. Exit status 1 when an error-level finding
exists (or the config itself is invalid), else 0.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from lightning_ddp_plus.conflicts.facts import ForwardProbe, ModelFacts, static_facts
from lightning_ddp_plus.conflicts.rules import DDPView, Finding, evaluate
from lightning_ddp_plus.sync.accumulation import merge_accumulation_settings


def settings_view(trainer: pl.Trainer) -> DDPView:
    strategy = trainer.strategy
    engine = getattr(strategy, "engine", None)
    if engine is not None:
        steps = merge_accumulation_settings(engine.window.requested, trainer.accumulate_grad_batches)
        return DDPView(
            engine.settings.find_unused_parameters,
            engine.settings.static_graph,
            bool(engine.settings.broadcast_buffers),
            steps,
        )
    kwargs = getattr(strategy, "_ddp_kwargs", {}) or {}
    return DDPView(
        find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
        static_graph=bool(kwargs.get("static_graph", False)),
        broadcast_buffers=bool(kwargs.get("broadcast_buffers", True)),
        gradient_accumulation_steps=int(trainer.accumulate_grad_batches),
    )


def probe_facts(model: pl.LightningModule, datamodule: pl.LightningDataModule | None) -> tuple[ModelFacts, str]:
    """Facts from one ``training_step`` on a training batch; static facts, and why, when that cannot run here."""
    try:
        if datamodule is not None:
            datamodule.prepare_data()
            datamodule.setup("fit")
            loader = datamodule.train_dataloader()
        else:
            model.setup("fit")
            loader = model.train_dataloader()
        batch = next(iter(loader))
        model.train()
        with ForwardProbe(model) as probe, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() outside a fit warns; the probe only needs the loss
            output = model.training_step(batch, 0)
        loss = output if isinstance(output, Tensor) else output["loss"] if isinstance(output, dict) else None
        if loss is None:
            raise ValueError("training_step returned no loss tensor")
        return probe.facts(loss), "one probe forward of training_step on a training batch"
    except Exception as error:  # noqa: BLE001 - any failure means: fall back to what can be read statically
        return static_facts(
            model
        ), f"static facts only (the probe forward could not run here: {type(error).__name__}: {error})"


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


def report(view: DDPView, facts: ModelFacts, source: str, findings: list[Finding]) -> str:
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

    sys.argv = [sys.argv[0], *args]  # LightningCLI warns when args and sys.argv disagree
    try:
        cli = LightningCLI(args=args, run=False, save_config_callback=None)
    except (ValueError, TypeError) as error:
        print(f"ERROR the configuration is invalid: {error}", file=sys.stderr)
        return 1
    view = settings_view(cli.trainer)
    facts, source = probe_facts(cli.model, cli.datamodule)
    findings = evaluate(view, facts)
    print(report(view, facts, source, findings))
    return 1 if any(finding.rule.level == "error" for finding in findings) else 0
