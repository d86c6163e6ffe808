"""A small 2-process DDP job for the tests: ``ddp_job.py OUT_JSON STRATEGY_KWARGS_JSON [TRAINER_KWARGS_JSON]``.

Run as a script because the popen launcher re-executes the command line once per extra rank.
"""

import json
import sys

import lightning as L

import lightning_ddp_plus
from tests.helpers import QUIET_TRAINER, ReplicaReport, TinyRegression


def main() -> None:
    out_path, strategy_kwargs = sys.argv[1], json.loads(sys.argv[2])
    trainer_kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    model_kwargs = trainer_kwargs.pop("model", {})
    strategy = strategy_kwargs.pop("name", None) or lightning_ddp_plus.DDPPlusStrategy(**strategy_kwargs)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=trainer_kwargs.pop("max_epochs", 2),
        **QUIET_TRAINER,
        callbacks=[ReplicaReport(out_path)],
        **trainer_kwargs,
    )
    trainer.fit(TinyRegression(**model_kwargs))


if __name__ == "__main__":
    main()
