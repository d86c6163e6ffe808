"""Gradients of the parameters DDP left out: those that did not require grad when it wrapped the module, and do now.

DDP registers only the parameters that require grad at its construction; one unfrozen later is never all-reduced, and
each rank steps it with its own gradient: the replicas drift apart, silently. Lightning's ``BaseFinetuning`` freezes
in its ``setup`` hook, before the strategy wraps the module, and unfreezes layers in later epochs: measured with stock
``DDPStrategy`` on 2 ranks, the replicas were 0.19 apart after three epochs.

``LeftOutGradients`` averages those gradients itself, after the backward that closes each accumulation window and
before anything reads them (per-item averaging, the optimizer step): one all-reduce per dtype on the gradient group,
as DDP would have, zeros standing in where a rank got no gradient (as ``find_unused_parameters=True`` sends). Which
parameters take part is read from ``requires_grad``, which the same callback sets alike on every rank. Parameters a
user excluded from DDP (``_ddp_params_and_buffers_to_ignore``) stay excluded.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from lightning_ddp_plus.pipeline.component import AgreedStep, BackwardStart, FitStart, StepComponent
from lightning_ddp_plus.sync.step_guard import through_one_flat_tensor


class LeftOutGradients(StepComponent):
    """Averages, at each window's end, the gradients of parameters DDP left out and that now require grad.

    Args:
        record: called around each all-reduce with its name and size (the engine's collective ledger).
        info: how a one-line report reaches the user (said once per fit, when it first acts).
    """

    def __init__(
        self,
        record: Callable[[str, int], AbstractContextManager[Any]] | None = None,
        info: Callable[[str], None] = lambda message: None,
    ) -> None:
        self.record = record or (lambda op, size: nullcontext())
        self.info = info
        self.left_out: list[tuple[str, Parameter]] = []  # frozen at the wrap, by name
        self._group: Any = None
        self._closing, self._said = False, False

    def fit_starts(self, fit: FitStart) -> None:
        ignored = set(getattr(fit.module, "_ddp_params_and_buffers_to_ignore", ()))
        self.left_out = [
            (name, parameter)
            for name, parameter in fit.module.named_parameters()
            if not parameter.requires_grad and name not in ignored
        ]
        self._group, self._closing, self._said = fit.ddp.process_group, False, False

    def before_backward(self, backward: BackwardStart) -> None:
        self._closing = backward.closes_window

    def agreed(self, agreed: AgreedStep) -> None:
        if not self._closing or agreed.out_of_memory or agreed.skipped:  # a skipped step keeps its gradients None
            return
        unfrozen = [(name, parameter) for name, parameter in self.left_out if parameter.requires_grad]
        if unfrozen:
            self.average([parameter for _, parameter in unfrozen])
            self._say(unfrozen)

    def average(self, parameters: list[Parameter]) -> None:
        """Average ``parameters``' gradients over the ranks, one all-reduce per dtype (a missing one counts zeros)."""
        by_dtype: dict[torch.dtype, list[Parameter]] = {}
        for parameter in parameters:
            by_dtype.setdefault(parameter.dtype, []).append(parameter)
        world = dist.get_world_size(self._group)

        def mean(flat: Tensor) -> None:
            with self.record("all_reduce", flat.numel() * flat.element_size()):
                dist.all_reduce(flat, group=self._group)
            flat.div_(world)

        for same in by_dtype.values():
            through_one_flat_tensor(same, mean)

    def _say(self, unfrozen: list[tuple[str, Parameter]]) -> None:
        if self._said:
            return
        self._said = True
        names = ", ".join(name for name, _ in unfrozen[:4]) + (", ..." if len(unfrozen) > 4 else "")
        self.info(
            f"DDPPlusStrategy: {len(unfrozen)} parameters ({names}) did not require grad when DDP wrapped the module "
            "and do now (unfrozen, as BaseFinetuning does): DDP never all-reduces them, so the strategy averages "
            "their gradients after each window's backward (stock DDP lets the replicas drift apart)."
        )
