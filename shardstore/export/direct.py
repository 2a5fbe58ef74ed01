"""One read, one write: `unshard` to safetensors (or `hf`) with every shard written straight into its place in
the output, no copy of it in the scratch store.

Every output byte's place is known once the checkpoint is planned: the same `SafetensorsPlan` the export
from a store makes (file names, headers, each tensor's byte range; for `hf`, each row block of a split
weight). The coordinator lays the files out (header written, the rest sized), each worker writes the
pieces of its unit into them (kernel-side where a piece's rows are contiguous in both files, row by row
otherwise, cast piece by piece under `--dtype`), makes them durable, and only then commits its unit in the
scratch store, which keeps its values and is the journal a rerun resumes from. The files live inside the
scratch store until every unit is in; then they are renamed into OUT, so a run killed at any moment leaves
nothing in OUT that looks finished.

Under hybrid sharding every replica group's files hold every byte, and the units of one rank in the
shard group hold the same pieces. The first unit of each group rank to start claims it (a file created
exclusively) and writes; the others only check and commit. A claim counts only once its unit is
journalled: a run that starts again voids the claims of units that never committed, so their pieces are
written by whichever unit of that group rank comes next.

Where this does not apply the two-step path runs (ingest into the scratch store, then export from it):
tensors the plan cannot place before the data is read (plain values under the model: their shapes come
with the data; a Composer model's config lives in its values), hybrid sharding of other formats than
rank files, `--verify-replicas`, Dask, `--store`, and OUT on object storage.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import dtypes
from ..ranges import FileRange, Part, blocks, copy_range, part_length
from ..store.manifest import ArrayEntry
from ..store.store import Store
from .output import output_error
from .resolve import ArrayRef
from .safetensors import CAST_BLOCK_BYTES, SafetensorsPlan, _cast, header

FOLDER = "__shardstore__/direct"  # inside the scratch store: the output files while they are written
LAYOUT = "layout.json"
CLAIMS = "claims"  # hybrid sharding: which unit writes each rank of the shard group
MOVING = "moving"  # the files are being renamed into OUT: one missing here is there already


@dataclass(frozen=True)
class Target:
    """Where (rows of) an array go in the output: file `file` from byte `offset`, as `dtype`."""

    file: int
    offset: int
    rows: tuple[int, int] | None  # only these rows of the array (a row block of a split weight)
    dtype: str


@dataclass(frozen=True)
class Layout:
    """The output files and where every array goes in them: what each worker is told."""

    folder: str  # where the files are written (inside the scratch store)
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    targets: dict[str, tuple[Target, ...]]  # store path -> its places
    hybrid: bool = False  # hybrid sharding: one unit per rank of the shard group writes (claims)

    @property
    def digest(self) -> str:
        text = json.dumps([self.names, self.sizes, sorted((p, [t.__dict__ for t in ts])
                                                          for p, ts in self.targets.items())])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def layout(store: Store, plan: SafetensorsPlan) -> Layout:
    """The output's layout: every tensor of `plan` an array of the store's plan (the caller made sure)."""
    targets: dict[str, list[Target]] = {}
    sizes = []
    for i, group in enumerate(plan.groups):
        offset = len(header(group, {}))
        for item in group:
            ref = item.source
            assert isinstance(ref, ArrayRef), item.key  # plain values never reach a one-pass plan
            targets.setdefault(ref.path, []).append(Target(i, offset, ref.rows, item.dtype))
            offset += item.nbytes
        sizes.append(offset)
    folder = os.path.join(os.fspath(store.location), FOLDER)
    return Layout(folder, tuple(plan.names), tuple(sizes), {p: tuple(t) for p, t in targets.items()},
                  store.manifest.extra.get("replicas", 1) > 1)


def prepare(store: Store, plan: SafetensorsPlan, lay: Layout) -> None:
    """Create the output files (header written, the rest sized) unless a run with this layout made them
    already; a layout of another run (other options) is replaced whole, with the commits it journalled."""
    folder = Path(lay.folder)
    marker = folder / LAYOUT
    if marker.exists() and marker.read_text() == lay.digest:
        _void_claims(store, folder / CLAIMS, lay.digest)
        return
    if (folder / CLAIMS).exists():
        shutil.rmtree(folder / CLAIMS)
    (folder / CLAIMS).mkdir(parents=True)
    marker.unlink(missing_ok=True)
    for name, group, size in zip(lay.names, plan.groups, lay.sizes):
        fd = os.open(folder / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, header(group, {}), 0)
            os.ftruncate(fd, size)
            os.fsync(fd)
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


class DirectWriter:
    """A worker's sink for the pieces of arrays the layout places: each written where it goes."""

    def __init__(self, lay: Layout):
        self.layout = lay
        self.fds: dict[int, int] = {}

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
        """Write one piece (a box of the array, or an element range of a flat one) to every place of it."""
        if not all(piece.sizes):
            return
        values: list[np.ndarray] = []  # the piece's elements in C order, built once if a run needs them
        try:
            for target in self.layout.targets[entry.path]:
                for first, count, out_at in _runs(entry, piece, target):
                    self._write(entry, piece, values, first, count, target, out_at)
        except OSError as exc:  # a full disk, a read-only one: one line naming the file, not a traceback
            error = output_error(Path(self.layout.folder), exc)
            if error is None:
                raise
            raise error from None

    def _write(self, entry: ArrayEntry, piece: Any, values: list[np.ndarray], first: int, count: int,
               target: Target, out_at: int) -> None:
        """`count` elements of `piece` from its element `first` (C order within the piece), to element
        `out_at` of the target's tensor."""
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
        if target.dtype == entry.dtype:
            _put(part, fd, offset)
            return
        for block in blocks([part], CAST_BLOCK_BYTES - CAST_BLOCK_BYTES % src.itemsize):
            data = _cast(np.frombuffer(block, dtype=src.raw), src, target.dtype)
            _pwrite(fd, data, offset)
            offset += len(data)

    def sync(self) -> None:
        """Make everything written durable: before the unit's commit, which is the journal."""
        for fd in self.fds.values():
            os.fsync(fd)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _runs(entry: ArrayEntry, piece: Any, target: Target) -> list[tuple[int, int, int]]:
    """(first element in the piece, count, first element in the target's tensor) of each contiguous run
    of the piece's elements that the target takes, in C order."""
    shape = entry.shape
    lo, hi = target.rows if target.rows is not None else (0, shape[0])
    if entry.flat:  # an element range of the flattened array
        (start,), (count,) = piece.offsets, piece.sizes
        row = math.prod(shape[1:])
        a, b = max(start, lo * row), min(start + count, hi * row)
        return [(a - start, b - a, a - lo * row)] if a < b else []
    offsets, sizes = piece.offsets, piece.sizes
    r0, r1 = max(offsets[0], lo), min(offsets[0] + sizes[0], hi)
    if r0 >= r1:
        return []
    # the dimensions from `k` on are whole in the piece: each run spans them (and all of dimension k-1's
    # extent in the piece when k-1 is dimension 0, for a block of whole rows)
    k = len(shape)
    while k > 1 and sizes[k - 1] == shape[k - 1] and offsets[k - 1] == 0:
        k -= 1
    if k == 1:  # whole rows: one run
        row = math.prod(shape[1:])
        return [((r0 - offsets[0]) * row, (r1 - r0) * row, (r0 - lo) * row)]
    run = math.prod(sizes[k - 1:])  # the piece's extent in dimension k-1, times the whole dimensions after
    out_strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    in_strides = [math.prod(sizes[d + 1:]) for d in range(len(shape))]
    runs = []
    for index in np.ndindex(*((r1 - r0,) + tuple(sizes[1:k - 1]))):
        at = (r0 + index[0],) + tuple(o + i for o, i in zip(offsets[1:k - 1], index[1:]))
        first = sum((a - o) * s for a, o, s in zip(at, offsets, in_strides))
        out = (at[0] - lo) * out_strides[0] + sum(a * s for a, s in zip(at[1:], out_strides[1:k - 1])) \
            + offsets[k - 1] * out_strides[k - 1]
        runs.append((first, run, out))
    return runs


def _put(part: Part, fd: int, offset: int) -> None:
    if isinstance(part, FileRange):
        copy_range(part, fd, offset)
        return
    for block in blocks([part]):
        _pwrite(fd, block, offset)
        offset += part_length(block)


def _pwrite(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
