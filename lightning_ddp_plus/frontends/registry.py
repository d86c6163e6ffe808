"""The strategy names the package registers, and how: one list for Lightning's Trainer registry and Fabric's.

Importing ``lightning_ddp_plus`` registers both front ends (``register_front_ends``); so does the ``ddp-plus`` command,
which imports only this subpackage.
"""

from __future__ import annotations

from typing import Any, Literal

#: Registered names and their launchers, mirroring Lightning's ``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``.
REGISTERED_NAMES: tuple[tuple[str, Literal["popen", "spawn", "fork"]], ...] = (
    ("ddp_plus", "popen"),
    ("ddp_plus_spawn", "spawn"),
    ("ddp_plus_fork", "fork"),
    ("ddp_plus_notebook", "fork"),
)


def register_names(strategy_class: Any, strategy_registry: Any) -> None:
    """Register every name for ``strategy_class`` in ``strategy_registry`` (again: a newer class replaces an older
    one), with the class's ``registry_label``; both front ends' ``register_strategies``."""
    for name, start_method in REGISTERED_NAMES:
        strategy_registry.register(
            name,
            strategy_class,
            description=f"{strategy_class.registry_label} with `start_method` '{start_method}'",
            override=True,
            start_method=start_method,
        )


def register_front_ends(trainer_strategy: Any, fabric_strategy: Any) -> None:
    """``Trainer(strategy="ddp_plus")`` builds ``trainer_strategy``, ``Fabric(strategy="ddp_plus")`` builds
    ``fabric_strategy``."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    trainer_strategy.register_strategies(StrategyRegistry)
    fabric_strategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
