"""The ``ddp-plus`` console script: LightningCLI with the strategy names registered.

``ddp-plus demo`` trains the main job shipped with the package (``--write-config FILE`` writes its config instead);
``ddp-plus fit --config configs/cpu.yaml`` trains; ``fit``, ``validate``, ``test`` and ``predict`` work as in
LightningCLI. ``ddp-plus check --config FILE`` runs the conflict checks without training (exit status 1 on an
error-level finding); ``ddp-plus report LOGDIR`` draws the ``ddp/`` telemetry a run logged with CSVLogger. The current
directory is put on ``sys.path`` (as ``python -m`` does) so that a config can name classes from the project it is run
in, e.g. ``my_project.models.MyModel`` from ``my_project/models.py``.

A strategy argument that is refused (a wrong type or name that jsonargparse refuses, a value the strategy's check
refuses, a device the backend does not fit) ends the command before anything is started, with the strategy's own
message first and no traceback (``cli_arguments``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError
from lightning_ddp_plus.frontends import cli_arguments
from lightning_ddp_plus.frontends.fabric import DDPPlusFabricStrategy
from lightning_ddp_plus.frontends.registry import register_front_ends
from lightning_ddp_plus.frontends.strategy import DDPPlusStrategy


def main(args: list[str] | None = None) -> None:
    """Entry point of ``ddp-plus``."""
    register_front_ends(DDPPlusStrategy, DDPPlusFabricStrategy)  # `strategy: ddp_plus` in a config
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["demo"]:
        argv = args = demo_arguments(argv[1:])
        if not argv:
            return
    if argv[:1] == ["check"]:
        from lightning_ddp_plus.diagnostics.check_command import run_check

        sys.exit(run_check(argv[1:]))
    if argv[:1] == ["report"]:
        from lightning_ddp_plus.diagnostics.report import main as run_report

        sys.exit(run_report(argv[1:]))
    run_lightning_cli(argv, from_sys_argv=args is None)


def run_lightning_cli(argv: list[str], from_sys_argv: bool = False) -> None:
    """LightningCLI on ``argv`` (``from_sys_argv``: it is the process's command line, which LightningCLI reads
    itself); a strategy argument it refuses, or that the strategy's own check refuses, ends the command with that
    check's message alone (the argument, the value, what is allowed, the fix), exit status 2."""
    from lightning.pytorch.cli import LightningCLI

    class ExplainingCLI(LightningCLI):
        def init_parser(self, **kwargs: Any) -> Any:
            parser = super().init_parser(**kwargs)
            refuse = parser.error

            def error(message: str, ex: Exception | None = None) -> NoReturn:
                explained = cli_arguments.explain(argv, message)
                if explained is not None:
                    refuse_arguments(explained)
                refuse(message, ex)

            parser.error = error  # type: ignore[method-assign]  # this parser's refusals only
            return parser

    try:
        ExplainingCLI(args=None if from_sys_argv else argv, save_config_kwargs={"overwrite": True})
    except (ArgumentValueError, ArgumentTypeError) as refused:  # the Trainer's checks, and those when fit starts
        refuse_arguments(str(refused))
    except (ValueError, TypeError) as refused:  # a check that failed while jsonargparse built the classes
        explained = cli_arguments.explain(argv, str(refused))
        if explained is None:
            raise
        refuse_arguments(explained)


def refuse_arguments(message: str) -> NoReturn:
    """End the command as argparse ends it on bad input (exit status 2), with the strategy's own message."""
    print(cli_arguments.error_text(message), file=sys.stderr)
    sys.exit(2)


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
