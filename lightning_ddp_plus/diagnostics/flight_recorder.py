"""NCCL's flight recorder: on an NCCL process group, torch can keep each rank's last collectives in a ring buffer
and write it to a file when a collective times out. What it records lies below Python (the NCCL kernels, their
state, the sequence numbers on each group), so it complements the collective ledger's stall report.

It is off unless variables are set before the process group is created. With the stall report on, each rank sets
those the user has not set, and the setup line and the timeout's error say where the dumps go. torch reads the
buffer size and the dump file under two names (the ``TORCH_FR_`` names, and the older ``TORCH_NCCL_`` ones), so both
are set alike; a variable the user set under either name is theirs, and ``TORCH_FR_BUFFER_SIZE=0`` keeps the
recorder off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

#: torch's names for the ring buffer's length (entries), newer first.
BUFFER_SIZE_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: torch's names for the dump file's prefix (the rank is appended), newer first.
DUMP_FILE_NAMES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
#: The entries kept when the user has not chosen.
ENTRIES = 2000
#: Where torch writes the dumps when no prefix is set.
TORCH_DUMP_PREFIX = "/tmp/nccl_trace_rank_"


@dataclass(frozen=True)
class FlightRecorder:
    """The recorder in effect on this rank, and the variables this package set for it (the rest were the user's)."""

    entries: int
    dumps_on_timeout: bool
    dump_prefix: str
    set_here: tuple[str, ...]

    @property
    def on(self) -> bool:
        return self.entries > 0

    def describe(self) -> str:
        """
        >>> print(FlightRecorder(2000, True, "/tmp/nccl_trace_rank_", ("TORCH_FR_BUFFER_SIZE",)).describe())
        NCCL flight recorder on (the last 2000 collectives per rank; dumped on a timeout to /tmp/nccl_trace_rank_<rank>; read with `python -m torch.distributed.flight_recorder.fr_trace /tmp --prefix nccl_trace_rank_`)
        """
        if not self.on:
            return f"NCCL flight recorder off ({BUFFER_SIZE_NAMES[0]}=0 was set)"
        folder, _, prefix = self.dump_prefix.rpartition("/")
        dump = (
            f"dumped on a timeout to {self.dump_prefix}<rank>"
            if self.dumps_on_timeout
            else f"not dumped on a timeout ({DUMP_ON_TIMEOUT}=0 was set)"
        )
        return (
            f"NCCL flight recorder on (the last {self.entries} collectives per rank; {dump}; read with "
            f"`python -m torch.distributed.flight_recorder.fr_trace {folder or '.'} --prefix {prefix}`)"
        )


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((environ[name] for name in names if environ.get(name)), None)


def plan_flight_recorder(environ: Mapping[str, str]) -> tuple[dict[str, str], FlightRecorder]:
    """The variables to set (those the user has not set, under either name) and the recorder that results.

    >>> to_set, recorder = plan_flight_recorder({"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"})
    >>> sorted(to_set), recorder.entries
    (['TORCH_FR_DUMP_TEMP_FILE', 'TORCH_NCCL_DEBUG_INFO_TEMP_FILE', 'TORCH_NCCL_DUMP_ON_TIMEOUT'], 500)
    """
    to_set: dict[str, str] = {}
    entries_text = _first(environ, BUFFER_SIZE_NAMES)
    if entries_text is None:
        entries_text = str(ENTRIES)
        to_set.update(dict.fromkeys(BUFFER_SIZE_NAMES, entries_text))
    prefix = _first(environ, DUMP_FILE_NAMES)
    if prefix is None:
        prefix = TORCH_DUMP_PREFIX
        to_set.update(dict.fromkeys(DUMP_FILE_NAMES, prefix))
    dumps = environ.get(DUMP_ON_TIMEOUT)
    if not dumps:
        dumps = to_set[DUMP_ON_TIMEOUT] = "1"
    try:
        entries = int(entries_text)
    except ValueError:
        entries = 0  # torch reads an unreadable size as no recorder, too
    if entries <= 0:
        to_set = {}  # the user turned it off: nothing of it is set
    recorder = FlightRecorder(entries, dumps not in ("0", "false", "False"), prefix, tuple(sorted(to_set)))
    return to_set, recorder


def turn_on_flight_recorder(environ: MutableMapping[str, str]) -> FlightRecorder:
    """Set what ``plan_flight_recorder`` decides in ``environ`` (this process's environment, before the process
    group exists)."""
    to_set, recorder = plan_flight_recorder(environ)
    environ.update(to_set)
    return recorder


def flight_recorder_for(
    backend: str, stall_report: bool, environ: MutableMapping[str, str], info: Callable[[str], None]
) -> FlightRecorder | None:
    """Before the process group exists: on NCCL, with the stall report on, NCCL's flight recorder, said once."""
    if backend != "nccl" or not stall_report:
        return None
    recorder = turn_on_flight_recorder(environ)
    info(f"lightning-ddp-plus: {recorder.describe()}")
    return recorder
