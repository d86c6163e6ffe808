"""The per-step agreement's flags, by name: each component declares the names of the flags it adds
(``StepComponent.agreement_flags``); ``AgreementFlags`` lays every declared name out once, in the pipeline's order,
so that one exchange after a synced backward carries them all; ``AgreedFlags`` is read back by name.

>>> flags = AgreementFlags(["epoch ends on a rank", "stop"])
>>> packed = flags.pack({"stop": 1})
>>> packed
[0, 1]
>>> agreed = flags.read([1, 1])
>>> agreed["stop"], agreed["epoch ends on a rank"], "out of memory" in agreed
(1, 1, False)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AgreedFlags:
    """Each declared flag's maximum over the ranks, by name (all 0 where the ranks agreed that nobody had news)."""

    values: Mapping[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> int:
        if name not in self.values:
            declared = ", ".join(repr(n) for n in self.values) or "none"
            raise KeyError(f"no agreement flag {name!r} was declared (declared: {declared})")
        return self.values[name]

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def get(self, name: str, default: int = 0) -> int:
        """The flag's value, or ``default`` where no component declared it (a feature turned off)."""
        return self.values.get(name, default)


class AgreementFlags:
    """The layout of the declared flags in the agreement's exchange: the same names in the same order on every
    rank (the components and their settings are the same everywhere)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names: tuple[str, ...] = tuple(names)
        repeated = sorted({name for name in self.names if self.names.count(name) > 1})
        if repeated:
            raise ValueError(f"agreement flags declared twice: {repeated}; each component names its own flags")
        self._zeros = AgreedFlags(dict.fromkeys(self.names, 0))

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def pack(self, values: Mapping[str, int]) -> list[int]:
        """This rank's values in the exchange's order (an undeclared name is refused: it would never travel)."""
        unknown = sorted(set(values) - set(self.names))
        if unknown:
            raise KeyError(f"agreement flags {unknown} were not declared by any component (declared: {self.names})")
        return [int(values.get(name, 0)) for name in self.names]

    def zeros(self) -> AgreedFlags:
        """Every flag 0 (a backward with no agreement, or one where nobody had news); one shared, read-only record."""
        return self._zeros

    def read(self, maximums: Sequence[int]) -> AgreedFlags:
        """The exchange's result (each flag's maximum over the ranks), by name."""
        if len(maximums) != len(self.names):
            raise ValueError(f"{len(maximums)} flag values for the {len(self.names)} declared: {self.names}")
        return AgreedFlags(dict(zip(self.names, (int(value) for value in maximums))))
