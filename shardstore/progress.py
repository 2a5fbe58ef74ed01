"""How long-running API calls report progress: one phase at a time ("ingest", "export"), in bytes.

The API only calls `start`, `advance`, `end` (per phase) and `note` (a line before the work, such as
which checkpoint was taken); what they show is the caller's business. The base class shows
nothing; `ConsoleProgress` (what the CLI shows, and `progress=True` in the API) draws a bar per phase on
a terminal and prints one line per phase elsewhere (a log, CI, a notebook's captured stderr).
"""

from __future__ import annotations

import sys
import time


class Progress:
    def start(self, phase: str, total: int | None, done: int = 0) -> None:
        """A phase begins: `total` bytes in all (None when unknown), `done` of them already done earlier
        (a resumed run)."""

    def advance(self, nbytes: int) -> None:
        """`nbytes` more of the current phase are done."""

    def end(self) -> None:
        """The current phase finished."""

    def note(self, text: str) -> None:
        """Something the user should know before the work starts (which checkpoint was found)."""


QUIET = Progress()


class ConsoleProgress(Progress):
    """A bar per phase on a terminal; elsewhere one plain line when each phase ends. Sizes in binary
    units throughout (KiB, MiB, GiB), in the bars and in the lines alike."""

    def __init__(self) -> None:
        self.bar = None
        self.tty = sys.stderr.isatty()
        self.total: int | None = None
        self.phase, self.before, self.moved, self.began = "", 0, 0, 0.0

    def start(self, phase: str, total: int | None, done: int = 0) -> None:
        self.end()
        self.phase, self.total, self.before, self.moved, self.began = phase, total, done, 0, time.monotonic()
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc=phase, unit="iB", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, dynamic_ncols=True, leave=True)

    def advance(self, nbytes: int) -> None:
        self.moved += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)

    def end(self) -> None:
        if not self.phase:
            return
        if self.bar is not None:
            if self.bar.total is not None and self.bar.n > self.bar.total:
                self.bar.total = self.bar.n  # container headers are counted too
            self.bar.close()
            self.bar = None
        else:
            took = time.monotonic() - self.began
            resumed = f" ({size_text(self.before)} were already done)" if self.before else ""
            print(f"{self.phase}: {size_text(self.moved)} in {took:.1f} s{resumed}", file=sys.stderr, flush=True)
        self.phase = ""

    def note(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def abandon(self) -> None:
        """On an error: the error line, not a stalled bar, is what the user should see last."""
        if self.bar is not None:
            self.bar.leave = False
            self.bar.close()
            self.bar = None
        self.phase = ""


def size_text(n: float) -> str:
    """1234567 -> "1.2 MiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def resolve(progress: "Progress | bool") -> Progress:
    """The API's `progress` argument: a Progress, True for what the CLI shows, False for nothing."""
    if progress is True:
        return ConsoleProgress()
    return QUIET if progress is False or progress is None else progress
