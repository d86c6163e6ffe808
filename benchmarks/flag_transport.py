"""How a step's agreement flags could travel, priced on bare torch DDP: in the last gradient bucket's all-reduce, or in
an all-reduce of their own, against DDP with no hook.

The per-step agreement carries a few integers (the guard's unfinished reduction, uneven inputs, out-of-memory, a
notice). Carrying them in the last bucket (the one every rank launches last, once it knows its news) needs a
communication hook that all-reduces the bucket with the flags appended: a copy of that bucket each step. This prices
that copy and the hook's Python against the alternatives, in one run, variants alternated, on bare torch DDP:

- ``builtin``: DDP's own all-reduce, no hook (the floor);
- ``python hook``: torch's ``allreduce_hook`` (what any Python hook costs);
- ``flags in last bucket``: ``ddp_plus``'s ``FlagCarrier`` (the package's own hook), 5 flags appended to the last
  bucket's all-reduce and read back after the backward;
- ``flags all-reduce``: no hook, then an all-reduce of 5 integers after the backward (what ``ddp_plus`` does where
  a ``ddp_comm_hook`` leaves nothing to ride in).

    python benchmarks/flag_transport.py [--width 1024 --layers 3 --steps 40 --repeats 5]
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ranks import run_ranks

VARIANTS = ("builtin", "python hook", "flags in last bucket", "flags all-reduce")


def rank_main(options: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from lightning_ddp_plus.sync.flag_carrier import FlagCarrier

    os.environ["RANK"] = os.environ["LOCAL_RANK"]  # one machine: the global rank is the local one
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(options.width, options.width) for _ in range(options.layers)]
    x = torch.randn(options.batch, options.width)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    models = {}
    carrier = FlagCarrier(lambda: [0] * 5)
    for name in VARIANTS:
        ddp = DistributedDataParallel(copy.deepcopy(torch.nn.Sequential(*layers)))  # a model of its own each
        if name == "python hook":
            ddp.register_comm_hook(None, allreduce_hook)
        elif name == "flags in last bucket":
            carrier.register(ddp)
        models[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4))
    flags = torch.zeros(5, dtype=torch.int64)
    for repeat in range(options.repeats):
        for name in VARIANTS:
            ddp, optimizer = models[name]
            step_times = []
            for _ in range(options.steps):
                started = time.perf_counter()
                ddp(x).square().mean().backward()
                if name == "flags all-reduce":
                    dist.all_reduce(flags)
                elif name == "flags in last bucket":
                    assert carrier.take() == [0] * 5
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step_times.append(time.perf_counter() - started)
            times[name].append(statistics.median(step_times[3:]))
    # every variant trained the same steps from the same weights: the flags must not have changed the gradients
    differences = {
        name: max(
            (a - b).abs().max().item()
            for a, b in zip(models[name][0].parameters(), models["python hook"][0].parameters())
        )
        for name in VARIANTS
    }
    if dist.get_rank() == 0:
        base = statistics.median(times["builtin"])
        result = {
            name: {
                "median step (ms)": round(1e3 * statistics.median(values), 3),
                "ratio to builtin": round(statistics.median(values) / base, 3),
                "repeats (ms)": [round(1e3 * v, 3) for v in values],
                "largest weight difference to python hook": differences[name],
            }
            for name, values in times.items()
        }
        print(json.dumps(result, indent=1))
        Path(os.environ["FLAG_OUT"]).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "flag_transport.json"))
    parser.add_argument("--as-rank", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.as_rank is not None:
        rank_main(options)
        return
    Path(options.out).resolve().parent.mkdir(parents=True, exist_ok=True)
    run_ranks(
        [sys.executable, __file__, *sys.argv[1:]], options.ranks, 900, {"FLAG_OUT": str(Path(options.out).resolve())}
    )
    print(Path(options.out).read_text())


if __name__ == "__main__":
    main()
