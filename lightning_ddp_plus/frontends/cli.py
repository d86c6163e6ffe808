"""The ``ddp-plus`` console script: LightningCLI with the strategy names registered.

``ddp-plus demo`` trains the main job shipped with the package (``--write-config FILE`` writes its config instead);
``ddp-plus fit --config configs/cpu.yaml`` trains; ``fit``, ``validate``, ``test`` and ``predict`` work as in
LightningCLI. ``ddp-plus check --config FILE`` runs the conflict checks without training (exit status 1 on an
error-level finding); ``ddp-plus report LOGDIR`` draws the ``ddp/`` telemetry a run logged with CSVLogger. The current
directory is put on ``sys.path`` (as ``python -m`` does) so that a config can name classes from the project it is run
in, e.g. ``my_project.models.MyModel`` from ``my_project/models.py``.
"""

from __future__ import annotations

import os
import sys

import lightning_ddp_plus  # noqa: F401  (registers the strategy names)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``ddp-plus``."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["demo"]:
        argv = demo_arguments(argv[1:])
        if not argv:
            return
        args = argv
    if argv[:1] == ["check"]:
        from lightning_ddp_plus.diagnostics.check_command import run_check

        sys.exit(run_check(argv[1:]))
    if argv[:1] == ["report"]:
        from lightning_ddp_plus.diagnostics.report import main as run_report

        sys.exit(run_report(argv[1:]))
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(args=args, save_config_kwargs={"overwrite": True})


def demo_arguments(argv: list[str]) -> list[str]:
    """``ddp-plus demo [--write-config FILE] [LightningCLI arguments]`` as ``fit`` arguments, or ``[]`` once the
    config is written. Lightning's popen launcher runs the same command line for every rank, so each rank gets here.

    >>> demo_arguments(["--trainer.max_epochs", "1"])[-2:]
    ['--trainer.max_epochs', '1']
    """
    from lightning_ddp_plus.demo import DEMO_CONFIG

    if argv[:1] == ["--write-config"]:
        if len(argv) != 2:
            sys.exit(
                "ddp-plus demo --write-config takes one argument, the file to write, e.g. `--write-config cpu.yaml`"
            )
        target = argv[1]
        if os.path.exists(target):  # never overwrite a config someone edited
            sys.exit(f"ddp-plus demo --write-config: {target} exists; name a new file or remove it first")
        with open(target, "w") as file:
            file.write(DEMO_CONFIG.read_text())
        print(f"wrote {target}; train with `ddp-plus fit --config {target}`")
        return []
    return ["fit", "--config", str(DEMO_CONFIG), *argv]


if __name__ == "__main__":
    main()
