"""Which checkpoint the export in an OUT folder came from, so that an export into a folder holding one
replaces it freely when it is of the same checkpoint (a rerun, a resumed export, another `--dtype`) and only
with `--overwrite` when it is of another (the step before, another run): file names alone cannot tell.

The record, `.shardstore-export.json` beside the export's files, holds every unit file's name and content
identity (read/primitives/identity.py: the digest of a torch zip's directory, or the sampled ends of any other
file), so a copy of the checkpoint elsewhere is the same checkpoint and a newer save over the same folder is
another. Two records are of the same checkpoint when the unit files they share are the same files: an export
from a partial store (`--allow-partial`) and the whole one after agree. A folder with export files and no
record (an export of an older shardstore, or another tool's) is left to the file-name checks as before.

The record is written before the export's files replace what OUT held: a crash between leaves OUT saying it
holds (perhaps some of) this checkpoint's export, which a rerun of the same checkpoint completes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Mapping

from ..errors import ExportError
from ..jsonin import loads
from ..sink.output import OutputFile
from ..store.store import Store

RECORD = ".shardstore-export.json"
MAX_RECORD = 64 << 20  # names and digests of every unit: ~100 bytes each, for up to hundreds of thousands of units

# (unit file names of the record) -> this checkpoint's identities of those of them it has, by name
Identities = Callable[[Iterable[str]], Mapping[str, str]]


def of_store(store: Store) -> dict[str, str]:
    """The content identity of every unit file a store ingested, by file name."""
    return {rec.file: rec.identity.split("@", 1)[0] for rec in store.records(refresh=False).values()
            if rec.identity is not None}


def check(out: Path, identities: Identities) -> None:
    """Refuse to export into `out` when it holds the export of another checkpoint. `identities` is asked
    only for names the record holds, so one unit's identity decides up front."""
    recorded = _recorded(out)
    if not recorded:
        return
    ours = identities(sorted(recorded))
    shared = sorted(set(recorded) & set(ours))
    other = next((name for name in shared if recorded[name] != ours[name]), None)
    if other is not None or not shared:
        why = (f"its {other} is another file than this checkpoint's" if other is not None
               else "none of its files is one of this checkpoint's")
        raise ExportError(f"{out}: holds the export of another checkpoint ({RECORD}: {why}); use --overwrite "
                          f"to replace that export, or another folder")


def write(out: Path, units: Mapping[str, str]) -> None:
    """Record (atomically) that `out` holds this checkpoint's export; before its files are written."""
    if not units:
        return
    with OutputFile(out / RECORD) as f:
        f.write(json.dumps({"units": dict(sorted(units.items()))}, indent=0).encode())


def _recorded(out: Path) -> dict[str, str] | None:
    """The record in `out`, if any; a damaged one is refused."""
    path = out / RECORD
    try:
        if not path.is_file():
            return None
        size = path.stat().st_size
        if size > MAX_RECORD:
            raise ExportError(f"{path}: {size} bytes, more than a record of an export holds; remove it, or use "
                              f"another folder")
        data = loads(path.read_bytes(), str(path), "the record of the export in OUT", ExportError)
    except OSError as exc:
        raise ExportError(f"{path}: cannot read the record of the export in OUT: {exc.strerror}") from None
    units = data.get("units") if isinstance(data, dict) else None
    if not isinstance(units, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in units.items()):
        raise ExportError(f"{path}: not a record shardstore wrote (no 'units' of names and identities); remove "
                          f"it, or use another folder")
    return units
