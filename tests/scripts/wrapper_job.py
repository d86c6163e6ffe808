"""What callbacks see of the DDP wrapper, stock vs ddp_plus: ``wrapper_job.py OUT_JSON CASES_JSON``.

A callback records whether ``trainer.model`` is a ``DistributedDataParallel`` in ``setup``, ``on_fit_start`` and
``on_train_start``; in ``on_fit_start`` it uses the wrapper as users do (``.module``, ``no_sync()``) and registers its
own counting communication hook; at the end it reports the wrapper's identity and the hook's calls.
"""

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, CheckpointNet, flat_parameters, job_main


class WrapperWitness(L.Callback):
    def __init__(self) -> None:
        self.seen: dict[str, bool] = {}
        self.wrapper_ids: list[int] = []
        self.hook_calls = 0

    def _record(self, name: str, trainer: L.Trainer) -> None:
        self.seen[name] = isinstance(trainer.model, DistributedDataParallel)

    def setup(self, trainer, pl_module, stage):
        self._record("setup", trainer)

    def on_fit_start(self, trainer, pl_module):
        self._record("on_fit_start", trainer)
        wrapper = trainer.model
        assert wrapper.module is pl_module
        with wrapper.no_sync():
            assert wrapper.require_backward_grad_sync is False
        wrapper.register_comm_hook(None, self.hook)
        self.wrapper_ids.append(id(wrapper))

    def on_train_start(self, trainer, pl_module):
        self._record("on_train_start", trainer)

    def on_train_end(self, trainer, pl_module):
        self.wrapper_ids.append(id(trainer.model))

    def hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.hook_calls += 1
        return default_hooks.allreduce_hook(state, bucket)


def run_case(case: dict) -> dict:
    if case["stock"]:
        strategy = L.pytorch.strategies.DDPStrategy(process_group_backend="gloo", **case.get("strategy", {}))
    else:
        strategy = DDPPlusStrategy(process_group_backend="gloo", **case.get("strategy", {}))
    witness = WrapperWitness()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, callbacks=[witness], **QUIET_TRAINER
    )
    model = CheckpointNet(**case.get("model", {}))
    trainer.fit(model)
    flat = flat_parameters(model)
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    return {
        **case,
        "seen": witness.seen,
        "same_wrapper": len(set(witness.wrapper_ids)) == 1 and len(witness.wrapper_ids) == 2,
        "hook_calls": witness.hook_calls,
        "optimizer_steps": trainer.global_step,
        "params": [t.tolist() for t in gathered],
        "settings": {"static_graph": strategy.settings.static_graph} if isinstance(strategy, DDPPlusStrategy) else None,
    }


if __name__ == "__main__":
    job_main(run_case)
