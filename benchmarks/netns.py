"""Two "nodes" on one machine: a network namespace each, joined by a veth pair shaped with ``tc ... tbf``.

Needs root and iproute2 (``ip``, ``tc``). netem is not needed (and not available on every kernel); tbf limits the
rate, which is what a gradient all-reduce between nodes is bound by.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Node:
    namespace: str
    interface: str
    address: str


def unavailable_reason() -> str | None:
    """Why two shaped nodes cannot be made here, or ``None`` when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (it creates network namespaces, a veth pair and tc qdiscs); run it with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found on PATH)"
    return None


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def _bring_up_shaped(node: Node, rate: str, burst: str, latency: str) -> None:
    """Address and bring up a node's interface (moved into its namespace), and shape its egress with tbf."""
    _run("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
    _run("ip", "-n", node.namespace, "link", "set", node.interface, "up")
    _run("ip", "-n", node.namespace, "link", "set", "lo", "up")
    _run(
        "ip", "netns", "exec", node.namespace, "tc", "qdisc", "add", "dev", node.interface, "root", "tbf",
        "rate", rate, "burst", burst, "latency", latency,
    )  # fmt: skip


@contextmanager
def two_nodes(
    rate: str, burst: str = "256kb", latency: str = "50ms", prefix: str = "ddpp"
) -> Iterator[tuple[Node, Node]]:
    """Namespaces ``<prefix><pid>a``/``b`` with 10.231.0.1 and .2 on a veth pair, each end shaped to ``rate``
    (``tc``'s units, e.g. ``1gbit``); removed on exit, even after an error."""
    tag = f"{prefix}{os.getpid() % 100000}"
    nodes = (Node(f"{tag}a", f"{tag}a0", "10.231.0.1"), Node(f"{tag}b", f"{tag}b0", "10.231.0.2"))
    created: list[str] = []
    try:
        for node in nodes:
            _run("ip", "netns", "add", node.namespace)
            created.append(node.namespace)
        _run("ip", "link", "add", nodes[0].interface, "type", "veth", "peer", "name", nodes[1].interface)
        for node in nodes:
            _run("ip", "link", "set", node.interface, "netns", node.namespace)
            _bring_up_shaped(node, rate, burst, latency)
        yield nodes
    finally:
        for namespace in created:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "delete", namespace], check=False, capture_output=True)


@contextmanager
def shaped_nodes(count: int, rate: str, burst: str = "256kb", latency: str = "50ms") -> Iterator[tuple[Node, ...]]:
    """``count`` namespaces on one switch: a bridge in a namespace of its own, and a veth pair from each node to it,
    each node's egress shaped to ``rate`` (a node sends at most ``rate``, as through its own NIC). Addresses
    10.232.0.1 ... ; removed on exit, even after an error."""
    tag = f"ddps{os.getpid() % 100000}"
    hub = f"{tag}h"
    nodes = tuple(Node(f"{tag}n{i}", f"{tag}n{i}e", f"10.232.0.{i + 1}") for i in range(count))
    created: list[str] = []
    try:
        _run("ip", "netns", "add", hub)
        created.append(hub)
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for index, node in enumerate(nodes):
            _run("ip", "netns", "add", node.namespace)
            created.append(node.namespace)
            port = f"{tag}p{index}"
            _run("ip", "link", "add", node.interface, "type", "veth", "peer", "name", port)
            _run("ip", "link", "set", node.interface, "netns", node.namespace)
            _run("ip", "link", "set", port, "netns", hub)
            _run("ip", "-n", hub, "link", "set", port, "master", "br0")
            _run("ip", "-n", hub, "link", "set", port, "up")
            _bring_up_shaped(node, rate, burst, latency)
        yield nodes
    finally:
        for namespace in reversed(created):
            subprocess.run(["ip", "netns", "delete", namespace], check=False, capture_output=True)


def sent_bytes(interface: str) -> int:
    """Bytes ``interface`` has sent (read inside its namespace: ``/sys/class/net`` shows the caller's namespace)."""
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


def tcp_throughput_mbit(nodes: tuple[Node, Node], megabytes: int) -> float:
    """Mbit/s of one TCP stream from node b to node a (what the shaping really lets through)."""
    port = 47011
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", nodes[0].namespace, sys.executable, __file__, "--receive", nodes[0].address, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)
        sender = subprocess.run(
            ["ip", "netns", "exec", nodes[1].namespace, sys.executable, __file__, "--send", nodes[0].address,
             str(port), str(megabytes)],
            check=False, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        output, _ = receiver.communicate(timeout=120)
        if sender.returncode:
            raise RuntimeError(sender.stderr)
        return float(output.strip())
    finally:
        if receiver.poll() is None:
            receiver.kill()


def _receive(address: str, port: int) -> None:
    with socket.create_server((address, port)) as server:
        connection, _ = server.accept()
        with connection:
            received, started = 0, None
            while chunk := connection.recv(1 << 20):
                started = started or time.perf_counter()
                received += len(chunk)
            print(received * 8 / (time.perf_counter() - started) / 1e6)


def _send(address: str, port: int, megabytes: int) -> None:
    block = b"\0" * (1 << 20)
    with socket.create_connection((address, port)) as connection:
        for _ in range(megabytes):
            connection.sendall(block)


if __name__ == "__main__":
    if sys.argv[1] == "--receive":
        _receive(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "--send":
        _send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
