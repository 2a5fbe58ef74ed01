"""Temporary files: every file shardstore writes (store objects, export outputs) is written as
".<name>.<pid>.<random>.tmp" beside its final name and renamed into place when whole, so a crash never
leaves a file that looks finished. What a killed writer leaves behind is swept by the next run.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

_TEMP = re.compile(r"^\..+\.([0-9]+)\.[0-9a-f]{8}\.tmp$")


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def is_temp(name: str) -> bool:
    return _TEMP.match(name) is not None


def alive(pid: int) -> bool:
    """Whether process `pid` can still be writing: it exists and is not a zombie (a zombie has exited;
    only its parent has not collected it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ...": comm may hold spaces and parentheses, so read after the last ")"
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc here: a process that exists counts as alive


def sweep(root: str | os.PathLike[str], recursive: bool = True) -> int:
    """Delete temporaries in `root` whose writer is gone; returns how many."""
    removed = 0
    walk = os.walk(root) if recursive else [(os.fspath(root), [], os.listdir(root) if os.path.isdir(root) else [])]
    for dirpath, _, names in walk:
        for name in names:
            m = _TEMP.match(name)
            if m and not alive(int(m.group(1))):
                Path(dirpath, name).unlink(missing_ok=True)
                removed += 1
    return removed
