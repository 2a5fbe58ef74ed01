"""The output laid out before any shard is read: which files, how long, and where every array goes.

A format's planner (safetensors.py, torch.py, dcp.py beside this) gives the layout and the bytes known
up front (headers, zip records), sketched rather than written (`Sketch`). `prepare` writes them into
files inside the scratch store; the workers fill in the rest. Under hybrid sharding one unit per rank of
the shard group writes (`claims`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import zlib
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Iterable

from ..crc import crc32_combine
from ..paths import pick
from ..ranges import BLOCK, Part
from ..store.store import Store
from .output import output_error

FOLDER = "__shardstore__/direct"  # inside the scratch store: the output files while they are written
LAYOUT = "layout.json"
CLAIMS = "claims"  # hybrid sharding: which unit writes each rank of the shard group
MOVING = "moving"  # the files are being renamed into OUT: one missing here is there already

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets and sizes


@dataclass(frozen=True)
class Target:
    """Where (a box of) an array goes in the output: file `file` from byte `offset`, as `dtype`."""

    file: int
    offset: int
    box: Box | None  # only this box of the array (a row block of a split weight, a DCP chunk); None: all
    dtype: str
    crc: bool = False  # a zip entry: the worker records the CRC-32 of what it writes (`Run`)


@dataclass(frozen=True)
class Layout:
    """The output files and where every array goes in them: what each worker is told."""

    folder: str  # where the files are written (inside the scratch store)
    names: tuple[str, ...]
    sizes: tuple[int, ...]  # as laid out; what follows (a zip's pickle and directory) comes at the finish
    targets: dict[str, tuple[Target, ...]]  # store path -> its places
    hybrid: bool = False  # hybrid sharding: one unit per rank of the shard group writes (claims)
    whole: str | None = None  # a `part`: the digest of the layout it is part of

    @cached_property  # (asked for once per unit and per journal record)
    def digest(self) -> str:
        if self.whole is not None:
            return self.whole
        text = json.dumps([self.names, self.sizes, sorted((p, [t.__dict__ for t in ts])
                                                          for p, ts in self.targets.items())])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def part(self, exact: Iterable[str], subtrees: frozenset[str] = frozenset()) -> "Layout":
        """The places of the store paths `exact` and `within` `subtrees` alone, for a task whose units
        hold nothing else. The whole layout went with every task: DeepSeek-V3's structure (46,181 tensors)
        pickled to 4.3 MB, sent with each of 61 tasks and unpickled in 0.22 s each time. A part keeps the
        whole one's digest, which the journal records name."""
        return replace(self, targets=pick(self.targets, exact, subtrees), whole=self.digest)


def new_layout(store: Store, names: Iterable[str], sizes: Iterable[int],
               targets: dict[str, list[Target]]) -> Layout:
    return Layout(os.path.join(os.fspath(store.location), FOLDER), tuple(names), tuple(sizes),
                  {p: tuple(t) for p, t in targets.items()}, store.manifest.facts.replicas > 1)


class Sketch:
    """A file written down rather than written: the bytes known up front, at their offsets, and the holes
    left for the workers (a zip writer's sink, torchzip.Sink)."""

    def __init__(self) -> None:
        self.pos = 0
        self.writes: list[tuple[int, bytes]] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        data = bytes(data)
        self.writes.append((self.pos, data))
        self.pos += len(data)

    def write_parts(self, parts: Iterable[Part], crc: int | None = None) -> int | None:
        for part in parts:  # only in-memory parts are sketched: small records
            assert isinstance(part, (bytes, bytearray, memoryview))
            if crc is not None:
                crc = zlib.crc32(part, crc)
            self.write(part)
        return crc

    def pwrite(self, data: bytes, offset: int) -> None:
        self.writes.append((offset, bytes(data)))

    def skip(self, n: int) -> None:
        self.pos += n

    def runs(self) -> list[tuple[int, bytes]]:
        """The writes as runs of adjacent bytes, each later write over the earlier ones (a zip's CRCs
        patched into its headers): what the file will hold, in the fewest writes."""
        runs: list[tuple[int, bytearray]] = []
        for at, data in sorted(self.writes, key=lambda w: w[0]):  # (stable: a later write stays later)
            if runs and runs[-1][0] + len(runs[-1][1]) >= at:
                start, buf = runs[-1]
                buf[at - start:at - start + len(data)] = data
            else:
                runs.append((at, bytearray(data)))
        return [(at, bytes(buf)) for at, buf in runs]

    def place(self, runs: list[tuple[int, bytes]], length: int, patches: Iterable[tuple[int, bytes]] = ()) -> None:
        """Another sketch's `runs` (`length` bytes from its start) again, from here on, with `patches`
        (offsets from its start) written over them; the runs they miss shared, not copied."""
        self.writes.extend((self.pos + at, data) for at, data in patched(runs, patches))
        self.pos += length


def patched(runs: list[tuple[int, bytes]], patches: Iterable[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """`runs` with `patches` (at the same offsets) written over them; a run no patch falls in is the same
    bytes object."""
    patches = list(patches)
    out = []
    for at, data in runs:
        mine = [(p - at, b) for p, b in patches if at <= p < at + len(data)]
        if mine:
            buf = bytearray(data)
            for offset, b in mine:
                buf[offset:offset + len(b)] = b
            data = bytes(buf)
        out.append((at, data))
    return out


def prepare(store: Store, lay: Layout, heads: list[list[tuple[int, bytes]]]) -> None:
    """Create the output files (the bytes known up front written, the rest sized) unless a run with this
    layout made them already; a layout of another run (other options) is replaced whole, with the commits
    it journalled."""
    folder = Path(lay.folder)
    marker = folder / LAYOUT
    if marker.exists() and marker.read_text() == lay.digest:
        _void_claims(store, folder / CLAIMS, lay.digest)
        return
    if (folder / CLAIMS).exists():
        shutil.rmtree(folder / CLAIMS)
    (folder / CLAIMS).mkdir(parents=True)
    marker.unlink(missing_ok=True)
    for name, writes, size in zip(lay.names, heads, lay.sizes):
        fd = os.open(folder / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for offset, data in writes:
                os.pwrite(fd, data, offset)
            os.ftruncate(fd, size)
            os.fsync(fd)
        except OSError as exc:  # a size the file system cannot hold (EFBIG), a full disk: one line
            exc.filename = str(folder / name)
            error = output_error(folder, exc)
            if error is None:
                raise
            raise error from None
        finally:
            os.close(fd)
    tmp = folder / f".{LAYOUT}.tmp"
    tmp.write_text(lay.digest)
    os.replace(tmp, marker)


def _void_claims(store: Store, claims: Path, digest: str) -> None:
    """A claim whose unit was never journalled (its run died) no longer holds: another unit of its group
    rank writes those pieces."""
    journalled = {rec.rank for rec in store.records().values() if rec.direct == digest}
    for claim in claims.iterdir():
        if int(claim.read_text() or -1) not in journalled:
            claim.unlink()


Run = tuple[int, int, int]  # (offset, length, CRC-32) of bytes a worker wrote into a file


def journalled_runs(store: Store, lay: Layout) -> dict[int, list[Run]]:
    """Every run the journalled units of this layout wrote into a zip entry, by file, in offset order."""
    runs: dict[int, list[Run]] = {}
    for rec in store.records().values():
        if rec.direct == lay.digest:
            for file, offset, length, crc in rec.runs:
                runs.setdefault(file, []).append((offset, length, crc))
    for listed in runs.values():
        listed.sort()
    return runs


def entry_crc(runs: list[Run], at: int, size: int, fd: int) -> int:
    """The CRC-32 of bytes [at, at + size) of a file: combined from the runs if they tile it exactly, else
    (a piece written row by row records none) read back from the file, durable by now."""
    i, pos, crc = bisect.bisect_left(runs, (at,)), at, 0
    while pos < at + size and i < len(runs) and runs[i][0] == pos:
        crc = crc32_combine(crc, runs[i][2], runs[i][1])
        pos += runs[i][1]
        i += 1
    if pos == at + size:
        return crc
    crc = 0
    for offset in range(at, at + size, BLOCK):
        crc = zlib.crc32(os.pread(fd, min(BLOCK, at + size - offset), offset), crc)
    return crc
