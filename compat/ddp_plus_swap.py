"""A pytest plugin that puts ``DDPPlusStrategy`` wherever Lightning's tests use ``DDPStrategy``.

Loaded with ``-p compat.ddp_plus_swap`` before Lightning's test modules import ``DDPStrategy``: the class is replaced
in Lightning's modules and in the strategy registry (``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook`` and the
``*_find_unused_parameters_*`` names), so ``Trainer(strategy="ddp")`` and ``DDPStrategy(...)`` both build ours.
"""

import lightning.pytorch.strategies.ddp as ddp_module
from lightning.pytorch import strategies
from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp_plus import DDPPlusStrategy

ORIGINAL = ddp_module.DDPStrategy


def _swap() -> None:
    import lightning.pytorch as pl

    for module in (strategies, ddp_module, pl):
        if getattr(module, "DDPStrategy", None) is ORIGINAL:
            module.DDPStrategy = DDPPlusStrategy
    for name, entry in list(StrategyRegistry.items()):
        if entry["strategy"] is ORIGINAL:
            StrategyRegistry.register(
                name, DDPPlusStrategy, description=entry["description"], override=True, **entry["init_params"]
            )


_swap()


def pytest_report_header(config):
    return f"compat: DDPStrategy replaced by {DDPPlusStrategy.__module__}.DDPPlusStrategy"
