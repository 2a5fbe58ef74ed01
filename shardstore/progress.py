"""How long-running API calls report progress: one phase at a time ("ingest", "export"), in bytes.

The API only calls these three methods; what they show is the caller's business (the CLI draws a bar per
phase on a terminal and prints one line per phase elsewhere). The base class shows nothing.
"""

from __future__ import annotations


class Progress:
    def start(self, phase: str, total: int | None, done: int = 0) -> None:
        """A phase begins: `total` bytes in all (None when unknown), `done` of them already done earlier
        (a resumed run)."""

    def advance(self, nbytes: int) -> None:
        """`nbytes` more of the current phase are done."""

    def end(self) -> None:
        """The current phase finished."""


QUIET = Progress()
