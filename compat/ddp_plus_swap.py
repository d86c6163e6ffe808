"""A pytest plugin that puts ``DDPPlusStrategy`` wherever Lightning's tests use ``DDPStrategy``, and
``DDPPlusFabricStrategy`` wherever Fabric's tests use Fabric's.

Loaded with ``-p compat.ddp_plus_swap`` before Lightning's test modules import ``DDPStrategy``: the class is replaced
in Lightning's modules and in the strategy registries (``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook`` and the
``*_find_unused_parameters_*`` names), so ``Trainer(strategy="ddp")``, ``Fabric(strategy="ddp")`` and
``DDPStrategy(...)`` all build ours.
"""

from types import ModuleType
from typing import Any

import lightning.fabric.connector as fabric_connector
import lightning.fabric.strategies as fabric_strategies
import lightning.fabric.strategies.ddp as fabric_ddp_module
import lightning.pytorch as pl
import lightning.pytorch.strategies.ddp as ddp_module
from lightning import fabric
from lightning.pytorch import strategies
from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy


def _swap(modules: tuple[ModuleType, ...], registry: Any, original: type, ours: type) -> None:
    for module in modules:
        if getattr(module, "DDPStrategy", None) is original:
            module.DDPStrategy = ours
    for name, entry in list(registry.items()):
        if entry["strategy"] is original:
            registry.register(name, ours, description=entry["description"], override=True, **entry["init_params"])


_swap((strategies, ddp_module, pl), StrategyRegistry, ddp_module.DDPStrategy, DDPPlusStrategy)
_swap(
    (fabric_strategies, fabric_ddp_module, fabric_connector, fabric),
    fabric_strategies.STRATEGY_REGISTRY,
    fabric_ddp_module.DDPStrategy,
    DDPPlusFabricStrategy,
)


def pytest_report_header(config):
    return (
        f"compat: DDPStrategy replaced by {DDPPlusStrategy.__module__}.DDPPlusStrategy, Fabric's by "
        f"{DDPPlusFabricStrategy.__name__}"
    )
