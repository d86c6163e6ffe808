"""Where a step's communication time goes on a shaped link, before any model: gloo all-reduces of one step's gradient
bytes between two namespaced nodes, against the link time ``bytes x 2(N-1)/N / rate``.

    sudo python benchmarks/link_allreduce.py [--rate 1gbit] [--megabytes 32] [--repeats 5]

Per case, the median over ``--repeats`` of the time to all-reduce ``--megabytes`` MiB of float32, as DDP would send
one optimizer step's gradients:

- ``one call``: a single all-reduce of the whole buffer;
- ``buckets of B MiB``: consecutive all-reduces of B MiB each (DDP's buckets, sent one after another);
- ``... after an idle gap``: the same after ``--idle-ms`` of sleep (a step's compute, during which the link is idle),
  with the kernel's ``tcp_slow_start_after_idle`` on (Linux's default) and off in both namespaces: whether TCP's
  congestion window restarting after idle costs the next step's first buckets;
- ``... while the rank computes``: the same while a thread of the rank multiplies matrices, as a backward computes
  while DDP's buckets travel: whether compute and communication compete for the node's cores.

Writes ``benchmarks/results/link_allreduce.json``; without root it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.netns import tcp_throughput_mbit, two_nodes, unavailable_reason
from benchmarks.ranks import base_environment, run_processes

BUCKETS_MB = (1, 5, 25, 100)


def timed(calls, repeats: int, idle_s: float = 0.0) -> float:
    """Median seconds of ``calls()`` over ``repeats`` (after one warm-up), each after ``idle_s`` of sleep."""
    import torch.distributed as dist

    calls()
    times = []
    for _ in range(repeats):
        dist.barrier()
        time.sleep(idle_s)
        started = time.perf_counter()
        calls()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextmanager
def computing() -> Iterator[None]:
    """A thread multiplying matrices (torch releases the GIL) for the length of the block: a backward's compute."""
    import torch

    done = threading.Event()

    def work() -> None:
        a = torch.randn(512, 512)
        while not done.is_set():
            a = torch.tanh(a @ a)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def fixed_compute() -> None:
    """About a step's compute of a small MLP on one thread (a fixed number of matrix products)."""
    import torch

    a = torch.full((512, 512), 1e-3)
    for _ in range(60):
        a = torch.tanh(a @ a)


def compute_while_communicating(calls, rounds: int) -> float:
    """Median seconds of ``fixed_compute`` on the main thread while another thread all-reduces ``rounds`` times
    (both ranks the same number of rounds; the main thread issues no collective meanwhile)."""
    import torch.distributed as dist

    dist.barrier()
    thread = threading.Thread(target=lambda: [calls() for _ in range(rounds)], daemon=True)
    thread.start()
    times = []
    while True:  # at least one sample: at a smoke test's size the rounds can end before the first check
        started = time.perf_counter()
        fixed_compute()
        times.append(time.perf_counter() - started)
        if not thread.is_alive():
            break
    thread.join()
    return statistics.median(times)


def node_main(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    buffer = torch.ones(args.megabytes * (1 << 20) // 4)

    def in_buckets(megabytes: float):
        size = int(megabytes * (1 << 20) // 4)
        pieces = list(torch.split(buffer, size))
        return lambda: [dist.all_reduce(piece) for piece in pieces]

    results = {"one call": timed(lambda: dist.all_reduce(buffer), args.repeats)}
    for megabytes in BUCKETS_MB:
        results[f"buckets of {megabytes} MiB"] = timed(in_buckets(megabytes), args.repeats)
    idle = args.idle_ms / 1e3
    results[f"buckets of 25 MiB after {args.idle_ms:g} ms idle"] = timed(in_buckets(25), args.repeats, idle)
    results[f"buckets of 1 MiB after {args.idle_ms:g} ms idle"] = timed(in_buckets(1), args.repeats, idle)
    with computing():  # what DDP's overlap asks of a one-core node: the backward computes while buckets travel
        results["buckets of 25 MiB while the rank computes"] = timed(in_buckets(25), args.repeats)
    # and the other way round: a fixed amount of compute, alone and while the buckets travel
    results["compute alone"] = timed(fixed_compute, args.repeats)
    results["compute while the buckets travel"] = compute_while_communicating(in_buckets(25), args.repeats)
    if dist.get_rank() == 0:
        Path(args.raw).write_text(json.dumps(results))
    dist.destroy_process_group()


def slow_start_after_idle(namespace: str, value: int) -> None:
    subprocess.run(
        ["ip", "netns", "exec", namespace, "sysctl", "-q", "-w", f"net.ipv4.tcp_slow_start_after_idle={value}"],
        check=True,
        capture_output=True,
    )


def run(args, slow_start: int, raw: Path) -> tuple[dict, float]:
    with two_nodes(args.rate) as nodes:
        for node in nodes:
            slow_start_after_idle(node.namespace, slow_start)
        measured = tcp_throughput_mbit(nodes, 64)
        commands, environments = [], []
        for rank, node in enumerate(nodes):
            environments.append(
                {**base_environment(), "MASTER_ADDR": nodes[0].address, "MASTER_PORT": "29511", "RANK": str(rank),
                 "WORLD_SIZE": "2", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": node.interface}
            )  # fmt: skip
            commands.append(
                ["ip", "netns", "exec", node.namespace, sys.executable, __file__, "--as-node", "--raw", str(raw),
                 "--megabytes", str(args.megabytes), "--repeats", str(args.repeats), "--idle-ms", str(args.idle_ms)]
            )  # fmt: skip
        run_processes(commands, environments, 1800)
    return json.loads(raw.read_text()), measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--megabytes", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle-ms", type=float, default=80.0, help="the idle gap (a step's compute)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "link_allreduce.json")
    parser.add_argument("--as-node", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--raw", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_node:
        node_main(args)
        return
    if (reason := unavailable_reason()) is not None:
        print(f"link_allreduce: skipped: {reason}")
        return
    raw = Path(args.out).with_suffix(".raw.json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    rate_bits = float(args.rate.removesuffix("gbit")) * 1e9 if args.rate.endswith("gbit") else float(args.rate)
    link_s = args.megabytes * (1 << 20) * 8 / rate_bits  # 2 ranks: each sends the buffer's bytes once
    summary: dict = {"rate": args.rate, "megabytes": args.megabytes, "link time (ms)": round(1e3 * link_s, 1)}
    for slow_start in (1, 0):
        results, measured = run(args, slow_start, raw)
        label = f"tcp_slow_start_after_idle={slow_start}"
        alone = results["compute alone"]
        summary[label] = {"tcp Mbit/s": round(measured), **{
            name: {"ms": round(1e3 * seconds, 1), **(
                {"x compute alone": round(seconds / alone, 2)} if name.startswith("compute")
                else {"x link time": round(seconds / link_s, 2)}
            )}
            for name, seconds in results.items()
        }}  # fmt: skip
    raw.unlink(missing_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
