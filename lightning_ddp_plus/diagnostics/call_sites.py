"""Where in the user's code a collective was issued, or where a rank's main thread is: the innermost frame outside
torch, Lightning, this package and Python's own library, with its source text.

``self.log(..., sync_dist=True)`` reaches the all-reduce through Lightning's ``result.py``; the call site of that
all-reduce is the ``self.log`` line of the user's ``training_step``, so that the metric's key is named.
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from types import FrameType


def _package_directory(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def _library_directories() -> tuple[str, ...]:
    """The directories of code that is not the user's: torch, Lightning (and its metrics and utilities), this
    package, and Python's library."""
    names = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torchmetrics")
    found = [_package_directory(name) for name in names]
    found.append(os.path.dirname(os.path.abspath(__file__)).rsplit(os.sep, 1)[0] + os.sep)  # lightning_ddp_plus/
    for key in ("stdlib", "platstdlib"):
        found.append(os.path.abspath(sysconfig.get_paths()[key]) + os.sep)
    return tuple(sorted({path for path in found if path}))


_LIBRARIES: tuple[str, ...] | None = None


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to torch, Lightning, this package or Python's own library.

    >>> is_library_file(__file__), is_library_file("/home/me/project/train.py")
    (True, False)
    """
    global _LIBRARIES
    if _LIBRARIES is None:
        _LIBRARIES = _library_directories()
    if filename.startswith("<"):  # <frozen ...>, <string>: Python's own
        return True
    path = os.path.abspath(filename)
    return any(path.startswith(directory) for directory in _LIBRARIES)


@dataclass(frozen=True)
class CallSite:
    """A line of the user's code: the file, the line number, the function and the line's source text."""

    filename: str
    line: int
    function: str
    source: str

    def __str__(self) -> str:
        """``model.py:57 in training_step: self.log("extra", x, sync_dist=True)``."""
        text = f"{os.path.basename(self.filename)}:{self.line} in {self.function}"
        return f"{text}: {self.source}" if self.source else text


def user_call_site(frame: FrameType | None) -> CallSite | None:
    """The innermost frame, from ``frame`` outwards, that is the user's (``None`` when every frame is a library's)."""
    while frame is not None:
        code = frame.f_code
        if not is_library_file(code.co_filename):
            source = linecache.getline(code.co_filename, frame.f_lineno).strip()
            return CallSite(code.co_filename, frame.f_lineno, code.co_name, source)
        frame = frame.f_back
    return None


def caller_site() -> CallSite | None:
    """The user's line that led to the current call (for a collective about to be issued)."""
    return user_call_site(sys._getframe(1))


#: ``torch.distributed``'s collectives, by the name of the function a thread waits in.
COLLECTIVE_FUNCTIONS = frozenset(
    {
        "all_reduce",
        "broadcast",
        "barrier",
        "monitored_barrier",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "broadcast_object_list",
        "reduce",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
    }
)
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


@dataclass(frozen=True)
class CollectiveCall:
    """A collective of ``torch.distributed`` that a thread is inside, and the line that called it (Lightning's own,
    such as the loop's SIGTERM broadcast, or the user's): one the collective ledger does not see."""

    op: str
    issued_at: CallSite

    def __str__(self) -> str:
        return f"{self.op} issued at {self.issued_at}"


def collective_in_progress(frame: FrameType | None) -> CollectiveCall | None:
    """The ``torch.distributed`` collective the thread whose innermost frame is ``frame`` waits in, if it waits in
    one (its innermost frames are ``torch.distributed``'s, one of them a collective)."""
    op = None
    while frame is not None and _TORCH_DISTRIBUTED in os.path.abspath(frame.f_code.co_filename):
        if frame.f_code.co_name in COLLECTIVE_FUNCTIONS and frame.f_code.co_filename.endswith("distributed_c10d.py"):
            op = frame.f_code.co_name  # the outermost one: all_gather_object waits inside its own all_gather
        frame = frame.f_back
    if op is None or frame is None:
        return None
    code = frame.f_code
    source = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return CollectiveCall(op, CallSite(code.co_filename, frame.f_lineno, code.co_name, source))


def stack_text(frame: FrameType | None, limit: int = 12) -> str:
    """The innermost ``limit`` frames of a stack, innermost last, as a traceback prints them."""
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame)[-limit:])
