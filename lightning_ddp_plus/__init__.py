"""lightning-ddp-plus: DistributedDataParallel for PyTorch Lightning, correct, explainable and fast.

The public names are importable from here; the subpackages are the architecture: ``frontends`` (the Trainer and
Fabric strategies, the Hugging Face port, the command line) adapt their framework and delegate to ``engine``, which
declares every argument once (``DDPPlusArguments``) and owns one component per concern, living in ``sync``,
``sharding``, ``conflicts``, ``diagnostics``, ``processes``, ``persistence``, ``preemption`` and ``crash`` (a
rank's death), all built on ``config``; ``memory`` plans a run's per-rank bytes (``ddp-plus check``).

Importing the package registers the strategy names ``ddp_plus``, ``ddp_plus_spawn``, ``ddp_plus_fork`` and
``ddp_plus_notebook`` with Lightning's strategy registry (``Trainer(strategy="ddp_plus")``) and with Fabric's
(``Fabric(strategy="ddp_plus")``).
"""

from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_deprecation

from lightning_ddp_plus.config.backend import KNOWN_BACKENDS
from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, renamed_message
from lightning_ddp_plus.config.settings import DDPSettings
from lightning_ddp_plus.config.timeout import DEFAULT_TIMEOUT, parse_timeout
from lightning_ddp_plus.conflicts.errors import DDPConflictError
from lightning_ddp_plus.crash.peer_death import peer_gone_in
from lightning_ddp_plus.crash.report import AfterDeathSave, RankDied
from lightning_ddp_plus.diagnostics.replicas import ReplicaDriftError
from lightning_ddp_plus.diagnostics.telemetry import DDPTelemetry
from lightning_ddp_plus.engine.arguments import DDPPlusArguments
from lightning_ddp_plus.frontends.fabric import DDPPlusFabricStrategy
from lightning_ddp_plus.frontends.hf import HFStyleDDPPlusStrategy
from lightning_ddp_plus.frontends.registry import REGISTERED_NAMES, register_front_ends
from lightning_ddp_plus.frontends.strategy import DDPPlusStrategy
from lightning_ddp_plus.persistence.files import CheckpointResumeError
from lightning_ddp_plus.persistence.io import AtomicCheckpointIO, CheckpointSaveError
from lightning_ddp_plus.preemption.report import Preempted, PreemptionReport
from lightning_ddp_plus.sharding.optimizer import elementwise_optimizer
from lightning_ddp_plus.sync.chunks import Chunk, ChunkOutOfMemoryError, UnsplittableBatchError
from lightning_ddp_plus.sync.comm_hooks import CommHook
from lightning_ddp_plus.sync.uneven import UnevenInputsError

__version__ = "0.2.0"

register_front_ends(DDPPlusStrategy, DDPPlusFabricStrategy)

__all__ = [
    "DEFAULT_TIMEOUT",
    "KNOWN_BACKENDS",
    "REGISTERED_NAMES",
    "AfterDeathSave",
    "ArgumentTypeError",
    "ArgumentValueError",
    "AtomicCheckpointIO",
    "CheckpointResumeError",
    "CheckpointSaveError",
    "Chunk",
    "ChunkOutOfMemoryError",
    "CommHook",
    "DDPConflictError",
    "DDPPlusArguments",
    "DDPPlusFabricStrategy",
    "DDPPlusStrategy",
    "DDPSettings",
    "DDPTelemetry",
    "HFStyleDDPPlusStrategy",
    "Preempted",
    "PreemptionReport",
    "RankDied",
    "ReplicaDriftError",
    "UnevenInputsError",
    "UnsplittableBatchError",
    "elementwise_optimizer",
    "parse_timeout",
    "peer_gone_in",
]

#: Former public names, still importable with a deprecation warning (``MicroBatch`` named a chunk of a batch, not a
#: micro-batch of an accumulation window).
_RENAMED = {"MicroBatch": "Chunk", "MicroBatchOutOfMemoryError": "ChunkOutOfMemoryError"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        rank_zero_deprecation(renamed_message(name, new, "0.2.0", f"import `lightning_ddp_plus.{new}`"))
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
