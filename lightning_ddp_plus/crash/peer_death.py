"""Telling a peer's death from other failures, by what a survivor's own collective or store call raised.

A rank whose process is gone (SIGKILL, a segfault, an out-of-memory kill, its node lost) closes its connections. On
gloo a survivor's next or pending collective then raises at once ("Connection closed by peer"); the job's store
raises "Broken pipe" or "Connection reset by peer" once its host is gone (the popen launcher's rank 0 hosts it). On
NCCL a survivor's collective does not fail by itself before the timeout (unless NCCL's transport sees the peer's
socket close: ``ncclRemoteError``): the launcher's notice of the death aborts the survivor's communicators
(``processes.launcher.abort_collectives_on_a_death``), and whether the survivor's wait then raises ("aborted") or
torch takes the whole process down depends on ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (``2``: it raises; torch's default
ends the process). That path is untested here (no GPUs; ``tests/gpu/nccl_rank_death_check.py`` is the check).
"""

from __future__ import annotations

import torch.distributed

#: What torch says in a survivor when a peer's process is gone.
PEER_GONE_MARKS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection was likely closed",
    "failed to connect/validate",
    "remote process exited or there was a network error",  # NCCL's ncclRemoteError, as torch raises it
    "NCCL communicator was aborted",
    "ProcessGroupNCCL is aborted",
)
#: torch's error for a lost connection to a peer or to the store (where this torch has it).
NETWORK_ERROR: type[BaseException] = getattr(torch.distributed, "DistNetworkError", ConnectionError)


def peer_gone_in(error: BaseException | None) -> str | None:
    """The first line of the first error in ``error``'s chain that says a peer is gone, or ``None``. An error of
    this package (one every rank agreed on, which says why) is not a death, whatever it was raised from.

    >>> peer_gone_in(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:26019. GLHF"))
    '[pair.cc:553] Connection closed by peer [127.0.0.1]:26019. GLHF'
    >>> peer_gone_in(ValueError("Connection closed by peer")) is None  # only what torch raises
    True
    >>> peer_gone_in(RuntimeError("CUDA out of memory")) is None
    True
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__module__.startswith("lightning_ddp_plus."):
            # an error this package explained (one every rank agreed on, say) is not a death to save after, unless
            # it explains a collective that broke because its peer ended (a peer's out-of-memory error): then its
            # first sentence is the cause
            broken = getattr(error, "broken_collective", None)
            return str(error).split(". ")[0] if broken is not None and peer_gone_in(broken) else None
        if isinstance(error, RuntimeError):
            text = str(error).strip()
            if isinstance(error, NETWORK_ERROR) or any(mark in text for mark in PEER_GONE_MARKS):
                return text.splitlines()[0].split(". This is typically")[0] if text else type(error).__name__
        error = error.__cause__ or error.__context__
    return None
