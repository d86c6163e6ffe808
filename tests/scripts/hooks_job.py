"""Communication-hook cases on one 2-rank process group: ``hooks_job.py OUT_JSON CASES_JSON``.

Each case trains ``TinyRegression`` for one epoch with a ``ddp_comm_hook`` (or none) and records, through
``ReplicaReport``, every rank's parameters, the hook's calls and whether every all-reduced gradient was exactly
representable in float16; with the setup line rank 0 logged. One pair of processes runs every case, so the imports
and the process group are paid once.
"""

import json
import tempfile
from pathlib import Path

import lightning as L

from lightning_ddp_plus import DDPPlusStrategy
from tests.helpers import QUIET_TRAINER, ReplicaReport, TinyRegression, job_main


def run_case(case: dict) -> dict:
    strategy = DDPPlusStrategy(process_group_backend="gloo", **case["strategy"])
    with tempfile.TemporaryDirectory() as directory:
        report = Path(directory) / "report.json"
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            **QUIET_TRAINER,
            callbacks=[ReplicaReport(str(report))],
        )
        trainer.fit(TinyRegression())
        found = json.loads(report.read_text()) if report.exists() else {}
    return {**case, **found, "setup_line": strategy.describe()}


if __name__ == "__main__":
    job_main(run_case)
