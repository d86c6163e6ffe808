"""Fabric's backward-sync control for ``DDPPlusFabricStrategy``: ``fabric.no_backward_sync(model, enabled=...)``
as Fabric's, except for the run's first backward with a static graph, which torch needs synced (rule R3)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch.nn import Module
from typing_extensions import override

from lightning_ddp_plus.engine.engine import DDPPlusEngine
from lightning_ddp_plus.private_apis.lightning import DDPBackwardSyncControl


class FirstStaticBackwardSynced(DDPBackwardSyncControl):
    """Fabric's ``no_backward_sync``, but the run's first backward with a static graph all-reduces."""

    def __init__(self, engine: DDPPlusEngine) -> None:
        self.engine = engine

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager[Any]:
        if enabled and self.engine.window.must_sync_first_backward(self.engine.settings.static_graph):
            return nullcontext()
        return super().no_backward_sync(module, enabled)
