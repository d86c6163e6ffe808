"""The package's own errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_ddp_plus.conflicts.rules import Finding


class DDPConflictError(RuntimeError):
    """DDP settings that torch's reducer cannot train this model with, found before any optimizer step."""

    def __init__(self, message: str, findings: list[Finding]) -> None:
        super().__init__(message)
        self.findings = findings
