"""Per-item averaging (``num_items``) against one process training the global batch: ``item_average_job.py OUT_JSON
CASES_JSON``, started once per rank on one 2-rank process group. The workload and the one-process reference are the
benchmark's (``benchmarks/item_averaging.py``), so that the test checks what the benchmark measures."""

from benchmarks.item_averaging import run_case
from tests.helpers import job_main

if __name__ == "__main__":
    job_main(run_case)
