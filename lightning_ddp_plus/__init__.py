"""lightning-ddp-plus: DistributedDataParallel for PyTorch Lightning, correct, explainable and fast.

Importing the package registers the strategy names ``ddp_plus``, ``ddp_plus_spawn``, ``ddp_plus_fork`` and
``ddp_plus_notebook`` with Lightning's strategy registry (``Trainer(strategy="ddp_plus")``) and with Fabric's
(``Fabric(strategy="ddp_plus")``).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp_plus.backend import KNOWN_BACKENDS
from lightning_ddp_plus.comm_hooks import CommHook
from lightning_ddp_plus.errors import DDPConflictError
from lightning_ddp_plus.fabric import DDPPlusFabricStrategy
from lightning_ddp_plus.replicas import ReplicaDriftError
from lightning_ddp_plus.settings import DDPSettings
from lightning_ddp_plus.strategy import REGISTERED_NAMES, DDPPlusStrategy
from lightning_ddp_plus.timeout import DEFAULT_TIMEOUT, parse_timeout
from lightning_ddp_plus.uneven import UnevenInputsError

__version__ = "0.2.0"

DDPPlusStrategy.register_strategies(StrategyRegistry)
DDPPlusFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "DEFAULT_TIMEOUT",
    "KNOWN_BACKENDS",
    "REGISTERED_NAMES",
    "CommHook",
    "DDPConflictError",
    "DDPPlusFabricStrategy",
    "DDPPlusStrategy",
    "DDPSettings",
    "ReplicaDriftError",
    "UnevenInputsError",
    "parse_timeout",
]
