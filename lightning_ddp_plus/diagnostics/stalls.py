"""What a stall means, from every rank's state: a pure decision over plain records, testable without processes.

When some rank has waited in a collective longer than the threshold, every rank describes itself (``RankState``:
the collective it is in, if any, its last collectives, its phase and step, and where its main thread is) and one
function decides (``explain_stall``):

- **out of step**: the ranks wait in different collectives, or at different sequence numbers. No rank is hung; a
  collective was issued on some ranks only. The job cannot go on, and the report names each rank's collective and
  the user's line that issued it;
- **not reached**: some ranks wait in a collective that others have not reached; the report names those ranks,
  the function and line they are in, for how long, and their stacks;
- **every rank waits** in the same collective: the data is not moving (a slow or cut link, a peer in trouble).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_ddp_plus.diagnostics.call_sites import CallSite, CollectiveCall
from lightning_ddp_plus.diagnostics.collective_ledger import CollectiveRecord

StallKind = Literal["out_of_step", "not_reached", "every_rank_waits"]

#: What issues a collective on some ranks only, in the order users meet it.
LIKELY_CAUSES = (
    "a metric logged with `sync_dist=True` on some ranks only (a condition that differs per rank, or different keys "
    "per rank in `log_dict`), a `barrier` / `all_gather` / `broadcast` inside a branch that only some ranks take "
    "(`if self.global_rank == 0:`), or one rank with an extra validation batch"
)


@dataclass
class RankState:
    """One rank at a stall: the collective its main thread waits in (``None``: it is not in one), its last
    collectives, its phase and step, and where its main thread is."""

    rank: int
    step: int
    phase: str
    sequence: int
    current: CollectiveRecord | None
    #: Seconds in the current collective, or since the rank last made progress when it is in none.
    seconds: float
    site: CallSite | None
    stack: str
    last: list[CollectiveRecord] = field(default_factory=list)
    #: Outside any collective of the ledger: a ``torch.distributed`` collective its main thread waits in all the
    #: same (one Lightning issues itself, such as its loop's SIGTERM broadcast before every training batch).
    outside_ledger: CollectiveCall | None = None

    def as_data(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "step": self.step,
            "phase": self.phase,
            "sequence": self.sequence,
            "current": self.current.as_data() if self.current else None,
            "seconds": self.seconds,
            "site": vars(self.site) if self.site else None,
            "stack": self.stack,
            "last": [record.as_data() for record in self.last],
            "outside_ledger": (
                {"op": self.outside_ledger.op, "issued_at": vars(self.outside_ledger.issued_at)}
                if self.outside_ledger
                else None
            ),
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> RankState:
        return cls(
            rank=data["rank"],
            step=data["step"],
            phase=data["phase"],
            sequence=data["sequence"],
            current=CollectiveRecord.from_data(data["current"]) if data["current"] else None,
            seconds=data["seconds"],
            site=CallSite(**data["site"]) if data["site"] else None,
            stack=data["stack"],
            last=[CollectiveRecord.from_data(record) for record in data["last"]],
            outside_ledger=(
                CollectiveCall(outside["op"], CallSite(**outside["issued_at"]))
                if (outside := data.get("outside_ledger"))
                else None
            ),
        )


@dataclass(frozen=True)
class StallReport:
    """The decision and its text; ``culprits``: the ranks the text blames (out of step: every rank whose collective
    differs from the one most ranks are in, or every rank when no collective has a majority; not reached: the ranks
    outside the collective)."""

    kind: StallKind
    text: str
    culprits: tuple[int, ...]


def _where(state: RankState) -> str:
    site = f"{state.site}" if state.site is not None else "library code (no frame of yours on its stack)"
    return f"{site}, in its {state.phase} of step {state.step}"


def _ops_by_sequence(state: RankState) -> dict[int, CollectiveRecord]:
    records = {record.sequence: record for record in state.last}
    if state.current is not None:
        records[state.current.sequence] = state.current
    return records


def first_mismatch(states: list[RankState]) -> int | None:
    """The first sequence number at which two ranks' ledgers hold different collectives (``None``: they agree
    wherever both have a record).

    >>> a = RankState(0, 3, "forward", 5, CollectiveRecord(5, "all_reduce", 4, "forward", 3, None, 0.0), 1.0, None, "")
    >>> b = RankState(1, 3, "backward", 5, CollectiveRecord(5, "gradient all_reduce", 8, "backward", 3, None, 0.0), 1.0, None, "")
    >>> first_mismatch([a, b]), first_mismatch([a, a])
    (5, None)
    """
    ledgers = [_ops_by_sequence(state) for state in states]
    common = sorted(set.intersection(*(set(ledger) for ledger in ledgers))) if ledgers else []
    for sequence in common:
        if len({ledger[sequence].op for ledger in ledgers}) > 1:
            return sequence
    return None


def _position(state: RankState) -> int:
    """The collective a rank is in, or the next one it will issue."""
    return state.current.sequence if state.current is not None else state.sequence + 1


def _out_of_step(states: list[RankState], sequence: int) -> StallReport:
    at = {state.rank: _ops_by_sequence(state)[sequence] for state in states}
    ops = [record.op for record in at.values()]
    majority = max(set(ops), key=lambda op: (ops.count(op), op))
    if ops.count(majority) <= len(ops) / 2:
        majority = ""  # no collective has a majority: every rank is a suspect
    lines = [f"rank {rank} issued {record.describe()}" for rank, record in at.items()]
    text = (
        f"The ranks are out of step: at collective {sequence} they issued different collectives, which can never "
        "pair up, so no rank is hung and waiting longer cannot help. "
        + "; ".join(lines)
        + ". The likely cause: "
        + LIKELY_CAUSES
        + ". Fix: issue the same collectives on every rank (log the metric on every rank, or with `rank_zero_only=True` "
        "and no `sync_dist`; move the collective out of the branch only some ranks take)."
    )
    return StallReport("out_of_step", text, tuple(rank for rank, record in at.items() if record.op != majority))


def _waits_in(state: RankState) -> str:
    if state.current is not None:
        return f"rank {state.rank} waits in {state.current.describe()}"
    assert state.outside_ledger is not None
    return (
        f"rank {state.rank} waits in {state.outside_ledger} (a collective of Lightning's or torch's own, outside the "
        f"ledger; its last collective in the ledger was {state.sequence}), at {_where(state)}"
    )


def _in_different_collectives(states: list[RankState]) -> StallReport:
    """Every rank waits in a collective, some in one the ledger does not see: they cannot pair up."""
    kinds = [state.current.op if state.current is not None else f"outside: {state.outside_ledger}" for state in states]
    majority = max(set(kinds), key=lambda kind: (kinds.count(kind), kind))
    if kinds.count(majority) <= len(kinds) / 2:
        majority = ""
    text = (
        "The ranks are out of step: every rank waits in a collective, but not in the same one, so they can never "
        "pair up; no rank is hung and waiting longer cannot help. "
        + "; ".join(_waits_in(state) for state in states)
        + ". The likely cause: "
        + LIKELY_CAUSES
        + ". Fix: issue the same collectives on every rank, in the same order."
    )
    return StallReport("out_of_step", text, tuple(s.rank for s, kind in zip(states, kinds) if kind != majority))


def _not_reached(waiting: list[RankState], behind: list[RankState]) -> StallReport:
    leader = max(waiting, key=_position)
    collective = leader.current
    assert collective is not None
    ranks = ", ".join(str(s.rank) for s in waiting if _position(s) == _position(leader))
    parts = []
    for state in behind:
        inside = f" (inside {state.current.op}, collective {state.current.sequence})" if state.current else ""
        parts.append(
            f"rank {state.rank} has not reached it: for {state.seconds:.0f} s it has been at {_where(state)}{inside}.\n"
            f"Its stack (innermost last):\n{state.stack.rstrip()}"
        )
    text = (
        f"Rank(s) {ranks} have waited {leader.seconds:.0f} s in {collective.describe()}; "
        + "\n".join(parts)
        + "\nFix: look at what that line waits for (a read from a slow filesystem, a lock, work only that rank does); "
        "the collective timeout ends the job if it never returns."
    )
    return StallReport("not_reached", text, tuple(s.rank for s in behind))


def explain_stall(states: list[RankState], world_size: int | None = None) -> StallReport:
    """The decision for every rank's state (see the module's docstring): the ranks' ledgers are compared by sequence
    number first (a different collective at one number is out of step), then by how far each rank got.

    A rank outside the ledger's collectives whose main thread still waits in a ``torch.distributed`` collective
    (Lightning issues some itself) while the others wait in the ledger's is out of step too, when every rank of the
    ``world_size`` answered: their answers crossed the network, so a cut link does not explain the wait.

    >>> site = CallSite("model.py", 57, "training_step", 'self.log("extra", x, sync_dist=True)')
    >>> log = CollectiveRecord(17, "all_reduce", 4, "forward", 3, site, 0.0)
    >>> grads = CollectiveRecord(17, "gradient all_reduce", 4096, "backward", 3, None, 0.0)
    >>> report = explain_stall([RankState(0, 3, "forward", 17, log, 9.0, site, ""), RankState(1, 3, "backward", 17, grads, 9.0, None, "")])
    >>> report.kind, report.culprits
    ('out_of_step', (0, 1))
    """
    waiting = [state for state in states if state.current is not None]
    if not waiting:
        raise ValueError("no rank waits in a collective: there is no stall to explain")
    mismatch = first_mismatch(states)
    if mismatch is not None:
        return _out_of_step(states, mismatch)
    everyone = world_size is None or len(states) == world_size
    every_rank_waits = all(s.current is not None or s.outside_ledger is not None for s in states)
    if everyone and every_rank_waits and any(s.current is None for s in states):
        return _in_different_collectives(states)
    ahead = max(_position(state) for state in waiting)
    behind = [s for s in states if _position(s) < ahead or s.current is None]
    if behind:
        return _not_reached(waiting, behind)
    collective = waiting[0].current
    assert collective is not None
    text = (
        f"Every rank has waited {min(s.seconds for s in waiting):.0f} s in {collective.describe()}: the ranks are in "
        "step, but the data is not moving (a slow or cut link, or a peer process in trouble)."
    )
    return StallReport("every_rank_waits", text, ())


def state_of(
    rank: int,
    ledger: Any,
    site: CallSite | None,
    stack: str,
    now: float | None = None,
    outside_ledger: CollectiveCall | None = None,
) -> RankState:
    """This rank's state, from its ledger and its main thread's innermost user frame, stack, and the collective
    outside the ledger it waits in, if any."""
    now = time.monotonic() if now is None else now
    current = ledger.current
    since = current.started if current is not None else ledger.progressed
    return RankState(
        rank=rank,
        step=ledger.step,
        phase=ledger.phase,
        sequence=ledger.sequence,
        current=current,
        seconds=now - since,
        site=site,
        stack=stack,
        last=ledger.last(),
        outside_ledger=outside_ledger if current is None else None,
    )
