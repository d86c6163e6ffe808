"""What torch's errors mean, added to their message: a reducer error gets its rule and the fix, a collective
timeout or a closed peer gets what it says about the other ranks, and who is still reachable.

Lightning replaces an exception's message on its way out of ``fit``; the front ends call ``explain`` from
``on_exception`` so that torch's own words stay first and ours follow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

from lightning_ddp_plus.config.timeout import format_timeout
from lightning_ddp_plus.conflicts.errors import DDPConflictError
from lightning_ddp_plus.conflicts.rules import rule_for_torch_error
from lightning_ddp_plus.diagnostics.stalls import StallReport
from lightning_ddp_plus.processes import reachability

#: Messages of collective timeouts (gloo, NCCL, the c10d store), not of other timeouts such as a DataLoader's.
COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ ?ms for (recv|send)|Watchdog caught collective operation timeout|"
    r"ran for \d+ milliseconds before timing out|Socket Timeout|wait timeout after \d+ ?ms|"
    r"(gloo|nccl|c10d|ProcessGroup)\S*.*(timed out|timeout)|Application timeout caused pair closure",
    re.IGNORECASE,
)
#: A peer's connection ended: that process is gone (an error of its own, a kill) or its node went down.
PEER_CLOSED = re.compile(r"Connection (closed|reset) by peer|Broken pipe", re.IGNORECASE)


def reducer_error_note(message: str) -> str | None:
    """Text to append to a torch reducer error: which rule it is and the fix (``None`` for other errors).

    >>> reducer_error_note("Expected to have finished reduction in the prior iteration")[:52]
    'lightning-ddp-plus: this is rule R4 (parameters that'
    """
    rule = rule_for_torch_error(message)
    if rule is None:
        return None
    return (
        f"lightning-ddp-plus: this is rule {rule.id} ({rule.title}). Fix: {rule.fix} With "
        "`checkpointing_conflict='error'` (the default) DDPPlusStrategy reports it before the first optimizer step; "
        "'resolve' changes the settings for you."
    )


def timeout_note(timeout: timedelta, argument: str = "timeout") -> str:
    """``argument``: what set the timeout in effect (``setup_timeout`` before the first training step)."""
    legitimately_slow = (
        "raise `setup_timeout` only if that rank is legitimately slow (e.g. data preparation on rank 0)"
        if argument == "setup_timeout"
        else "if that rank is legitimately slow before training (data preparation on rank 0, loading a large "
        "model), raise `setup_timeout` rather than `timeout`"
    )
    return (
        f"lightning-ddp-plus: a collective waited longer than the process group's timeout "
        f"({format_timeout(timeout)}, set by `DDPPlusStrategy({argument}=...)`): another rank is hung, "
        f"crashed or much slower, or cut off. Fix: find the rank that stopped (its own error or a stack dump); "
        f"{legitimately_slow}."
    )


PEER_CLOSED_NOTE = (
    "lightning-ddp-plus: a peer closed its connection, so that process ended (an error of its own, a kill "
    "or its node going down); its log holds the cause. This rank stops too, so the job ends."
)


def stall_note(report: StallReport, timeout: timedelta, argument: str = "timeout") -> str:
    if report.kind == "out_of_step":
        return (
            "lightning-ddp-plus: the ranks were out of step, so the job ended without waiting for the timeout (one "
            f"rank ended its process so that every rank's collective returned).\n{report.text}"
        )
    return f"{timeout_note(timeout, argument)}\nWhat the ranks reported while the collective waited:\n{report.text}"


@dataclass(frozen=True)
class TimeoutContext:
    """What a collective timeout's note says: the timeout in effect and the argument that set it (``setup_timeout``
    before the first training step), what the ranks reported while the collective waited, and where NCCL's flight
    recorder wrote its dumps."""

    timeout: timedelta
    argument: str = "timeout"
    stall: StallReport | None = None
    flight_recorder: str | None = None


def explain(exception: BaseException, context: TimeoutContext) -> None:
    """Append to a torch error which rule it is and the fix, or what a collective timeout or a closed peer means
    (what the ranks reported, when the stall watchdog saw it), and then which ranks are still reachable. The
    package's own errors already say all of it."""
    if isinstance(exception, DDPConflictError) or not exception.args or not isinstance(exception.args[0], str):
        return
    message = exception.args[0]
    about_peers = bool(COLLECTIVE_TIMEOUT.search(message) or PEER_CLOSED.search(message))
    if about_peers and context.stall is not None:
        note: str | None = stall_note(context.stall, context.timeout, context.argument)
    elif COLLECTIVE_TIMEOUT.search(message):
        note = timeout_note(context.timeout, context.argument)
    elif PEER_CLOSED.search(message):
        note = PEER_CLOSED_NOTE
    else:
        note = reducer_error_note(message)
    if about_peers and context.flight_recorder is not None:
        note = f"{note or ''}\nlightning-ddp-plus: {context.flight_recorder}".lstrip("\n")
    if note is not None:
        exception.args = (f"{message}\n\n{note}", *exception.args[1:])
    # the probes take up to 2 s, so the note above is in place first, whatever happens to them
    where = reachability.diagnose() if about_peers else None
    if where:
        exception.args = (f"{exception.args[0]}\n{where}", *exception.args[1:])
