"""From a checkpoint's spec (every array's boxes and the unit holding each, whatever the format said them
in: ShardedTensor metadata, DCP's .metadata, DTensor placements, DeepSpeed's partitions) to a Zarr
layout where every chunk has exactly one writer.

Each array's outer grid (Zarr's *shard* shape) is cut at every box boundary the spec names, so a
grid cell never straddles two ranks' shards and whoever holds a shard can write its cells whole, without
a read-modify-write. For FSDP that grid is simply ceil(d0 / W) rows. Inside a cell, small inner chunks
(~1 MiB) make slices cheap to read. Tensors too small to deserve one file per rank are *staged*: each
rank appends its pieces to one per-rank file, and the single cell is assembled once every piece is in; a
tensor one unit holds whole is not: it is its own cell, written by that unit.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import reduce

import numpy as np

from . import dtypes
from .errors import CheckpointError
from .read.contract import CheckpointSpec, ShardedSpec
from .read.registry import get
from .records import TensorRef
from .store.manifest import ArrayEntry, Manifest
from .trainers.registry import detect

CHUNK_TARGET_BYTES = 1 << 20  # inner chunk: the unit a lazy read fetches
MIN_CHUNK_BYTES = 64 << 10
SMALL_ARRAY_BYTES = 1 << 20  # at or below this, one cell for the whole tensor, assembled from staging
MIN_CELL_BYTES = 64 << 10  # per-rank cells smaller than this are staged too ...
MAX_STAGED_BYTES = 64 << 20  # ... unless the whole tensor is larger than this
MAX_CELLS = 1 << 20
REPLICATED_ARRAY_BYTES = 64 << 10
FLAT_CELL_BYTES = 4 << 20  # cells of a flat tensor whose shard edges fall mid-row  # plain (unsharded) tensors this large get an array of their own


def _grid(spec: ShardedSpec) -> tuple[int, ...]:
    cell = []
    for dim, size in enumerate(spec.shape):
        cuts = {b for s in spec.shards if all(spec.shape) and all(s.sizes)
                for b in (s.offsets[dim], s.offsets[dim] + s.sizes[dim])} - {0, size}
        cell.append(reduce(math.gcd, cuts) if cuts else max(size, 1))
    return tuple(cell)


def _inner_chunk(cell: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    if not cell:
        return cell
    row = math.prod(cell[1:]) * itemsize
    rows = cell[0]
    best = 1
    for d in range(1, math.isqrt(rows) + 1):
        if rows % d == 0:
            for cand in (d, rows // d):
                if cand * row <= CHUNK_TARGET_BYTES and cand > best:
                    best = cand
    if best * row < MIN_CHUNK_BYTES or rows // best > 65536:
        best = rows  # no divisor gives a sensible chunk: read the cell whole
    return (best,) + cell[1:]


def check_tiling(path: str, spec: ShardedSpec, cell: tuple[int, ...]) -> None:
    """Every element of the tensor is covered by exactly one shard (per replica group)."""
    plan = ArrayEntry(path, spec.dtype, spec.shape, cell, cell, False)
    if plan.ncells > MAX_CELLS:
        raise CheckpointError(f"{path}: shard boundaries cut the tensor into {plan.ncells} pieces; too irregular")
    # one count per cell, each shard's block of cells counted in one slice (a flat optimizer bucket of a
    # hundred parameters has tens of thousands of cells: not a Python loop per cell)
    covered = np.zeros(plan.grid, dtype=np.uint32)
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for s in spec.shards:
        if len(s.offsets) != len(spec.shape) or len(s.sizes) != len(spec.shape):
            raise CheckpointError(f"{path}: shard rank {s.rank} has the wrong number of dimensions")
        if any(o < 0 or o + n > d for o, n, d in zip(s.offsets, s.sizes, spec.shape)):
            raise CheckpointError(f"{path}: shard at {list(s.offsets)} of rank {s.rank} lies outside {list(spec.shape)}")
        if not all(s.sizes) or (s.offsets, s.sizes) in seen:
            continue  # empty, or the same shard once more (another replica group)
        seen.add((s.offsets, s.sizes))
        covered[tuple(slice(o // c, -(-(o + n) // c)) for o, n, c in zip(s.offsets, s.sizes, cell))] += 1
    if covered.size and covered.max() > 1:
        raise CheckpointError(f"{path}: shards overlap at cell {[int(i) for i in np.argwhere(covered > 1)[0]]}")
    if all(spec.shape) and covered.size and covered.min() == 0:
        missing = [int(i) for i in np.argwhere(covered == 0)[0]]
        raise CheckpointError(f"{path}: no shard covers cell {missing} of {list(spec.shape)}")


def plan_flat(path: str, spec: ShardedSpec) -> ArrayEntry:
    """A tensor whose shards are element ranges (FSDP1 flat parameters). Cells are blocks of whole rows:
    aligned with every shard edge when the edges allow cells of a sensible size (then no cell has two
    writers), else about an eighth of the smallest shard, and the cells astride an edge are staged."""
    if not spec.shape:
        raise CheckpointError(f"{path}: a 0-d tensor split as a flat range; not a layout FSDP writes")
    info = dtypes.info(spec.dtype)
    total, row = math.prod(spec.shape), math.prod(spec.shape[1:])
    ranges = sorted({(s.offsets[0], s.sizes[0]) for s in spec.shards if s.sizes[0]})
    end = 0
    for start, count in ranges:
        if start != end:
            what = "overlap" if start < end else "leave a gap"
            raise CheckpointError(f"{path}: its flat shards {what} at element {min(start, end)}")
        end = start + count
    if end != total:
        raise CheckpointError(f"{path}: its flat shards cover {end} of its {total} elements")
    smallest = min((count for _, count in ranges), default=total) * info.itemsize
    if total * info.itemsize <= SMALL_ARRAY_BYTES or (smallest < MIN_CELL_BYTES and total * info.itemsize <= MAX_STAGED_BYTES):
        cell = tuple(max(d, 1) for d in spec.shape)
        return ArrayEntry(path, spec.dtype, spec.shape, cell, _inner_chunk(cell, info.itemsize), True,
                          layout=spec.layout_digest(), flat=True)
    edges = reduce(math.gcd, [start for start, _ in ranges], total)
    if edges % row == 0 and edges * info.itemsize >= MIN_CELL_BYTES:
        rows = edges // row
    else:
        target = max(MIN_CELL_BYTES, min(FLAT_CELL_BYTES, smallest // 8))
        rows = max(1, min(spec.shape[0], target // (row * info.itemsize)))
    cell = (rows,) + tuple(spec.shape[1:])
    return ArrayEntry(path, spec.dtype, spec.shape, cell, _inner_chunk(cell, info.itemsize), False,
                      layout=spec.layout_digest(), flat=True)


def plan_array(path: str, spec: ShardedSpec) -> ArrayEntry:
    if spec.flat:
        return plan_flat(path, spec)
    info = dtypes.info(spec.dtype)
    cell = _grid(spec)
    check_tiling(path, spec, cell)
    nbytes = math.prod(spec.shape) * info.itemsize
    cell_bytes = math.prod(cell) * info.itemsize
    # A tensor every holder holds whole is one cell its holder writes: staging is for the pieces of one that
    # several units share, and would route the bytes through the coordinator to assemble what is whole.
    whole = nbytes > 0 and bool(spec.shape) and all(
        tuple(s.offsets) == (0,) * len(spec.shape) and tuple(s.sizes) == tuple(spec.shape) for s in spec.shards)
    staged = not whole and (nbytes <= SMALL_ARRAY_BYTES or (cell_bytes < MIN_CELL_BYTES and nbytes <= MAX_STAGED_BYTES))
    if staged:
        cell = tuple(max(d, 1) for d in spec.shape)
    return ArrayEntry(path, spec.dtype, spec.shape, cell, _inner_chunk(cell, info.itemsize), staged,
                      layout=spec.layout_digest())


def plain_nbytes(ref: TensorRef) -> int:
    return math.prod(ref.shape) * dtypes.info(ref.dtype).itemsize


def plan_replicated(path: str, ref: TensorRef) -> ArrayEntry:
    """A plain tensor (every rank holds all of it, as FSDP's NO_SHARD at world size 1 does): one cell."""
    cell = tuple(max(d, 1) for d in ref.shape)
    return ArrayEntry(path, ref.dtype, tuple(ref.shape), cell, _inner_chunk(cell, dtypes.info(ref.dtype).itemsize),
                      staged=False, replicated=True)


def plan_checkpoint(spec: CheckpointSpec) -> Manifest:
    """Plan the whole store from a checkpoint's spec (from any format: see read/source.py)."""
    arrays, objects = {}, list(spec.objects)
    alike: dict[tuple, ArrayEntry] = {}  # a layout planned once for all tensors sharing its shard list
    for path, array in spec.arrays.items():
        key = (id(array.shards), array.shape, array.dtype, array.flat)
        arrays[path] = replace(alike[key], path=path) if key in alike else plan_array(path, array)
        alike.setdefault(key, arrays[path])
    for path, ref in spec.replicated.items():
        if plain_nbytes(ref) >= REPLICATED_ARRAY_BYTES:
            arrays[path] = plan_replicated(path, ref)
        else:
            objects.append(path)
    order = {p: i for i, p in enumerate(spec.tree.leaf_paths())}
    objects.sort(key=lambda p: order.get(p, len(order)))
    facts = replace(spec.facts, format=spec.format, group_size=spec.group_size,
                    replicas=max(spec.facts.replicas, spec.world_size // spec.group_size))
    return Manifest(detect(spec.tree, spec.facts.trainer, get(spec.format)), spec.world_size,
                    spec.tree, arrays, objects, facts)

