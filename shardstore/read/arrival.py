"""What `watch` asks of a format while a checkpoint arrives (`Format.arrivals`), and what it remembers
between looks at the folder.

A unit file is taken once it is whole by its format's own measure (a torch zip's central directory, written
last, is there; a .distcp file reaches the end of the last item .metadata places in it) and its size and
mtime have not changed since the previous look: a file still being written or copied is left alone until
then. Files copied under a temporary name and renamed into place are only seen once they have their final
name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CheckpointError
from .source import Source


@dataclass(frozen=True)
class Arrived:
    """The checkpoint arriving (its format and the units known so far) and those of its units ready to
    ingest: (path, unit number) each."""

    source: Source
    ready: list[tuple[str, int]]


@dataclass
class Looks:
    """Each file's (size, mtime) at the previous look, and what a format parsed once per version of a file
    (a DCP .metadata can be tens of MB at scale)."""

    seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    parsed: dict[str, tuple[tuple[int, int], Any]] = field(default_factory=dict)

    def still(self, path: str, whole: Callable[[str, int], bool]) -> bool:
        """Whether `path` has the same size and mtime as at the previous look, and is `whole` (given its size)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        stamp = (st.st_size, st.st_mtime_ns)
        ready = self.seen.get(path) == stamp and whole(path, st.st_size)
        self.seen[path] = stamp
        return ready

    def parse(self, path: str, read: Callable[[str], Any]) -> Any:
        """`read(path)` once per version of the file, or None while it is absent or does not read yet
        (`read` raising CheckpointError)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        stamp = (st.st_size, st.st_mtime_ns)
        if self.parsed.get(path, (None,))[0] != stamp:
            try:
                self.parsed[path] = (stamp, read(path))
            except CheckpointError:
                return None
        return self.parsed[path][1]

