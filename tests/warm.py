"""Job scripts started from an interpreter that has already imported the stack, so a test pays torch's, Lightning's
and the package's imports once per pytest worker instead of once per process (measured here: about 8 s of CPU each;
the suite started 263 interpreters, 118 of them now forks).

A server process per pytest worker imports what the job scripts import, then forks one child per job process. The
child is a real process: a session of its own, its own environment, working directory, argv (``/proc/PID/cmdline``
too, so ``pgrep -f`` finds it) and exit status; it is killed, hangs and crashes as a fresh interpreter would. What a
fork cannot change is what the C libraries read when they load (``MALLOC_*``, ``LD_*``); a job whose environment sets
such a variable, and any command that is not ``python SCRIPT``, starts a fresh interpreter instead. Ranks that a job
starts itself (Lightning's popen launcher, torchrun's workers) are fresh interpreters, as for a user.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Read by the C runtime when it loads, so a fork would not see them: these start a fresh interpreter.
_READ_AT_LOAD = ("MALLOC_", "LD_", "GLIBC_TUNABLES", "PYTHON")
#: Names the server to a job that starts processes of its own (``benchmarks/ranks.py``); a user's run never sets it.
SERVER_VARIABLE = "DDP_PLUS_WARM_SERVER"
#: Room in the server's own argv for a child's: /proc/PID/cmdline is that memory, rewritten in the child.
_ARGV_ROOM = 32768  # a job's argv carries its cases as JSON


def can_fork(args: list[str], env: dict[str, str]) -> bool:
    """Whether ``args`` is ``python SCRIPT.py ...`` with an environment a fork can give."""
    if len(args) < 2 or args[0] != sys.executable or not args[1].endswith(".py"):
        return False
    if env.get("PYTHONPATH") != str(REPO_ROOT):
        return False
    changed = {key for key in env if env.get(key) != os.environ.get(key)} | set(os.environ) - set(env)
    return not any(key.startswith(_READ_AT_LOAD) for key in changed - {"PYTHONPATH"})


class WarmProcess:
    """The part of ``subprocess.Popen`` the tests use, for a child of the server: its pid, its output as a text
    stream, ``poll``/``wait``/``communicate`` and its exit code (negative for a signal, as ``Popen`` gives)."""

    def __init__(self, connection: socket.socket, pid: int, stdout: TextIO | None) -> None:
        self.pid, self.stdout, self.returncode = pid, stdout, None
        self._connection = connection
        self._chunks: list[bytes] = []

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = self._chunks  # kept across a time-out, as Popen keeps them
        if self.stdout is not None and not self.stdout.closed:
            fd = self.stdout.fileno()
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([fd], [], [], left)[0]:
                    raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        if self.stdout is not None:
            self.stdout.close()
        return b"".join(chunks).decode(errors="replace"), None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _read_status(self) -> None:
        data = self._connection.recv(64)
        self.returncode = os.waitstatus_to_exitcode(int(data)) if data else -signal.SIGKILL
        self._connection.close()


class _Server:
    """The client's handle on this pytest worker's server (started at the first job, ended with the worker)."""

    process: subprocess.Popen | None = None
    path = ""

    @classmethod
    def address(cls) -> str:
        if cls.process is None or cls.process.poll() is not None:
            cls.path = str(Path(tempfile.mkdtemp(prefix="ddp-plus-warm-")) / "socket")
            room = "#" * _ARGV_ROOM
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
            cls.process = subprocess.Popen(
                [sys.executable, __file__, cls.path, room], env=env, stdin=subprocess.DEVNULL
            )
            while not os.path.exists(cls.path):
                if cls.process.poll() is not None:
                    raise RuntimeError(f"the warm interpreter ended with {cls.process.returncode} before it listened")
                time.sleep(0.05)
        return cls.path

    @classmethod
    def stop(cls) -> None:
        if cls.process is not None:
            cls.process.kill()
            cls.process.wait()
            cls.process = None
            os.unlink(cls.path)
            os.rmdir(os.path.dirname(cls.path))


def popen(
    args: list[str], env: dict[str, str], cwd: Path | str, output_fd: int | None = None, server: str | None = None
) -> WarmProcess:
    """Start ``python SCRIPT ARGS`` (see ``can_fork``) as a child of the warm server, in a session of its own; its
    output (stdout and stderr together) comes as ``.stdout``, or goes to ``output_fd``. ``server``: the address of a
    running server (``SERVER_VARIABLE``), else this worker's."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(server or _Server.address())
    read_end, write_end = os.pipe() if output_fd is None else (None, output_fd)
    request = json.dumps({"argv": args[1:], "env": env, "cwd": str(cwd)}).encode()
    socket.send_fds(connection, [len(request).to_bytes(8, "big") + request], [write_end])
    if read_end is not None:
        os.close(write_end)
    pid = int(connection.recv(32).split(b"\n")[0])
    stdout = os.fdopen(read_end, "r", errors="replace") if read_end is not None else None
    return WarmProcess(connection, pid, stdout)


def environment() -> dict[str, str]:
    """For a job that starts processes of its own through ``benchmarks/ranks.py``: the variable that has them forked
    from this worker's server too."""
    return {SERVER_VARIABLE: _Server.address()}


def stop() -> None:
    """End this worker's server (its children are sessions of their own: each test ends those it started)."""
    _Server.stop()


# ---- the server side ----


def _receive(connection: socket.socket) -> tuple[dict[str, Any], int]:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 1)
    size = int.from_bytes(message[:8], "big")
    while len(message) < size + 8:
        message += connection.recv(1 << 20)
    return json.loads(message[8 : size + 8]), fds[0]


def _set_cmdline(argv: list[str]) -> None:
    """Write ``argv`` over this process's own argv memory: what /proc/PID/cmdline (ps, pgrep) shows."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49 of proc(5))
    text = "\0".join([sys.executable, *argv]).encode()[: end - start - 1]
    with open("/proc/self/mem", "r+b", buffering=0) as memory:
        memory.seek(start)
        memory.write(text + b"\0" * (end - start - len(text)))


def _become(request: dict[str, Any], output_fd: int, set_by_imports: dict[str, str]) -> int:
    """In the forked child: be ``python SCRIPT ARGS`` and return its exit code."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(devnull)
    os.close(output_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})
    argv = request["argv"]
    _set_cmdline(argv)
    sys.argv = list(argv)
    sys.path[0] = str(Path(argv[0]).resolve().parent)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if name in os.environ:
            import torch

            torch.set_num_threads(int(os.environ[name]))
            break
    import numpy

    numpy.random.seed()  # a fresh interpreter seeds its global generator from the system's entropy
    tempfile.tempdir = None  # and finds its temporary folder from its own environment (TMPDIR)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 (the interpreter reports any uncaught exception, then exits 1)
        sys.excepthook(*sys.exc_info())  # as the interpreter does (torch.distributed's hook prefixes the rank)
        return 1
    return 0


def serve(path: str) -> int:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the server ends with its pytest worker
    # What the job scripts import, so that a child finds it in sys.modules.
    before = dict(os.environ)
    import lightning.pytorch  # noqa: F401
    import torch.distributed  # noqa: F401

    import lightning_ddp_plus  # noqa: F401
    import tests.helpers  # noqa: F401

    # what the imports set (Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK), which a fresh interpreter would set too
    set_by_imports = {key: value for key, value in os.environ.items() if before.get(key) != value}
    gc.freeze()  # the children's collections then leave the imported objects' pages shared (gc.freeze's own use)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the name: it appears once the socket listens
    children: dict[int, socket.socket] = {}
    while True:
        if select.select([listener], [], [], 0.05)[0]:
            connection, _ = listener.accept()
            request, output_fd = _receive(connection)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                for other in children.values():
                    other.close()
                return _become(request, output_fd, set_by_imports)
            os.close(output_fd)
            connection.sendall(f"{pid}\n".encode())
            children[pid] = connection
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(str(status).encode())
                except OSError:  # the test gave up on it
                    pass
                connection.close()


if __name__ == "__main__":
    sys.path[0] = str(REPO_ROOT)
    code = serve(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
