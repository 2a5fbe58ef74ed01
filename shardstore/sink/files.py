"""A worker's sink for the pieces the layout places: each written where it goes in the output.

The store's `UnitWriter` is the other sink (ingest.py hands each piece to one or the other): both take
the same pieces from the read side. A piece is written kernel-side where its bytes are contiguous in both
files (copy_file_range from the rank file), row by row for a box that is not, cast block by block under
`--dtype`. Into a zip entry (torch, DCP) the worker also records each run's CRC-32 (the rank file's own
where the run is one of its storage records whole) for the finish to combine.

A unit's pieces are written one output file at a time, a file no other worker is writing first: ext4
(like most file systems) takes a file's inode lock for every buffered write, so two workers writing one
file wait on each other, while two writing different files do not (measured, two processes copying
0.6 GB each from cached files: 0.80-0.86 s into one file, 0.51-0.53 s into two).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import itertools
import math
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import StoreError
from ..ranges import BLOCK, FileRange, Part, blocks, copy_range, copy_summed, joined, part_length, pwrite_all
from ..store.manifest import ArrayEntry
from .layout import CLAIMS, Layout, Target
from .output import output_error

RECORDED_RUNS = 64  # a piece in more runs than this (a column box, row by row): the finish reads it back


class DirectWriter:
    def __init__(self, lay: Layout):
        self.layout = lay
        self.fds: dict[int, int] = {}
        self.runs: list[list[int]] = []  # [file, offset, length, CRC-32] written into zip entries
        self._bands: dict[str, _Bands] = {}
        self._pending: dict[int, list[tuple[ArrayEntry, Any, Target]]] = {}  # by output file, until `flush`

    def _fd(self, file: int) -> int:
        if file not in self.fds:
            self.fds[file] = os.open(os.path.join(self.layout.folder, self.layout.names[file]), os.O_WRONLY)
        return self.fds[file]

    def places(self, path: str) -> bool:
        return path in self.layout.targets

    def claim(self, group_rank: int, rank: int) -> bool:
        """Whether this unit writes its pieces: always, but under hybrid sharding only the first unit of
        its rank in the shard group (the others hold a copy of the same pieces)."""
        if not self.layout.hybrid:
            return True
        path = os.path.join(self.layout.folder, CLAIMS, str(group_rank))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            with open(path) as f:
                return f.read() == str(rank)  # this unit's own claim, from before a crash
        try:
            os.write(fd, str(rank).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def piece(self, entry: ArrayEntry, piece: Any) -> None:
        """Take one piece (a box of the array, or an element range of a flat one) for every place of it:
        written by `flush`, with the unit's other pieces, file by file."""
        if not all(piece.sizes):
            return
        bands = self._bands.get(entry.path)
        if bands is None:
            bands = self._bands[entry.path] = _Bands(entry, self.layout.targets[entry.path])
        for target in bands.near(entry, piece):
            self._pending.setdefault(target.file, []).append((entry, piece, target))

    def flush(self) -> None:
        """Write every piece taken since the last flush (one unit's), one output file at a time: the file
        with the most bytes to go that no other writer holds, else (all held) the one with the most."""
        left = self._bytes_to_go()  # once: a file's share does not change while the others are written
        try:
            while self._pending:
                file, held = self._next_file({f: left[f] for f in self._pending})
                try:
                    values: dict[int, list[np.ndarray]] = {}  # a piece's elements in C order, if a run needs them
                    for entry, piece, target in self._pending.pop(file):
                        runs = _runs(entry, piece, target)
                        if len(runs) > RECORDED_RUNS and target.dtype == entry.dtype \
                                and self._scatter(entry, piece, target, runs):
                            continue
                        record = target.crc and len(runs) <= RECORDED_RUNS
                        for first, count, out_at in runs:
                            self._write(entry, piece, values.setdefault(id(piece), []), first, count, target,
                                        out_at, record)
                finally:
                    if held:
                        fcntl.flock(self._fd(file), fcntl.LOCK_UN)
        except OSError as exc:  # a full disk, a read-only one: one line naming the file, not a traceback
            error = output_error(Path(self.layout.folder), exc)
            if error is None:
                raise
            raise error from None

    def _bytes_to_go(self) -> dict[int, int]:
        return {file: sum(math.prod(p.sizes) * dtypes.info(t.dtype).itemsize for _, p, t in items)
                for file, items in self._pending.items()}

    def _next_file(self, left: dict[int, int]) -> tuple[int, bool]:
        """Of the pending files (`left`: their bytes to go), the one to write now, and whether this writer
        holds its lock (a hint between workers: a file system without flock, or a file every other writer
        holds, is written anyway). A failed unit's pieces are dropped by `close`."""
        order = sorted(left, key=lambda f: -left[f])
        for file in order:
            try:
                fcntl.flock(self._fd(file), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return file, True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return order[0], False  # no locks here (a network file system mounted without them)
        return order[0], False

    def _scatter(self, entry: ArrayEntry, piece: Any, target: Target, runs: list[tuple[int, int, int]]) -> bool:
        """Many runs (a column box, row by row), each written from the piece's rows read into memory a
        block at a time; False where the piece's bytes are not one range of its file. copy_file_range
        costs about 10 us a call whatever its length: the 1.6 million 1 KB rows of a 5.3 GB MoE's
        row-parallel weights were 17 s of its two workers' 23 s."""
        size = dtypes.info(entry.dtype).itemsize
        row = math.prod(piece.sizes[1:]) * size  # bytes of one row of the piece
        if row == 0 or piece.rows(0, 0) is None:
            return False
        fd, held, start = self._fd(target.file), memoryview(b""), 0
        for first, count, out_at in runs:
            at, n = first * size, count * size
            if at < start or at + n > start + len(held):  # the next block of whole rows, from this run's
                start = at - at % row
                rows = min(-(-max(at + n - start, BLOCK) // row), piece.sizes[0] - start // row)
                held = memoryview(joined([piece.rows(start // row, rows)]))
            pwrite_all(fd, held[at - start:at - start + n], target.offset + out_at * size)
        return True

    def _write(self, entry: ArrayEntry, piece: Any, values: list[np.ndarray], first: int, count: int,
               target: Target, out_at: int, record: bool) -> None:
        """`count` elements of `piece` from its element `first` (C order within the piece), to element
        `out_at` of the target's tensor; with `record`, the run's CRC-32 noted."""
        src, dst = dtypes.info(entry.dtype), dtypes.info(target.dtype)
        fd, offset = self._fd(target.file), target.offset + out_at * dst.itemsize
        row = math.prod(piece.sizes[1:])
        part: Part | None = None
        if first % row == 0 and count % row == 0:
            part = piece.rows(first // row, count // row)
        if part is None:
            if not values:
                values.append(np.ascontiguousarray(piece.values()).reshape(-1))
            part = values[0][first:first + count].data
        if target.dtype != entry.dtype:
            for data in dtypes.cast([part], src, target.dtype):
                pwrite_all(fd, data, offset)
                offset += len(data)
            return
        known = piece.crc() if record and first == 0 and count == math.prod(piece.sizes) else None
        crc = _put(part, fd, offset, checksum=record and known is None)  # else kernel-side where it can
        if record:
            crc = known if known is not None else crc
            if crc is None:
                raise StoreError(f"{target.file}: no CRC-32 for the bytes written at {offset}")
            self.runs.append([target.file, offset, part_length(part), crc])

    def take_runs(self) -> list[list[int]]:
        """The runs written since the last call: one unit's, for its commit record (a worker's writer
        serves every unit of its batch)."""
        runs, self.runs = self.runs, []
        return runs

    def sync(self) -> None:
        """Make everything written durable: before the commit of the units that wrote it (the journal)."""
        for fd in self.fds.values():
            os.fsync(fd)

    def close(self) -> None:
        self._pending.clear()  # a unit that failed before its flush: its pieces are not written
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class _Bands:
    """An array's targets in order of their first row, to find those a piece may overlap without visiting
    all of them: a DCP export has one target per cell of the store (a 50k-row embedding, hundreds), and
    a unit's piece overlaps a few. At W=256, visiting every target of every piece was a third of a worker's
    time for `--format dcp`."""

    def __init__(self, entry: ArrayEntry, targets: tuple[Target, ...]):
        rows = entry.shape[0] if entry.shape else 1
        spans = sorted(((t.box[0][0], t.box[1][0]) if t.box is not None and entry.shape else (0, rows), i)
                       for i, t in enumerate(targets))
        self.starts = [start for (start, _), _ in spans]
        self.targets = [targets[i] for _, i in spans]
        self.longest = max((n for (_, n), _ in spans), default=0)

    def near(self, entry: ArrayEntry, piece: Any) -> list[Target]:
        """The targets whose rows may meet the piece's (a superset: `_runs` finds the exact overlap)."""
        if not entry.shape:
            return self.targets
        if entry.flat:  # an element range: the rows it touches
            row = max(math.prod(entry.shape[1:]), 1)
            first, end = piece.offsets[0] // row, -(-(piece.offsets[0] + piece.sizes[0]) // row)
        else:
            first, end = piece.offsets[0], piece.offsets[0] + piece.sizes[0]
        # a target starting more than `longest` rows before the piece ends before it
        lo = bisect.bisect_right(self.starts, first - self.longest)
        return self.targets[lo:bisect.bisect_left(self.starts, end)]


def _runs(entry: ArrayEntry, piece: Any, target: Target) -> list[tuple[int, int, int]]:
    """(first element in the piece, count, first element in the target's tensor) of each contiguous run
    of the piece's elements that the target takes, in C order."""
    shape = entry.shape
    t_off, t_size = target.box if target.box is not None else ((0,) * len(shape), shape)
    if entry.flat:  # an element range of the flattened array; a target of whole rows
        (start,), (count,) = piece.offsets, piece.sizes
        row = math.prod(shape[1:])
        a, b = max(start, t_off[0] * row), min(start + count, (t_off[0] + t_size[0]) * row)
        return [(a - start, b - a, a - t_off[0] * row)] if a < b else []
    p_off, p_size = piece.offsets, piece.sizes
    lo = [max(p, t) for p, t in zip(p_off, t_off)]
    hi = [min(p + s, t + u) for p, s, t, u in zip(p_off, p_size, t_off, t_size)]
    if any(a >= b for a, b in zip(lo, hi)):
        return []
    # From dimension k on, the overlap is all of the piece and all of the target: contiguous in both, so
    # each run spans those dimensions and its extent in dimension k - 1.
    k = len(shape)
    while k > 0 and lo[k - 1] == p_off[k - 1] == t_off[k - 1] and hi[k - 1] - lo[k - 1] == p_size[k - 1] == t_size[k - 1]:
        k -= 1
    if k == 0:  # the piece is the target
        return [(0, math.prod(p_size), 0)]
    run = (hi[k - 1] - lo[k - 1]) * math.prod(p_size[k:])
    in_strides = [math.prod(p_size[d + 1:]) for d in range(k)]
    out_strides = [math.prod(t_size[d + 1:]) for d in range(k)]
    # each run starts at one index of the overlap's first k - 1 dimensions, in C order, and lo[k - 1];
    # counted out by numpy (a column box of a big weight is a run per row: millions, row by row)
    first = sum((lo[d] - p_off[d]) * in_strides[d] for d in range(k))
    first_out = sum((lo[d] - t_off[d]) * out_strides[d] for d in range(k))
    starts, starts_out = np.array([first], dtype=np.int64), np.array([first_out], dtype=np.int64)
    for d in range(k - 1):
        steps = np.arange(hi[d] - lo[d], dtype=np.int64)
        starts = (starts[:, None] + steps * in_strides[d]).reshape(-1)
        starts_out = (starts_out[:, None] + steps * out_strides[d]).reshape(-1)
    return list(zip(starts.tolist(), itertools.repeat(run), starts_out.tolist()))


def _put(part: Part, fd: int, offset: int, checksum: bool = False) -> int | None:
    """Write `part` at `offset`; with `checksum`, return its CRC-32 (a local range's summed in place)."""
    if isinstance(part, FileRange):
        if checksum:
            return copy_summed(part, fd, offset)
        copy_range(part, fd, offset)
        return None
    crc = 0
    for block in blocks([part]):
        if checksum:
            crc = zlib.crc32(block, crc)
        pwrite_all(fd, block, offset)
        offset += part_length(block)
    return crc if checksum else None
