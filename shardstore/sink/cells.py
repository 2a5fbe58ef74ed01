"""Everything one unit of work (a rank file, a .distcp file) writes into the store, committed at once.

The read side hands over pieces: boxes of an array (offsets, sizes) that can give their bytes, as one
contiguous range of whole rows where the file has them so, else as an array view. What happens to them
is the store's business: which cells a piece fills and how a cell is laid out, which replica cells are
already committed by another unit (the first commit wins; `verify` compares), which small pieces go
through the unit's staging file. Nothing reaches a commit record until everything it lists is durable.
"""

from __future__ import annotations

import math
import os
from typing import Any, Protocol

import numpy as np

from .. import dtypes
from ..errors import CheckpointError
from ..ranges import Part, joined, part_length
from ..store.manifest import INLINE_STAGING, ArrayEntry, CommitRecord
from ..store.store import BLOBS, STAGING_CACHE_BYTES, Store, first_difference
from . import Piece


INLINE_BYTES = 1 << 20  # a unit's staged bytes up to this size (and its share of STAGING_CACHE_BYTES) go in
# its commit record (store format 3) ...
HANDBACK_BYTES = 1 << 20  # ... else into a staging file, which up to this size is also handed back to the coordinator


class Committed(Protocol):
    """What a commit record says of the unit it commits (read/contract.py's `Unit` has these)."""

    rank: int
    path: str
    world_size: int
    group_rank: int
    group_size: int

    @property
    def size(self) -> int: ...


class UnitWriter:
    def __init__(self, store: Store, where: str, verify_replicas: bool = False,
                 batch_cells: dict[str, set[int]] | None = None):
        self.store, self.where, self.verify = store, where, verify_replicas
        # replica cells the batch's earlier units wrote (ingest_files): present as if committed, since
        # they will be, in the same commit as this unit
        self.batch_cells = batch_cells if batch_cells is not None else {}
        self.written: list[str] = []
        self.cells: dict[str, list[int]] = {}
        self.crcs: dict[str, dict[str, int]] = {}  # cells that are a source record unchanged: its CRC-32
        self.packs: list[str] = []  # in a packed store: the packs its cells went into, and where in them
        self.spans: dict[str, list[list[int]]] = {}
        self.staged: dict[str, list[list[Any]]] = {}
        self.objects: dict[str, Any] = {}
        self._staging: list[Part] = []
        self._staged_bytes = 0
        self.staging: bytes | None = None  # the staging file written, if small enough to hand back
        # Which replica cells to write is decided by the records the store has seen: the caller refreshes
        # them once per batch (ingest_files), not per unit, which at world size 1024 lists 1024 records
        # per unit. A copy another unit committed since is written again, harmlessly (first commit wins).
        self._replicas = store.manifest.facts.replicas

    def put_blob(self, data: bytes | memoryview) -> str:
        digest = self.store.put_blob(data)
        self.written.append(f"{BLOBS}/{digest}")
        return digest

    def value(self, path: str, encoded: Any) -> None:
        self.objects[path] = encoded

    def piece(self, entry: ArrayEntry, piece: Piece) -> None:
        if not all(piece.sizes):
            return
        if entry.staged:
            self._stage(entry, piece.offsets, piece.sizes, _rows(piece, 0, piece.sizes[0]))
            return
        if entry.flat:
            self._flat_piece(entry, piece)
            return
        cells = entry.cells_of(piece.offsets, piece.sizes)
        for index in cells:
            parts, valid_rows = _cell_parts(entry, piece, index)
            whole = len(cells) == 1 and valid_rows == piece.sizes[0] and tuple(entry.cell[1:]) == tuple(piece.sizes[1:])
            self._cell(entry, index, parts, valid_rows, piece.crc() if whole else None)

    def _cell(self, entry: ArrayEntry, index: tuple[int, ...], parts: list[Part], valid_rows: int,
              crc: int | None = None) -> None:
        flat = entry.flat_index(index)
        replica = entry.replicated or self._replicas > 1
        if replica and (flat in self.store.cells_present(entry.path) or flat in self.batch_cells.get(entry.path, ())):
            # Another replica's copy is committed (or is in this batch): first commit wins. A cell file
            # that no commit record covers (its writer died or was refused) counts for nothing and is rewritten.
            if self.verify:
                self._verify(entry, index, parts)
            return
        if replica:
            self.batch_cells.setdefault(entry.path, set()).add(flat)
        self.cells.setdefault(entry.path, []).append(flat)
        if crc is not None:
            self.crcs.setdefault(entry.path, {})[str(flat)] = crc
        key, span = self.store.write_cell(entry, index, parts, valid_rows)
        if span is None:
            self.written.append(key)
            return
        if key not in self.packs:  # (a task's cells go into one pack; a second only under --verify-replicas)
            self.packs.append(key)
            self.written.append(key)
        self.spans.setdefault(entry.path, []).append([self.packs.index(key), span[1], span[2]])

    def _flat_piece(self, entry: ArrayEntry, piece: Piece) -> None:
        """An element range: the cells it fills whole are written, its parts of the others staged."""
        (start,), (count,) = piece.offsets, piece.sizes
        row = entry.cell_elements // entry.cell[0]
        for cell, first, stop in entry.flat_cells(start, count):
            part = _rows(piece, first - start, stop - first)
            lo, hi = cell * entry.cell_elements, min((cell + 1) * entry.cell_elements, math.prod(entry.shape))
            if (first, stop) == (lo, hi):
                self._cell(entry, (cell,) + (0,) * (len(entry.shape) - 1), [part], (hi - lo) // row)
            else:
                self._stage(entry, (first,), (stop - first,), part)

    def _stage(self, entry: ArrayEntry, offsets: tuple[int, ...], sizes: tuple[int, ...], part: Part) -> None:
        nbytes = part_length(part)
        self._staging.append(part)
        self.staged.setdefault(entry.path, []).append([list(offsets), list(sizes), self._staged_bytes, nbytes])
        self._staged_bytes += nbytes

    def record(self, unit: Committed, only: str | None, identity: str | None = None, direct: str | None = None,
               runs: list[list[int]] | None = None) -> CommitRecord:
        """The unit's staged pieces written (while its file is still open), and the record that commits
        everything it wrote (`written`) once that is durable: `Store.commit_ranks`."""
        rank, world_size = unit.rank, unit.world_size
        inline = None
        share = min(INLINE_BYTES, STAGING_CACHE_BYTES // max(world_size, 1))  # what the coordinator can hold
        if self._staging and self._staged_bytes <= share and self.store.manifest.version >= INLINE_STAGING:
            # a PUT (or a file and its sync) per unit less, and no read of it back: at world size 256, 286 KB
            inline = joined(self._staging)  # of norms a rank; the fixtures 4-8 KB
            self._staging = []
        if self._staging:
            parts = self._staging
            if self._staged_bytes <= HANDBACK_BYTES:  # handed back to the coordinator: it assembles from
                self.staging = joined(parts)  # these, not a read of the file
                parts = [self.staging]
            self.written.append(self.store.write_staging(rank, parts))
            self._staging = []
        return CommitRecord(rank, os.path.basename(unit.path), unit.size, self.cells, self.staged, self.objects, only,
                            world_size, unit.group_rank, unit.group_size, self.crcs, identity, direct, runs or [],
                            inline, self.packs, self.spans)

    def _verify(self, entry: ArrayEntry, index: tuple[int, ...], parts: list[Part]) -> None:
        """Compare this unit's copy of a cell with the committed one; name the first difference."""
        mine = joined(parts)
        theirs = self.store.read_cell_bytes(entry, index, len(mine))
        if mine == theirs:
            return
        bounds = entry.cell_bounds(index)
        element = first_difference(mine, theirs, dtypes.info(entry.dtype).itemsize,
                                   (bounds[0][1] - bounds[0][0],) + tuple(entry.cell[1:]), tuple(lo for lo, _ in bounds))
        raise CheckpointError(f"{self.where}: replica of {entry.path} differs from the copy already in the store, "
                              f"first at element {element}")


def _rows(piece: Piece, first: int, count: int) -> Part:
    """Rows [first, first + count) of a piece: its byte range in the file, else a contiguous copy."""
    part = piece.rows(first, count)
    return part if part is not None else np.ascontiguousarray(piece.values()[first:first + count]).data


def _cell_parts(entry: ArrayEntry, piece: Piece, index: tuple[int, ...]) -> tuple[list[Part], int]:
    """The bytes of cell `index` that `piece` holds, laid out as the cell's valid rows (trailing dimensions
    padded to the cell's), and how many rows are valid."""
    bounds = entry.cell_bounds(index)
    rel = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(bounds, piece.offsets))
    valid_rows = bounds[0][1] - bounds[0][0]
    trailing_full = all(hi - lo == c for (lo, hi), c in zip(bounds[1:], entry.cell[1:]))
    if trailing_full and tuple(entry.cell[1:]) == tuple(piece.sizes[1:]):
        part = piece.rows(rel[0].start, valid_rows)
        if part is not None:
            return [part], valid_rows
    region = piece.values()[rel]
    buf = np.zeros((valid_rows,) + tuple(entry.cell[1:]), dtype=region.dtype)
    buf[tuple(slice(0, n) for n in region.shape)] = region
    return [buf.data], valid_rows

