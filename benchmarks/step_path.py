"""The house's figures for one Trainer step (issue 58): which package files one step enters, and how often a call
climbs back into a file already on the stack; the engine members the front ends use; the methods the two front ends
write alike; the package's lines.

One step is batch 3 of a 1-rank gloo fit with the default arguments, traced with ``sys.setprofile`` from the end of
batch 2 to the end of batch 3 (the data fetch, the hooks, the step, the backward and the optimizer step). A call
climbs back when a package function in file A calls one in file B (B not A) while B is already on the stack further
out. Nothing is timed: the figures are counts.

    python benchmarks/step_path.py [--out figures.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_ddp_plus"


class StepTrace:
    """The package files entered while it is on, and the calls that climbed back."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.climbs: set[str] = set()

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = self._package_file(frame)
        if callee is None:
            return
        self.files.add(callee)
        caller = frame.f_back
        caller_file = self._package_file(caller) if caller is not None else None
        if caller is None or caller_file is None or caller_file == callee:
            return
        outer = caller.f_back
        while outer is not None:
            if self._package_file(outer) == callee:
                self.climbs.add(f"{caller_file}:{caller.f_code.co_name} -> {callee}:{frame.f_code.co_name}")
                return
            outer = outer.f_back

    @staticmethod
    def _package_file(frame: FrameType) -> str | None:
        name = frame.f_code.co_filename
        return os.path.relpath(name, PACKAGE) if name.startswith(str(PACKAGE)) else None


def trace_one_step(root: str) -> StepTrace:
    """Batch 3 of a 1-rank gloo fit with the default arguments, traced (see the module's docstring)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_ddp_plus

    trace = StepTrace()

    class Tracing(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2:
                sys.setprofile(trace.profile)
            elif batch_idx == 3:
                sys.setprofile(None)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = pl.Trainer(
        strategy=lightning_ddp_plus.DDPPlusStrategy(process_group_backend="gloo"),
        accelerator="cpu",
        devices=1,
        max_steps=5,
        callbacks=[Tracing()],
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=4))
    return trace


def engine_members_used_by_front_ends() -> list[str]:
    """Every ``engine.<member>`` the front ends name."""
    members = set()
    for path in (PACKAGE / "frontends").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                inner = node.value
                if (isinstance(inner, ast.Attribute) and inner.attr == "engine") or (
                    isinstance(inner, ast.Name) and inner.id == "engine"
                ):
                    members.add(node.attr)
    return sorted(members)


def methods_written_alike() -> list[str]:
    """The methods both front-end classes define with the same name and the same body."""

    def methods(name: str) -> dict[str, str]:
        tree = ast.parse((PACKAGE / "frontends" / name).read_text())
        front_end = next(node for node in tree.body if isinstance(node, ast.ClassDef))
        return {
            node.name: ast.dump(ast.Module(body=node.body, type_ignores=[]))
            for node in front_end.body
            if isinstance(node, ast.FunctionDef)
        }

    trainer, fabric = methods("strategy.py"), methods("fabric.py")
    return sorted(name for name in trainer.keys() & fabric.keys() if trainer[name] == fabric[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the figures to this JSON file")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        trace = trace_one_step(root)
    figures = {
        "files_entered_by_one_step": sorted(trace.files),
        "calls_climbing_back": sorted(trace.climbs),
        "engine_members_used_by_front_ends": engine_members_used_by_front_ends(),
        "methods_written_alike_in_both_front_ends": methods_written_alike(),
        "package_lines": sum(len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")),
    }
    for name, value in figures.items():
        shown = value if isinstance(value, int) else f"{len(value)}: {', '.join(value)}"
        print(f"{name}: {shown}")
    if options.out:
        Path(options.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
