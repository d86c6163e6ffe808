"""The survivors' agreement: which step is saved, and which survivor writes it.

Survivors may stand one optimizer step apart (a collective can end on some ranks and fail on others), so the most
steps any survivor holds wins, and the lowest rank holding it writes. They agree through the job's store while it
lives, never through a collective (one would include the dead rank): each survivor sets its step under a key of its
own, waits for the others' for at most ``answer_seconds``, and the first to decide sets the decision once
(``compare_set``), which every survivor reads back. A rank that has not answered by then counts as gone. A rank a
survivor knows is dead (its launcher saw it die, or its process on the survivor's machine is gone) is not waited
for, and the survivor answers for it with ``gone`` under its key, so that survivors on other machines wait for it no
longer either. When the
store is gone too (its host was the rank that died), each survivor decides alone and writes its own step: every
survivor holds a whole step, at most one behind the most any rank completed, so whichever write lands last is
still a whole step within that bound.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

#: How long a survivor waits for the others' steps. A survivor learns of the death at its next collective, so this
#: covers the compute between two collectives (a forward and a backward) of the slowest survivor.
ANSWER_SECONDS = 5.0
#: How long a survivor that does not write waits for the writer's save before ending without one.
SAVE_WAIT_SECONDS = 300.0
_POLL_SECONDS = 0.05
#: What a survivor answers for a rank it knows is dead.
_GONE = b"gone"


@dataclass(frozen=True, kw_only=True)
class SurvivorsAgreed:
    """What the survivors agreed after a peer's death."""

    step: int
    """The optimizer steps of the state to save: the most any survivor holds."""
    writer: int
    """The survivor that writes it (the lowest rank holding ``step``)."""
    answered: tuple[int, ...]
    """The ranks that answered in time (this one included)."""
    through_store: bool
    """``False``: the store was gone (its host died), and this rank decided alone."""
    alone_because: str | None = None
    """Why this rank decided alone (``None``: it did not)."""

    def gone(self, world_size: int) -> tuple[int, ...]:
        """The ranks that did not answer: dead, or too late to take part."""
        return tuple(rank for rank in range(world_size) if rank not in self.answered)


def choose_writer(steps: Mapping[int, int]) -> tuple[int, int]:
    """``(writer, step)``: the most steps any survivor holds, written by the lowest rank holding them.

    >>> choose_writer({1: 6, 2: 7, 3: 7})
    (2, 7)
    """
    step = max(steps.values())
    return min(rank for rank, held in steps.items() if held == step), step


class SurvivorAgreement:
    """One survivor's side of the agreement, through ``store`` (``None``: no store, decide alone).

    Args:
        store: the job's store.
        rank: this rank.
        world_size: the ranks of the job.
        prefix: the keys of this fit (each fit of a process has its own).
        known_dead: the ranks this process's launcher saw die, read again while waiting (not waited for).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        prefix: str,
        known_dead: Callable[[], AbstractSet[int]] = frozenset,
        answer_seconds: float = ANSWER_SECONDS,
        save_wait_seconds: float = SAVE_WAIT_SECONDS,
    ) -> None:
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix
        self.known_dead = known_dead
        self.answer_seconds, self.save_wait_seconds = answer_seconds, save_wait_seconds
        self._shared = b""

    def agree(self, step: int, shared: bytes = b"") -> SurvivorsAgreed:
        """``shared``: what this rank hands the writer (``shared_with_writer``), set before its step is."""
        self._shared = shared
        if self.store is None:
            return self._alone(step, "no store")
        try:
            return self._through_store(step)
        except RuntimeError as error:  # the store's host is gone (DistNetworkError, DistStoreError)
            return self._alone(
                step, f"the store failed: {str(error).strip().splitlines()[0] if str(error) else error!r}"
            )

    def _alone(self, step: int, why: str) -> SurvivorsAgreed:
        return SurvivorsAgreed(
            step=step, writer=self.rank, answered=(self.rank,), through_store=False, alone_because=why
        )

    def _through_store(self, step: int) -> SurvivorsAgreed:
        if self._shared:
            self.store.set(self._key(f"shared/{self.rank}"), self._shared)
        self.store.set(self._key(f"step/{self.rank}"), str(step))
        keys = {rank: self._key(f"step/{rank}") for rank in range(self.world_size)}
        deadline = time.monotonic() + self.answer_seconds
        present = self._answers(keys, set())
        while len(present) < self.world_size and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            present |= self._answer_for_known_dead(keys, present)
            # one call a poll for every missing answer (a lost node's ranks), not one a rank: the store's host takes
            # one call a poll from each survivor, and each key is looked at on its own once, after the wait
            missing = [keys[rank] for rank in range(self.world_size) if rank not in present]
            if self.store.check(missing):
                present = set(keys)
        present = self._answers(keys, present)
        answers = {rank: self.store.get(keys[rank]) for rank in present}
        steps = {rank: int(answer) for rank, answer in answers.items() if answer != _GONE}
        writer, chosen = choose_writer(steps)
        proposal = json.dumps({"writer": writer, "step": chosen, "answered": sorted(steps)})
        decided = json.loads(self.store.compare_set(self._key("decision"), "", proposal))
        return SurvivorsAgreed(
            step=decided["step"], writer=decided["writer"], answered=tuple(decided["answered"]), through_store=True
        )

    def _answers(self, keys: Mapping[int, str], present: set[int]) -> set[int]:
        """The ranks whose key is set, after answering ``gone`` for those known dead (a step set first stands)."""
        present = present | self._answer_for_known_dead(keys, present)
        return present | {rank for rank, key in keys.items() if rank not in present and self.store.check([key])}

    def _answer_for_known_dead(self, keys: Mapping[int, str], present: set[int]) -> set[int]:
        """``gone`` under the key of each rank known dead that has not answered (its key is then set): those ranks."""
        dead = set(self.known_dead()) - present
        for rank in dead:
            self.store.compare_set(keys[rank], "", _GONE)
        return dead

    def announce_own_error(self, error: BaseException) -> None:
        """A rank whose fit ends with an error of its own (not a peer's death), before its process ends: the
        survivors then save nothing over the files there (it may be a NaN check that fired after a step)."""
        text = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        try:
            self.store.set(self._key(f"own_error/{self.rank}"), text[:500])
        except (RuntimeError, AttributeError):  # no store: the survivors cannot be told
            pass

    def peers_own_errors(self) -> dict[int, str]:
        """The ranks that said their fit ended with an error of their own (``announce_own_error``)."""
        errors: dict[int, str] = {}
        try:
            for rank in range(self.world_size):
                key = self._key(f"own_error/{rank}")
                if rank != self.rank and self.store.check([key]):
                    errors[rank] = self.store.get(key).decode()
        except (RuntimeError, AttributeError):  # no store: nothing said
            return errors
        return errors

    def shared_with_writer(self, agreed: SurvivorsAgreed) -> dict[int, bytes]:
        """On the writer: what each survivor that answered handed it in ``agree`` (set before its answer, so here
        whenever it handed something)."""
        if not agreed.through_store:
            return {self.rank: self._shared} if self._shared else {}
        keys = {rank: self._key(f"shared/{rank}") for rank in agreed.answered if rank != self.rank}
        shared = {rank: self.store.get(key) for rank, key in keys.items() if self.store.check([key])}
        return {**shared, self.rank: self._shared} if self._shared else shared

    def announce_saved(self, saved: Mapping[str, Any]) -> None:
        """The writer, once the file is in place: what the others report."""
        try:
            self.store.set(self._key("saved"), json.dumps(dict(saved)))
        except (RuntimeError, AttributeError):  # no store: nobody waits
            pass

    def wait_saved(self) -> dict[str, Any] | None:
        """A survivor that does not write: the writer's report, or ``None`` when it did not come in time."""
        deadline = time.monotonic() + self.save_wait_seconds
        try:
            while time.monotonic() < deadline:
                if self.store.check([self._key("saved")]):
                    report: dict[str, Any] = json.loads(self.store.get(self._key("saved")))
                    return report
                time.sleep(_POLL_SECONDS)
        except RuntimeError:
            return None
        return None

    def _key(self, name: str) -> str:
        return f"ddp_plus/after_death/{self.prefix}/{name}"
