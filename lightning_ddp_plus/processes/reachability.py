"""After a collective failed: which peers can this rank still reach? A hung peer and a cut link look the same to gloo
("Application timeout caused pair closure", "Timed out waiting ... for recv") and to NCCL (a watchdog timeout).

When the process group is up, every rank publishes the address it reaches the master node from, with its process
(the machine's boot id, its pid and start time), in one store write.
After a collective timeout or a closed connection, the failing rank probes with plain TCP connects of at most
``PROBE_SECONDS`` each, all at once: the master node (the job's store), and, where the store still answers, every
other rank's host. A host that refuses the connection answered, so it is reachable; one that gives no answer, or "No
route to host" / "Network is unreachable", is cut off. The note then says which: a peer is unreachable (the link or
that node is down), or every host answers (a rank is hung or crashed: read its log).

After a peer's death, the survivors read the processes back: a peer's process on this machine that is gone, or a
zombie its launcher has not reaped yet, is dead, with no need to wait for its answer (under torchrun, no launcher of
this package sees the death).

The job's store is reached through ``private_apis.torch_distributed.default_store`` (torch keeps it private).
"""

from __future__ import annotations

import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_ddp_plus.private_apis.torch_distributed import default_store

PROBE_SECONDS = 2.0
MAX_HOSTS_PROBED = 32
_KEY = "ddp_plus/host/{rank}"
_published: dict[str, str] = {}  # this process's own address, read before a link can go down


def outgoing_address(master_addr: str, master_port: int) -> str:
    """This host's address on the route to the master node (no packet is sent: a UDP socket is only connected)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, master_port))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _machine() -> str:
    """This machine as its processes are told apart: the boot's id and the pid namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:  # no procfs: no peer's process can be looked at
        return ""


def _start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat``), or ``None`` when it is gone or a zombie."""
    try:
        state, *fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else fields[18]


def publish_host(store: Any | None = None, rank: int | None = None) -> None:
    """Write this rank's address and process to the job's store (no-op without a process group or address)."""
    master_addr, master_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if store is None and not dist.is_initialized() or not master_addr or not master_port:
        return
    store = store if store is not None else default_store()
    rank = rank if rank is not None else dist.get_rank()
    _published["address"] = outgoing_address(master_addr, int(master_port))
    process = {"machine": _machine(), "pid": os.getpid(), "start": _start_time(os.getpid())}
    store.set(_KEY.format(rank=rank), json.dumps({"address": _published["address"], **process}))


class ProcessesHere:
    """The peers' processes on this machine, read from the store once (after a death: no store call per look).

    Args:
        store: the job's store (``None``: its host is gone, no peer is looked at).
        world_size: the ranks of the job.
        own_rank: this rank.
    """

    def __init__(self, store: Any | None, world_size: int, own_rank: int) -> None:
        machine = _machine()
        try:
            records = _peer_records(store, world_size, own_rank) if store is not None and machine else {}
        except Exception:  # noqa: BLE001 - a store that fails is one whose host is gone: no peer can be looked at
            records = {}
        self.processes = {rank: record for rank, record in records.items() if record.get("machine") == machine}

    def gone(self) -> set[int]:
        """The peers whose process is gone or a zombie: dead, whatever the store says."""
        return {rank for rank, p in self.processes.items() if _start_time(int(p["pid"])) != p["start"]}


def probe(address: str, port: int, seconds: float = PROBE_SECONDS) -> str | None:
    """Why ``address`` cannot be reached, or ``None`` when it answers (a refused connection is an answer).

    >>> probe("127.0.0.1", 9) is None  # nothing listens on port 9 here: refused, so reachable
    True
    """
    try:
        with socket.create_connection((address, port), timeout=seconds):
            return None
    except ConnectionRefusedError:
        return None
    except TimeoutError:
        return f"no answer within {seconds:g} s"
    except OSError as error:
        return error.strerror or str(error)


def _peer_records(store: Any, world_size: int, own_rank: int) -> dict[int, dict[str, Any]]:
    store.set_timeout(timedelta(seconds=PROBE_SECONDS))
    records = {}
    for rank in range(world_size):
        if rank != own_rank:
            try:
                records[rank] = json.loads(store.get(_KEY.format(rank=rank)))
            except Exception:  # noqa: BLE001, S112 - a rank that never published is simply not looked at
                continue
    return records


def _peer_hosts(store: Any, world_size: int, own_rank: int) -> dict[int, str]:
    return {rank: str(record["address"]) for rank, record in _peer_records(store, world_size, own_rank).items()}


def diagnose() -> str | None:
    """A sentence on who is reachable from this rank, or ``None`` when there is no process group to ask about."""
    master_addr, master_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not dist.is_initialized() or not master_addr or not master_port:
        return None
    rank, world_size, port = dist.get_rank(), dist.get_world_size(), int(master_port)
    own = _published.get("address") or outgoing_address(master_addr, port)
    master_problem = probe(master_addr, port)
    if master_problem is not None:
        return (
            f"A peer is unreachable: rank {rank} (host {own}) cannot reach the master node {master_addr}:{port} "
            f"({master_problem}), so the link between the nodes, or that node, is down."
        )
    try:
        hosts = _peer_hosts(default_store(), world_size, rank)
    except Exception:  # noqa: BLE001 - without the store no peer can be named
        hosts = {}
    others = sorted({address for address in hosts.values() if address != own})[:MAX_HOSTS_PROBED]
    with ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
        problems = dict(zip(others, pool.map(lambda address: probe(address, port), others)))
    cut_off = {address: problem for address, problem in problems.items() if problem is not None}
    if cut_off:
        names = "; ".join(
            f"{address} (rank {', '.join(str(r) for r, a in sorted(hosts.items()) if a == address)}: {problem})"
            for address, problem in cut_off.items()
        )
        return f"A peer is unreachable from rank {rank} (host {own}): {names}. The link to it, or that node, is down."
    if others:
        return (
            f"Every peer host answers rank {rank} ({len(others)} probed), so no link is down: a rank is hung or "
            "crashed; its own log says why."
        )
    return None
